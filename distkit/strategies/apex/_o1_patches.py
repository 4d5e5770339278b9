"""Legacy apex O1's torch patches, in place only while distkit runs a forward pass.

At O1, ``amp.initialize`` replaces hundreds of torch functions and Tensor methods with casting
wrappers for the rest of the process. On a GPU (an H200, torch 2.11, apex 25.04; see
docs/gpu.md) that broke code outside distkit's steps: the user's forward pass of a CPU model
after ``fit`` (apex caches a CPU tensor as its own cast, then reads the missing ``grad_fn`` of
that leaf: AttributeError), and any later training in the process without amp (apex's cast
cache is emptied only by ``amp.scale_loss``; its parent check indexes ``next_functions[1]``,
which torch 2.x's cast no longer has: IndexError).

So distkit takes the patches back right after ``amp.initialize`` and puts them in place around
its own forward passes only (the strategy's ``autocast()`` region, which the training step and
evaluation already enter), as ``torch.autocast`` is scoped. apex keeps what it patched in its
O1 handle's ``_all_wrappers`` list of ``(owner, name, original)`` (``utils.set_func_save``, in
every apex that has ``amp.initialize``); an owner is a module, a class or a dict.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any


def _get(owner: Any, name: str) -> Any:
    return owner[name] if isinstance(owner, dict) else getattr(owner, name)


def _set(owner: Any, name: str, value: Any) -> None:
    if isinstance(owner, dict):
        owner[name] = value
    else:
        setattr(owner, name, value)


@dataclass
class O1Patches:
    """apex's O1 patches, taken out of torch; :meth:`active` puts them back for a block."""

    #: ``(owner, name, original, wrapper)`` in apex's order (one name may be patched twice:
    #: its second entry's "original" is the first wrapper)
    entries: list[tuple[Any, str, Any, Any]]
    _depth: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    @classmethod
    def take(cls, handle: Any) -> O1Patches | None:
        """Restore every original apex's ``handle`` saved and keep the wrappers; None when
        the handle saved nothing (O0, O2, O3: nothing patched)."""
        saved = list(getattr(handle, "_all_wrappers", None) or [])
        if not saved:
            return None
        entries = [(owner, name, original, _get(owner, name)) for owner, name, original in saved]
        patches = cls(entries)
        patches._restore()
        handle._all_wrappers = []  # nothing left for apex's own _deactivate to swap
        return patches

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """The patches in place for the block (nested blocks: the outermost decides)."""
        with self._lock:
            self._depth += 1
            if self._depth == 1:
                for owner, name, _, wrapper in self.entries:
                    _set(owner, name, wrapper)
        try:
            yield
        finally:
            with self._lock:
                self._depth -= 1
                if self._depth == 0:
                    self._restore()

    def _restore(self) -> None:
        for owner, name, original, _ in reversed(self.entries):
            _set(owner, name, original)
