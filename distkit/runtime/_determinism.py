"""``deterministic=``: torch's process-wide switches for reproducible kernels, set while a
Runtime is open and put back as they were when it closes.

``True`` turns on ``torch.use_deterministic_algorithms`` (an operation without a
deterministic implementation raises, such as ``index_add_`` / ``scatter_add_`` on CUDA, whose
atomics add in any order), ``torch.backends.cudnn.deterministic`` and turns
``torch.backends.cudnn.benchmark`` off (its timing picks algorithms by the clock); ``"warn"``
does the same but such an operation warns instead of raising. On CUDA, cuBLAS needs
``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (or ``:16:8``) for reproducible matrix products; it is set
when unset, and cuBLAS reads it once, when the process first uses it: where CUDA was
initialised before the Runtime, a warning says so (set the variable before any CUDA work).

What this cannot make deterministic: the order a backend sums the ranks' gradients in is
fixed for a fixed topology (NCCL's ring or tree, gloo, Horovod's fusion) but differs between
world sizes, node layouts or NCCL versions; DataLoader workers' own random state (seed them
with ``worker_init_fn``); and code outside PyTorch's kernels (custom CUDA extensions, apex,
DeepSpeed's fused optimizers).
"""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass

import torch

from distkit.errors import ConfigurationError

#: the values ``deterministic=`` takes
MODES = (False, True, "warn")
CUBLAS_VARIABLE = "CUBLAS_WORKSPACE_CONFIG"
CUBLAS_SETTING = ":4096:8"


def check_deterministic(value: object) -> None:
    """``deterministic=`` is False, True or ``"warn"``."""
    if not any(value is mode or (isinstance(value, str) and value == mode) for mode in MODES):
        raise ConfigurationError(
            f"deterministic must be False, True or 'warn', got {value!r}: True makes an "
            "operation without a deterministic implementation raise, 'warn' makes it warn"
        )


@dataclass(frozen=True)
class Determinism:
    """The global settings as they were before :func:`apply_determinism` changed them."""

    algorithms: bool
    warn_only: bool
    cudnn_deterministic: bool
    cudnn_benchmark: bool
    cublas: str | None  # the variable's value (None: unset)

    def restore(self) -> None:
        """Put every setting back as it was."""
        torch.use_deterministic_algorithms(self.algorithms, warn_only=self.warn_only)
        torch.backends.cudnn.deterministic = self.cudnn_deterministic
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        if self.cublas is None:
            os.environ.pop(CUBLAS_VARIABLE, None)
        else:
            os.environ[CUBLAS_VARIABLE] = self.cublas


def apply_determinism(mode: bool | str) -> Determinism | None:
    """Turn ``mode`` on (before the strategy starts); returns what to restore (None: off)."""
    check_deterministic(mode)
    if mode is False:
        return None
    before = Determinism(
        algorithms=torch.are_deterministic_algorithms_enabled(),
        warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
        cudnn_deterministic=torch.backends.cudnn.deterministic,
        cudnn_benchmark=torch.backends.cudnn.benchmark,
        cublas=os.environ.get(CUBLAS_VARIABLE),
    )
    if before.cublas is None:
        os.environ[CUBLAS_VARIABLE] = CUBLAS_SETTING
        if torch.cuda.is_initialized():
            warnings.warn(
                f"deterministic={mode!r}: CUDA was initialised before the Runtime, and cuBLAS "
                f"reads {CUBLAS_VARIABLE} once, when it is first used, so matrix products may "
                f"stay non-deterministic; set {CUBLAS_VARIABLE}={CUBLAS_SETTING} in the "
                "environment, or create the Runtime (or Trainer) before any CUDA work",
                RuntimeWarning,
                stacklevel=3,
            )
    torch.use_deterministic_algorithms(True, warn_only=mode == "warn")
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    return before
