"""``rt.save_weights`` / ``trainer.save_weights``: the full model as safetensors, from any backend.

A collective. The ranks first agree (one tagged exchange, so a call on some ranks only fails
on every rank instead of hanging); then every rank plans the same shards from names, shapes
and dtypes alone, and fetches the tensors one by one in that order through the strategy's
:meth:`~distkit.strategies.capabilities.StateIO.full_tensor` (fsdp: an all-gather each).
Rank 0 keeps the tensors of the shard being filled, writes it, lets it go: it holds about one
shard's bytes at a time, never the whole model (a ``.safetensors`` file path is one shard).
A failed write on rank 0 does not stop the fetching (the others would wait in a gather that
rank 0 never joins): rank 0 drops the rest, and every rank learns of the failure at the end,
in the broadcast that also holds every rank until the files are complete.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from torch import nn

from distkit.checkpoint import _pretrained, _storage
from distkit.checkpoint import _safetensors as st
from distkit.errors import ConfigurationError
from distkit.runtime import _agreement
from distkit.runtime._rank_zero_write import share_outcome
from distkit.runtime._set_up import SetUpModel
from distkit.strategies.base import Strategy

CALL = "save_weights"
DEFAULT_MAX_SHARD_SIZE = "5GB"


@dataclass(frozen=True)
class Written:
    """What a save wrote (the same on every rank, but ``peak_held``)."""

    files: list[Path | str]  # the weight files, in shard order (URLs on a store)
    index: Path | str | None  # a sharded folder's index
    configs: list[Path | str]  # a transformers model's config files
    total_size: int  # bytes of tensor data
    #: rank 0: the most tensor bytes it held at once (0 on the other ranks)
    peak_held: int

    @property
    def paths(self) -> list[Path | str]:
        """Every file written, the weights first."""
        return [*self.files, *([self.index] if self.index else []), *self.configs]


@dataclass(frozen=True)
class _Plan:
    module: nn.Module
    path: Path
    max_bytes: int


def save_weights(
    strategy: Strategy,
    model: object,
    path: object,
    *,
    max_shard_size: object = DEFAULT_MAX_SHARD_SIZE,
    what: str = "rt.save_weights",
    options: dict[str, Any] | None = None,
) -> Written:
    """``model``'s full weights into ``path`` (see the module docstring). A collective."""

    def prepare() -> _agreement.Proposal[_Plan]:
        if not isinstance(model, nn.Module):
            raise ConfigurationError(
                f"{what} takes a torch.nn.Module (the model rt.setup returned, or your own), "
                f"got {type(model).__name__}"
            )
        if not isinstance(path, (str, os.PathLike)):
            raise ConfigurationError(
                f"{what}'s path must be a str or os.PathLike (a .safetensors file, or a "
                f"folder), got {type(path).__name__} {path!r}"
            )
        max_bytes = st.parse_size(max_shard_size)
        st.safetensors_torch(what)  # missing on one rank: every rank says so, none hangs
        module = strategy.unwrap(model.module if isinstance(model, SetUpModel) else model)
        st.weight_specs(module.state_dict(keep_vars=True))  # refuses non-tensor entries
        target = Path(path)
        if strategy.is_main:
            st.check_target(target)  # rank 0 writes: its file system is the one that counts
        agreed = {
            "model": _agreement.describe_model(module),
            "max_shard_size": str(max_bytes),
            "layout": "one file" if st.is_file_path(target) else "a folder",
        }
        details = {"model": lambda: _agreement.named_shapes(module)}
        return _agreement.Proposal(agreed, _Plan(module, target, max_bytes), details=details)

    if isinstance(path, (str, os.PathLike)) and _storage.is_url(path):
        url = str(os.fspath(path))
        return _save_to_store(strategy, model, url, max_shard_size, what, options)
    plan, _ = _agreement.exchange(strategy, CALL, prepare)
    return _write(strategy, plan, what)


def _save_to_store(
    strategy: Strategy,
    model: object,
    url: str,
    max_shard_size: object,
    what: str,
    options: dict[str, Any] | None,
) -> Written:
    """Weights to a URL: written to a local folder as to a local path (rank 0's), then
    uploaded, the weights first; every rank learns how the upload went."""
    with _storage.staged("weights") as folder:
        local = folder / _storage.name_of(url)
        written = save_weights(strategy, model, local, max_shard_size=max_shard_size, what=what)
        failure = None
        if strategy.is_main:
            try:
                _storage.upload_tree(local, url, options)
            except Exception as exc:
                failure = exc
        share_outcome(strategy, failure, f"the weights to {url}")
    moved = lambda path: _storage.join(url, path.name) if path != local else url  # noqa: E731
    return Written(
        files=[moved(p) for p in written.files],
        index=None if written.index is None else moved(written.index),
        configs=[moved(p) for p in written.configs],
        total_size=written.total_size,
        peak_held=written.peak_held,
    )


def _write(strategy: Strategy, plan: _Plan, what: str) -> Written:
    state_io = strategy.state_io
    entries = state_io.weight_entries(plan.module)  # every rank (a legacy plugin gathers)
    specs, _aliases = st.weight_specs(entries)
    one_file = st.is_file_path(plan.path)
    shards = [specs] if one_file else st.plan_shards(specs, plan.max_bytes)
    target = st.target_for(plan.path, len(shards))
    main = strategy.is_main
    writer = st.ShardWriter(what) if main else None
    failure: Exception | None = None
    for file, shard in zip(target.files, shards, strict=True):
        for spec in shard:  # every rank, in the same order: a sharded tensor is gathered
            tensor = state_io.full_tensor(entries[spec.name], keep=writer is not None)
            if writer is not None and tensor is not None:
                writer.add(spec.name, tensor)
            del tensor
        if writer is not None:
            try:
                writer.write(file)
            except Exception as exc:  # the others go on gathering: stop writing, not fetching
                failure, writer = exc, None
    peak_held = 0 if writer is None else writer.peak_held
    if main and failure is None:
        try:
            _finish(plan.module, target, shards)
        except Exception as exc:
            failure = exc
    share_outcome(strategy, failure, f"the weights to {plan.path}")
    folder = target.folder
    return Written(
        files=list(target.files),
        index=target.index_file,
        configs=[] if folder is None else list(_pretrained.config_files(plan.module, folder)),
        total_size=sum(spec.nbytes for spec in specs),
        peak_held=peak_held,
    )


def _finish(module: nn.Module, target: st.Target, shards: list[list[st.TensorSpec]]) -> None:
    """Rank 0, once every shard is written: the index, a transformers config, the sweep."""
    if target.index_file is not None:
        st.write_index(target, shards)
    if target.folder is not None and _pretrained.is_pretrained(module):
        _pretrained.write_configs(module, target.folder)
    st.remove_stale(target)
