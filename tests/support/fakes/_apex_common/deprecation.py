"""Deprecation helpers that real apex (22.12 and later) exposes at top level (FAKE, for tests).

Real apex defines ``apex.DeprecatedFeatureWarning`` (a ``FutureWarning``) and
``apex.deprecated_warning(msg)``, which warns on rank 0 only (or when no process group exists).
The legacy fake uses it where real apex does: ``apex.parallel.DistributedDataParallel``.
"""

from __future__ import annotations

import warnings

import torch


class DeprecatedFeatureWarning(FutureWarning):
    """Warning category real apex uses for features it is about to remove."""


def deprecated_warning(msg: str) -> None:
    """Warn with ``DeprecatedFeatureWarning``, on rank 0 only when a process group exists."""
    dist = torch.distributed
    if not dist.is_available() or not dist.is_initialized() or dist.get_rank() == 0:
        warnings.warn(msg, DeprecatedFeatureWarning, stacklevel=3)
