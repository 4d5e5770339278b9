"""Collectives that say which call each rank is in, so ranks in different calls fail at once.

A collective called on some ranks only (``save_checkpoint`` under ``if trainer.is_main:`` in a
callback, ``evaluate`` from ``on_epoch_end`` on one rank) meets whatever collective the other
ranks run next. Two different collectives paired by the backend do not fail: they wait, or
exchange each other's bytes, until the collective timeout. So every collective ``fit`` runs
between the steps (the stop check, log points, the non-finite check) and the first of every
agreement (``fit``, ``evaluate``, ``save_checkpoint``) is one and the same operation: a
host-side sum of a vector of one fixed length, in which each rank writes the code of its call
in a slot of its own. Whatever pair of them meets, the sum completes, every rank reads every
rank's call, and when they differ every rank raises the same
:class:`~distkit.errors.RankDisagreementError`, naming the calls.

What this cannot catch: a rank that has gone on into a collective of another kind, the
gradient all-reduce of the next training step, while another rank calls ``evaluate`` from
``on_train_step_end``. There the hang warning names the rank that waits
(``Trainer(hang_warning=...)``).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any

import torch

from distkit.errors import RankDisagreementError
from distkit.strategies.base import Strategy

#: the calls, as messages name them (their order gives their codes: never reorder)
CALLS = {
    "fit": "fit",
    "evaluate": "evaluate",
    "save_checkpoint": "save_checkpoint",
    "stop": "fit's stop check (after a step, a validation or an epoch)",
    "log": "fit's log point",
    "nonfinite": "fit's non-finite loss check",
    "setup": "rt.setup",
    "loader": "an epoch of rt.loader (its first batch)",
    "barrier": "rt.barrier",
    "items": "an optimizer step's item count (token-exact losses)",
    "predict": "predict",
    "save_weights": "save_weights",
    "preempt": "fit's preemption stop (after the agreed step)",
}
_CODES = {call: float(code) for code, call in enumerate(CALLS, start=1)}
_NAMES = {code: CALLS[call] for call, code in _CODES.items()}
#: the operation's name where a backend matches operations by name (Horovod): one for all
NAME = "distkit.call"
COLLECTIVE = (
    "fit, evaluate and save_checkpoint are collective: call them on every rank, in the same "
    "order, and from callbacks only where every rank calls them (distkit writes checkpoints "
    "from rank 0: do not guard save_checkpoint with `if trainer.is_main:`)"
)


def payload_slots(world_size: int) -> int:
    """The numbers every tagged sum carries besides the tags (the most any call needs: the
    non-finite check's three per rank)."""
    return 3 * world_size


def tagged_sum(strategy: Strategy, call: str, values: Sequence[float] = ()) -> list[float]:
    """The sum over ranks of ``values`` (host-side numbers), once every rank is in ``call``.

    A collective: one host-side all-reduce of ``4 x world_size`` float64 numbers.

    Raises:
        RankDisagreementError: on every rank, when some rank is in another call.
    """
    size, rank = strategy.world_size, strategy.rank
    slots = payload_slots(size)
    if len(values) > slots:
        raise ValueError(f"{len(values)} values in a tagged sum: at most {slots}")
    vector = torch.zeros(slots + size, dtype=torch.float64)
    vector[: len(values)] = torch.tensor([float(v) for v in values], dtype=torch.float64)
    vector[slots + rank] = _CODES[call]
    total = strategy.all_reduce_async(vector, name=NAME).wait().tolist()
    codes = total[slots:]
    if any(code != _CODES[call] for code in codes):
        raise RankDisagreementError(_different_calls(codes))
    return total[: len(values)]


def _different_calls(codes: Sequence[float]) -> str:
    other = "a collective of another kind (no call tag)"
    calls = rank_groups([_NAMES.get(code, other) for code in codes])
    where = "; ".join(f"{ranks_text(ranks)} in {name}" for name, ranks in calls)
    return f"the ranks are in different calls: {where}. {COLLECTIVE}."


def rank_groups(values: Sequence[Hashable]) -> list[tuple[Any, list[int]]]:
    """Ranks grouped by value, in order of first appearance."""
    groups: dict[Hashable, list[int]] = {}
    for rank, value in enumerate(values):
        groups.setdefault(value, []).append(rank)
    return list(groups.items())


def ranks_text(ranks: Sequence[int]) -> str:
    """``rank 2`` / ``ranks 0,1`` / ``ranks 0-5,7``."""
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and spans[-1][1] == rank - 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    text = ",".join(
        str(a) if a == b else f"{a},{b}" if b == a + 1 else f"{a}-{b}" for a, b in spans
    )
    return f"rank {text}" if len(ranks) == 1 else f"ranks {text}"
