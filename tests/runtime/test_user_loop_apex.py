"""A user's own loop on apex: legacy amp sets every model and optimizer up in one
``amp.initialize`` (lists, one loss scaler per optimizer: ``num_losses``) at the loop's first
forward, ``rt.backward`` scales each loss with its optimizer's scaler, an overflow skips that
optimizer's step only, and the loop trains like the same loop on ddp; modern apex is torch's
amp under the same loop.

NVIDIA apex is CUDA-only and not on PyPI: these tests use the FAKE apex packages of
tests/support/fakes and FAKE CUDA (the strategy's CUDA probe is patched), on real gloo ranks.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import distkit
from distkit.errors import ConfigurationError, UnsupportedFeatureError
from tests.runtime.test_user_loop import FEATURES, gan_loop, user_loop
from tests.support.exactness import TOL  # user_loop and gan_loop train in float64
from tests.support.fakes import use_fake_apex
from tests.support.workloads import make_dataset, make_mlp, max_abs_diff

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.filterwarnings("ignore:distkit apex:UserWarning"),
    pytest.mark.filterwarnings("ignore::FutureWarning"),
]


def _fake_cuda() -> None:
    """FAKE CUDA: let the apex strategy run on CPU (the fakes need no GPU)."""
    import distkit.strategies.apex as apex_strategy

    apex_strategy._require_cuda = lambda choices: None


def _on_fake_apex(kind: str, loop: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    """Per rank: ``loop(*args)`` with the FAKE ``kind`` apex and FAKE CUDA; its result and
    the fake apex calls."""
    _fake_cuda()
    with use_fake_apex(kind), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        import apex

        result = loop(*args, **kwargs)
        result["calls"] = [(name, dict(details)) for name, details in apex.CALLS]
    return result


def test_a_user_loop_on_legacy_apex_at_two_ranks_equals_one_ddp_process(run_on_ranks):
    """accumulation 2 and an uneven last window; apex's DDP averages over gloo (fake)."""
    one = run_on_ranks(user_loop, "ddp", 8, 2, world_size=1)[0]
    two = run_on_ranks(_on_fake_apex, "legacy", user_loop, "apex", 4, 2, world_size=2)
    for rank in two:
        assert max_abs_diff(rank["state"], one["state"]) <= TOL
    names = [name for name, _ in two[0]["calls"]]
    assert names.count("amp.initialize") == 1
    assert names.index("amp.initialize") < names.index("parallel.DistributedDataParallel")


def test_a_user_loop_on_modern_apex_equals_one_ddp_process(run_on_ranks):
    one = run_on_ranks(user_loop, "ddp", 8, 2, world_size=1)[0]
    two = run_on_ranks(_on_fake_apex, "modern", user_loop, "apex", 4, 2, world_size=2)
    for rank in two:
        assert max_abs_diff(rank["state"], one["state"]) <= TOL


def test_a_gan_on_legacy_apex_initialises_amp_once_with_a_scaler_per_optimizer(run_on_ranks):
    """Two models, two optimizers: one amp.initialize with both lists and num_losses=2;
    the discriminator's loss is scaled with its scaler (found from the graph), the
    generator's with the one the loop names (it reaches both models' parameters)."""
    one = run_on_ranks(gan_loop, "ddp", 8, world_size=1)[0]
    two = run_on_ranks(_on_fake_apex, "legacy", gan_loop, "apex", 4, world_size=2)
    for rank in two:
        assert max_abs_diff(rank["gen"], one["gen"]) <= TOL
        assert max_abs_diff(rank["disc"], one["disc"]) <= TOL
    calls = two[0]["calls"]
    (init,) = [details for name, details in calls if name == "amp.initialize"]
    assert init["num_losses"] == 2
    loss_ids = [details["loss_id"] for name, details in calls if name == "amp.scale_loss"]
    assert loss_ids[:4] == [1, 0, 1, 0]  # opt_g was set up first: scaler 0


def two_models_one_optimizer_each() -> dict[str, str]:
    """The generator loss of a GAN without optimizer=: refused, naming the fix; a model set
    up after the first forward: refused, saying why."""
    _fake_cuda()
    out = {}
    with use_fake_apex("legacy"), distkit.Runtime("apex") as rt:
        gen = nn.Linear(4, FEATURES)
        gen, opt_g = rt.setup(gen, torch.optim.SGD(gen.parameters(), lr=0.1))
        disc = nn.Linear(FEATURES, 1)
        disc, _ = rt.setup(disc, torch.optim.SGD(disc.parameters(), lr=0.1))
        x = torch.randn(8, 4)
        try:
            rt.backward(disc(gen(x)).mean())
        except ConfigurationError as exc:
            out["unnamed"] = str(exc)
        rt.backward(disc(gen(x)).mean(), optimizer=opt_g)  # named: accepted
        try:
            rt.backward(disc(gen(x)).mean(), optimizer=torch.optim.SGD(gen.parameters()))
        except ConfigurationError as exc:
            out["foreign"] = str(exc)
        try:
            rt.setup(nn.Linear(2, 2))
        except UnsupportedFeatureError as exc:
            out["late"] = str(exc)
    return out


def test_legacy_apex_asks_which_optimizer_a_loss_reaching_several_is_for(run_on_ranks):
    out = run_on_ranks(two_models_one_optimizer_each, world_size=1)[0]
    assert "rt.backward(loss, optimizer=opt_g)" in out["unnamed"]
    assert "2 set-up optimizers" in out["unnamed"]
    assert "optimizer= takes an optimizer this Runtime's rt.setup returned" in out["foreign"]
    assert "once per process" in out["late"] and "before the first forward" in out["late"]


def overflow_in_one_loss(path: str) -> dict[str, Any]:
    """fp16, two models: the first step's discriminator loss overflows. Only opt_d skips
    that step, only its scaler halves; both scales survive rt.save / rt.load."""
    _fake_cuda()
    out: dict[str, Any] = {}
    with use_fake_apex("legacy"):
        import apex

        with distkit.Runtime("apex", precision="fp16") as rt:
            a, b = make_mlp(seed=1), make_mlp(seed=2)
            a, opt_a = rt.setup(a, torch.optim.SGD(a.parameters(), lr=0.1))
            b, opt_b = rt.setup(b, torch.optim.SGD(b.parameters(), lr=0.1))
            before = {
                "a": {k: v.clone() for k, v in a.state_dict().items()},
                "b": {k: v.clone() for k, v in b.state_dict().items()},
            }
            x, y = make_dataset(8).tensors
            loss_fn = nn.functional.cross_entropy
            rt.backward(loss_fn(a(x), y))
            rt.backward(loss_fn(b(x), y) * math.inf)
            opt_a.step()
            opt_b.step()
            out["outcomes"] = [opt_a.last_outcome.value, opt_b.last_outcome.value]
            out["a_moved"] = max_abs_diff(a.state_dict(), before["a"]) > 0
            out["b_moved"] = max_abs_diff(b.state_dict(), before["b"]) > 0
            scalers = apex.amp._amp_state.loss_scalers
            out["scales"] = [s.loss_scale() for s in scalers]
            rt.save(path, {"a": a, "b": b, "opt_a": opt_a, "opt_b": opt_b})
        with distkit.Runtime("apex", precision="fp16") as rt:
            a, b = make_mlp(seed=3), make_mlp(seed=4)
            a, opt_a = rt.setup(a, torch.optim.SGD(a.parameters(), lr=0.1))
            b, opt_b = rt.setup(b, torch.optim.SGD(b.parameters(), lr=0.1))
            rt.load(path, {"a": a, "b": b, "opt_a": opt_a, "opt_b": opt_b})
            out["resumed_scales"] = [s.loss_scale() for s in apex.amp._amp_state.loss_scalers]
    return out


def test_legacy_apex_overflow_of_one_loss_skips_its_optimizer_only(run_on_ranks, tmp_path):
    out = run_on_ranks(overflow_in_one_loss, str(tmp_path / "ck.pt"), world_size=1)[0]
    assert out["outcomes"] == ["stepped", "skipped: fp16 overflow"]
    assert out["a_moved"] and not out["b_moved"]
    assert out["scales"] == [2.0**16, 2.0**15]
    assert out["resumed_scales"] == out["scales"]  # every scaler, not only the first


def set_up_together_by_default() -> dict[str, Any]:
    with distkit.Runtime("ddp") as rt:
        strategy = rt.strategy
        teacher, student = make_mlp(seed=1), make_mlp(seed=2)
        params = list(student.parameters())
        opts = [torch.optim.SGD(params[:2], lr=0.1), torch.optim.Adam(params[2:])]
        done = strategy.setup_together([(teacher, []), (student, opts)])
        return {
            "together": strategy.sets_up_together,
            "teacher_as_is": done[0] == (teacher, []),
            "student_wrapped": type(done[1][0]).__name__,
            "optimizers": len(done[1][1]),
        }


def test_the_default_set_up_together_sets_each_model_up_alone(run_on_ranks):
    """Strategy.setup_together's default (any backend but legacy apex): each model with its
    first optimizer, then the others; a model without optimizers is placed only."""
    for out in run_on_ranks(set_up_together_by_default, world_size=2):
        assert out == {
            "together": False,
            "teacher_as_is": True,
            "student_wrapped": "DistributedDataParallel",
            "optimizers": 2,
        }
