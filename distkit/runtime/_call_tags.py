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

A rank that has gone on into a collective of another kind instead (the gradient all-reduce
of its next step, while rank 0 alone calls ``rt.save`` or ``evaluate``) never meets the sum:
the sums run on a gloo group of their own, so the two wait instead of pairing (on one group
gloo aborted the process). The waiting rank then reads where every rank is (the progress the
watchdog publishes, ``hang_warning`` on): a rank further on than this one, for longer than
the publication's delay, has passed this call and will not join it, and this rank raises
:class:`~distkit.errors.RankDisagreementError` naming it; its failure then stops the others.
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from typing import Any

import torch

from distkit.errors import RankDisagreementError
from distkit.faults._channel import SideChannel, progress_key
from distkit.faults._progress import Position
from distkit.strategies._collectives import PendingSum
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
    "rt.save": "rt.save",
    "full_state_dict": "full_state_dict",
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
    """The numbers every tagged sum carries besides the tags (the most any call needs: a log
    point's three with the non-finite check's three per rank)."""
    return 3 * world_size + 3


def tagged_sum(strategy: Strategy, call: str, values: Sequence[float] = ()) -> list[float]:
    """The sum over ranks of ``values`` (host-side numbers), once every rank is in ``call``.

    A collective: one host-side all-reduce of ``4 x world_size + 3`` float64 numbers (on one
    rank, none: ``values`` come back as they are).

    Raises:
        RankDisagreementError: on every rank, when some rank is in another call.
    """
    size, rank = strategy.world_size, strategy.rank
    slots = payload_slots(size)
    if len(values) > slots:
        raise ValueError(f"{len(values)} values in a tagged sum: at most {slots}")
    if size == 1:  # one rank: the sum is its own numbers, and no other rank can differ
        return [float(v) for v in values]
    vector = torch.zeros(slots + size, dtype=torch.float64)
    vector[: len(values)] = torch.tensor([float(v) for v in values], dtype=torch.float64)
    vector[slots + rank] = _CODES[call]
    total = _joined(strategy, strategy.all_reduce_async(vector, name=NAME), call).tolist()
    codes = total[slots:]
    if any(code != _CODES[call] for code in codes):
        raise RankDisagreementError(_different_calls(codes))
    return total[: len(values)]


#: a tagged sum still under way after this long starts reading where the other ranks are
LOOK_AFTER_S = 1.0
#: how long a rank must be seen further on before this one concludes it passed the call:
#: longer than the watchdogs' publication delay (MAX_INTERVAL_S, 1 s) twice over, so a
#: rank whose own progress is not published yet, or a peer that left the same sum a moment
#: before this rank saw it done, is never taken for one gone on
GONE_ON_S = 3.0


def _joined(strategy: Strategy, pending: PendingSum, call: str) -> torch.Tensor:
    """The sum, once every rank joined it; or RankDisagreementError when a rank is seen
    further on than this one (it passed this call: see the module's docstring)."""
    done = getattr(pending, "done", None)  # a plugin's sum may offer only wait()
    if done is None or strategy.world_size == 1:
        return pending.wait()
    start = time.monotonic()
    look_at, delay, ahead_since = start + LOOK_AFTER_S, 2e-5, None
    channel = None
    while not done():
        time.sleep(delay)
        delay = min(delay * 2, 0.01)
        now = time.monotonic()
        if now < look_at:
            continue
        look_at = now + 0.25
        channel = channel or strategy.side_channel()
        if channel is None:
            return pending.wait()
        mine, ahead = _further_on(channel, strategy.rank, strategy.world_size)
        if not ahead:
            ahead_since = None
        elif ahead_since is None:
            ahead_since = now
        elif now - ahead_since >= GONE_ON_S and not done():
            abandon = getattr(pending, "abandon", None)
            if abandon is not None:
                abandon()  # or this rank's clean-up would wait for the sum forever
            raise RankDisagreementError(_gone_on(call, mine, ahead, now - start))
    return pending.wait()


def _further_on(
    channel: SideChannel, rank: int, world_size: int
) -> tuple[Position | None, list[tuple[int, Position]]]:
    """This rank's published position, and the ranks published further on than it."""
    published = channel.get_many([progress_key(r) for r in range(world_size)])
    positions = {r: Position.decode(text) for r, text in enumerate(published) if text}
    mine = positions.get(rank)
    if mine is None:
        return None, []
    return mine, [
        (r, p) for r, p in positions.items() if p is not None and p.key > mine.key and r != rank
    ]


def _gone_on(
    call: str, mine: Position | None, ahead: list[tuple[int, Position]], waited: float
) -> str:
    where = "; ".join(f"rank {r} in {p.describe()}" for r, p in ahead)
    here = "" if mine is None else f" ({mine.describe()})"
    return (
        f"this rank waited {waited:.0f}s in {CALLS[call]}{here} for ranks that went on past "
        f"it: {where}. They will not join it. {collective_fix(call)}."
    )


#: the Runtime's own collectives: a mismatch among them names the Runtime's calls
_RUNTIME_CALLS = ("rt.save", "barrier", "loader", "setup", "full_state_dict")


def collective_fix(call: str) -> str:
    """What to do when ranks are not all in ``call``: the Runtime's calls name the Runtime's."""
    if call == "preempt":
        return (
            "the ranks agree on the preemption stop at the same optimizer step: in your own "
            "loop call rt.preempted() exactly once per optimizer step on every rank (not "
            "under a condition that differs between ranks)"
        )
    if call in _RUNTIME_CALLS:
        return (
            "rt.save, rt.barrier, rt.setup, rt.evaluate and (for a sharded model) "
            "full_state_dict are collective: call them on every rank at the same point of "
            "the loop (rt.save writes from rank 0 by itself: do not guard it with "
            "`if rt.is_main:`)"
        )
    return COLLECTIVE


def _different_calls(codes: Sequence[float]) -> str:
    other = "a collective of another kind (no call tag)"
    calls = rank_groups([_NAMES.get(code, other) for code in codes])
    where = "; ".join(f"{ranks_text(ranks)} in {name}" for name, ranks in calls)
    names = set(codes)
    user_loop = {_CODES[c] for c in _RUNTIME_CALLS}
    text = collective_fix("rt.save") if names & user_loop else COLLECTIVE
    return f"the ranks are in different calls: {where}. {text}."


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
