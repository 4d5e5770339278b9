"""``Callback.on_before_optimizer_step``: once per optimizer step, on the final gradients.

Final means averaged over ranks and unscaled (fp16), before clipping: the same tensors on
every backend as one process over the global batch. Multi-rank cases run on real gloo
processes.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

import distkit
from distkit.callbacks import Callback
from distkit.strategies._steps import GradientClip, StepOutcome
from distkit.strategies.dp import DataParallelStrategy
from tests.support.exactness import DTYPE, TOL
from tests.support.gates import needs
from tests.support.horovod_runner import run_with_horovodrun
from tests.support.workloads import make_dataset, make_mlp

pytestmark = pytest.mark.timeout(300)


def _full(grad: torch.Tensor) -> torch.Tensor:
    # fsdp: a DTensor holding this rank's shard; gathering it is a collective (every rank)
    full = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
    return full.detach().cpu().clone()


class GradRecorder(Callback):
    """The gradients each step's hook saw (full tensors, in the optimizer's order)."""

    stops_training = False

    def __init__(self, scale: float | None = None) -> None:
        self.steps: list[list[torch.Tensor]] = []
        self.optimizers: list[torch.optim.Optimizer] = []
        self.scale = scale

    def on_before_optimizer_step(self, trainer, optimizer):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        self.steps.append([_full(p.grad) for p in params])
        self.optimizers.append(optimizer)
        if self.scale is not None:
            for p in params:
                p.grad.mul_(self.scale)


def _fit(strategy, batch_size: int, *, n: int = 32, callbacks=(), dtype=None, **settings) -> dict:
    trainer = distkit.Trainer(strategy, batch_size=batch_size, max_epochs=1, progress=False,
                              callbacks=list(callbacks), **settings)  # fmt: skip
    # float64 where runs are compared (tests/support/exactness.py), float32 for mixed precision
    if dtype is None:
        dtype = DTYPE if settings.get("precision", "32") == "32" else torch.float32
    model = make_mlp(dtype=dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data = make_dataset(n, dtype=dtype)
    trainer.fit(model, optimizer, data, loss_fn=nn.functional.cross_entropy)
    recorder = next((c for c in callbacks if isinstance(c, GradRecorder)), None)
    out = {
        "steps": [] if recorder is None else recorder.steps,
        "same_optimizer": recorder is None or all(o is optimizer for o in recorder.optimizers),
        "state": {k: v.detach().cpu().clone() for k, v in model.state_dict().items()},
    }
    trainer.close()
    return out


def _max_diff(a: list[list[torch.Tensor]], b: list[list[torch.Tensor]]) -> float:
    assert len(a) > 0
    pairs = [(x, y) for sa, sb in zip(a, b, strict=True) for x, y in zip(sa, sb, strict=True)]
    return max((x - y).abs().max().item() for x, y in pairs)


def _recorded(strategy: str, batch_size: int, **settings) -> dict:
    return _fit(strategy, batch_size, callbacks=[GradRecorder()], **settings)


def test_before_optimizer_step_sees_the_global_mean_gradients_at_ddp_x2(run_on_ranks):
    ranks = run_on_ranks(partial(_recorded, grad_accum_steps=2), "ddp", 4, world_size=2)
    one = _recorded("dp", 8, grad_accum_steps=2)
    assert len(one["steps"]) == 2  # 32 samples, global batch 8 x 2 micro-batches: 2 steps
    assert one["same_optimizer"] and all(rank["same_optimizer"] for rank in ranks)
    for rank in ranks:
        assert _max_diff(rank["steps"], one["steps"]) <= TOL


def test_before_optimizer_step_sees_sharded_gradients_whole_at_fsdp_x2(run_on_ranks):
    ranks = run_on_ranks(partial(_recorded, grad_accum_steps=2), "fsdp", 4, world_size=2)
    one = _recorded("dp", 8, grad_accum_steps=2)
    for rank in ranks:
        assert _max_diff(rank["steps"], one["steps"]) <= TOL


@needs("horovod")
def test_before_optimizer_step_sees_the_global_mean_gradients_at_horovod_x2(tmp_path):
    here = "tests.callbacks.test_before_optimizer_step"
    calls = [
        (here, "_recorded", ("horovod", 4), {"grad_accum_steps": 2}),
        (here, "_recorded", ("horovod", 4), {"precision": "fp16"}),
    ]
    ranks = run_with_horovodrun(calls, tmp_path)
    one = _recorded("dp", 8, grad_accum_steps=2)
    fp32 = _recorded("dp", 8)
    for accumulated, fp16 in ranks:
        assert _max_diff(accumulated["steps"], one["steps"]) <= TOL
        assert _max_diff(fp16["steps"], fp32["steps"]) <= 2e-2  # unscaled: not 2**16 larger


def test_before_optimizer_step_sees_unscaled_gradients_under_fp16():
    fp16 = _recorded("dp", 8, precision="fp16")
    fp32 = _recorded("dp", 8, dtype=torch.float32)
    # scaled ones would be 2**16 times larger; fp16 arithmetic differs in the third digit
    for step16, step32 in zip(fp16["steps"], fp32["steps"], strict=True):
        for g16, g32 in zip(step16, step32, strict=True):
            torch.testing.assert_close(g16, g32, rtol=2e-2, atol=2e-3)


class NormLog(Callback):
    stops_training = False

    def __init__(self) -> None:
        self.norms: list[float] = []

    def on_train_step_end(self, trainer, logs):
        self.norms.append(float(logs["grad_norm"]))


def test_before_optimizer_step_sees_the_gradients_before_clipping():
    recorder, logged = GradRecorder(), NormLog()
    _fit("dp", 8, callbacks=[recorder, logged], gradient_clip_norm=1e-3)
    seen = [torch.linalg.vector_norm(torch.stack([g.norm() for g in step])).item()
            for step in recorder.steps]  # fmt: skip
    assert seen == pytest.approx(logged.norms, rel=1e-5)
    assert min(seen) > 1e-2  # far above the clip: clipped ones would have norm 1e-3


def test_before_optimizer_step_changes_the_step_when_it_changes_the_gradients():
    untouched = _fit("dp", 8)["state"]
    frozen = _fit("dp", 8, callbacks=[GradRecorder(scale=0.0)])["state"]
    doubled = _fit("dp", 8, callbacks=[GradRecorder(scale=2.0)])["state"]
    initial = make_mlp().state_dict()
    assert all(torch.equal(frozen[k], initial[k]) for k in initial)  # zero gradients: no move
    assert any(not torch.allclose(doubled[k], untouched[k]) for k in initial)


class OldStepPlugin(DataParallelStrategy):
    """A plugin whose ``step`` predates ``before_step``."""

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        clip: GradientClip | None = None,
        skip_nonfinite: bool = False,
    ) -> tuple[StepOutcome, torch.Tensor | None]:
        self.steps = getattr(self, "steps", 0) + 1
        return super().step(optimizer, clip=clip, skip_nonfinite=skip_nonfinite)


def test_before_optimizer_step_plugin_step_without_the_keyword_keeps_working():
    plugin = OldStepPlugin()
    _fit(plugin, 8)  # no callback uses the hook: the step is called as before
    assert plugin.steps == 4


def test_before_optimizer_step_plugin_step_without_the_keyword_is_refused_with_the_fix():
    with pytest.raises(distkit.ConfigurationError, match=r"OldStepPlugin\.step.*before_step"):
        _fit(OldStepPlugin(), 8, callbacks=[GradRecorder()])
