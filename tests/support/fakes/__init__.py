"""Fake third-party packages for distkit's tests (test doubles; no vendor code).

NVIDIA apex cannot be installed on these CPU machines (CUDA-only, not on PyPI; the PyPI package
named ``apex`` is an unrelated Pyramid toolkit). Three fake ``apex`` packages stand in for the
three things ``import apex`` can find in the wild:

``FAKES_DIR / "apex_legacy"``
    NVIDIA apex <= 25.04: ``apex.amp``, ``apex.parallel``, ``apex.fp16_utils``,
    ``apex.optimizers``, ``apex.normalization``.
``FAKES_DIR / "apex_modern"``
    NVIDIA apex >= 25.07: only ``apex.optimizers`` and ``apex.normalization``; importing
    ``apex.amp`` / ``apex.parallel`` / ``apex.fp16_utils`` raises ``ModuleNotFoundError``.
``FAKES_DIR / "apex_impostor"``
    PyPI ``apex`` 0.9.10dev (Pyramid auth toolkit): ``import apex`` raises
    ``ModuleNotFoundError: No module named 'pyramid_mailer'``.

Both NVIDIA fakes share one implementation (``FAKES_DIR / "_apex_common"``, loaded by each as
its private subpackage ``apex._common``) and record every fake API call in ``apex.CALLS`` (a
list of ``(name, details)``; ``apex.reset_calls()`` empties it). The current amp loss scale is
read as with real apex: ``apex.amp._amp_state.loss_scalers[0].loss_scale()``.

Activate one with::

    from tests.support.fakes import use_fake_apex

    with use_fake_apex("legacy"):
        import apex
        from apex import amp

For a subprocess (torchrun), put ``str(FAKE_APEX_DIRS["legacy"])`` first on ``PYTHONPATH``.
"""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path

FAKES_DIR = Path(__file__).resolve().parent

FAKE_APEX_DIRS: dict[str, Path] = {
    "legacy": FAKES_DIR / "apex_legacy",
    "modern": FAKES_DIR / "apex_modern",
    "impostor": FAKES_DIR / "apex_impostor",
}


def _drop_apex_modules() -> None:
    for name in [n for n in sys.modules if n == "apex" or n.startswith("apex.")]:
        del sys.modules[name]


@contextlib.contextmanager
def use_fake_apex(kind: str) -> Iterator[Path]:
    """Make ``import apex`` find the ``kind`` fake ("legacy", "modern" or "impostor").

    Drops every cached ``apex`` / ``apex.*`` module before and after, puts the fake's directory
    first on ``sys.path`` and restores ``sys.path`` exactly on exit. Each activation imports a
    fresh package (fresh ``CALLS`` list, fresh amp state). Yields the directory. Code that kept
    a reference to an ``apex`` module from an earlier activation keeps the old module: import
    apex inside functions, not at module level, in code under test.
    """
    try:
        directory = FAKE_APEX_DIRS[kind]
    except KeyError:
        raise ValueError(
            f"unknown fake apex kind {kind!r}; expected one of {sorted(FAKE_APEX_DIRS)}"
        ) from None
    saved_path = list(sys.path)
    _drop_apex_modules()
    sys.path.insert(0, str(directory))
    importlib.invalidate_caches()
    try:
        yield directory
    finally:
        _drop_apex_modules()
        sys.path[:] = saved_path
        importlib.invalidate_caches()


__all__ = ["FAKES_DIR", "FAKE_APEX_DIRS", "use_fake_apex"]
