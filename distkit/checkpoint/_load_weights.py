"""``distkit.load_weights(model, path)``: safetensors weights into a plain module.

Reads what ``save_weights`` writes, and Hugging Face's own folders: one ``.safetensors`` file,
a folder with ``model.safetensors``, or a sharded folder with ``model.safetensors.index.json``.
Every name and shape is checked from the files' headers before any weight is copied, so a
refused load leaves the model as it was; then the files are read one at a time (the memory
of one shard).

A model built on the meta device (``distkit.init_empty()``) has no storage to copy into: its
weights are checked the same way, then recorded on it and read when the set-up gives it
storage (see :mod:`distkit.checkpoint._pending_weights`); they are reported as ``pending``,
never as ``loaded``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from distkit.checkpoint import _pending_weights, _storage
from distkit.checkpoint import _safetensors as st
from distkit.errors import CheckpointError, ConfigurationError

FEATURE = "load_weights"


class LoadedWeights(NamedTuple):
    """What :func:`load_weights` did: the names it loaded, the model's names the files lack
    (``strict=False`` only), the files' names the model lacks (``strict=False`` only), and
    the names it recorded for a model on the meta device, to be read when ``fit`` or
    ``rt.setup`` gives them storage (``loaded`` is then empty: nothing is in the model yet).
    Tied aliases of a loaded (or pending) tensor count as loaded (or pending)."""

    loaded: list[str]
    missing_keys: list[str]
    unexpected_keys: list[str]
    pending: list[str]


def load_weights(
    model: nn.Module,
    path: str | os.PathLike[str],
    *,
    strict: bool = True,
    storage_options: dict[str, Any] | None = None,
) -> LoadedWeights:
    """Load safetensors weights into ``model`` (a plain ``nn.Module``, before ``rt.setup`` or
    ``fit``: fine-tuning then starts from them).

    A model built on the meta device (``distkit.init_empty()``, a model larger than one
    process) is checked the same way, and its weights are read at the set-up, each rank its
    own slices under fsdp: they come back as ``pending``, not ``loaded``.

    Args:
        model: the module; its own ``state_dict()`` keys are matched (no ``module.`` prefix).
        path: a ``.safetensors`` file, or a folder holding ``model.safetensors`` or a sharded
            ``model.safetensors.index.json`` with its shards.
        strict: refuse names the files lack or the model lacks. A tied alias
            (``lm_head.weight`` tied to the embedding) absent from the files is fine when its
            partner is loaded. Shapes must match either way.
        storage_options: for a URL ``path`` (``s3://...``): the fsspec filesystem's options
            (None: the store's standard configuration). A URL is copied to this machine
            first, then read as a local path.

    Returns:
        :class:`LoadedWeights` (``loaded``, ``missing_keys``, ``unexpected_keys``,
        ``pending``).

    Raises:
        CheckpointError: no such file or folder, a file of another format, a folder without
            weights, a damaged index, names or shapes that do not match.
        ConfigurationError: a model set up for fsdp, or one partly on the meta device.
    """
    if not isinstance(model, nn.Module):
        raise ConfigurationError(
            f"load_weights takes a torch.nn.Module, got {type(model).__name__}: pass the model "
            "you built (before rt.setup)"
        )
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigurationError(
            f"load_weights' path must be a str or os.PathLike (a .safetensors file or a "
            f"folder), got {type(path).__name__} {path!r}"
        )
    st.safetensors_torch(FEATURE)  # the missing dependency first, whatever the path
    if _storage.is_url(path):
        local = _storage.download(os.fspath(path), storage_options)
        try:
            files = weight_files(local)
        except CheckpointError as exc:
            raise CheckpointError(str(exc).replace(str(local), os.fspath(path))) from None
        return _load(model, files, local, strict)
    files = weight_files(Path(path))
    return _load(model, files, Path(path), strict)


def weight_files(path: Path) -> dict[Path, list[str] | None]:
    """The files to read, each with the names its index says it holds (None: no index)."""
    if not path.exists():
        kind = "file" if st.is_file_path(path) else "file or folder"
        raise CheckpointError(
            f"load_weights: no such {kind}: {path}. Pass a .safetensors file or a folder "
            f"holding {st.WEIGHTS_NAME} or {st.INDEX_NAME}"
        )
    if path.is_file():
        if not st.is_file_path(path):
            raise CheckpointError(
                f"load_weights reads safetensors files (*{st.SUFFIX}), got {path}. A torch "
                "file (.pt/.bin) loads with model.load_state_dict(torch.load(path, "
                "weights_only=True)); a distkit checkpoint with trainer.load_checkpoint"
            )
        return {path: None}
    single, index = path / st.WEIGHTS_NAME, path / st.INDEX_NAME
    if single.is_file() and index.is_file():
        raise CheckpointError(
            f"{path} holds both {st.WEIGHTS_NAME} and {st.INDEX_NAME}: two saves mixed. "
            "Remove the older one (or save the weights again)"
        )
    if single.is_file():
        return {single: None}
    if index.is_file():
        return _indexed(index)
    found = sorted(p.name for p in path.iterdir())[:8]
    raise CheckpointError(
        f"{path} holds no {st.WEIGHTS_NAME} or {st.INDEX_NAME} (it holds: "
        f"{', '.join(found) or 'nothing'}). Pass a folder that save_weights wrote, or a "
        ".safetensors file"
    )


def _indexed(index: Path) -> dict[Path, list[str] | None]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        if not isinstance(weight_map, dict):
            raise TypeError("weight_map is not a dict")
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(
            f"{index} is not a safetensors index ({type(exc).__name__}: {exc}): it needs "
            '{"weight_map": {name: file}}. Save the weights again'
        ) from None
    files: dict[Path, list[str] | None] = {}
    for name, file in weight_map.items():
        names = files.setdefault(index.parent / str(file), [])
        assert names is not None
        names.append(name)
    absent = [p.name for p in files if not p.is_file()]
    if absent:
        raise CheckpointError(
            f"{index} names shard files that are not in {index.parent}: "
            f"{', '.join(absent[:5])}. Copy the whole folder, or save the weights again"
        )
    return files


class _Header(NamedTuple):
    file: Path
    shape: tuple[int, ...]
    dtype: str  # safetensors' name: "F32", "BF16", "I64", "BOOL", ...


def _headers(files: dict[Path, list[str] | None]) -> dict[str, _Header]:
    """Every saved name with its file, shape and dtype, read from the headers (no data)."""
    safe_open = st.safetensors_torch(FEATURE).safe_open
    saved: dict[str, _Header] = {}
    for file, listed in files.items():
        try:
            with safe_open(str(file), framework="pt") as handle:
                names = list(handle.keys())
                for name in names:
                    part = handle.get_slice(name)
                    saved[name] = _Header(file, tuple(part.get_shape()), part.get_dtype())
        except Exception as exc:  # safetensors raises its own SafetensorError
            raise CheckpointError(
                f"{file} is not a readable safetensors file ({type(exc).__name__}: {exc}): "
                "truncated or of another format? Save the weights again"
            ) from None
        if listed is not None and sorted(listed) != sorted(names):
            lacking = sorted(set(listed) - set(names))[:5]
            raise CheckpointError(
                f"{file} lacks tensors its index lists ({', '.join(lacking) or 'others'}): "
                "the folder mixes two saves. Save the weights again"
            )
    return saved


def _load(model: nn.Module, files: dict[Path, list[str] | None], path: Path, strict: bool) -> Any:
    saved = _headers(files)
    state = model.state_dict(keep_vars=True)
    if any(_is_sharded(value) for value in state.values()):
        raise ConfigurationError(
            "load_weights got a model whose weights are sharded (set up for fsdp): load the "
            "weights into the model you built, before rt.setup / fit, which then shard them"
        )
    meta = _on_meta(model)
    aliases = st.shared_aliases(state)
    groups: dict[str, list[str]] = {}
    for name in state:
        groups.setdefault(aliases.get(name, name), []).append(name)
    missing = [
        name
        for name in state
        if name not in saved
        and not any(other in saved for other in groups[aliases.get(name, name)])
    ]
    unexpected = [name for name in saved if name not in state]
    if strict and (missing or unexpected):
        raise CheckpointError(_mismatch(path, missing, unexpected))
    wrong = [
        f"{name}: file {list(header.shape)}, model {list(state[name].shape)}"
        for name, header in saved.items()
        if name in state and tuple(state[name].shape) != header.shape
    ]
    if wrong:
        raise CheckpointError(
            f"{path} has tensors of other shapes than the model's: {'; '.join(wrong[:5])}"
            f"{' ...' if len(wrong) > 5 else ''}. Build the model with the configuration the "
            "weights were saved from"
        )
    integers = [
        f"{name}: file {header.dtype}, model {state[name].dtype}"
        for name, header in saved.items()
        if name in state
        and state[name].is_floating_point()
        and (header.dtype.startswith(("I", "U")) or header.dtype == "BOOL")
    ]
    if integers:  # load_state_dict would cast them without a word
        raise CheckpointError(
            f"{path} holds integer tensors where the model has floating-point ones: "
            f"{'; '.join(integers[:5])}. Those are not weights of this model (a file of "
            "token ids or counts?): save the weights as floats, or load them yourself with "
            "the cast you mean"
        )
    load_file = st.safetensors_torch(FEATURE).load_file
    if meta:  # no storage to copy into: checked now, read at the set-up
        pending = _record(model, files, saved, state, groups, aliases, missing, load_file)
        return LoadedWeights([], missing, unexpected, pending)
    # every file's digest verified before any tensor is copied: a damaged shard leaves the
    # model as it was (one file: read once; several: a verifying read, then the loading one)
    held: dict[str, torch.Tensor] | None = None
    if len(files) == 1:
        held = _verified(next(iter(files)), load_file)  # read once: verified, then loaded
    else:
        for file in files:  # a verifying read each, let go: one shard in memory at a time
            _verified(file, load_file)
    for file in files:
        tensors = held if held is not None else load_file(str(file))
        chunk = {k: v for k, v in tensors.items() if k in state}
        model.load_state_dict(chunk, strict=False)  # names checked above
        del chunk, tensors
    _pending_weights.forget(model)  # one recorded on meta tensors that are gone since
    loaded = [name for name in state if name not in missing]
    return LoadedWeights(loaded, missing, unexpected, [])


def _on_meta(model: nn.Module) -> bool:
    """Whether ``model`` is wholly on the meta device; refused when it is partly."""
    tensors = [(n, t) for n, t in (*model.named_parameters(), *model.named_buffers())]
    meta = [name for name, tensor in tensors if tensor.is_meta]
    if meta and len(meta) < len(tensors):
        held = [name for name, tensor in tensors if not tensor.is_meta]
        raise ConfigurationError(
            f"load_weights got a model partly on the meta device ({', '.join(meta[:3])} on "
            f"meta; {', '.join(held[:3])} with values): a copy into a meta tensor is lost, and "
            "distkit materialises only a model wholly on meta. Build it wholly under "
            "distkit.init_empty() (its weights are then read at the set-up), or wholly on the "
            "CPU"
        )
    return bool(meta)


def _record(
    model: nn.Module,
    files: dict[Path, list[str] | None],
    saved: dict[str, _Header],
    state: dict[str, Any],
    groups: dict[str, list[str]],
    aliases: dict[str, str],
    missing: list[str],
    load_file: Any,
) -> list[str]:
    """Where each of the meta ``model``'s tensors is in the files, recorded on it; the names
    recorded. Every file's digest is verified first, as for a model with values (one file in
    memory at a time); a file changed after that is refused when it is read."""
    stamps = {file: _pending_weights.file_stamp(file) for file in files}
    for file in files:
        _verified(file, load_file)
    chosen: dict[str, _pending_weights.StoredTensor] = {}
    for name in state:
        if name in missing:
            continue
        key = (
            name
            if name in saved
            else next(other for other in groups[aliases.get(name, name)] if other in saved)
        )  # a tied alias the files lack: its partner's tensor
        header = saved[key]
        chosen[name] = _pending_weights.StoredTensor(
            header.file, key, header.shape, stamps[header.file]
        )
    _pending_weights.record(model, chosen)
    return list(chosen)


def _verified(file: Path, load_file: Any) -> dict[str, torch.Tensor] | None:
    """``file``'s tensors, checked against the digest save_weights recorded; None for a file
    without one (written elsewhere: taken as it is, not read here)."""
    safe_open = st.safetensors_torch(FEATURE).safe_open
    with safe_open(str(file), framework="pt") as handle:
        recorded = (handle.metadata() or {}).get(st.DIGEST_KEY)
    if recorded is None:
        return None
    tensors: dict[str, torch.Tensor] = load_file(str(file))
    if st.tensors_digest(tensors) != recorded:
        raise CheckpointError(
            f"{file} is damaged: its tensors do not match the digest save_weights recorded "
            "(a changed bit, or a partial copy). Nothing was loaded. Copy the file again from "
            "where it was saved, or save the weights again"
        )
    return tensors


def _is_sharded(value: object) -> bool:
    if not torch.distributed.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(value, DTensor)


def _mismatch(path: Path, missing: list[str], unexpected: list[str]) -> str:
    parts = []
    if missing:
        parts.append(f"the model's {', '.join(missing[:8])} are not in the files")
    if unexpected:
        parts.append(f"the files' {', '.join(unexpected[:8])} are not in the model")
    return (
        f"{path} does not match the model: {'; '.join(parts)}. Build the model the weights were "
        "saved from, or pass strict=False to load the names both have (the result lists the "
        "rest)"
    )
