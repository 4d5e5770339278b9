"""Run promises on real processes and say, per promise, whether the strategy kept it."""

from __future__ import annotations

import tempfile
import traceback
import unittest
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from distkit.errors import ConfigurationError
from distkit.strategies.base import Strategy
from distkit.testing._horovodrun_ranks import run_under_horovodrun
from distkit.testing._processes import plain_env, run_on_ranks, torchrun_env
from distkit.testing._promises import BY_NAME, promise_named
from distkit.testing._target import StrategyUnderTest
from distkit.testing._worker import Outcome, Plan, RankSetup, read_outcome, run_rank, write_plan
from distkit.testing._workload import DTYPE, check_dtype

#: the names of every promise, in the order a launch runs them
PROMISES: tuple[str, ...] = tuple(BY_NAME)
#: how the ranks are started: forked processes with torchrun's variables, or horovodrun
LAUNCHERS = ("processes", "horovodrun")


class PromiseSkipped(unittest.SkipTest):
    """The promise says nothing about this run (e.g. world-size invariance with one process).

    A :class:`unittest.SkipTest`, so unittest and pytest report a skip with the reason.
    """


@dataclass(frozen=True)
class ContractRun:
    """What one launch of a strategy's ranks reported, promise by promise.

    Attributes:
        strategy: the strategy's name.
        world_size: how many processes ran.
        launcher: ``"processes"`` or ``"horovodrun"``.
        outcomes: per promise that ran, each rank's outcome (None: the rank reported nothing).
        skipped: per promise that did not apply, the reason.
        problem: what went wrong with the launch itself (a rank died, a time-out), if anything.
    """

    strategy: str
    world_size: int
    launcher: str
    outcomes: Mapping[str, list[Outcome | None]] = field(default_factory=dict, repr=False)
    skipped: Mapping[str, str] = field(default_factory=dict)
    problem: str | None = None

    def check(self, promise: str) -> None:
        """Verify one promise from the ranks' results.

        Raises:
            AssertionError: the strategy broke the promise; the message names the promise,
                the strategy and what differed (or the rank's traceback).
            PromiseSkipped: the promise does not apply to this run; the message says why.
            ConfigurationError: ``promise`` is unknown, or was not run in this launch.
        """
        checked = promise_named(promise)
        if promise in self.skipped:
            raise PromiseSkipped(self.skipped[promise])
        if promise not in self.outcomes:
            raise ConfigurationError(
                f"promise {promise!r} was not run in this launch; it ran: "
                f"{', '.join(self.outcomes) or 'nothing'}. Pass it to run_promises(...)"
            )
        header = (
            f"strategy {self.strategy!r} fails promise {promise!r} ({checked.summary}) with "
            f"world_size={self.world_size} under launcher={self.launcher!r}"
        )
        values = []
        for rank, outcome in enumerate(self.outcomes[promise]):
            if outcome is None:
                why = f":\n{self.problem}" if self.problem else ""
                raise AssertionError(f"{header}: rank {rank} reported no result{why}")
            if not outcome.ok:
                raise AssertionError(f"{header}: rank {rank} raised:\n{outcome.error}")
            values.append(outcome.value)
        try:
            checked.verify(values, self.world_size)
        except AssertionError as exc:
            raise AssertionError(f"{header}: {exc}") from None
        except Exception:  # results of a shape the verifier does not expect
            raise AssertionError(
                f"{header}: its results cannot be verified:\n{traceback.format_exc()}"
            ) from None


def run_promises(
    strategy: str | type[Strategy],
    promises: Iterable[str] = PROMISES,
    *,
    world_size: int | None = None,
    launcher: str | None = None,
    strategy_kwargs: Mapping[str, Any] | None = None,
    rank_setup: RankSetup | None = None,
    timeout: float = 300.0,
    dtype: torch.dtype = DTYPE,
) -> ContractRun:
    """Run the bodies of ``promises`` in one launch of real processes; check each with ``check``.

    Launches cost seconds, so one launch runs every body in turn; a body that raises fails its
    own promise only.

    Args:
        strategy: a registered name (a plugin's entry point name works in every process), or
            a :class:`~distkit.Strategy` subclass defined at module level (the ranks import
            it by name: a ``register_strategy()`` call in the calling process is not seen by
            the ranks).
        promises: names from :data:`PROMISES` (default: all), or one name.
        world_size: how many processes (default: 1 for a strategy whose launcher family is a
            single ``python`` process, else 2).
        launcher: ``"processes"`` (forked processes with torchrun's variables, joined on
            loopback; a single-process strategy gets no launcher variables) or
            ``"horovodrun"``; default: the one the strategy's launcher family names.
        strategy_kwargs: keyword arguments for the strategy's class (picklable).
        rank_setup: a module-level callable returning a context manager that every rank
            enters around the bodies (e.g. to put a fake library on the path).
        timeout: seconds the whole launch may take.
        dtype: what the training promises train the workload (model and data) in.
            ``torch.float64`` (the default) compares N processes with one within 1e-9: in
            float64 they differ by their summation order alone, on any CPU.
            ``torch.float32`` for a strategy that cannot train float64: within 1e-5, which
            is all float32 can say (``distkit.testing._workload.TOLERANCES`` says why).

    Raises:
        ConfigurationError: an unknown promise, launcher or dtype, or a world size the
            strategy cannot run with.
        MissingDependencyError: ``launcher="horovodrun"`` without a horovodrun command.
    """
    target = StrategyUnderTest(strategy, dict(strategy_kwargs or {}), check_dtype(dtype))
    names = [promises] if isinstance(promises, str) else promises
    chosen = list(dict.fromkeys(promise_named(name).name for name in names))
    family = target.resolve().launcher.launcher
    single = family == "python"
    launcher = launcher or _default_launcher(family, target.label)
    if launcher not in LAUNCHERS:
        raise ConfigurationError(f"unknown launcher {launcher!r}. Allowed: {', '.join(LAUNCHERS)}")
    world = _world_size(world_size, single, target.label)
    exceptions = target.resolve().contract_exceptions
    skipped = {n: r for n in chosen if (r := promise_named(n).not_applicable(world)) is not None}
    skipped.update({n: f"{target.label}: {exceptions[n]}" for n in chosen if n in exceptions})
    to_run = tuple(name for name in chosen if name not in skipped)
    run = ContractRun(target.label, world, launcher, skipped=skipped)
    if not to_run:
        return run
    with tempfile.TemporaryDirectory(prefix="distkit-contract-") as tmp:
        workdir = Path(tmp)
        write_plan(workdir, Plan(target, to_run, rank_setup))
        problem = _launch(workdir, launcher, world, single, timeout)
        outcomes = {name: [read_outcome(workdir, name, r) for r in range(world)] for name in to_run}
    return ContractRun(target.label, world, launcher, outcomes, skipped, problem)


def check_promise(
    promise: str,
    strategy: str | type[Strategy],
    *,
    world_size: int | None = None,
    launcher: str | None = None,
    strategy_kwargs: Mapping[str, Any] | None = None,
    rank_setup: RankSetup | None = None,
    timeout: float = 300.0,
    dtype: torch.dtype = DTYPE,
) -> None:
    """Launch real processes and check that ``strategy`` keeps ``promise``.

    The arguments are those of :func:`run_promises`. To check several promises, run them in
    one launch with :func:`run_promises` and call :meth:`ContractRun.check` for each.

    Raises:
        AssertionError: the promise is broken; the message names the promise, the strategy
            and what differed.
        PromiseSkipped: the promise does not apply (e.g. world-size invariance at one process).
    """
    run = run_promises(
        strategy,
        [promise],
        world_size=world_size,
        launcher=launcher,
        strategy_kwargs=strategy_kwargs,
        rank_setup=rank_setup,
        timeout=timeout,
        dtype=dtype,
    )
    run.check(promise)


def _world_size(given: int | None, single: bool, label: str) -> int:
    if given is None:
        return 1 if single else 2
    if isinstance(given, bool) or not isinstance(given, int) or given < 1:
        raise ConfigurationError(f"world_size={given!r}; allowed: an int >= 1 (or None)")
    if single and given != 1:
        raise ConfigurationError(
            f"strategy {label!r} runs as a single python process; world_size={given} is not "
            "possible: pass world_size=1 (or leave it out)"
        )
    return given


def _default_launcher(family: str, label: str) -> str:
    if family in ("torchrun", "python"):
        return "processes"
    if family in LAUNCHERS:
        return family
    raise ConfigurationError(
        f"strategy {label!r} runs under {family!r}, which distkit.testing cannot start: pass "
        f"launcher= one of {', '.join(LAUNCHERS)} if the strategy also runs under it"
    )


def _launch(workdir: Path, launcher: str, world: int, single: bool, timeout: float) -> str | None:
    if launcher == "horovodrun":
        return run_under_horovodrun(workdir, world, timeout)
    try:
        run_on_ranks(
            run_rank,
            str(workdir),
            world_size=world,
            timeout=timeout,
            launcher_env=plain_env if single else torchrun_env,
            agent_store=not single,  # many Trainers, one after another, in every rank
        )
    except AssertionError as exc:  # a rank died outside the bodies, or the launch timed out
        return str(exc)
    return None
