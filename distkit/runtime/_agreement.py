"""Ranks agree before a collective call, or every one of them fails saying why.

Ranks whose collectives run out of step hang (or, on gloo, fail later with an error that
names nothing useful): one resumed from a checkpoint that another cannot see, one has a
dataset of another length, one called ``save_checkpoint`` under ``if trainer.is_main:``.
So ``fit``, ``evaluate`` and ``save_checkpoint`` begin with one gather of a small message
per rank (a tagged sum of the pickles' sizes, then the pickles): the call it is in, the
values that must match (strings), what it shares with the others, or the error it met while
preparing. Every rank receives the same
list and takes the same decision: go on, or raise :class:`RankDisagreementError` naming the
ranks and their values. A rank's own error before the exchange is part of the exchange too,
so no rank is left waiting for one that raised.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import torch
from torch import nn

from distkit.errors import RankDisagreementError
from distkit.runtime import _call_tags
from distkit.runtime._call_tags import rank_groups as _groups
from distkit.runtime._call_tags import ranks_text as _ranks
from distkit.strategies.base import Strategy

T = TypeVar("T")

COLLECTIVE = _call_tags.COLLECTIVE
FIXES = {
    "fit": "Give every rank the same checkpoint (a checkpoint_dir every rank can read, or the "
    "same resume= file), the same data and model, and the same Trainer settings.",
    "evaluate": "Give every rank the whole evaluation data: distkit shards it itself.",
    "predict": "Give every rank the whole data to predict, and the same gather: distkit "
    "shards the data itself.",
    "save_checkpoint": COLLECTIVE + ".",
    "rt.save": _call_tags.collective_fix("rt.save") + ".",
    "save_weights": "save_weights is collective: call it on every rank (rank 0 writes; do "
    "not guard it with `if rt.is_main:`), with the same model and max_shard_size.",
    "setup": "Set up the same model (the same shapes) with the same optimizers on every rank.",
    "loader": "Iterate the loader on every rank, the same epochs in the same order (no "
    "loop under `if rt.is_main:`; loader.epoch(e) with the same e everywhere).",
}


@dataclass(frozen=True)
class Proposal(Generic[T]):
    """What a rank prepared for a call: ``agreed`` must match on every rank, ``shared`` is
    sent to every rank, ``local`` stays here."""

    agreed: dict[str, str]
    local: T
    shared: Any = None
    # per agreed key: this rank's (name, value) items, gathered only when the key differs,
    # to say where (e.g. which parameter's shape)
    details: dict[str, Callable[[], list[tuple[str, str]]]] = field(default_factory=dict)


@dataclass(frozen=True)
class Message:
    """What one rank sends (plain strings and the shared object: cheap to pickle)."""

    call: str
    agreed: dict[str, str]
    shared: Any = None
    error: str | None = None


def exchange(
    strategy: Strategy, call: str, prepare: Callable[[], Proposal[T]]
) -> tuple[T, list[Any]]:
    """``prepare()`` here, then agree with every rank; returns (local, every rank's shared).

    Raises:
        RankDisagreementError: on every rank, when ranks are in different calls, disagree on
            an agreed value, or some (not all) failed to prepare.
        Exception: the rank's own error when every rank failed to prepare (or in a world of
            one), as itself.
    """
    try:
        prepared = prepare()
    except Exception as exc:
        if strategy.world_size > 1:  # raises unless every rank failed, each on its own
            _gather(strategy, Message(call, {}, error=f"{type(exc).__name__}: {exc}"), exc)
        raise
    if strategy.world_size == 1:
        return prepared.local, [prepared.shared]
    messages = _gather(strategy, Message(call, prepared.agreed, prepared.shared))
    if disagreement(messages) is not None:
        raise RankDisagreementError(_explain(messages, _detail(strategy, messages, prepared)))
    return prepared.local, [message.shared for message in messages]


def per_data_rank(strategy: Strategy, per_rank: list[Any]) -> list[Any]:
    """Every rank's entry (in rank order) as one per data-parallel rank: under tensor
    parallelism, the first rank's of each tensor-parallel group (its others hold the same
    data state and random streams); elsewhere ``per_rank`` as given. No collective."""
    if strategy.data_world_size == strategy.world_size:
        return per_rank
    return [per_rank[ranks[0]] for ranks in strategy.data_groups]


def _gather(strategy: Strategy, mine: Message, error: Exception | None = None) -> list[Message]:
    """Every rank's message; raises when this rank failed to prepare (``error``) and others
    did not."""
    try:
        messages: list[Message] = _exchange_messages(strategy, mine)
    except RankDisagreementError:
        raise
    except Exception as exc:
        if not strategy.is_peer_loss(exc):
            raise
        raise RankDisagreementError(
            f"rank {strategy.rank} waited for the other ranks in {mine.call}, but one of them "
            f"went away ({str(exc).split('. ')[0][:300]}). If only some ranks call "
            f"{mine.call}, that is the cause: {_call_tags.collective_fix(mine.call)}."
        ) from exc
    if error is not None:
        if all(message.error is not None and message.call == mine.call for message in messages):
            return messages  # every rank failed on its own: each raises its own error
        raise RankDisagreementError(_explain(messages)) from error
    return messages


def _exchange_messages(strategy: Strategy, mine: Message) -> list[Message]:
    """Every rank's message, in two collectives and two host reads: first a sum that every
    collective between fit's steps also is (a rank in one of those instead, which did not
    make this call, fails there as this one does), carrying each rank's pickled size in a
    slot of its own; then one gather of the pickles, padded to the largest."""
    size, rank = strategy.world_size, strategy.rank
    payload = pickle.dumps(mine)
    slots = [0.0] * size
    slots[rank] = float(len(payload))
    lengths = [int(n) for n in _call_tags.tagged_sum(strategy, mine.call, slots)]
    padded = torch.zeros(max(lengths), dtype=torch.uint8)
    padded[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    gathered = strategy.all_gather(padded)
    rows = (gathered if gathered.device.type == "cpu" else gathered.cpu()).numpy()
    return [pickle.loads(rows[r, :n].tobytes()) for r, n in enumerate(lengths)]


def disagreement(messages: Sequence[Message]) -> str | None:
    """What the ranks' messages disagree on, in words (None when they agree). Pure."""
    calls = _groups([m.call for m in messages])
    if len(calls) > 1:
        where = "; ".join(f"{_ranks(ranks)} in {call}" for call, ranks in calls)
        fix = _call_tags.collective_fix(messages[0].call)
        return f"the ranks are in different calls: {where}. {fix}."
    call = messages[0].call
    failed = _groups([m.error for m in messages])
    if any(error is not None for error, _ in failed):
        lines = [f"{_ranks(r)} could not prepare {call}: {e}" for e, r in failed if e is not None]
        ready = [r for e, rs in failed if e is None for r in rs]
        if ready:
            verb = "was" if len(ready) == 1 else "were"
            lines.append(f"{_ranks(ready)} {verb} ready; every rank stops instead of waiting")
        return "\n".join(lines)
    lines = []
    for key in _keys(messages):
        values = _groups([m.agreed.get(key, "(not given)") for m in messages])
        if len(values) > 1:
            lines.append(f"  {key}: " + "; ".join(f"{_ranks(r)}: {v}" for v, r in values))
    if not lines:
        return None
    return f"the ranks disagree on what {call} needs to match:\n" + "\n".join(lines)


def _explain(messages: Sequence[Message], detail: str = "") -> str:
    """The disagreement, where it lies, and the fix (ranks in different calls carry theirs)."""
    fix = "" if len({m.call for m in messages}) > 1 else f"\n{FIXES.get(messages[0].call, '')}"
    return f"{disagreement(messages)}{detail}{fix}"


def _detail(strategy: Strategy, messages: Sequence[Message], prepared: Proposal[Any]) -> str:
    """For agreed keys that differ and have details, where they first differ (a 2nd gather).

    Every rank reaches this with the same messages, so all of them take part or none.
    """
    if any(m.error is not None for m in messages) or len(_groups([m.call for m in messages])) > 1:
        return ""
    keys = [
        key
        for key in _keys(messages)
        if key in prepared.details and len(_groups([m.agreed.get(key) for m in messages])) > 1
    ]
    if not keys:
        return ""
    mine = {key: prepared.details[key]() for key in keys}
    per_rank: list[dict[str, list[tuple[str, str]]]] = strategy.all_gather_object(mine)
    return "".join(f"\n  {key}, {first_difference([d[key] for d in per_rank])}" for key in keys)


def first_difference(per_rank: Sequence[Sequence[tuple[str, str]]]) -> str:
    """Where ranks' (name, value) lists first differ, e.g. ``first at 0.weight: ...``. Pure."""
    longest = max(len(items) for items in per_rank)
    for index in range(longest):
        cells = [tuple(items[index]) if index < len(items) else None for items in per_rank]
        if len(_groups(cells)) > 1:
            shown = _groups(["(none)" if c is None else f"{c[0]} {c[1]}" for c in cells])
            return "first difference: " + "; ".join(f"{_ranks(r)}: {v}" for v, r in shown)
    return "no difference item by item"


def describe_model(model: nn.Module) -> str:
    """Its class, tensor and parameter counts and a digest of the state's names and shapes
    (the class too: two models of the same shapes set up in another order on some rank)."""
    shapes = named_shapes(model)
    digest = hashlib.sha1(repr(shapes).encode()).hexdigest()[:10]
    values = sum(p.numel() for p in model.parameters())
    kind = type(model).__qualname__
    return f"a {kind}: {len(shapes)} tensors, {values:,} parameter values, shapes #{digest}"


def named_shapes(model: nn.Module) -> list[tuple[str, str]]:
    """(name, shape) of every tensor in the model's state (parameters and buffers)."""
    return [(k, str(tuple(v.shape))) for k, v in model.state_dict().items() if hasattr(v, "shape")]


def _keys(messages: Sequence[Message]) -> list[str]:
    keys: dict[str, None] = {}
    for message in messages:
        keys.update(dict.fromkeys(message.agreed))
    return list(keys)
