"""The process runner the tests use: :mod:`distkit.testing._processes`, re-exported.

It moved into the package so that plugin authors run their strategies on the same real
processes as distkit's own tests (``distkit.testing.run_on_ranks``).
"""

from __future__ import annotations

import os

import torch

from distkit.testing._processes import free_port, plain_env, run_on_ranks, torchrun_env

__all__ = ["children_see_cuda", "free_port", "plain_env", "run_on_ranks", "torchrun_env"]


def children_see_cuda() -> bool:
    """Whether the processes a test starts see a GPU (tests/conftest.py may hide a lone one
    from them; decide at run time, after the session's fixtures)."""
    return torch.cuda.is_available() and os.environ.get("CUDA_VISIBLE_DEVICES") != ""
