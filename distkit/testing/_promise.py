"""What a promise is: a per-rank body, a verifier of every rank's results, and when it applies."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from distkit.testing._target import StrategyUnderTest

#: ``body(strategy, workdir)`` runs on every rank and returns picklable results
Body = Callable[[StrategyUnderTest, Path], Any]
#: ``verify(results_in_rank_order, world_size)`` raises AssertionError saying what differed
Verify = Callable[[list[Any], int], None]


@dataclass(frozen=True)
class Promise:
    """One promise every strategy keeps.

    Attributes:
        name: the name in :data:`distkit.testing.PROMISES`.
        summary: the promise in a few words, for messages.
        body: what every rank runs.
        verify: what the calling process checks of all the ranks' results.
        min_world_size: the fewest processes with which the promise says anything.
    """

    name: str
    summary: str
    body: Body
    verify: Verify
    min_world_size: int = 1

    def not_applicable(self, world_size: int) -> str | None:
        """Why this promise cannot be checked with ``world_size`` processes (None: it can)."""
        if world_size >= self.min_world_size:
            return None
        return (
            f"{self.name} compares runs at two world sizes and needs world_size >= "
            f"{self.min_world_size}; this run has {world_size} process (a strategy that runs "
            "as a single process has no other world size to compare with)"
        )


def expect(condition: bool, message: str) -> None:
    """Raise AssertionError(message) unless ``condition`` (kept under ``python -O`` too)."""
    if not condition:
        raise AssertionError(message)


def max_abs_diff(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> float:
    """The largest absolute difference between two state dicts with the same keys."""
    expect(a.keys() == b.keys(), f"different parameter names: {sorted(a)} vs {sorted(b)}")
    return max(
        ((a[k].double() - b[k].double()).abs().max().item() for k in a if a[k].numel()),
        default=0.0,
    )


def close(a: Any, b: Any, tolerance: float = 1e-6) -> bool:
    """Whether numbers, or dicts and lists of them, agree within ``tolerance`` (relative)."""
    if isinstance(a, dict) or isinstance(b, dict):
        return (
            isinstance(a, dict)
            and isinstance(b, dict)
            and a.keys() == b.keys()
            and all(close(a[k], b[k], tolerance) for k in a)
        )
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)):
        return (
            isinstance(a, (list, tuple))
            and isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(close(x, y, tolerance) for x, y in zip(a, b, strict=True))
        )
    if not (isinstance(a, (int, float)) and isinstance(b, (int, float))):
        return False
    return abs(float(a) - float(b)) <= tolerance * max(1.0, abs(float(b)))


def expect_norms_like_one_process(
    results: list[dict[str, Any]], one: dict[str, Any], *, clip: float, tolerance: float, what: str
) -> None:
    """Each rank's gradient norms before clipping (``"norms"``) equal one process's, and
    that process's exceed ``clip`` somewhere (else the promise would not test clipping);
    ``what`` names where the norms come from, for the message."""
    expect(
        any(norm > clip for norm in one["norms"]),
        f"the workload's gradient norms {one['norms'][:4]}... never exceed {clip}: "
        "the promise would not test clipping",
    )
    for rank, r in enumerate(results):
        expect(
            close(r["norms"], one["norms"], tolerance),
            f"rank {rank}: the gradient norms before clipping ({what}) {r['norms'][:4]}... "
            f"differ from one process's at N times the batch {one['norms'][:4]}... (clipping "
            "must see the averaged, unscaled, accumulated gradients)",
        )
