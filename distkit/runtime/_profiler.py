"""A ``torch.profiler`` run over a window of steps, one trace file per rank and cycle.

``Trainer(profiler=...)`` and ``rt.profile(...)`` take a :class:`Profiler`: which steps are
recorded (torch's ``schedule``: skip ``skip_first``, then ``repeat`` cycles of ``wait`` idle,
``warmup`` traced and thrown away, ``active`` recorded), on which ranks, and into which folder.
Each finished cycle is written as ``<dir>/rank<r>/rank<r>.<step>.pt.trace.json``: Chrome's
trace format (``chrome://tracing``, https://ui.perfetto.dev), which is also what TensorBoard's
profiler plugin reads (``tensorboard --logdir <dir>``: one run per rank). A file is written
beside its name and renamed, so a run that fails or is killed leaves whole files only.

Off (the default) nothing here is created: the step loop holds None and checks it.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from distkit._validate import check_flags, check_ints, check_path, unwritable_reason
from distkit.errors import ConfigurationError

#: what the trainer's ranges are named, ``distkit/<phase>``
RANGE_PREFIX = "distkit/"
#: ``profiler=`` values that switch the profiler on with the default settings
_ON = (True, "pytorch")


@dataclass(frozen=True)
class Profiler:
    """What ``Trainer(profiler=...)`` and ``rt.profile(...)`` record, and where.

    Args:
        dir: the folder; each profiled rank writes ``rank<r>/rank<r>.<step>.pt.trace.json``
            in it (created on the first write).
        wait: optimizer steps of each cycle that run unprofiled.
        warmup: steps traced and thrown away (the profiler's own start-up cost).
        active: steps recorded in each cycle (each is a ``ProfilerStep#<n>`` range).
        repeat: cycles; 0 repeats them until training ends (a file per cycle).
        skip_first: steps skipped once, before the first cycle.
        ranks: the ranks that profile (None: every rank); the others run no profiler.
        record_shapes: record the input shapes of each operator.
        profile_memory: record tensor allocations and frees.
        with_stack: record the Python stack of each operator (larger files).
    """

    dir: str | os.PathLike[str] = "distkit-profile"
    wait: int = 1
    warmup: int = 1
    active: int = 3
    repeat: int = 1
    skip_first: int = 0
    ranks: Sequence[int] | None = None
    record_shapes: bool = False
    profile_memory: bool = False
    with_stack: bool = False

    def __post_init__(self) -> None:
        check_path("Profiler(dir=...)", self.dir, "a folder path (str or os.PathLike)")
        if Path(self.dir).exists() and not Path(self.dir).is_dir():
            raise ConfigurationError(
                f"Profiler(dir={os.fspath(self.dir)!r}) is a file, and the traces go into a "
                "folder there: pass another dir=..., or move the file away"
            )
        unwritable = unwritable_reason(Path(self.dir))
        if unwritable is not None:  # found now, not as a raw OSError when the fit starts
            raise ConfigurationError(
                f"Profiler(dir={os.fspath(self.dir)!r}): {unwritable}, and each profiled rank "
                "makes its folder there when the fit starts; pass a dir=... this process can "
                "create and write, e.g. dir='runs/profile'"
            )
        check_ints(
            **{
                "Profiler(wait=...)": (self.wait, 0),
                "Profiler(warmup=...)": (self.warmup, 0),
                "Profiler(active=...)": (self.active, 1),
                "Profiler(repeat=...)": (self.repeat, 0),
                "Profiler(skip_first=...)": (self.skip_first, 0),
            }
        )
        check_flags(
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
        )
        if self.ranks is not None:
            ranks = self.ranks
            if isinstance(ranks, (str, bytes)) or not isinstance(ranks, Sequence) or not ranks:
                raise ConfigurationError(
                    f"Profiler(ranks={ranks!r}): pass a non-empty list of ranks, e.g. "
                    "ranks=[0], or None to profile every rank"
                )
            for rank in ranks:
                check_ints(**{"each of Profiler(ranks=...)": (rank, 0)})
            object.__setattr__(self, "ranks", tuple(sorted(set(ranks))))

    def check_world(self, world_size: int) -> None:
        """Every chosen rank exists in a world of ``world_size``."""
        missing = [r for r in self.ranks or () if r >= world_size]
        if missing:
            raise ConfigurationError(
                f"Profiler(ranks={list(self.ranks or ())}) names rank(s) {missing}, and this "
                f"job has {world_size} (ranks 0 to {world_size - 1}): choose ranks below "
                f"{world_size}, or ranks=None for every rank"
            )

    def profiles(self, rank: int) -> bool:
        return self.ranks is None or rank in self.ranks


def profiler_settings(value: object) -> Profiler | None:
    """``Trainer(profiler=...)`` as settings: None when off."""
    if value is None or value is False:
        return None
    if isinstance(value, Profiler):
        return value
    if any(value is on or (isinstance(on, str) and value == on) for on in _ON):
        return Profiler()
    raise ConfigurationError(
        f"profiler={value!r}; allowed: None or False (off), True or 'pytorch' (torch.profiler "
        "with the default window), or distkit.Profiler(dir=..., wait=..., warmup=..., "
        "active=..., ranks=...) for your own"
    )


class PhaseRanges:
    """The trainer's ``distkit/<phase>`` ranges: one open at a time, each opened where its
    phase starts and closed where the next one does (or by :meth:`end`)."""

    def __init__(self) -> None:
        self._open: torch.autograd.profiler.record_function | None = None

    def begin(self, phase: str) -> None:
        self.end()
        self._open = torch.autograd.profiler.record_function(RANGE_PREFIX + phase)
        self._open.__enter__()

    def end(self) -> None:
        if self._open is not None:
            opened, self._open = self._open, None
            opened.__exit__(None, None, None)

    def around(self, phase: str) -> torch.autograd.profiler.record_function:
        """A range for a ``with`` block (outside the step's phases: the all-reduce probe)."""
        return torch.autograd.profiler.record_function(RANGE_PREFIX + phase)


class ProfileRun:
    """One rank's profiler in a ``with`` block; :meth:`step` after every optimizer step.

    On a rank the settings leave out (``enabled`` False) it records and writes nothing, and
    :meth:`step` does nothing, so one loop runs on every rank.

    Attributes:
        folder: where this rank's traces go (``<dir>/rank<r>``).
        traces: the files written so far, one per finished cycle.
        profiler: the ``torch.profiler.profile`` (None on a rank that does not profile):
            ``run.profiler.key_averages().table()`` once the block ends.
    """

    def __init__(self, settings: Profiler, rank: int, device: torch.device) -> None:
        self.settings = settings
        self.rank = rank
        self.enabled = settings.profiles(rank)
        self.folder = Path(settings.dir) / f"rank{rank}"
        self.traces: list[Path] = []
        self.steps = 0  # optimizer steps run under this profiler
        self.ranges = PhaseRanges()
        self.profiler: torch.profiler.profile | None = None
        if not self.enabled:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profiler = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(
                wait=settings.wait,
                warmup=settings.warmup,
                active=settings.active,
                repeat=settings.repeat,
                skip_first=settings.skip_first,
            ),
            on_trace_ready=self._write,
            record_shapes=settings.record_shapes,
            profile_memory=settings.profile_memory,
            with_stack=settings.with_stack,
        )

    def step(self) -> None:
        """One step done (call it after each optimizer step): the window moves on."""
        if self.profiler is not None:
            self.steps += 1
            self.profiler.step()

    def __enter__(self) -> ProfileRun:
        if self.profiler is not None:
            self.folder.mkdir(parents=True, exist_ok=True)
            self.profiler.__enter__()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        # always stopped, on an error too: a cycle cut short is written whole, and no
        # profiler stays on in this process
        self.ranges.end()
        if self.profiler is not None:
            self.profiler.__exit__(kind, error, traceback)
            if kind is None:  # a failing run has its own error to say
                self._warn_if_nothing_recorded()

    def _warn_if_nothing_recorded(self) -> None:
        """A run that ended before the window's first active step: say so, not a silent
        empty folder (torch writes a cycle cut short in its active steps, none before)."""
        s = self.settings
        before = s.skip_first + s.wait + s.warmup  # steps before the first recorded one
        if self.steps > before:
            return
        window = (
            f"Profiler(skip_first={s.skip_first}, wait={s.wait}, warmup={s.warmup}, "
            f"active={s.active})"
        )
        written = (
            f"its trace {str(self.traces[0])!r} holds only what ran after the last step"
            if self.traces
            else f"no trace was written to {str(self.folder)!r}"
        )
        warnings.warn(
            f"{window} records optimizer steps {before + 1} to {before + s.active} (counted "
            f"from 1), and this run ended after {self.steps} step(s) under it: no step was "
            f"profiled on rank {self.rank}, and {written}. Lower skip_first, wait or warmup "
            f"(e.g. Profiler(wait=0, warmup=1, active=1) records the second step), or "
            "profile a longer run",
            stacklevel=3,
        )

    def _write(self, profiler: Any) -> None:
        """A finished cycle's trace, written beside its name and renamed (never half a file)."""
        path = self.folder / f"rank{self.rank}.{profiler.step_num}.pt.trace.json"
        partial = path.with_name(f".{path.name}.tmp")
        try:
            profiler.export_chrome_trace(os.fspath(partial))
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
        self.traces.append(path)


def open_profile(
    settings: Profiler | None, rank: int, device: torch.device, world_size: int
) -> ProfileRun | None:
    """A fit's profiler on this rank: None when off, or when this rank is not chosen."""
    if settings is None:
        return None
    settings.check_world(world_size)
    if not settings.profiles(rank):
        return None
    return ProfileRun(settings, rank, device)


def user_profile(
    settings: Profiler | None,
    options: dict[str, Any],
    *,
    rank: int,
    world_size: int,
    device: torch.device,
) -> ProfileRun:
    """``rt.profile(settings, **options)``'s run: ``options`` replace fields of
    ``settings`` (or of the defaults)."""
    if settings is not None and not isinstance(settings, Profiler):
        raise ConfigurationError(
            f"rt.profile takes a distkit.Profiler or keyword arguments, got "
            f"{type(settings).__name__}: rt.profile(wait=1, warmup=1, active=3, dir='...')"
        )
    names = {f.name for f in dataclasses.fields(Profiler)}
    unknown = sorted(set(options) - names)
    if unknown:
        raise ConfigurationError(
            f"rt.profile got unknown argument(s) {unknown}; allowed: {', '.join(sorted(names))}"
        )
    chosen = dataclasses.replace(settings or Profiler(), **options)
    chosen.check_world(world_size)
    return ProfileRun(chosen, rank, device)
