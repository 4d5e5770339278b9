"""How exactly a user's own loop on distkit.Runtime keeps world-size invariance: the largest
parameter difference between the same loop at 2 processes (batch b per process) and at 1
process (batch 2b), for each case the tests hold to 1e-5.

The loops are the test suite's own (tests/runtime): 21 samples (an uneven last global batch),
an MLP, SGD with momentum or Adam, two epochs. Real gloo processes on this machine; Horovod's
rows need ``python -m distkit.horovod_build`` (they are reported as skipped without it).

    PYTHONPATH=. python benchmarks/runtime_exactness.py

The token-exact rows (issue 27) train the tests' tiny language model on padded sequences of
very different lengths (tests/support/token_workloads.py) at 2 processes with batch 2 and
accumulation 2, the Trainer with ``distkit.Loss(total, count)`` and a user's loop with
``rt.backward(total, count=n)``, against one plain-torch process that takes the mean over every
token of each global batch of 8; the last row is the batch-mean loss, for contrast.

Prints one line per case: max |difference| over every parameter, and the bound the tests use.
"""

from __future__ import annotations

import importlib.util
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from distkit.testing import run_on_ranks  # noqa: E402
from tests.runtime import test_user_checkpoint as ckpt  # noqa: E402
from tests.runtime import test_user_loop as loops  # noqa: E402
from tests.support import token_workloads as tokens  # noqa: E402
from tests.support.workloads import max_abs_diff  # noqa: E402

BOUND = 1e-5


def _worst(results: list[dict[str, Any]], reference: dict[str, Any], *keys: str) -> float:
    return max(max_abs_diff(r[k], reference[k]) for r in results for k in keys)


def _horovod(function: str, args: tuple[Any, ...]) -> list[dict[str, Any]]:
    from tests.support.horovod_runner import run_with_horovodrun

    with tempfile.TemporaryDirectory() as folder:
        calls = [("tests.runtime.test_user_loop", function, args, {})]
        return [result for (result,) in run_with_horovodrun(calls, Path(folder))]


def _tokens(fn: Callable[..., Any], strategy: str, **kwargs: Any) -> float:
    """Token-exact training at 2 processes (batch 2, accumulation 2) against one plain-torch
    process computing the mean over every token of each global batch of 8."""
    exact = tokens.reference(8)
    if strategy == "horovod":
        from tests.support.horovod_runner import run_with_horovodrun

        with tempfile.TemporaryDirectory() as folder:
            calls = [("tests.support.token_workloads", fn.__name__, (strategy, 2, 2), kwargs)]
            ranks = [result for (result,) in run_with_horovodrun(calls, Path(folder))]
    else:
        ranks = run_on_ranks(partial(fn, **kwargs), strategy, 2, 2, world_size=2,
                             agent_store=True)  # fmt: skip
    return max(max_abs_diff(rank["state"], exact) for rank in ranks)


def _save_kill_load() -> float:
    with tempfile.TemporaryDirectory() as folder:
        path = str(Path(folder) / "ckpt.pt")
        reference = run_on_ranks(ckpt.uninterrupted, 8, world_size=1, agent_store=True)[0]
        run_on_ranks(ckpt.save_after, 4, path, 1, world_size=2, agent_store=True)
        resumed = run_on_ranks(ckpt.resume_from, 4, path, world_size=2, agent_store=True)
        return _worst(resumed, reference, "state")


def main() -> None:
    def one(fn: Callable[..., Any], *args: Any) -> dict[str, Any]:
        result: dict[str, Any] = run_on_ranks(fn, *args, world_size=1, agent_store=True)[0]
        return result

    def two(fn: Callable[..., Any], *args: Any) -> list[dict[str, Any]]:
        results: list[dict[str, Any]] = run_on_ranks(fn, *args, world_size=2, agent_store=True)
        return results

    horovod = importlib.util.find_spec("horovod") is not None
    rows: list[tuple[str, Callable[[], float] | None]] = [
        ("ddp x2 vs 1, accumulation 1", lambda: _worst(
            two(loops.user_loop, "ddp", 4, 1), one(loops.user_loop, "ddp", 8, 1), "state")),
        ("ddp x2 vs 1, grad_accum_steps=2", lambda: _worst(
            two(loops.user_loop, "ddp", 4, 2), one(loops.user_loop, "ddp", 8, 2), "state")),
        ("ddp x2 vs 1, accumulation 2, clipping", lambda: _worst(
            two(partial(loops.user_loop, clip=0.05), "ddp", 4, 2),
            one(partial(loops.user_loop, clip=0.05), "ddp", 8, 2), "state")),
        ("fsdp x2 vs ddp 1, accumulation 2", lambda: _worst(
            two(loops.user_loop, "fsdp", 4, 2), one(loops.user_loop, "ddp", 8, 2), "state")),
        ("GAN (2 models, 2 optimizers) ddp x2 vs 1", lambda: _worst(
            two(loops.gan_loop, "ddp", 4), one(loops.gan_loop, "ddp", 8), "gen", "disc")),
        ("one model, 2 optimizers, ddp x2 vs 1", lambda: _worst(
            two(loops.parts_loop, "ddp", 4), one(loops.parts_loop, "ddp", 8), "state")),
        ("rt.save mid-epoch + kill + rt.load (x2) vs uninterrupted", _save_kill_load),
        ("horovod x2 vs ddp 1, accumulation 2", (lambda: _worst(
            _horovod("user_loop", ("horovod", 4, 2)), one(loops.user_loop, "ddp", 8, 2),
            "state")) if horovod else None),
        ("GAN horovod x2 vs ddp 1", (lambda: _worst(
            _horovod("gan_loop", ("horovod", 4)), one(loops.gan_loop, "ddp", 8), "gen", "disc"))
            if horovod else None),
        ("token-exact Trainer ddp x2 (b 2, accum 2) vs token mean", lambda: _tokens(
            tokens.fit_tokens, "ddp")),
        ("token-exact user loop ddp x2 vs token mean", lambda: _tokens(
            tokens.loop_tokens, "ddp")),
        ("token-exact Trainer fsdp x2 vs token mean", lambda: _tokens(
            tokens.fit_tokens, "fsdp")),
        ("token-exact Trainer horovod x2 vs token mean", (lambda: _tokens(
            tokens.fit_tokens, "horovod")) if horovod else None),
        ("batch-mean loss ddp x2 vs token mean (not exact)", lambda: _tokens(
            tokens.fit_tokens, "ddp", exact=False)),
    ]  # fmt: skip
    width = max(len(name) for name, _ in rows)
    for name, measure in rows:
        if measure is None:
            print(f"{name:<{width}}  skipped (no horovod: python -m distkit.horovod_build)")
            continue
        worst = measure()
        verdict = "ok" if worst <= BOUND else "OVER THE BOUND"
        print(f"{name:<{width}}  max |diff| = {worst:.2e}  (bound {BOUND:.0e}: {verdict})")


if __name__ == "__main__":
    main()
