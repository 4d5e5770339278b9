"""The per-rank side of a contract run: each promise's body in turn, each outcome to a file.

Both launchers run it: forked processes call :func:`run_rank`; horovodrun starts
``python -m distkit.testing._worker WORKDIR``. A body that raises becomes that promise's
failure on this rank, and the next body still runs; an outcome is written as soon as its body
ends, so a launch that hangs later still reports the promises it finished.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import sys
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distkit.launch._env import LaunchEnv
from distkit.testing._promises import promise_named
from distkit.testing._target import StrategyUnderTest

RankSetup = Callable[[], contextlib.AbstractContextManager[Any]]
_PLAN = "plan.pkl"


@dataclass(frozen=True)
class Outcome:
    """One rank's result of one promise's body: its value, or the traceback it raised."""

    ok: bool
    value: Any = None
    error: str = ""


@dataclass(frozen=True)
class Plan:
    """What every rank of one launch runs."""

    target: StrategyUnderTest
    promises: tuple[str, ...]
    rank_setup: RankSetup | None = None


def write_plan(workdir: Path, plan: Plan) -> None:
    (workdir / _PLAN).write_bytes(pickle.dumps(plan))


def read_outcome(workdir: Path, promise: str, rank: int) -> Outcome | None:
    """What ``rank`` reported for ``promise``; None when it reported nothing."""
    path = _outcome_path(workdir, promise, rank)
    if not path.exists():
        return None
    outcome = pickle.loads(path.read_bytes())
    assert isinstance(outcome, Outcome)
    return outcome


def run_rank(workdir: str) -> None:
    """Run the plan in ``workdir`` on this rank (the launcher's variables say which)."""
    folder = Path(workdir)
    plan: Plan = pickle.loads((folder / _PLAN).read_bytes())
    rank = LaunchEnv.detect().rank
    try:
        setup = plan.rank_setup() if plan.rank_setup is not None else contextlib.nullcontext()
        with setup:
            for name in plan.promises:
                _write(folder, name, rank, _run_body(name, plan.target, folder))
    except Exception:
        setup_name = getattr(plan.rank_setup, "__qualname__", repr(plan.rank_setup))
        failed = Outcome(False, error=f"rank_setup {setup_name} raised:\n" + _trace())
        for name in plan.promises:
            if not _outcome_path(folder, name, rank).exists():
                _write(folder, name, rank, failed)


def _run_body(name: str, target: StrategyUnderTest, workdir: Path) -> Outcome:
    try:
        return Outcome(True, promise_named(name).body(target, workdir))
    except Exception:
        return Outcome(False, error=_trace())


def _write(workdir: Path, promise: str, rank: int, outcome: Outcome) -> None:
    try:
        data = pickle.dumps(outcome)
    except Exception:
        data = pickle.dumps(Outcome(False, error="its result cannot be pickled:\n" + _trace()))
    path = _outcome_path(workdir, promise, rank)
    partial = path.with_suffix(".partial")
    partial.write_bytes(data)
    os.replace(partial, path)


def _outcome_path(workdir: Path, promise: str, rank: int) -> Path:
    return workdir / f"{promise}.rank{rank}.pkl"


def _trace() -> str:
    return traceback.format_exc()


if __name__ == "__main__":
    import torch

    from distkit.testing import _worker  # not this __main__ copy: outcomes pickle by its name

    torch.set_num_threads(1)
    _worker.run_rank(sys.argv[1])
