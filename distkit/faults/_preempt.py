"""Preemption: a signal asks the job to stop, and it stops without losing a step.

A scheduler that needs the machines back signals the job and waits a while before it kills
it: SLURM sends ``--signal=USR1@90`` 90 s before the time limit (and SIGTERM when it cancels
or preempts), Kubernetes sends SIGTERM and waits ``terminationGracePeriodSeconds``. During a
``fit`` with ``preempt_signals``, such a signal does not interrupt anything: it is noted, every
rank finishes its optimizer step, the ranks agree on the step after which all of them stop,
the run is saved at that step, and ``fit`` raises
:class:`~distkit.errors.TrainingPreempted` (exit status 128 + the signal's number).

The signal may reach one rank only, or every rank at a different step, and a rank's main
thread may be blocked in a collective when it arrives. The ranks agree without a collective
per step, through the side channel (the rendezvous store, Horovod's key-value server):

1. A rank that receives a signal posts the job's *request* (first poster wins: which signal,
   which rank, when). A thread on every rank polls for it every :data:`POLL_S` seconds, so a
   rank learns of it within that time wherever its main thread is.
2. At its first step boundary after it learned of the request, each rank writes the number of
   optimizer steps it has completed (``seen/<rank>``) and trains on.
3. Once every rank's number is there, the stop step is the largest of them plus one. Every
   step of data-parallel training needs every rank's part (a gradient all-reduce), so no rank
   can complete step ``s + 1`` before the last rank to write has written its ``s``: every rank
   reads the last number at a boundary no later than the stop step, and none passes it.
4. At the stop step the ranks check with one host-side sum that they all stopped there (a
   strategy that trains without a collective per step would fail here, loudly), and the
   trainer saves.

Without a signal none of this costs a step anything: the boundary check reads one attribute.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, NoReturn

from distkit.errors import ConfigurationError, TrainingPreempted
from distkit.faults._channel import SideChannel
from distkit.faults._say import say
from distkit.launch._requeue import requeue

#: the signals a fit with a ``checkpoint_dir`` treats as preemption unless told otherwise
DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)
#: how often each rank's thread looks for the job's request (seconds)
POLL_S = 0.2
_UNCATCHABLE = (signal.SIGKILL, signal.SIGSTOP)
_PREFIX = "distkit/preempt"
#: the signals that preempt the fit running in this process now (() outside one): DataLoader
#: workers started during it ignore them (see shield_worker)
_active: tuple[int, ...] = ()

Handler = Callable[[int, FrameType | None], Any] | int | None


def preempt_signals(value: object, checkpoint_dir: object) -> tuple[signal.Signals, ...]:
    """``preempt_signals=`` as a tuple of signals (None: the default, which needs a
    ``checkpoint_dir``; ``()``: off), or a ConfigurationError naming what is wrong."""
    if value is None:
        return DEFAULT_SIGNALS if checkpoint_dir is not None else ()
    items: Iterable[object]
    if isinstance(value, (str, int)):
        items = (value,)
    elif isinstance(value, Iterable):
        items = list(value)
    else:
        raise ConfigurationError(
            f"preempt_signals must be signals (a tuple such as (signal.SIGTERM, "
            f"signal.SIGUSR1)), () to turn preemption off, or None for the default; got "
            f"{type(value).__name__}: {value!r}"
        )
    found: list[signal.Signals] = []
    for item in items:
        signum = _as_signal(item)
        if signum not in found:
            found.append(signum)
    if found and checkpoint_dir is None:
        names = ", ".join(s.name for s in found)
        raise ConfigurationError(
            f"preempt_signals=({names}) needs checkpoint_dir=...: on such a signal every rank "
            "stops after the same step and the run is saved there, so there must be a folder "
            "to save it in. Pass checkpoint_dir (with resume='auto' the next start continues "
            "from it), or preempt_signals=() to have SIGTERM stop the job at once"
        )
    return tuple(found)


def _as_signal(item: object) -> signal.Signals:
    signum: signal.Signals | None = None
    if isinstance(item, str):
        name = item.upper() if item.upper().startswith("SIG") else f"SIG{item.upper()}"
        signum = getattr(signal.Signals, name, None)
    elif isinstance(item, int) and not isinstance(item, bool):
        with contextlib.suppress(ValueError):
            signum = signal.Signals(item)
    if signum is None:
        raise ConfigurationError(
            f"preempt_signals: {item!r} is not a signal; give signal.Signals members, their "
            "numbers or names (signal.SIGTERM, 15 or 'SIGTERM')"
        )
    if signum in _UNCATCHABLE:
        raise ConfigurationError(
            f"preempt_signals: {signum.name} cannot be caught by any process, so nothing can "
            "be saved when it arrives; schedulers send SIGTERM or SIGUSR1 first (SLURM "
            "--signal=USR1@90, Kubernetes' SIGTERM before its grace period): use those"
        )
    if signum == signal.SIGINT:
        raise ConfigurationError(
            "preempt_signals: SIGINT is Ctrl-C, which stops every rank at once "
            "(TrainingInterrupted); preemption is for a scheduler's SIGTERM or SIGUSR1"
        )
    return signum


@dataclass
class Request:
    """The job's preemption request: the first signal any rank received."""

    signum: int
    rank: int
    at: float  # time.time() when it arrived

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name

    def encode(self) -> str:
        return json.dumps({"signum": self.signum, "rank": self.rank, "at": self.at})

    @classmethod
    def decode(cls, text: str) -> Request | None:
        try:
            raw = json.loads(text)
            return cls(int(raw["signum"]), int(raw["rank"]), float(raw["at"]))
        except (ValueError, KeyError, TypeError):
            return None


@dataclass
class Stop:
    """Where and how a preempted fit stopped (filled in by the loop that saves)."""

    request: Request
    step: int
    agreed_at: float  # time.time() when this rank knew the stop step
    stopped_at: float = 0.0  # when this rank reached it
    saved_at: float = 0.0  # when the checkpoint was on disk
    checkpoint: str | None = None


@dataclass
class Preemption:
    """One fit's (or one Runtime block's) preemption: its signals and the ranks' agreement.

    Args:
        signals: the signals that preempt.
        requeue: ask SLURM to requeue the job once the checkpoint is saved (rank 0).
    """

    signals: tuple[signal.Signals, ...]
    requeue: bool = False
    #: names this fit among those of one process (the same on every rank)
    key: str = "0"
    #: the handlers the signals had before: a user's own run once the run is saved
    previous: dict[int, Handler] = field(default_factory=dict)
    #: further signals that arrived once preemption had begun (ignored, counted)
    repeats: int = 0
    _rank: int = 0
    _world_size: int = 1
    _channel: SideChannel | None = None
    _prefix: str = _PREFIX
    _local: Request | None = None  # the signal this rank received
    _request: Request | None = None  # the job's (this rank's, or another rank's it read)
    _posted: bool = False
    _written: bool = False  # this rank wrote its step to seen/<rank>
    _stop_step: int | None = None
    _agreed_at: float = 0.0
    _lock: threading.RLock = field(default_factory=threading.RLock, repr=False)
    _poller: threading.Thread | None = field(default=None, repr=False)
    _halt: threading.Event = field(default_factory=threading.Event, repr=False)

    # ------------------------------------------------------------------ life
    def start(self, *, rank: int, world_size: int, channel: SideChannel | None) -> None:
        """Begin listening for the job's request (polling the side channel, when there are
        peers to hear it from)."""
        self._rank, self._world_size, self._channel = rank, world_size, channel
        self._prefix = f"{_PREFIX}/{self.key}"
        if world_size > 1 and channel is not None:
            self._poller = threading.Thread(target=self._poll, name="distkit-preempt", daemon=True)
            self._poller.start()

    def close(self) -> None:
        """Stop the polling thread (out of the store before the group can be destroyed)."""
        self._halt.set()
        if self._poller is not None:
            self._poller.join(timeout=5.0)
            self._poller = None

    # ------------------------------------------------------------------ signals
    def arrived(self, signum: int) -> None:
        """A preempting signal reached this process (from any thread, any number of times)."""
        with self._lock:
            if self._local is not None:
                self.repeats += 1
                return
            self._local = Request(int(signum), self._rank, time.time())
            if self._request is None:
                self._request = self._local

    def handler(self, signum: int, frame: FrameType | None) -> None:
        """The Python-level handler (main thread): note the signal, nothing more."""
        self.arrived(signum)

    # ------------------------------------------------------------------ agreement
    def due(self, step: int) -> bool:
        """At a step boundary (``step`` optimizer steps completed): whether every rank stops
        here. Reads one attribute until a request is known."""
        if self._request is None:
            return False
        if self._stop_step is None:
            self._agree(step)
        return self._stop_step is not None and step >= self._stop_step

    def _agree(self, step: int) -> None:
        channel = self._channel
        if self._world_size == 1 or channel is None:
            self._stop_step, self._agreed_at = step, time.time()
            return
        if not self._written:
            self._post(channel)  # before seen/<rank>: whoever reads every seen reads a request
            channel.set(f"{self._prefix}/seen/{self._rank}", str(step))
            self._written = True
        seen = channel.get_many([f"{self._prefix}/seen/{r}" for r in range(self._world_size)])
        if all(value is not None for value in seen):
            self._stop_step = max(int(value or 0) for value in seen) + 1
            self._agreed_at = time.time()

    def stop(self, step: int) -> Stop:
        """What the ranks stopped for (the job's request, as every rank reads it)."""
        request = self._read_request() or self._request or self._local
        assert request is not None  # due() was True
        return Stop(request, step, self._agreed_at or time.time(), stopped_at=time.time())

    def _read_request(self) -> Request | None:
        if self._channel is None or self._world_size == 1:
            return None
        with contextlib.suppress(Exception):
            text = self._channel.get(f"{self._prefix}/request")
            if text is not None:
                return Request.decode(text)
        return None

    def _post(self, channel: SideChannel) -> None:
        """Post this rank's signal as the job's request, unless it was posted already (the
        store keeps the first rank's)."""
        with self._lock:
            local = None if self._posted else self._local
            self._posted = self._posted or local is not None
        if local is None:
            return
        stored = channel.set_first(f"{self._prefix}/request", local.encode())
        first = Request.decode(stored)
        if first is not None:
            self._request = first

    def _poll(self) -> None:
        """Every POLL_S until the fit ends: post this rank's signal, or read the job's
        request while none is known."""
        channel = self._channel
        assert channel is not None
        key = f"{self._prefix}/request"
        while not self._halt.wait(POLL_S):
            try:
                if self._local is not None and not self._posted:
                    self._post(channel)
                elif self._request is None:
                    text = channel.get(key)
                    request = None if text is None else Request.decode(text)
                    if request is not None and self._request is None:
                        self._request = request
            except Exception:  # the channel's host went away: the failure path takes over
                return


def active_signals() -> tuple[int, ...]:
    """The signals that preempt the fit running in this process (() when none does)."""
    return _active


@contextlib.contextmanager
def active(preempt: Preemption | None) -> Iterator[None]:
    """Mark ``preempt``'s signals as this process's preempting ones for the block."""
    global _active
    before = _active
    if preempt is not None:
        _active = tuple(int(s) for s in preempt.signals)
    try:
        yield
    finally:
        _active = before


def shield_worker(signals: tuple[int, ...]) -> None:
    """In a DataLoader worker: ignore the preempting ``signals``.

    Schedulers and launchers signal a rank's whole process group (torchrun ``killpg``s each
    worker's session; ``kill -TERM -<pgid>``), which holds its DataLoader workers. PyTorch's
    workers die on SIGTERM (and on SIGUSR1, by default), and the rank then fails with "DataLoader
    worker exited unexpectedly" before it reaches the agreed step. The rank's own process
    stops the workers once the run is saved, as at any fit's end.
    """
    for signum in signals:
        signal.signal(signum, signal.SIG_IGN)


@contextlib.contextmanager
def listening(preempt: Preemption | None) -> Iterator[None]:
    """Install ``preempt``'s handler for its signals for the block (main thread only), the
    previous handlers kept in ``preempt.previous`` and put back afterwards."""
    if preempt is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    for signum in preempt.signals:
        preempt.previous[signum] = signal.signal(signum, preempt.handler)
    try:
        yield
    finally:
        for number, previous in preempt.previous.items():
            signal.signal(number, previous if previous is not None else signal.SIG_DFL)


def _users_own(handler: Handler) -> bool:
    """Whether ``handler`` is a handler of the user's (not a default, and not distkit's own:
    an outer guard's, whose SIGTERM handler would raise its termination over the save)."""
    if not callable(handler) or handler is signal.default_int_handler:
        return False
    return not str(getattr(handler, "__module__", "") or "").startswith("distkit.")


def finish(
    preempt: Preemption, stop: Stop, *, rank: int, resume: str = "with resume='auto'"
) -> NoReturn:
    """After the preemption checkpoint: the timeline (rank 0), the signal's previous handler
    (a user's own, on every rank), the requeue (rank 0), then
    :class:`~distkit.errors.TrainingPreempted` with status 128 + the signal's number.
    ``resume``: how the next start continues (the Trainer's option, or a loop's rt.load)."""
    request = stop.request
    code = 128 + request.signum
    where = f" in {stop.checkpoint}" if stop.checkpoint else ""
    timeline = (
        f"distkit: preempted: {request.name} reached rank {request.rank}; every rank stopped "
        f"after step {stop.step}, {stop.stopped_at - request.at:.2f} s after the signal; the "
        f"checkpoint{where} was saved {stop.saved_at - request.at:.2f} s after the signal (the "
        f"save took {stop.saved_at - stop.stopped_at:.2f} s); exit status {code}"
    )
    if preempt.repeats:
        timeline += f" ({preempt.repeats} more signal(s) during the stop were ignored)"
    if rank == 0:
        say(timeline)
    handler = preempt.previous.get(request.signum)
    try:
        if callable(handler) and _users_own(handler):
            handler(request.signum, None)  # it may raise or exit itself
    finally:  # the requeue happens whatever that handler did
        if preempt.requeue and rank == 0:
            say(f"distkit: {requeue()}")
    raise TrainingPreempted(
        f"training preempted by {request.name} (rank {request.rank}): every rank stopped after "
        f"step {stop.step} and the run was saved{where}; start the job again {resume} to "
        "continue",
        code=code,
        signal=request.signum,
        step=stop.step,
        checkpoint=stop.checkpoint,
    )
