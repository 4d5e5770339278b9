"""A small key-value channel beside the collectives: failure notices, progress, stacks.

Collectives block while a peer is missing, so ranks that must tell each other "I failed" or
"I am still in step 5, forward" need another path. torch.distributed offers the rendezvous
store (a TCP key-value server); horovodrun offers its rendezvous HTTP key-value server. A
strategy hands one out through :meth:`~distkit.Strategy.side_channel`; the watchdog and the
failure handling talk to it only through :class:`SideChannel`, never from the training step.
"""

from __future__ import annotations

from typing import Protocol

FAILURE_KEY = "distkit/failure"


def progress_key(rank: int) -> str:
    return f"distkit/progress/{rank}"


def ack_key(rank: int) -> str:
    """Set by a rank once it has read the failure notice."""
    return f"distkit/ack/{rank}"


def stack_key(rank: int) -> str:
    return f"distkit/stack/{rank}"


class SideChannel(Protocol):
    """Strings by key, shared by every rank of one group (one job attempt)."""

    def set(self, key: str, value: str) -> None:
        """Store ``value`` under ``key`` (overwrites)."""

    def get(self, key: str) -> str | None:
        """The value under ``key``, or None when there is none yet (never blocks)."""

    def set_first(self, key: str, value: str) -> str:
        """Store ``value`` unless ``key`` holds one already; returns the value that is stored."""

    def get_many(self, keys: list[str]) -> list[str | None]:
        """:meth:`get` for several keys (one round trip where the channel allows)."""


def announce_failure(channel: SideChannel | None, message: str) -> bool:
    """Leave a failure notice for the peers; True if it is the first one (ours is shown)."""
    if channel is None:
        return True
    return channel.set_first(FAILURE_KEY, message) == message


def peer_failure(channel: SideChannel | None) -> str | None:
    """The first failure notice any rank left, if any."""
    return None if channel is None else channel.get(FAILURE_KEY)
