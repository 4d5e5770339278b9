"""The per-rank watchdog thread of a multi-process ``fit``.

It never touches the training step. Every ``interval`` seconds it:

* looks for a failure notice another rank left; if one appears and this rank's main thread has
  not left ``fit`` within ``grace`` seconds (blocked somewhere the failed peer's closed
  connections do not reach), it says so in one line and exits the process;
* publishes this rank's :class:`~distkit.faults._progress.Progress` (and, once its progress has
  stood still for half of ``hang_warning``, its main thread's stack);
* on rank 0, names every rank stuck behind the others for ``hang_warning`` seconds.
"""

from __future__ import annotations

import sys
import threading
import time

from distkit.faults._channel import SideChannel, ack_key, peer_failure, progress_key, stack_key
from distkit.faults._last_resort import exit_now
from distkit.faults._progress import HangDetector, Progress, describe_stall, main_thread_stack

EXIT_CODE = 1


class Watchdog:
    """A daemon thread; :meth:`stop` ends it and waits for it (so no store call outlives it).

    Args:
        channel: the strategy's side channel.
        rank, world_size: this rank and the number of ranks.
        progress: this rank's progress, written by the training loop.
        interval: seconds between looks for a failure notice.
        grace: seconds the main thread has to leave ``fit`` after a peer failed before the
            process exits (None: never exit, only the collectives' own errors stop it).
        hang_warning: seconds without progress before a rank is named (None: off). This
            rank's progress is published when it changed, every ``interval`` at most (one
            store write a second at most: a rank waiting in a call its peers never join
            reads where they are, see runtime/_call_tags); rank 0 reads every rank's every
            ``hang_warning / 8`` seconds (at least ``interval``), so the cost on the store
            stays small for big jobs.
    """

    def __init__(
        self,
        channel: SideChannel,
        *,
        rank: int,
        world_size: int,
        progress: Progress,
        interval: float,
        grace: float | None,
        hang_warning: float | None,
    ) -> None:
        self.channel = channel
        self.rank = rank
        self.world_size = world_size
        self.progress = progress
        self.interval = interval
        self.grace = grace
        self.hang_warning = hang_warning
        self.notice: str | None = None  # the failure notice, once seen (the store may go)
        self._heartbeat_every = None if hang_warning is None else max(interval, hang_warning / 8)
        self._next_heartbeat = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="distkit-watchdog", daemon=True)
        self._published = ""
        self._unchanged_since = 0.0
        self._stack_sent = False
        self._detector = (
            HangDetector(hang_warning) if hang_warning is not None and rank == 0 else None
        )

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                if self.grace is not None:
                    notice = peer_failure(self.channel)
                    if notice is not None:
                        self.notice = notice
                        self.channel.set(ack_key(self.rank), "1")
                        self._wait_then_exit(notice)
                        return
                now = time.monotonic()
                if self.hang_warning is not None:
                    self._publish(now)
                if self._heartbeat_every is not None and now >= self._next_heartbeat:
                    self._next_heartbeat = now + self._heartbeat_every
                    self._heartbeat(now)
            except Exception:
                # the channel went away: its host may have died (then the next collective
                # fails and the main thread stops) or just finished first: never guess
                return

    def _wait_then_exit(self, notice: str) -> None:
        # (on gloo a peer blocked in a collective with the failed rank wakes when that rank's
        # process exits: DDP keeps the group's connections open until then)
        assert self.grace is not None
        if self._stop.wait(self.grace):
            return  # the main thread left fit (its collective failed): it handles the rest
        exit_now(
            f"distkit: rank {self.rank} is still blocked {self.grace:g}s after a peer failed "
            f"({notice}); exiting",
            EXIT_CODE,
        )

    def _publish(self, now: float) -> None:
        """This rank's progress into the store, when it changed."""
        text = self.progress.encode()
        if text != self._published:
            self._published, self._unchanged_since, self._stack_sent = text, now, False
            self.channel.set(progress_key(self.rank), text)

    def _heartbeat(self, now: float) -> None:
        """The stuck rank's stack, and rank 0's look at every rank (after :meth:`_publish`)."""
        assert self.hang_warning is not None
        text = self._published  # what _publish just put in the store
        if not self._stack_sent and now - self._unchanged_since >= self.hang_warning / 2:
            # tagged with the progress it belongs to, so a stale stack is never shown
            self.channel.set(stack_key(self.rank), f"{text}\n{main_thread_stack()}")
            self._stack_sent = True
        if self._detector is None:
            return
        published = self.channel.get_many([progress_key(r) for r in range(self.world_size)])
        for stall in self._detector.observe(now, published):
            tag, _, stack = (self.channel.get(stack_key(stall.rank)) or "").partition("\n")
            shown = stack if tag == stall.text else None
            print(describe_stall(stall, shown), file=sys.stderr, flush=True)
