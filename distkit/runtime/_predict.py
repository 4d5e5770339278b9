"""``predict``: every sample's output once, in the data's order, whatever the world size.

Each rank runs the evaluation pass over its shard (the same shards, the same spare forward
passes where the strategy's forward communicates), keeps each real batch's output on the CPU,
then the ranks exchange their batch sizes: from them every rank knows where each of its
samples sits in the data's order (:mod:`distkit.data._sample_order`). Then the outputs are
gathered (``gather="all"``: to every rank; ``"main"``: kept by rank 0) or written to a file
per rank (``gather=None``, ``write_to=folder``).

An output that is not one value per sample is found on the rank that made it; that rank goes
on with its forward passes (another may wait in one of them) and every rank raises after the
pass, naming it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from distkit._validate import check_path
from distkit.batch import to_device
from distkit.data import LoaderSpec
from distkit.data._sample_order import counted_batches, sample_order, sample_positions
from distkit.data._stream_spec import StreamSpec
from distkit.errors import ConfigurationError
from distkit.runtime import _agreement
from distkit.runtime._outputs import batch_to_cpu, split_batch_output
from distkit.runtime._prediction_files import remove_files, write_file
from distkit.runtime._preparation import checked_placement, describe_data
from distkit.runtime._runtime_arguments import check_model
from distkit.strategies._placement import Placement
from distkit.strategies.base import Strategy

PredictFn = Callable[[nn.Module, Any], Any]
#: the values ``gather`` takes: to every rank, to rank 0, or none (each rank writes a file)
GATHER = ("all", "main", None)


def default_predict(model: nn.Module, batch: Any) -> Any:
    """``model(inputs)`` for an ``(inputs, target)`` or ``(inputs,)`` batch, ``model(**batch)``
    for a dict, ``model(batch)`` for a tensor."""
    if isinstance(batch, torch.Tensor):
        return model(batch)
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (list, tuple)) and len(batch) in (1, 2):
        return model(batch[0])
    length = f" of length {len(batch)}" if isinstance(batch, (list, tuple)) else ""
    raise ConfigurationError(
        f"predict cannot tell the inputs of a {type(batch).__name__} batch{length}: the "
        "default predict_fn takes (inputs, target) or (inputs,) batches, dicts (model(**batch)) "
        "and tensors. Pass predict_fn=lambda model, batch: model(...)"
    )


@dataclass(frozen=True)
class PredictPlan:
    """What a prediction needs, checked on every rank before it starts."""

    spec: LoaderSpec | StreamSpec
    placement: Placement
    predict_fn: PredictFn
    gather: str | None
    folder: Path | None


def prepare_predict(
    setups: Any,
    model: nn.Module,
    read: Callable[[], LoaderSpec | StreamSpec],
    predict_fn: PredictFn | None,
    gather: object,
    write_to: object,
    input_device: torch.device | None,
) -> _agreement.Proposal[PredictPlan]:
    """``predict``'s checks; ``read()`` describes its data (after the other checks)."""
    check_model(model)
    if predict_fn is not None and not callable(predict_fn):
        raise ConfigurationError(
            f"predict_fn must be callable as predict_fn(model, batch) -> output, got "
            f"{type(predict_fn).__name__}"
        )
    if not (gather is None or (isinstance(gather, str) and gather in GATHER)):
        raise ConfigurationError(
            f"gather={gather!r} is not a gather mode; allowed: 'all' (every rank returns every "
            "output), 'main' (rank 0 does, the others an empty list), None (with "
            "write_to=folder: each rank writes its outputs to a file)"
        )
    check_path("write_to", write_to, "a folder path (str or os.PathLike)")
    folder = None if write_to is None else Path(write_to)  # type: ignore[arg-type]
    if gather is None and folder is None:
        raise ConfigurationError(
            "gather=None writes each rank's outputs to a file: pass write_to=folder too (and "
            "read them with distkit.read_predictions(folder)), or gather='all' / 'main'"
        )
    if gather is not None and folder is not None:
        raise ConfigurationError(
            f"write_to= is for outputs too large to gather, written instead: pass gather=None "
            f"with it (gather={gather!r} returns them)"
        )
    if folder is not None and folder.exists() and not folder.is_dir():
        raise ConfigurationError(f"write_to={str(folder)!r} is a file; pass a folder")
    placement = checked_placement(setups, model, input_device)
    spec = read()
    agreed = {"data samples": describe_data(spec), "gather": repr(gather)}
    plan = PredictPlan(spec, placement, predict_fn or default_predict, gather, folder)
    return _agreement.Proposal(agreed, plan)


def predict_shard(
    strategy: Strategy,
    module: nn.Module,
    batches: Iterable[tuple[Any, int]],
    predict_fn: PredictFn,
    placement: Placement,
) -> tuple[list[tuple[int, Any]], str | None]:
    """This rank's real batches' (size, output on the CPU), and the first output that is not
    one value per sample (in words; then no more outputs are kept, but every forward pass
    runs). In eval mode under ``torch.no_grad()`` and the strategy's autocast; the module's
    mode is restored after."""
    kept: list[tuple[int, Any]] = []
    error = None
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad():
            for number, (batch, size) in enumerate(batches):
                with strategy.autocast():
                    output = predict_fn(module, to_device(batch, placement.input_device))
                if not size or error is not None:
                    continue  # a spare pass (or one past a refused output): only the forward
                try:
                    kept.append((size, batch_to_cpu(output, size)))
                except ConfigurationError as exc:
                    error = f"rank {strategy.rank}, batch {number} of its shard: {exc}"
    finally:
        module.train(was_training)
    return kept, error


def run_predict(strategy: Strategy, module: nn.Module, plan: PredictPlan, seed: int) -> list[Any]:
    """The prediction of an agreed ``plan`` (a collective); ``seed`` seeds a stream's
    shuffling and the DataLoader workers, as for ``evaluate``."""
    batches = counted_batches(strategy, plan.spec, seed)
    if plan.folder is not None:
        plan.folder.mkdir(parents=True, exist_ok=True)
        if strategy.local_rank == 0:  # no rank writes before the exchange of sizes below
            remove_files(plan.folder)
    kept, error = predict_shard(strategy, module, batches, plan.predict_fn, plan.placement)
    sizes = [size for size, _ in kept]
    # a tensor-parallel group's ranks predict the same samples: its first rank's count
    leader = strategy.data_leader
    exchanged: list[tuple[list[int], str | None, bool]] = strategy.all_gather_object(
        (sizes, error, leader)
    )
    errors = [message for _, message, _ in exchanged if message is not None]
    if errors:
        raise ConfigurationError("predict_fn's output is not one value per sample: " + errors[0])
    counts = [rank_sizes for rank_sizes, _, counted in exchanged if counted]
    positions = sample_positions(sample_order(plan.spec), counts)
    total = sum(len(p) for p in positions)
    records = list(
        zip(positions[strategy.data_rank].split(sizes), (out for _, out in kept), strict=True)
    )
    if not leader:
        records = []
    if plan.folder is not None:
        try:
            if leader:
                share, shares = strategy.data_rank, strategy.data_world_size
                write_file(plan.folder, share, shares, total, records)
            failure = None
        except (OSError, ConfigurationError) as exc:
            failure = f"rank {strategy.rank} could not write its file: {type(exc).__name__}: {exc}"
        # every rank returns once every file is written, or raises where one could not be
        failures = [f for f in strategy.all_gather_object(failure) if f is not None]
        if failures:
            raise ConfigurationError(f"predict(write_to={str(plan.folder)!r}): {failures[0]}")
        return []
    gathered: list[list[tuple[torch.Tensor, Any]]] = strategy.all_gather_object(records)
    if plan.gather == "main" and not strategy.is_main:
        return []
    return in_order(gathered, total)


def in_order(per_rank: Iterable[Iterable[tuple[torch.Tensor, Any]]], total: int) -> list[Any]:
    """Every rank's (positions, batch output) records as one output per sample, in order."""
    samples: list[Any] = [None] * total
    for records in per_rank:
        for positions, output in records:
            for position, sample in zip(
                positions.tolist(), split_batch_output(output, len(positions)), strict=True
            ):
                samples[position] = sample
    return samples
