"""The process runner the tests use: :mod:`distkit.testing._processes`, re-exported.

It moved into the package so that plugin authors run their strategies on the same real
processes as distkit's own tests (``distkit.testing.run_on_ranks``).
"""

from __future__ import annotations

from distkit.testing._processes import free_port, plain_env, run_on_ranks, torchrun_env

__all__ = ["free_port", "plain_env", "run_on_ranks", "torchrun_env"]
