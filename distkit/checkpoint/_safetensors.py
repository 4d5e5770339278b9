"""Model weights as safetensors files, in the layout Hugging Face reads.

A path ending in ``.safetensors`` is one file. Any other path is a folder: ``model.safetensors``
when the weights fit in ``max_shard_size``, else ``model-00001-of-0000N.safetensors`` shards and
``model.safetensors.index.json`` (``{"metadata": {"total_size": ...}, "weight_map": {name:
file}}``). Every file carries the metadata ``{"format": "pt"}`` (transformers requires it).

The shards are planned from names, shapes and dtypes alone (:func:`plan_shards`), so a writer
can fetch one tensor at a time and hold one shard's bytes at most (:class:`ShardWriter`).

Writing a folder: each file is written atomically (a temp file renamed over it), the index last;
then the weight files of an earlier save that this one did not rewrite (another shard count,
or ``model.safetensors`` beside a sharded save) are removed. Other files in the folder (a
tokenizer, a README) are left alone. A crash mid-save can leave new shards beside the old index
when both saves have the same shard count: save again. The folder is not swapped for a temp
folder because it may hold such files of the user's.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import torch

from distkit._atomic import TempFile, fsync_dir, write_text
from distkit._imports import require
from distkit.errors import CheckpointError, ConfigurationError

SUFFIX = ".safetensors"
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"
METADATA = {"format": "pt"}
HINT = "pip install 'distkit[safetensors]'"
#: the metadata key of a file's digest: sha256 over its tensors' names, dtypes, shapes and
#: bytes in name order (load_weights verifies it where present; other writers' files have none)
DIGEST_KEY = "distkit_sha256"
#: file extensions a path to a weights folder is unlikely to have (a mistyped file name)
FILE_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt", ".pkl", ".safetensor", ".json", ".h5", ".npz")
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", re.IGNORECASE)


def safetensors_torch(feature: str) -> ModuleType:
    """``safetensors.torch``, imported on first use (or the error that says how to get it)."""
    return require("safetensors.torch", feature=feature, hint=HINT)


def parse_size(value: object, name: str = "max_shard_size") -> int:
    """Bytes from an int or a string such as ``"500MB"``, ``"2GB"`` or ``"1GiB"`` (KB/MB/GB/TB
    are powers of 1000, KiB/MiB/GiB/TiB of 1024, as Hugging Face reads them)."""
    allowed = (
        'allowed: a positive int (bytes) or a string such as "500MB", "5GB" or "1GiB" '
        "(units B, KB, MB, GB, TB, KiB, MiB, GiB, TiB)"
    )
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ConfigurationError(f"{name}={value!r} ({type(value).__name__}); {allowed}")
    if isinstance(value, int):
        size = value
    else:
        match = _SIZE.fullmatch(value)
        unit = match.group(2).lower() if match else None
        if match is None or unit not in _UNITS:
            raise ConfigurationError(f"{name}={value!r} is not a size; {allowed}")
        size = int(float(match.group(1)) * _UNITS[unit])
    if size < 1:
        raise ConfigurationError(f"{name}={value!r} is not positive; {allowed}")
    return size


# ---------------------------------------------------------------------- what is saved
class TensorSpec(NamedTuple):
    """One tensor to save, known before its data is fetched."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def shared_aliases(state: Mapping[str, Any]) -> dict[str, str]:
    """Names whose value is the same object as an earlier name's (tied weights), mapped to that
    first name. ``state``: a ``state_dict(keep_vars=True)``, whose values are the module's own
    parameters and buffers, so tied ones are one object under two names."""
    first: dict[int, str] = {}
    aliases = {}
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            continue
        seen = first.setdefault(id(value), name)
        if seen != name:
            aliases[name] = seen
    return aliases


def weight_specs(state: Mapping[str, Any]) -> tuple[list[TensorSpec], dict[str, str]]:
    """What :func:`plan_shards` plans for ``state`` (a ``state_dict(keep_vars=True)``; a
    sharded tensor's shape is its global one), and the aliases left out (saved once, under the
    first name, as Hugging Face does: safetensors refuses shared tensors)."""
    others = [f"{k} ({type(v).__name__})" for k, v in state.items() if not _is_tensor(v)]
    if others:
        raise CheckpointError(
            f"save_weights saves tensors only, and the model's state_dict holds other values: "
            f"{', '.join(others[:5])}. Save them yourself (e.g. with rt.save), or return "
            "tensors from the module's get_extra_state"
        )
    aliases = shared_aliases(state)
    specs = [
        TensorSpec(name, tuple(value.shape), value.dtype)
        for name, value in state.items()
        if name not in aliases
    ]
    return specs, aliases


def _is_tensor(value: object) -> bool:
    return isinstance(value, torch.Tensor)


def plan_shards(specs: Iterable[TensorSpec], max_bytes: int) -> list[list[TensorSpec]]:
    """``specs`` cut into shards, in order, each at most ``max_bytes`` (a tensor larger than
    that alone in its own shard, as Hugging Face does). No data needed: every rank plans alike."""
    shards: list[list[TensorSpec]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def shard_name(index: int, count: int) -> str:
    return f"model-{index + 1:05d}-of-{count:05d}.safetensors"


# ---------------------------------------------------------------------- where it goes
class Target(NamedTuple):
    """Where a save writes: ``files`` in order of the shards, ``index_file`` for a sharded
    folder."""

    folder: Path | None  # None: one file, the path given
    files: list[Path]
    index_file: Path | None


def is_file_path(path: Path) -> bool:
    """Whether ``path`` names one safetensors file (else a folder)."""
    return path.suffix == SUFFIX


def check_target(path: Path) -> None:
    """Refuse what cannot be written: a folder where a file goes and the other way round, a
    folder name that looks like a file of another kind. Cheap: before any collective."""
    if is_file_path(path):
        if path.is_dir():
            raise CheckpointError(
                f"{path} is a folder, and a path ending in {SUFFIX} is written as one file: "
                f"pass a file path (e.g. {path / WEIGHTS_NAME}) or the folder without the suffix"
            )
        return
    if path.suffix.lower() in FILE_SUFFIXES:
        raise CheckpointError(
            f"save_weights got {path}: a path ending in {SUFFIX} is one file, any other path "
            f"a folder, and {path.suffix!r} looks like a file of another format. Pass "
            f"{path.with_suffix(SUFFIX)} (one file) or a folder path"
        )
    if path.exists() and not path.is_dir():
        raise CheckpointError(
            f"{path} is a file, and a path without the {SUFFIX} suffix is a folder: pass "
            f"{path.with_suffix(SUFFIX)} for one file, or a folder path"
        )


def target_for(path: Path, shards: int) -> Target:
    if is_file_path(path):
        return Target(None, [path], None)
    if shards == 1:
        return Target(path, [path / WEIGHTS_NAME], None)
    return Target(path, [path / shard_name(i, shards) for i in range(shards)], path / INDEX_NAME)


# ---------------------------------------------------------------------- writing
class ShardWriter:
    """Holds the tensors of the shard being filled, writes it, lets it go.

    ``held`` is the bytes of tensors held now and ``peak_held`` the most ever held at once: a
    save that holds one shard at a time keeps ``peak_held`` at most the largest shard's bytes.
    """

    def __init__(self, feature: str) -> None:
        self._st = safetensors_torch(feature)
        self._tensors: dict[str, torch.Tensor] = {}
        self.held = 0
        self.peak_held = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        # contiguous: safetensors writes raw bytes; .cpu() of a CPU tensor copies nothing
        self._tensors[name] = tensor.detach().cpu().contiguous()
        self.held += self._tensors[name].nbytes
        self.peak_held = max(self.peak_held, self.held)

    def drop(self) -> None:
        self._tensors = {}
        self.held = 0

    def write(self, path: Path) -> None:
        """The held tensors to ``path`` (atomically), then let them go."""
        tensors, self._tensors = self._tensors, {}
        self.held = 0
        with _writing(path):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = TempFile(path)

            def write(handle: Any) -> None:
                # safetensors writes by name; the fsync of publish's own handle (the same
                # file) makes the bytes durable before the rename
                metadata = {**METADATA, DIGEST_KEY: tensors_digest(tensors)}
                self._st.save_file(tensors, str(tmp.path), metadata=metadata)

            tmp.publish(path, write)


def write_index(target: Target, shards: list[list[TensorSpec]]) -> None:
    """The Hugging Face index of a sharded folder (keys sorted, as transformers writes it)."""
    assert target.index_file is not None
    weight_map = {
        spec.name: file.name
        for file, shard in zip(target.files, shards, strict=True)
        for spec in shard
    }
    total = sum(spec.nbytes for shard in shards for spec in shard)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    with _writing(target.index_file):
        write_text(json.dumps(index, indent=2, sort_keys=True) + "\n", target.index_file)


def remove_stale(target: Target) -> list[Path]:
    """Weight files of an earlier save in ``target``'s folder that this save did not write."""
    if target.folder is None:
        return []
    keep = {file.name for file in target.files}
    if target.index_file is not None:
        keep.add(target.index_file.name)
    removed = []
    for entry in _entries(target.folder):
        stale = entry.name in (WEIGHTS_NAME, INDEX_NAME) or _SHARD.fullmatch(entry.name)
        if stale and entry.name not in keep and entry.is_file():
            with contextlib.suppress(FileNotFoundError):
                entry.unlink()
                removed.append(entry)
    if removed:
        fsync_dir(target.folder)
    return removed


def _entries(folder: Path) -> Iterator[Path]:
    with os.scandir(folder) as found:
        for entry in found:
            yield Path(entry.path)


@contextlib.contextmanager
def _writing(path: Path) -> Iterator[None]:
    try:
        yield
    except OSError as exc:
        raise CheckpointError(
            f"cannot write the weights file {path} ({type(exc).__name__}: "
            f"{exc.strerror or exc}): check that the folder is writable and the disk has room"
        ) from exc


def tensors_digest(tensors: Mapping[str, torch.Tensor]) -> str:
    """The digest :data:`DIGEST_KEY` records: a flipped bit in any tensor changes it."""
    digest = hashlib.sha256()
    for name in sorted(tensors):
        tensor = tensors[name].detach().cpu().contiguous()
        digest.update(f"{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        if tensor.numel():
            digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
