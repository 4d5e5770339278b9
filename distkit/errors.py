"""Exceptions raised by distkit.

Every error says what was given, what is allowed, and how to fix it. Each class also derives
from the builtin exception that fits, so ``except ValueError`` in user code keeps working.
"""

from __future__ import annotations


class DistkitError(Exception):
    """Base class of every error distkit raises on purpose."""


class UnknownStrategyError(DistkitError, ValueError):
    """The strategy name is not registered."""


class MissingDependencyError(DistkitError, ImportError):
    """A backend library that the chosen strategy needs is not installed or not usable."""


class StrategyPluginError(DistkitError, ImportError):
    """A plugin's strategy cannot be loaded; the message names its distribution and the fix."""


class LauncherMismatchError(DistkitError, RuntimeError):
    """The process was started by a launcher that the chosen strategy cannot run under."""


class ConfigurationError(DistkitError, ValueError):
    """An argument (or a combination of arguments) is invalid."""


class UnsupportedFeatureError(DistkitError, RuntimeError):
    """The chosen backend cannot offer a requested feature on this machine."""


class ApexNotInstalledError(MissingDependencyError):
    """strategy='apex' but no ``apex`` package is importable."""


class ApexImpostorError(MissingDependencyError):
    """The importable ``apex`` is not NVIDIA apex (PyPI's ``apex`` is an unrelated package)."""


class ApexNeedsCudaError(UnsupportedFeatureError):
    """NVIDIA apex is CUDA-only and no CUDA device is available."""


class ApexLegacyApiMissingError(UnsupportedFeatureError):
    """``strict=True`` asked for apex.amp / apex.parallel, which apex >= 25.07 removed."""


class PeerFailureError(DistkitError, RuntimeError):
    """Another rank failed (or vanished) during ``fit``, so this rank stopped too.

    Attributes:
        failed_rank: the rank that failed first, if known.
        reason: what that rank reported (its exception type and message), or how it was lost.
    """

    def __init__(self, message: str, *, failed_rank: int | None = None, reason: str = "") -> None:
        super().__init__(message)
        self.failed_rank = failed_rank
        self.reason = reason


class PeerStuckError(PeerFailureError):
    """This rank's collective timed out while another rank made no progress during ``fit``.

    Raised instead of the backend's bare timeout when the ranks' published progress shows
    who was behind (``hang_warning`` on). The message names each such rank and where it was
    last seen (epoch, step, phase, and its innermost frame when known).

    Attributes:
        stuck_ranks: the ranks behind this one when its collective timed out.
    """

    def __init__(
        self,
        message: str,
        *,
        failed_rank: int | None = None,
        reason: str = "",
        stuck_ranks: tuple[int, ...] = (),
    ) -> None:
        super().__init__(message, failed_rank=failed_rank, reason=reason)
        self.stuck_ranks = stuck_ranks


class TrainingInterrupted(KeyboardInterrupt, SystemExit):
    """Ctrl-C (SIGINT) or SIGTERM stopped a ``fit``; every rank raises it (one line is printed).

    It is a ``KeyboardInterrupt``, so ``except KeyboardInterrupt`` and ``finally`` blocks run as
    usual, and a ``SystemExit`` with ``code`` 130 (Ctrl-C) or 143 (SIGTERM), so a script that
    does not catch it exits with the shell's status for that signal, without a traceback on
    every rank.
    """

    def __init__(self, message: str, *, code: int = 130) -> None:
        super().__init__(message)
        self.code = code  # 130 for Ctrl-C (SIGINT), 143 for SIGTERM


class TrainingPreempted(TrainingInterrupted):
    """A preempting signal (``Trainer(preempt_signals=...)``: SIGTERM, SIGUSR1) stopped a
    ``fit`` after every rank finished the same optimizer step, and the run was saved there.

    Every rank raises it. ``code`` is 128 + the signal's number (143 for SIGTERM, 138 for
    SIGUSR1), the status a script that does not catch it exits with: schedulers and the
    Kubeflow training operator's ``ExitCode`` restart policy treat it as retryable. The next
    start with ``resume="auto"`` continues from ``checkpoint`` exactly.

    Attributes:
        signal: the signal's number (the first one any rank received).
        step: the optimizer step every rank stopped after.
        checkpoint: the checkpoint written at that step.
    """

    def __init__(
        self, message: str, *, code: int, signal: int, step: int, checkpoint: str | None
    ) -> None:
        super().__init__(message, code=code)
        self.signal = signal
        self.step = step
        self.checkpoint = checkpoint


class RankDisagreementError(DistkitError, RuntimeError):
    """The ranks cannot run a collective call together; every rank raises it instead of hanging.

    They differ in what must match (the checkpoint they resume from, data lengths, model
    shapes, settings), some of them failed to prepare the call, they are in different calls
    (``save_checkpoint`` on rank 0 only), or another rank left while this one waited. The
    message names the ranks and their values.
    """


class TrainerClosedError(DistkitError, RuntimeError):
    """The trainer was closed (by ``close()``, or after a failed multi-process ``fit``)."""


class CheckpointError(DistkitError, RuntimeError):
    """A checkpoint could not be written or read, or does not fit what it is resumed with.

    Missing, corrupt, unsafe (needs pickled code) or of another format; or its tensors do not
    fit the model, or its optimizer state is another optimizer's.
    """


class WorkerError(DistkitError, RuntimeError):
    """A :func:`distkit.spawn` worker failed in a way that cannot be re-raised as itself: its
    exception does not pickle, it died without a word (killed, ``os._exit``), or the workers
    ran past ``timeout``. The worker's traceback, when there is one, is the ``__cause__``."""


class NonFiniteLossError(DistkitError, FloatingPointError):
    """A training loss was NaN or infinite (``nonfinite="raise"``), raised on every rank.

    The message names the value, the rank(s), the epoch and the step, and how many steps
    later it was found (the losses are read at log points, validations, checkpoints and
    epoch ends, not after every step).
    """
