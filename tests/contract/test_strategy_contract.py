"""The strategy contract: every promise of distkit.testing.PROMISES, on every backend.

One launch per backend runs the bodies of all the promises (a module-scoped fixture: a launch
costs seconds, Horovod's most); each test then checks one promise from that launch's results,
so one broken promise does not hide the others. The same functions are what plugin authors
run (docs/reference/testing.md).

Backends: ddp (2 gloo processes), dp (1 process), fsdp (2 gloo processes; once registered),
horovod (``horovodrun -np 2 --gloo``), apex-fake (see ``_fake_legacy_apex_and_cuda``) and
deepspeed (2 gloo processes, ZeRO stage 2, its default). The training promises train in
float64 (distkit.testing's default: exact to the summation order on any CPU), DeepSpeed's in
float32 (its ZeRO optimizer keeps float32 master weights).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

import distkit
import distkit.testing
from distkit._imports import is_importable
from distkit.testing._horovodrun_ranks import horovodrun_path
from tests.support.fakes import use_fake_apex

# `--random-order` keeps this module's order (its module is still shuffled among the others):
# the tests are grouped by backend so that each backend's ranks launch once; shuffled, the
# fixture relaunched a backend for nearly every test (13-16 s a Horovod launch, 10 minutes)
pytestmark = [pytest.mark.timeout(300), pytest.mark.random_order(disabled=True)]


@contextlib.contextmanager
def _fake_legacy_apex_and_cuda() -> Iterator[None]:
    """On each rank: FAKE legacy apex (tests/support/fakes) and FAKE CUDA, as
    tests/strategies/test_apex.py does.

    NVIDIA apex is CUDA-only and not on PyPI, so the apex backend runs the contract against
    the fake legacy package (its DDP really averages over gloo) on CPU, the strategy's CUDA
    probe patched out. Real apex runs only on CUDA machines (tests/strategies/test_apex.py).
    """
    import distkit.strategies.apex as apex_strategy

    apex_strategy._require_cuda = lambda choices: None
    with use_fake_apex("legacy"):
        yield


def _horovod_missing() -> str | None:
    if is_importable("horovod.torch") and horovodrun_path():
        return None
    return (
        "Horovod is not installed: `python -m distkit.horovod_build` builds it "
        "(nox -s tests does this before running the tests)"
    )


def _deepspeed_missing() -> str | None:
    if is_importable("deepspeed"):
        return None
    return "DeepSpeed is not installed: pip install 'distkit[deepspeed]' (nox -s tests does)"


def _fsdp_missing() -> str | None:
    return None if "fsdp" in distkit.available_strategies() else "fsdp not registered yet"


# backend id -> (run_promises arguments, why it cannot run here or None)
BACKENDS = {
    "ddp": (dict(strategy="ddp"), lambda: None),
    "dp": (dict(strategy="dp"), lambda: None),
    "fsdp": (dict(strategy="fsdp"), _fsdp_missing),
    "horovod": (dict(strategy="horovod", launcher="horovodrun"), _horovod_missing),
    "apex-fake": (dict(strategy="apex", rank_setup=_fake_legacy_apex_and_cuda), lambda: None),
    # ZeRO steps float32 master weights and refuses a float64 model: the float32 contract
    "deepspeed": (dict(strategy="deepspeed", dtype=torch.float32), _deepspeed_missing),
}


@pytest.fixture(scope="module", params=list(BACKENDS))
def contract(request: pytest.FixtureRequest) -> distkit.testing.ContractRun:
    """Every promise's body, run once on the backend's processes."""
    arguments, missing = BACKENDS[request.param]
    reason = missing()
    if reason is not None:
        pytest.skip(reason)
    return distkit.testing.run_promises(**arguments)


@pytest.mark.parametrize("promise", distkit.testing.PROMISES)
def test_strategy_keeps_its_promise(contract: distkit.testing.ContractRun, promise: str) -> None:
    """A single-process backend (dp) skips the promises that compare world sizes
    (world_size_invariance, runtime_world_size_invariance, clipping), saying why."""
    contract.check(promise)
