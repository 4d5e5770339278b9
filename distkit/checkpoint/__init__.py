"""One backend-neutral checkpoint format, written atomically and read without running code.

A checkpoint is a plain ``torch.save`` of a dict of tensors, numbers, strings, lists and dicts,
so ``torch.load(..., weights_only=True)`` reads it and a file that needs pickled code is
refused. The model state is the unwrapped module's (no ``module.`` prefixes) in fp32; the
optimizer state is the torch optimizer's own ``state_dict`` (keyed by parameter order, the
same whatever wrapper trained it); the loss scaler is in torch ``GradScaler`` form (a strategy
with a scaler of its own converts to and from it in its ``state_dict`` hooks).

A sharded checkpoint (``FSDPStrategy(checkpoint="sharded")``) keeps the model and optimizer
tensors in a folder beside the file, and only their names, shapes and dtypes in it (see
``distkit.checkpoint._shard_files``).
"""

from __future__ import annotations

import contextlib
import os
import pickle
import random
import re
import shutil
import warnings
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any, BinaryIO, cast

import numpy as np
import torch

from distkit._atomic import TempFile, mtime_ns, write_text
from distkit._version import __version__
from distkit.checkpoint import _checkpoint_fields as _fields
from distkit.checkpoint import _digest, _layout, _shard_files, _storage
from distkit.errors import CheckpointError

FORMAT = "distkit-checkpoint"
#: 2: each entry at the top level, distkit's records under "distkit" (see _layout); 1: the
#: records at the top level (still read)
VERSION = 2
#: the reserved top-level key of a checkpoint's records
RECORDS = _layout.RECORDS
LATEST = "latest"
#: the record saying the file carries a digest (so one that lost it is refused)
INTEGRITY = _layout.INTEGRITY
_PREFIX = "step-"


def producer(strategy: str, precision: str, world_size: int, **more: str | None) -> dict[str, Any]:
    """What made a checkpoint, as its records say it (the Trainer's and the Runtime's alike):
    the strategy, its precision and world size, distkit's and torch's versions, and ``more``."""
    return {
        "strategy": strategy,
        "precision": precision,
        "world_size": world_size,
        **more,
        "distkit": __version__,
        "torch": str(torch.__version__),
    }


# ---------------------------------------------------------------------- state conversion
def model_state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The module's state on CPU, reduced-precision floats upcast to fp32."""
    out = {}
    for key, value in module.state_dict().items():
        tensor = value.detach().cpu()
        if tensor.is_floating_point() and tensor.dtype in (torch.float16, torch.bfloat16):
            tensor = tensor.float()
        out[key] = tensor.clone()
    return out


def strip_wrapper_prefix(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Remove ``module.`` prefixes a DDP/DataParallel wrapper left in a foreign state dict."""
    if state and all(key.startswith("module.") for key in state):
        return {key[len("module.") :]: value for key, value in state.items()}
    return dict(state)


def rng_state() -> dict[str, Any]:
    """This process's torch, numpy and ``random`` generator states, as weights-only data."""
    np_state: Any = np.random.get_state(legacy=True)
    py_version, py_internal, py_gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": {
            "keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64)),
            "pos": int(np_state[2]),
            "has_gauss": int(np_state[3]),
            "cached_gaussian": float(np_state[4]),
        },
        "python": {"version": py_version, "internal": list(py_internal), "gauss": py_gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    """Restore what :func:`rng_state` returned."""
    torch.set_rng_state(state["torch"].cpu())
    np_state = state["numpy"]
    np.random.set_state(
        (
            "MT19937",
            # .cpu(): a checkpoint loaded onto a GPU (map_location) holds the keys there
            np_state["keys"].cpu().numpy().astype(np.uint32),
            np_state["pos"],
            np_state["has_gauss"],
            np_state["cached_gaussian"],
        )
    )
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"].cpu())


# ---------------------------------------------------------------------- files
def atomic_save(
    payload: Mapping[str, Any],
    path: str | os.PathLike[str],
    *,
    storage_options: Mapping[str, Any] | None = None,
) -> None:
    """Write ``payload`` to ``path`` so that a crash leaves either the old file or the new one.

    Temp file in the same folder, flushed and fsynced, renamed over the target, folder fsynced.
    The file's mode follows the umask, as with ``torch.save``. A URL (``s3://...``): the
    file is written and checked locally, then uploaded in one piece (see ``_storage``).
    """
    if _storage.is_url(path):
        _upload(payload, os.fspath(path), storage_options)
        return
    path = _storage.local_path(path)
    if path.is_dir():
        raise CheckpointError(
            f"{path} is a folder; a checkpoint is a file: pass a file path such as "
            f"{path / 'model.pt'}"
        )
    with _writing(path):
        path.parent.mkdir(parents=True, exist_ok=True)
        _save_new(TempFile(path), path, payload)


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    """OS errors of a write as a CheckpointError that names the file (nothing was replaced)."""
    try:
        yield
    except OSError as exc:
        raise CheckpointError(
            f"cannot write the checkpoint {path} ({type(exc).__name__}: {exc.strerror or exc}"
            f"{_free_space(path.parent)}); the previous file, if any, is unchanged. Check that "
            "the folder is writable and the disk has room"
        ) from exc


def _free_space(folder: Path) -> str:
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return ""
    return f"; {free / 1e9:.2f} GB free there"


def _upload(payload: Mapping[str, Any], url: str, options: Mapping[str, Any] | None) -> None:
    remote = _storage.Remote(url, options)
    if remote.isdir(url):
        raise CheckpointError(
            f"{url} is a folder; a checkpoint is a file: pass a path such as {url}/model.pt"
        )
    with _storage.staged(_storage.name_of(url)) as folder:
        local = folder / _storage.name_of(url)
        with _writing(local):
            _save_new(TempFile(local), local, payload)
        remote.put(local, url)


def _save_new(tmp: TempFile, path: Path, payload: Mapping[str, Any]) -> None:
    def write(handle: BinaryIO) -> None:
        writer = _digest.HashingWriter(handle)
        try:
            # a raw binary stream: torch.save writes to it as to a file (typeshed: no IO[bytes])
            content = _layout.stored(payload)
            content[RECORDS] = {**content[RECORDS], INTEGRITY: _digest.ALGORITHM}
            torch.save(content, cast(IO[bytes], writer))
        except RuntimeError:
            if writer.failure is not None:  # a full disk: torch says "unexpected pos"
                raise writer.failure from None
            raise
        writer.seal()

    tmp.publish(path, write, _require_weights_only)


def _require_weights_only(path: Path) -> None:
    """Refuse to publish a file that ``load`` would refuse (checked before the rename)."""
    try:
        torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise CheckpointError(
            "the checkpoint holds an object that cannot be loaded weights-only (only tensors, "
            "numbers, strings, lists and dicts can): store plain values in extra=... (e.g. "
            f"obj.state_dict()). Nothing was written. torch: {str(exc).splitlines()[0]}"
        ) from None


def load(
    path: str | os.PathLike[str],
    map_location: torch.device | str = "cpu",
    *,
    verify: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> dict[str, Any]:
    """Read a distkit checkpoint onto ``map_location``, never running pickled code.

    The file's digest is checked before anything is read (and a sharded checkpoint's shard
    files against theirs), then every field a resume reads. A checkpoint from a distkit that
    wrote no digest loads unverified, with a warning (once per file).

    Args:
        path: the checkpoint file.
        map_location: where its tensors go.
        verify: check the digests (``False`` skips them: only for tools that read a file's
            bookkeeping and not its weights).
        storage_options: for a URL ``path`` (``s3://...``), the fsspec filesystem's options
            (credentials, endpoint); None: its standard configuration.

    Returns the file's entries (``"model"``, ``"optimizer"``, ... or the names ``rt.save``
    was given) and distkit's records (``"producer"``, ``"scaler"``, ...) in one mapping; see
    :func:`load_entries` for the two apart.

    Raises:
        CheckpointError: missing, truncated, corrupt or changed file (its digest differs); a
            file that needs arbitrary pickled objects (refused for safety); not a distkit
            checkpoint; or a field a resume reads is damaged (the error names it).
    """
    return _layout.flat(
        *load_entries(path, map_location, verify=verify, storage_options=storage_options)
    )


def load_entries(
    path: str | os.PathLike[str],
    map_location: torch.device | str = "cpu",
    *,
    verify: bool = True,
    storage_options: Mapping[str, Any] | None = None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`load`'s reading, as ``(entries, records)``: the file's named entries, and
    distkit's records (the reserved ``"distkit"`` key's). A file of the first layout is read
    into this one."""
    if _storage.is_url(path):
        return _download(os.fspath(path), map_location, verify, storage_options)
    path = _storage.local_path(path)
    _require_torch_file(path)
    verified = _verify_digest(path) if verify else False
    content = _read(path, map_location)
    parts = _layout.split(path, content, FORMAT) if isinstance(content, dict) else None
    if parts is None:
        raise CheckpointError(
            f"{path} is not a distkit checkpoint (no format={FORMAT!r} marker). To start from "
            "plain weights, load them into the model yourself: "
            "model.load_state_dict(torch.load(path, weights_only=True))"
        )
    entries, payload = parts  # (payload: the records, from here on)
    version = payload.get("version", 0)
    if not isinstance(version, int) or isinstance(version, bool):
        raise CheckpointError(
            f"{path} is damaged: its field 'version' is {type(version).__name__} {version!r}, "
            "not an int. Resume from another checkpoint"
        )
    if version > VERSION:
        raise CheckpointError(
            f"{path} has checkpoint format version {payload['version']}, newer than this "
            f"distkit reads ({VERSION}); upgrade distkit"
        )
    if verify and not verified:
        _unverified(path, payload)
    if isinstance(payload.get("shards"), str):  # a sharded checkpoint: its folder sits beside it
        payload["shards"] = str(path.parent / payload["shards"])
        if verify:
            _verify_shards(path, payload)
    _fields.check(path, entries, payload)
    return entries, payload


def _download(
    url: str,
    map_location: torch.device | str,
    verify: bool,
    options: Mapping[str, Any] | None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A checkpoint object read through a local copy, every check as for a local file (the
    messages name the URL)."""
    remote = _storage.Remote(url, options)
    with _storage.staged(_storage.name_of(url)) as folder:
        local = folder / _storage.name_of(url)
        try:
            remote.get(url, local)
        except FileNotFoundError:
            what = "a folder, not a checkpoint file" if remote.isdir(url) else "not there"
            raise CheckpointError(f"no checkpoint at {url} ({what})") from None
        try:
            entries, records = load_entries(local, map_location, verify=verify)
        except CheckpointError as exc:
            raise CheckpointError(str(exc).replace(str(local), url)) from None
    if _shard_files.is_sharded(records):
        raise CheckpointError(
            f"{url} is a sharded checkpoint, and distkit reads sharded checkpoints from local "
            "or shared file systems only (not yet from object stores): copy the file and its "
            "shards folder to a local path and resume from there"
        )
    return entries, records


def _verify_digest(path: Path) -> bool:
    try:
        return _digest.verify(path)
    except _digest.DigestMismatch as exc:
        raise CheckpointError(
            f"{path} is corrupt: its bytes differ from those distkit wrote ({exc}): a flipped "
            "bit, a copy that went wrong, or an edit. Resume from another checkpoint "
            "(resume='auto' falls back to the newest one that verifies)"
        ) from None
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from None


#: files loaded without a digest to check, warned about once each
_UNVERIFIED: set[Path] = set()


def _unverified(path: Path, payload: dict[str, Any]) -> None:
    if payload.get(INTEGRITY):  # written with a digest, which is gone: the tail was damaged
        raise CheckpointError(
            f"{path} is damaged: it was written with a {payload[INTEGRITY]} digest at its end, "
            "and that digest is missing or unreadable, so its contents cannot be trusted. "
            "Resume from another checkpoint"
        )
    if path.resolve() not in _UNVERIFIED:
        _UNVERIFIED.add(path.resolve())
        warnings.warn(
            f"{path} carries no digest (written before distkit kept digests, or re-saved by "
            "another tool): it is loaded without checking its bytes. Save it again to add one",
            stacklevel=3,
        )


def _verify_shards(path: Path, payload: dict[str, Any]) -> None:
    folder = Path(payload["shards"])
    if not folder.is_dir():
        raise CheckpointError(
            f"{path} is a sharded checkpoint and its shards folder {folder.name} is not beside "
            "it: copy the checkpoint file together with that folder (or resume from another "
            "checkpoint)"
        )
    digests = payload.get(_shard_files.DIGESTS)
    if digests is None:
        if payload.get(INTEGRITY):
            raise CheckpointError(f"{path} is damaged: its shards have no digests recorded")
        return
    # an older checkpoint hashed the helper files too: one that was deleted is no damage
    digests = {
        name: digest
        for name, digest in digests.items()
        if Path(name).name not in _shard_files.HELPERS or (folder / name).exists()
    }
    try:
        _digest.check_files(folder, digests)
    except _digest.DigestMismatch as exc:
        raise CheckpointError(
            f"{path} has damaged shards in {folder.name}: {exc}. Resume from another "
            "checkpoint (resume='auto' falls back to the newest one that verifies)"
        ) from None


def _read(path: Path, map_location: torch.device | str) -> Any:
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch words every weights-only failure alike; a refused class names a GLOBAL, while
        # random bytes after a pickle header give "Unsupported operand" and the like
        if "Unsupported global" not in str(exc):
            detail = str(exc).partition("WeightsUnpickler error:")[2].strip().split("\n")[0]
            raise CheckpointError(
                f"{path} is corrupt: its pickle cannot be read ({detail or exc}). Resume from "
                "another checkpoint"
            ) from None
        raise CheckpointError(
            f"{path} needs pickled Python objects to load, and distkit loads checkpoints with "
            "weights_only=True so that a file can never run code. Re-save it with plain "
            f"tensors/numbers/strings (torch's error: {str(exc).splitlines()[0]})"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise CheckpointError(
            f"{path} is not a readable checkpoint (truncated or corrupt?): {exc}"
        ) from None


# torch.save writes a zip archive; before torch 1.6 (or with _use_new_zipfile_serialization=False)
# a raw pickle stream, which starts with the PROTO opcode
_TORCH_MAGIC = (b"PK\x03\x04", b"\x80")


def _require_torch_file(path: Path) -> None:
    if path.is_dir():
        raise CheckpointError(
            f"{path} is a folder, not a checkpoint file: pass a file in it (step-*.pt), or "
            f"checkpoint_dir={str(path)!r} with resume='auto' for its newest checkpoint"
        )
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    with path.open("rb") as handle:
        head = handle.read(4)
    if not head:
        raise CheckpointError(
            f"{path} is empty (0 bytes): a copy or save that never finished? Resume from "
            "another checkpoint"
        )
    if not head.startswith(_TORCH_MAGIC):
        raise CheckpointError(
            f"{path} is not a torch file (it starts with {head!r}; torch.save writes a zip "
            "archive, which starts with b'PK'): pass a checkpoint written by distkit"
        )


_STEP_FILE = re.compile(r"step-(\d+)\.pt")
# temp files of distkit._atomic.TempFile (and of tempfile.mkstemp, which earlier versions used)
_TEMP_FILE = re.compile(r"\.(step-\d+\.pt|latest|write-check)\.\w+\.tmp")


def step_of(path: Path | str) -> int | None:
    """The step number in a ``step-XXXXXXXXX.pt`` file name (None for any other name)."""
    name = path.name if isinstance(path, Path) else _storage.name_of(path)
    match = _STEP_FILE.fullmatch(name)
    return int(match.group(1)) if match else None


def where(path: str | os.PathLike[str]) -> Path | str:
    """``path`` as a local Path, or a URL as it is (``s3://...``)."""
    return os.fspath(path) if _storage.is_url(path) else _storage.local_path(path)


def name_for(global_step: int) -> str:
    """The file name of a checkpoint folder's checkpoint of ``global_step``."""
    return f"{_PREFIX}{global_step:09d}.pt"


class CheckpointFolder:
    """A folder of ``step-XXXXXXXXX.pt`` files with a ``latest`` pointer; keeps the last K.

    Args:
        folder: where checkpoints go (every rank must see it when resuming).
        keep_last: how many checkpoints to keep (older ones are deleted after a save).
    """

    #: fsspec options for a folder on a store (None: a local folder)
    storage_options: Mapping[str, Any] | None = None

    def __init__(self, folder: str | os.PathLike[str], keep_last: int = 3) -> None:
        self.folder = _storage.local_path(folder)
        self.keep_last = keep_last

    @property
    def where(self) -> str:
        """The folder, as messages name it."""
        return str(self.folder)

    def written_ns(self, path: Path | str) -> int:
        """When ``path`` (a checkpoint of this folder) was written, in ns (0: gone)."""
        return mtime_ns(Path(path))

    def path_for(self, global_step: int) -> Path | str:
        """Where the checkpoint of ``global_step`` goes (a URL for a folder on a store)."""
        return self.folder / name_for(global_step)

    def save(self, payload: Mapping[str, Any], global_step: int) -> Path | str:
        """Write the checkpoint of ``global_step``, point ``latest`` at it, prune the folder.

        Temp files that killed saves (or failed ``latest`` writes) left behind are removed
        too, so the folder holds at most ``keep_last`` checkpoints' worth of data.
        """
        path = self.folder / name_for(global_step)
        with _writing(path):
            self.folder.mkdir(parents=True, exist_ok=True)
            tmp = TempFile(path)
            # only rank 0 writes here, one save at a time: a temp file older than this one is
            # left by a writer that is gone (removed first, in case the disk is full)
            self._remove_temp_files(older_than_ns=tmp.started_ns)
            _save_new(tmp, path, payload)
        with _writing(self.folder / LATEST):
            write_text(path.name + "\n", self.folder / LATEST)
        # by write time, not by step number: files a previous run left with higher step
        # numbers are older than the one just written, and go first
        others = sorted((p for p in self._files() if p != path), key=mtime_ns)
        for old in others[: max(0, len(others) - (self.keep_last - 1))]:
            with contextlib.suppress(FileNotFoundError):
                old.unlink()
        return path

    def _remove_temp_files(self, older_than_ns: int) -> None:
        for entry in self.folder.iterdir():
            if _TEMP_FILE.fullmatch(entry.name) and mtime_ns(entry) < older_than_ns:
                with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                    entry.unlink()

    def check_writable(self) -> None:
        """Raise :class:`CheckpointError` now if this process cannot write checkpoints here."""
        if self.folder.exists() and not self.folder.is_dir():
            reason = "it is a file, not a folder"
        else:
            try:
                self.folder.mkdir(parents=True, exist_ok=True)
                probe = TempFile(self.folder / ".write-check")
                os.close(probe.fd)
                os.unlink(probe.path)
                return
            except OSError as exc:
                reason = f"{type(exc).__name__}: {exc.strerror or exc}"
        raise CheckpointError(
            f"cannot write checkpoints to {self.folder} ({reason}). Pass a checkpoint_dir that "
            "rank 0 can create and write: it writes every checkpoint"
        )

    def checkpoints(self) -> list[Path | str]:
        """Complete checkpoint files, in step order (the highest step last)."""
        return list(self._files())

    def _files(self) -> list[Path]:
        if not self.folder.is_dir():
            return []
        found = [(step_of(p), p) for p in self.folder.glob(f"{_PREFIX}*.pt")]
        return [p for step, p in sorted((s, p) for s, p in found if s is not None)]

    def latest(self) -> Path | str | None:
        """The checkpoint ``latest`` names, else the highest step, else ``None``.

        ``resume="auto"`` goes by step numbers (see ``distkit.trainer._resume``); this is for people
        and tools that follow the pointer.
        """
        pointer = self.folder / LATEST
        if pointer.is_file():
            named = self.folder / pointer.read_text().strip()
            if named.is_file():
                return named
        found = self._files()
        return found[-1] if found else None


def checkpoint_folder(
    folder: str | os.PathLike[str],
    keep_last: int = 3,
    storage_options: Mapping[str, Any] | None = None,
) -> CheckpointFolder:
    """The checkpoint folder at ``folder``: a local one, or one on a store for a URL."""
    if _storage.is_url(folder):
        from distkit.checkpoint._remote_folder import RemoteCheckpointFolder

        return RemoteCheckpointFolder(os.fspath(folder), keep_last, storage_options)
    return CheckpointFolder(folder, keep_last)


def shards_named_by(path: Path) -> str | None:
    """The shards folder the checkpoint file ``path`` names (None: a file of one piece)."""
    named = load(path, verify=False).get(_shard_files.KEY)
    return None if named is None else str(named)
