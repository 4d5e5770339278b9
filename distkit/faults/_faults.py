"""When one rank fails, every rank stops soon, and the user's own handlers still run.

Without this, a rank that raises leaves the others blocked in a collective until its timeout
(30 minutes by default). During ``fit``:

* the rank that raises leaves a notice for its peers (through the strategy's side channel),
  closes its trainer, waits (briefly) until every peer's watchdog has seen the notice, and
  **re-raises its exception**: the user's ``except``, ``finally`` and ``with`` blocks run, and
  an uncaught error prints its traceback once;
* a peer whose collective fails because of that (when the failed rank's connections close)
  raises :class:`~distkit.PeerFailureError` naming the failed rank and its error; if its main
  thread is still stuck ``fault_timeout`` seconds after the notice, its watchdog says so in one
  line and exits the process;
* Ctrl-C: the first rank to see it prints one line for the whole job, and every rank raises
  :class:`~distkit.errors.TrainingInterrupted` (a ``KeyboardInterrupt`` that exits with status
  130 and no traceback when uncaught); a rank whose main thread stays blocked in C++ past the
  grace cannot raise it: it tells its peers and exits with 130 (143 for SIGTERM);
* a collective that times out while a peer's published progress is behind this rank's raises
  :class:`~distkit.errors.PeerStuckError` naming that rank and where it was, not the backend's
  bare timeout.
"""

from __future__ import annotations

import contextlib
import functools
import json
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

from distkit.errors import DistkitError, PeerFailureError, PeerStuckError, TrainingInterrupted
from distkit.faults import _channel
from distkit.faults._channel import SideChannel, ack_key, progress_key, stack_key
from distkit.faults._last_resort import exit_now
from distkit.faults._preempt import Preemption, active, listening
from distkit.faults._progress import Position, Progress
from distkit.faults._say import say
from distkit.faults._signals import Terminated, terminate_as_exception
from distkit.faults._watchdog import EXIT_CODE, Watchdog


class Watched(Protocol):
    """What the fail-fast guard reads of the strategy it watches (every ``Strategy`` has
    these): faults sit below the strategies and name none of them."""

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    def side_channel(self) -> SideChannel | None: ...

    def is_peer_loss(self, exc: BaseException) -> bool: ...


INTERRUPT = "interrupt"
ERROR = "error"
MAX_INTERVAL_S = 1.0  # how often a watchdog looks for a failure notice, at most
DEFAULT_TERM_GRACE_S = 10.0  # after a SIGTERM, when fault_timeout=None
BLOCKED_NOTICE_S = 2.0  # at most this long to leave a notice before a blocked rank exits


@contextlib.contextmanager
def fail_fast(
    strategy: Watched,
    *,
    fault_timeout: float | None,
    hang_warning: float | None,
    progress: Progress,
    on_failure: Callable[[], None],
    preempt: Preemption | None = None,
) -> Iterator[None]:
    """Run a ``fit``; on an exception, tell the peers, run ``on_failure``, then raise.

    Args:
        strategy: the trainer's strategy (its side channel carries the notices).
        fault_timeout: seconds a rank may stay stuck after a peer failed before it exits
            (None: no watchdog exit, and the failing rank keeps its frames' variables).
        hang_warning: seconds without progress before rank 0 names a stuck rank (None: off).
        progress: this rank's progress, written by the training loop.
        on_failure: releases what the run holds (closes the trainer); runs before the
            exception propagates, bounded by ``fault_timeout``.
        preempt: the signals that preempt the run (noted; the loop stops at a step every
            rank agrees on), or None.
    """
    if preempt is not None:
        channel = strategy.side_channel() if strategy.world_size > 1 else None
        if strategy.world_size > 1 and channel is None:
            if strategy.rank == 0:
                say(
                    f"distkit: {type(strategy).__name__} offers no side channel, so its ranks "
                    "cannot agree on a step to stop at: preempt_signals are ignored, and "
                    "SIGTERM stops the job at once"
                )
            preempt = None
        else:
            preempt.start(rank=strategy.rank, world_size=strategy.world_size, channel=channel)
    try:
        with (
            active(preempt),
            _guard(strategy, fault_timeout, hang_warning, progress, on_failure, preempt),
        ):
            yield
    finally:
        if preempt is not None:
            preempt.close()


@contextlib.contextmanager
def _guard(
    strategy: Watched,
    fault_timeout: float | None,
    hang_warning: float | None,
    progress: Progress,
    on_failure: Callable[[], None],
    preempt: Preemption | None,
) -> Iterator[None]:
    if strategy.world_size == 1:
        try:
            with listening(preempt):
                yield
        except KeyboardInterrupt as exc:
            if isinstance(exc, TrainingInterrupted):
                raise
            where = _where(progress)
            say(f"distkit: rank 0 interrupted (Ctrl-C) in {where}; stopping every rank")
            raise TrainingInterrupted(f"training interrupted (Ctrl-C) in {where}") from None
        return
    periods = [t / 4 for t in (fault_timeout, hang_warning) if t is not None]
    interval = max(0.2, min([MAX_INTERVAL_S, *periods]))
    channel = strategy.side_channel()
    watchdog = None
    if channel is not None and (fault_timeout is not None or hang_warning is not None):
        watchdog = Watchdog(
            channel,
            rank=strategy.rank,
            world_size=strategy.world_size,
            progress=progress,
            interval=interval,
            grace=fault_timeout,
            hang_warning=hang_warning,
        )
        watchdog.start()
    grace = fault_timeout or DEFAULT_TERM_GRACE_S
    on_blocked = functools.partial(_exit_blocked, strategy, progress, grace)
    try:
        with terminate_as_exception(grace, on_blocked, preempt) as term:
            try:
                yield
            except BaseException as exc:
                term.handling = True  # from now on a SIGTERM only marks it, a SIGINT is ignored
                if watchdog is not None:
                    watchdog.stop()
                if preempt is not None:
                    preempt.close()  # out of the store too, before the group is released
                # without a watchdog on this rank there is none on the peers either: no acks
                ack_wait = 0.0 if watchdog is None else 2 * interval + 1.0
                failure = _Failure(strategy, progress, fault_timeout, on_failure, ack_wait)
                seen = None if watchdog is None else watchdog.notice
                replacement = failure.handle(exc, seen, terminated=term.received)
                if replacement is None:
                    raise
                raise replacement from None
    finally:
        if watchdog is not None:
            # out of the store before anyone can destroy the process group (a store call
            # racing with teardown aborts the process)
            watchdog.stop()


@dataclass
class _Failure:
    """What one rank does with the exception that ended its multi-process ``fit``."""

    strategy: Watched
    progress: Progress
    grace: float | None
    on_failure: Callable[[], None]
    ack_wait: float  # how long the first failing rank waits for its peers to see its notice

    def handle(
        self, exc: BaseException, seen: str | None, *, terminated: bool = False
    ) -> BaseException | None:
        """Announce, release, and choose what to raise (None: the original exception).

        ``terminated``: a SIGTERM arrived (the launcher stops this rank, usually because a
        peer failed); ``seen``: the failure notice the watchdog read, if any.
        """
        if isinstance(exc, TrainingInterrupted):
            return None  # already handled (a nested fit)
        rank = self.strategy.rank
        notice, reachable = self._read_notice(seen)
        peer = notice if notice is not None and notice.get("rank") != rank else None
        # a SIGTERM explains a collective's failure after it (the launcher stopping this
        # rank), not an error of distkit's own: that is the cause, said as itself (a
        # preempting SIGTERM that met a RankDisagreementError, say)
        own = isinstance(exc, DistkitError) and not isinstance(exc, PeerFailureError)
        if isinstance(exc, Terminated) or (terminated and peer is None and not own):
            if peer is not None:  # stopped by the launcher because that peer failed
                self._release(first=False)
                return _peer_failure_error(rank, peer)
            where = _where(self.progress)
            first = reachable and self._announce(INTERRUPT, f"terminated (SIGTERM) in {where}")
            if first:
                say(f"distkit: rank {rank} terminated (SIGTERM) in {where}; stopping every rank")
            self._release(first)
            return TrainingInterrupted(f"training terminated (SIGTERM) in {where}", code=143)
        if isinstance(exc, KeyboardInterrupt):
            where = _where(self.progress)
            text = f"interrupted (Ctrl-C) in {where}"
            first = self._announce(INTERRUPT, text) if reachable else rank == 0 and not notice
            if first:
                say(f"distkit: rank {rank} {text}; stopping every rank")
            self._release(first)
            return TrainingInterrupted(f"training {text}")
        if peer is not None and peer.get("kind") == INTERRUPT:
            # a peer was interrupted (or terminated): stop the same way, silently
            text = str(peer.get("text", "interrupted"))
            self._release(first=False)
            code = 143 if "SIGTERM" in text else 130
            return TrainingInterrupted(
                f"training stopped: rank {peer.get('rank')} {text}", code=code
            )
        if self.strategy.is_peer_loss(exc) or (peer is not None and _collective_error(exc)):
            if peer is None:
                detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
                peer = {"kind": ERROR, "rank": None, "text": f"a peer went away ({detail})"}
                if reachable:
                    self._announce(ERROR, peer["text"])
            self._release(first=False)
            return _peer_failure_error(rank, peer)
        stuck = self._stuck_peers(exc) if peer is None and reachable else None
        if stuck is not None:
            first = self._announce(ERROR, _summary(stuck))
            self._release(first)
            return stuck
        first = reachable and self._announce(ERROR, _summary(exc))
        self._release(first)
        return None

    def _read_notice(self, seen: str | None) -> tuple[dict[str, Any] | None, bool]:
        """The first failure notice (read now, or as the watchdog saw it) and whether the
        side channel answered."""
        raw, reachable = seen, False
        with contextlib.suppress(Exception):  # the channel's host may have gone
            raw = _channel.peer_failure(self.strategy.side_channel()) or seen
            reachable = self.strategy.side_channel() is not None
        if raw is None:
            return None, reachable
        try:
            notice = json.loads(raw)
        except ValueError:
            notice = None
        if not isinstance(notice, dict):
            notice = {"kind": ERROR, "rank": None, "text": raw}
        return notice, reachable

    def _stuck_peers(self, exc: BaseException) -> PeerStuckError | None:
        """The error naming the ranks this one waited for, when ``exc`` is a collective's
        timeout (None: not a timeout, or no rank to name: ``exc`` says all there is).

        A collective of every rank that times out lacks at least one of them. Named: the
        ranks whose last published progress is behind this rank's; failing those, the ranks
        at the same point whose main thread was last seen elsewhere than this rank's
        collective call; failing those, the one rank at the same point whose stack is not
        known, if every other rank is accounted for (with two ranks: the other one).
        Progress (and, once it has stood still for ``hang_warning / 2``, the stack) is
        published only while ``hang_warning`` is on, every ``hang_warning / 8`` seconds: a
        rank is named where it was last seen.
        """
        own = Position.decode(self.progress.encode())
        channel = self.strategy.side_channel()
        if own is None or channel is None or not _timed_out(exc):
            return None
        rank, size = self.strategy.rank, self.strategy.world_size
        try:
            published = channel.get_many([progress_key(r) for r in range(size)])
            stacks = channel.get_many([stack_key(r) for r in range(size)])
        except Exception:  # the channel's host may have gone: keep the backend's error
            return None
        here = _call_that_raised(exc)
        behind: dict[int, str] = {}
        level: dict[int, str] = {}
        unknown: dict[int, str] = {}
        for r, text in enumerate(published):
            position = Position.decode(text or "")
            if r == rank or position is None or position.key > own.key:
                continue
            tag, _, frames = (stacks[r] or "").partition("\n")
            frame = _innermost_frame(frames) if tag == text and frames.strip() else None
            seen = f"rank {r} was last seen in {position.describe()}"
            if frame is not None:
                seen += f", at {frame[0]}:{frame[1]} in {frame[2]}" + (
                    f": {frame[3]}" if frame[3] else ""
                )
            if position.key < own.key:
                behind[r] = seen
            elif frame is None:
                unknown[r] = seen
            elif frame[:3] != here:  # not waiting where this rank waits
                level[r] = seen
        accounted = all(text is not None for text in published)
        named = behind or level or (unknown if len(unknown) == 1 and accounted else {})
        if not named:
            return None
        ranks = sorted(named)
        who = f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"
        return PeerStuckError(
            f"rank {rank} timed out in a collective in {own.describe()}, waiting for {who}: "
            f"{'; '.join(named[r] for r in ranks)}. A rank that makes no progress (a "
            "deadlocked data loader, an endless loop, a hung device) or waits in another "
            "collective holds every rank up until the collective timeout "
            f"(Trainer(collective_timeout=...)). The backend said: {_summary(exc)}",
            failed_rank=ranks[0],
            reason=f"made no progress: {named[ranks[0]]}",
            stuck_ranks=tuple(ranks),
        )

    def _announce(self, kind: str, text: str) -> bool:
        """Leave a notice for the peers; True if it was the job's first."""
        notice = {"kind": kind, "rank": self.strategy.rank, "text": text}
        place = getattr(self.strategy, "place", None)  # "pipeline stage 1 of 2", or None
        if isinstance(place, str):
            notice["place"] = place
        message = json.dumps(notice)
        try:
            return _channel.announce_failure(self.strategy.side_channel(), message)
        except Exception:
            return self.strategy.rank == 0  # the channel broke: let rank 0 speak for the job

    def _release(self, first: bool) -> None:
        """Close the trainer (bounded by ``grace``); the first failing rank then waits for acks.

        Peers learn of the failure from the side channel. When this rank hosts that channel
        (rank 0 under a plain ``env://`` rendezvous, without torchrun's agent), it must live
        until every peer's watchdog has read the notice, so the first failing rank waits (at
        most ``ack_wait``) for their acknowledgements before its error propagates.
        """
        channel = self.strategy.side_channel() if first else None
        if not first:
            _acknowledge(self.strategy)  # another rank's notice came first: it may wait for us
        peers = [r for r in range(self.strategy.world_size) if r != self.strategy.rank]
        _bounded(self.on_failure, self.grace)
        if channel is not None:
            _wait_for_acks(channel, peers, self.ack_wait)


def _where(progress: Progress) -> str:
    return f"epoch {progress.epoch + 1}, step {progress.step + 1}"


def _exit_blocked(strategy: Watched, progress: Progress, grace: float, signum: int) -> None:
    """A signal came ``grace`` seconds ago and the main thread never ran its handler: it is
    blocked outside Python (a collective, other native code). Tell the peers, as the handler
    would have, and say so in one line; the caller exits the process next."""
    rank = strategy.rank
    name = signal.Signals(signum).name
    what = "interrupted (Ctrl-C)" if signum == signal.SIGINT else f"terminated ({name})"
    text = f"{what} in {_where(progress)}"
    message = json.dumps({"kind": INTERRUPT, "rank": rank, "text": text})
    announced: list[bool] = []

    def announce() -> None:  # a thread: a store whose host went away may not answer
        try:
            announced.append(_channel.announce_failure(strategy.side_channel(), message))
        except Exception:
            announced.append(rank == 0)

    thread = threading.Thread(target=announce, name="distkit-blocked-notice", daemon=True)
    thread.start()
    thread.join(BLOCKED_NOTICE_S)
    why = (
        f"its main thread was still blocked {grace:g}s after the signal, in a collective or "
        f"other native code, so it exits with status {128 + signum} without running its "
        "handlers"
    )
    if announced and announced[0]:
        say(f"distkit: rank {rank} {text}; stopping every rank; {why}")
    else:
        say(f"distkit: rank {rank} got {signal.Signals(signum).name}, but {why}")


def _timed_out(exc: BaseException) -> bool:
    # what gloo's collectives raise at the timeout ("Timed out waiting 3000ms for recv ...")
    return _collective_error(exc) and re.search(r"timed? ?out", str(exc), re.IGNORECASE) is not None


def _call_that_raised(exc: BaseException) -> tuple[str, int, str] | None:
    """File, line and function of the innermost Python frame ``exc`` passed through: where
    this rank called the collective (a rank blocked in the same call shows the same frame)."""
    tb = exc.__traceback__
    if tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    return tb.tb_frame.f_code.co_filename, tb.tb_lineno, tb.tb_frame.f_code.co_name


def _innermost_frame(stack: str) -> tuple[str, int, str, str] | None:
    """File, line, function and code of a formatted stack's last frame."""
    lines = stack.strip().splitlines()
    for i in range(len(lines) - 1, -1, -1):
        found = re.match(r'\s*File "(.+)", line (\d+), in (.+)', lines[i])
        if found:
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            return found[1], int(found[2]), found[3], code
    return None


def _collective_error(exc: BaseException) -> bool:
    # what a collective raises when a peer closed its connections (gloo, Horovod)
    return isinstance(exc, RuntimeError) and not isinstance(exc, DistkitError)


def _summary(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _peer_failure_error(rank: int, notice: dict[str, Any]) -> PeerFailureError:
    failed = notice.get("rank")
    reason = str(notice.get("text", ""))
    who = "another rank" if failed is None else f"rank {failed}"
    if failed is not None and notice.get("place"):
        who += f" ({notice['place']})"
    return PeerFailureError(
        f"rank {rank} stopped because {who} failed: {reason} (its own output shows the traceback)",
        failed_rank=failed,
        reason=reason,
    )


def _acknowledge(strategy: Watched) -> None:
    with contextlib.suppress(Exception):
        channel = strategy.side_channel()
        if channel is not None:
            channel.set(ack_key(strategy.rank), "1")


def _wait_for_acks(channel: SideChannel, peers: list[int], seconds: float) -> None:
    deadline = time.monotonic() + seconds
    with contextlib.suppress(Exception):
        while time.monotonic() < deadline:
            if all(v is not None for v in channel.get_many([ack_key(r) for r in peers])):
                return
            time.sleep(0.02)


def _bounded(on_failure: Callable[[], None], grace: float | None) -> None:
    """Run ``on_failure``; if it blocks beyond ``grace`` seconds, exit the process."""
    timer = None
    if grace is not None:
        timer = threading.Timer(grace, _exit_stuck, args=(grace,))
        timer.daemon = True
        timer.start()
    try:
        with contextlib.suppress(Exception):  # the original error matters more
            on_failure()
    finally:
        if timer is not None:
            timer.cancel()


def _exit_stuck(grace: float) -> None:
    exit_now(
        f"distkit: releasing the process group took more than {grace:g}s after a failure; exiting",
        EXIT_CODE,
    )
