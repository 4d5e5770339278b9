"""Tests of the FAKE apex packages in tests/support/fakes (so strategy tests can trust them).

Every test here exercises a fake: the legacy NVIDIA apex (<= 25.04), the modern one (>= 25.07)
or the unrelated PyPI ``apex`` (Pyramid toolkit). Behaviour asserted here is the behaviour of
real apex as read in NVIDIA/apex (amp/frontend.py, amp/handle.py, amp/scaler.py,
amp/_process_optimizer.py, parallel/__init__.py, parallel/distributed.py, optimizers/*.py) and
of the PyPI sdist apex-0.9.10dev.
"""

from __future__ import annotations

import copy
import importlib
import importlib.metadata
import importlib.util
import math
import sys
import warnings
from typing import Any

import pytest
import torch
from torch import nn

from tests.support.fakes import FAKE_APEX_DIRS, FAKES_DIR, use_fake_apex
from tests.support.multiprocess import free_port

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.filterwarnings("ignore:apex.parallel.DistributedDataParallel is deprecated"),
]


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


def _batch(seed: int, n: int = 8) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, 5, generator=generator), torch.randint(0, 3, (n,), generator=generator)


def _loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    x, y = batch
    return nn.functional.cross_entropy(model(x), y)


def _plain_grads(model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> list:
    """Grads of a copy of ``model`` after one plain backward per batch (accumulated)."""
    reference = copy.deepcopy(model)
    reference.zero_grad(set_to_none=True)
    for batch in batches:
        _loss(reference, batch).backward()
    return [p.grad.clone() for p in reference.parameters()]


def _max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


class _SingleRankGroup:
    """A 1-process gloo group on loopback (no launcher variables touched)."""

    def __enter__(self) -> None:
        torch.distributed.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1
        )

    def __exit__(self, *exc: object) -> None:
        torch.distributed.destroy_process_group()


# --------------------------------------------------------------------------- activation helper


def test_use_fake_apex_restores_sys_path_and_modules() -> None:
    """use_fake_apex (fake activation helper) puts the fake first and restores sys.path/modules."""
    before = list(sys.path)
    sys.modules.pop("apex", None)
    for kind, directory in FAKE_APEX_DIRS.items():
        assert directory.parent == FAKES_DIR
        with use_fake_apex(kind) as active:
            assert active == directory
            assert sys.path[0] == str(directory)
            assert importlib.util.find_spec("apex").origin.startswith(str(directory))
            if kind != "impostor":
                import apex

                assert apex.__fake_apex__ == kind
                assert "apex._common" in sys.modules
        assert sys.path == before
        assert not [m for m in sys.modules if m == "apex" or m.startswith("apex.")]
    with pytest.raises(ValueError, match="unknown fake apex kind"), use_fake_apex("nvidia"):
        pass


def test_each_activation_gets_fresh_state() -> None:
    """The fake apex recorder and amp state start empty on every activation."""
    with use_fake_apex("legacy"):
        import apex
        from apex import amp

        amp.initialize(_model(), verbosity=0)
        assert apex.CALLS
        calls = apex.CALLS
        apex.reset_calls()
        assert calls is apex.CALLS and calls == []
        amp.initialize(_model(), verbosity=0)
        assert [name for name, _ in apex.CALLS] == ["amp.initialize"]
    with use_fake_apex("legacy"):
        import apex

        assert apex.CALLS == []
        assert not hasattr(apex.amp._amp_state, "loss_scalers")
        assert not hasattr(apex.amp._amp_state, "opt_properties")


def test_legacy_and_modern_metadata_version_is_0_1() -> None:
    """Both NVIDIA fakes carry apex's real installed version, 0.1, like real apex."""
    for kind in ("legacy", "modern"):
        with use_fake_apex(kind):
            assert importlib.metadata.version("apex") == "0.1"


# --------------------------------------------------------------------------- amp.initialize


def test_initialize_returns_the_same_objects_single_or_list() -> None:
    """Fake amp.initialize returns the very objects passed, in the shapes real apex returns."""
    with use_fake_apex("legacy"):
        from apex import amp

        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        weight = model[0].weight.detach().clone()
        out_model, out_opt = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
        assert out_model is model and out_opt is optimizer
        assert model[0].weight.dtype == torch.float32  # the CPU fake casts nothing
        assert torch.equal(model[0].weight, weight)

        models = [_model(1), _model(2)]
        optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
        out_models, out_opts = amp.initialize(models, optimizers, opt_level="O1", verbosity=0)
        assert out_models is models and out_opts is optimizers

        lone = _model(3)
        assert amp.initialize(lone, opt_level="O0", verbosity=0) is lone


def test_initialize_refuses_models_already_wrapped_in_ddp_or_dp() -> None:
    """Fake amp.initialize raises, like real apex, for DDP- / apex-DDP- / DP-wrapped models."""
    with use_fake_apex("legacy"):
        from apex import amp, parallel

        with pytest.raises(RuntimeError, match=r"torch\.nn\.parallel\.DataParallel"):
            amp.initialize(nn.DataParallel(_model()), verbosity=0)
        with _SingleRankGroup():
            torch_ddp = nn.parallel.DistributedDataParallel(_model())
            with pytest.raises(RuntimeError, match="AFTER \nthe model"):
                amp.initialize(torch_ddp, verbosity=0)
            apex_ddp = parallel.DistributedDataParallel(_model())
            with pytest.raises(RuntimeError, match=r"apex\.parallel\.DistributedDataParallel"):
                amp.initialize(apex_ddp, verbosity=0)
            # torch's DDP dropped while the group is alive: had its Reducer outlived the
            # group, freeing it would destroy the gloo group with the GIL held (pybind11's
            # dealloc), joining a worker thread that still needs the GIL to free the
            # constructor's broadcast: a deadlock that hung this test on a loaded 2-core
            # machine (torch issue 56297)
            del torch_ddp


def test_initialize_validation_errors() -> None:
    """Fake amp.initialize rejects what real apex rejects (opt level, overrides, types, reuse)."""
    with use_fake_apex("legacy"):
        from apex import amp

        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with pytest.raises(RuntimeError, match="Unexpected optimization level 00"):
            amp.initialize(model, optimizer, opt_level="00", verbosity=0)
        with pytest.raises(RuntimeError, match="master_weights with O1"):
            amp.initialize(model, optimizer, opt_level="O1", master_weights=True, verbosity=0)
        with pytest.raises(RuntimeError, match="keep_batchnorm_fp32 should be None"):
            amp.initialize(model, optimizer, opt_level="O1", keep_batchnorm_fp32=True, verbosity=0)
        with pytest.raises(AssertionError, match="keep_batchnorm_fp32 must be a boolean"):
            amp.initialize(model, optimizer, opt_level="O2", keep_batchnorm_fp32="yes", verbosity=0)
        with pytest.raises(TypeError, match="optimizers must be"):
            amp.initialize(model, (optimizer,), verbosity=0)
        with pytest.raises(TypeError, match="models must be"):
            amp.initialize((model,), optimizer, verbosity=0)
        with pytest.raises(RuntimeError, match=r"\.half\(\)"):
            amp.initialize(_model().half(), verbosity=0)

        amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
        with pytest.raises(RuntimeError, match=r"only be passed through amp\.initialize once"):
            amp.initialize(model, optimizer, opt_level="O1", verbosity=0)


@pytest.mark.parametrize(
    ("opt_level", "override", "dynamic", "scale"),
    [
        ("O0", None, False, 1.0),
        ("O1", None, True, 2.0**16),
        ("O2", None, True, 2.0**16),
        ("O3", None, False, 1.0),
        ("O1", 128, False, 128.0),
        ("O2", "256.0", False, 256.0),
        ("O0", "dynamic", True, 2.0**16),
    ],
)
def test_loss_scale_defaults_and_overrides(
    opt_level: str, override: Any, dynamic: bool, scale: float
) -> None:
    """The fake amp's loss scaler starts where real apex's does for each opt level/override."""
    with use_fake_apex("legacy"):
        import apex
        from apex import amp

        model = _model()
        amp.initialize(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            opt_level=opt_level,
            loss_scale=override,
            verbosity=0,
        )
        scaler = apex.amp._amp_state.loss_scalers[0]
        assert scaler.dynamic is dynamic
        assert scaler.loss_scale() == scale
        assert scaler._has_overflow is False
        (details,) = apex.calls_named("amp.initialize")
        assert details["opt_level"] == opt_level
        assert details["loss_scale"] == ("dynamic" if dynamic else scale)


# --------------------------------------------------------------------------- amp.scale_loss


def test_scale_loss_yields_scaled_loss_and_leaves_true_grads() -> None:
    """Fake amp.scale_loss yields loss*scale and unscales grads on exit (dynamic O1)."""
    with use_fake_apex("legacy"):
        import apex
        from apex import amp

        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
        batch = _batch(0)
        expected = _plain_grads(model, [batch])
        loss = _loss(model, batch)
        with amp.scale_loss(loss, optimizer) as scaled:
            assert scaled.dtype == torch.float32
            assert scaled.item() == pytest.approx(loss.item() * 2.0**16, rel=1e-6)
            scaled.backward()
            # inside the block the grads are still scaled
            assert model[0].weight.grad.abs().max() > 1000 * expected[0].abs().max()
        assert _max_diff([p.grad for p in model.parameters()], expected) < 1e-6
        scaler = apex.amp._amp_state.loss_scalers[0]
        assert scaler.loss_scale() == 2.0**16 and scaler._unskipped == 1
        assert apex.calls_named("amp.scale_loss")[0]["loss_scale"] == 2.0**16


def test_scale_loss_accumulates_over_several_backward_passes() -> None:
    """Fake amp stashes earlier grads like real apex: accumulated grads equal plain ones."""
    with use_fake_apex("legacy"):
        from apex import amp

        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = amp.initialize(model, optimizer, opt_level="O2", verbosity=0)
        batches = [_batch(1), _batch(2), _batch(3)]
        expected = _plain_grads(model, batches)
        for batch in batches:
            with amp.scale_loss(_loss(model, batch), optimizer) as scaled:
                scaled.backward()
        assert _max_diff([p.grad for p in model.parameters()], expected) < 1e-6

        # delay_unscale keeps grads scaled until a later non-delayed block
        optimizer.zero_grad()
        with amp.scale_loss(_loss(model, batches[0]), optimizer, delay_unscale=True) as scaled:
            scaled.backward()
        assert model[0].weight.grad.abs().max() > 1000
        for batch in batches[1:]:
            with amp.scale_loss(_loss(model, batch), optimizer) as scaled:
                scaled.backward()
        assert _max_diff([p.grad for p in model.parameters()], expected) < 1e-6


def test_static_scale_one_is_a_plain_backward() -> None:
    """With O0's static scale 1.0 the fake, like real apex, yields loss.float() untouched."""
    with use_fake_apex("legacy"):
        import apex
        from apex import amp

        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        amp.initialize(model, optimizer, opt_level="O0", verbosity=0)
        loss = _loss(model, _batch(0))
        with amp.scale_loss(loss, optimizer) as scaled:
            assert torch.equal(scaled, loss.float())
            scaled.backward()
        assert apex.amp._amp_state.loss_scalers[0]._unskipped == 0  # no update_scale at all


def test_overflow_skips_next_step_and_halves_dynamic_scale() -> None:
    """Fake amp: inf grads -> scale halved, next optimizer.step() is a recorded no-op."""
    with use_fake_apex("legacy"):
        import apex
        from apex import amp

        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = amp.initialize(model, optimizer, opt_level="O1", verbosity=0)
        scaler = apex.amp._amp_state.loss_scalers[0]
        before = [p.detach().clone() for p in model.parameters()]

        with amp.scale_loss(_loss(model, _batch(0)) * math.inf, optimizer) as scaled:
            scaled.backward()
        assert scaler._has_overflow is True
        assert scaler.loss_scale() == 2.0**15 and scaler._unskipped == 0
        optimizer.step()  # skipped
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        assert apex.calls_named("amp.overflow") == [{"loss_id": 0, "new_loss_scale": 2.0**15}]
        assert len(apex.calls_named("amp.skip_step")) == 1

        optimizer.zero_grad()
        with amp.scale_loss(_loss(model, _batch(1)), optimizer) as scaled:
            scaled.backward()
        assert scaler._has_overflow is False
        optimizer.step()  # the real step is back
        assert not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
        assert len(apex.calls_named("amp.skip_step")) == 1


def test_overflow_respects_min_loss_scale_and_static_scale_never_skips() -> None:
    """Fake amp: dynamic scale never drops below min_loss_scale; a static scale never skips."""
    with use_fake_apex("legacy"):
        import apex
        from apex import amp

        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        amp.initialize(model, optimizer, min_loss_scale=2.0**16, verbosity=0)
        with amp.scale_loss(_loss(model, _batch(0)) * math.inf, optimizer) as scaled:
            scaled.backward()
        assert apex.amp._amp_state.loss_scalers[0].loss_scale() == 2.0**16
        assert len(apex.calls_named("amp.overflow")) == 1

    with use_fake_apex("legacy"):
        import apex
        from apex import amp

        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        amp.initialize(model, optimizer, opt_level="O1", loss_scale=128.0, verbosity=0)
        with amp.scale_loss(_loss(model, _batch(0)) * math.inf, optimizer) as scaled:
            scaled.backward()
        scaler = apex.amp._amp_state.loss_scalers[0]
        assert scaler.loss_scale() == 128.0 and scaler._has_overflow is False
        assert apex.calls_named("amp.overflow") == []


def test_dynamic_scale_grows_after_2000_unskipped_steps_up_to_max() -> None:
    """Fake amp doubles a dynamic scale after 2000 clean steps, capped at max_loss_scale."""
    with use_fake_apex("legacy"):
        import apex
        from apex import amp

        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        amp.initialize(model, optimizer, max_loss_scale=2.0**17, verbosity=0)
        scaler = apex.amp._amp_state.loss_scalers[0]
        batch = _batch(0)
        for _ in range(1999):
            with amp.scale_loss(_loss(model, batch), optimizer) as scaled:
                scaled.backward()
            optimizer.zero_grad()
        assert scaler.loss_scale() == 2.0**16 and scaler._unskipped == 1999
        with amp.scale_loss(_loss(model, batch), optimizer) as scaled:
            scaled.backward()
        assert scaler.loss_scale() == 2.0**17 and scaler._unskipped == 0
        amp.load_state_dict({"loss_scaler0": {"loss_scale": 2.0**17, "unskipped": 1999}})
        with amp.scale_loss(_loss(model, batch), optimizer) as scaled:
            scaled.backward()
        assert scaler.loss_scale() == 2.0**17  # capped


# --------------------------------------------------------------------------- amp state dicts


def test_state_dict_round_trip() -> None:
    """Fake amp.state_dict / load_state_dict use and restore real apex's format."""
    with use_fake_apex("legacy"):
        from apex import amp

        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        amp.initialize(model, optimizer, opt_level="O1", num_losses=2, verbosity=0)
        with amp.scale_loss(_loss(model, _batch(0)) * math.inf, optimizer) as scaled:
            scaled.backward()
        with amp.scale_loss(_loss(model, _batch(1)), optimizer, loss_id=1) as scaled:
            scaled.backward()
        saved = amp.state_dict()
        assert list(saved) == ["loss_scaler0", "loss_scaler1"]
        assert saved["loss_scaler0"] == {"loss_scale": 2.0**15, "unskipped": 0}
        assert saved["loss_scaler1"] == {"loss_scale": 2.0**16, "unskipped": 1}
        payload = copy.deepcopy(saved)

    with use_fake_apex("legacy"):
        import apex
        from apex import amp

        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        amp.initialize(model, optimizer, opt_level="O1", num_losses=2, verbosity=0)
        amp.load_state_dict(payload)
        assert amp.state_dict() == payload
        assert apex.amp._amp_state.loss_scalers[0].loss_scale() == 2.0**15
        with pytest.raises(RuntimeError, match='Unexpected key\\(s\\) in state_dict: "scaler"'):
            amp.load_state_dict({"loss_scaler0": payload["loss_scaler0"], "scaler": {}})
        assert [n for n, _ in apex.CALLS if n.startswith("amp.") and "state_dict" in n] == [
            "amp.load_state_dict",
            "amp.state_dict",
            "amp.load_state_dict",
        ]


def test_amp_calls_before_initialize_raise_like_real_apex() -> None:
    """Fake amp before initialize: scale_loss RuntimeError, state dicts AttributeError."""
    with use_fake_apex("legacy"):
        from apex import amp

        with pytest.raises(AttributeError, match="loss_scalers"):
            amp.state_dict()
        with pytest.raises(AttributeError, match="loss_scalers"):
            amp.load_state_dict({"loss_scaler0": {"loss_scale": 1.0, "unskipped": 0}})
        not_initialized = pytest.raises(RuntimeError, match="Amp state has not been initialized")
        with not_initialized, amp.scale_loss(torch.tensor(1.0), []):
            pass


def test_enabled_false_is_a_no_op_and_state_dict_crashes() -> None:
    """Fake amp with enabled=False: inputs returned, loss untouched, state_dict crashes (real)."""
    with use_fake_apex("legacy"):
        from apex import amp

        model = _model()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        assert amp.initialize(model, optimizer, enabled=False) == (model, optimizer)
        assert not hasattr(optimizer, "_amp_stash")
        loss = _loss(model, _batch(0))
        with amp.scale_loss(loss, optimizer) as scaled:
            assert scaled is loss
        with pytest.raises(AttributeError, match="loss_scalers"):
            amp.state_dict()


# --------------------------------------------------------------------------- apex DDP


def test_apex_ddp_needs_a_process_group_and_has_no_no_sync() -> None:
    """Fake apex DDP: raises without a process group, warns deprecation, has no no_sync."""
    with use_fake_apex("legacy"):
        import apex
        from apex.parallel import DistributedDataParallel

        with pytest.raises(ValueError, match="Default process group has not been initialized"):
            DistributedDataParallel(_model())
        with _SingleRankGroup():
            with pytest.raises(ValueError, match="shared_param is no longer supported"):
                DistributedDataParallel(_model(), shared_param=True)
            with pytest.warns(apex.DeprecatedFeatureWarning, match="deprecated"):
                ddp = DistributedDataParallel(_model())
            assert not hasattr(ddp, "no_sync")
            assert isinstance(ddp.module, nn.Sequential)
            assert next(iter(ddp.state_dict())).startswith("module.")
            _loss(ddp, _batch(0)).backward()
            # the refused constructions recorded nothing
            assert [n for n, _ in apex.CALLS] == [
                "parallel.DistributedDataParallel",
                "ddp.broadcast",
                "ddp.allreduce",
            ]


def _rank_body_ddp_averages() -> dict[str, Any]:
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else None
    assert rank is None
    torch.distributed.init_process_group("gloo", init_method="env://")
    try:
        rank = torch.distributed.get_rank()
        world = torch.distributed.get_world_size()
        with use_fake_apex("legacy"):
            import apex
            from apex import amp
            from apex.parallel import DistributedDataParallel

            model = _model(seed=10 + rank)  # different on purpose: construction broadcasts
            reference = _model(seed=10)
            batches = [_batch(100 + r) for r in range(world)]
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                ddp = DistributedDataParallel(model)
            broadcast_diff = _max_diff(list(model.parameters()), list(reference.parameters()))

            _loss(ddp, batches[rank]).backward()
            per_rank = [_plain_grads(reference, [b]) for b in batches]
            expected = [sum(gs) / world for gs in zip(*per_rank, strict=True)]
            plain_diff = _max_diff([p.grad for p in model.parameters()], expected)
            allreduces_plain = len(apex.calls_named("ddp.allreduce"))

            # amp then apex DDP (the order real apex requires), scaled loss, averaged grads
            amp_model = _model(seed=10)
            optimizer = torch.optim.SGD(amp_model.parameters(), lr=0.1)
            amp_model, optimizer = amp.initialize(amp_model, optimizer, opt_level="O1", verbosity=0)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                amp_ddp = DistributedDataParallel(amp_model)
            with amp.scale_loss(_loss(amp_ddp, batches[rank]), optimizer) as scaled:
                scaled.backward()
            amp_diff = _max_diff([p.grad for p in amp_model.parameters()], expected)
            return {
                "broadcast_diff": broadcast_diff,
                "plain_diff": plain_diff,
                "amp_diff": amp_diff,
                "allreduces_plain": allreduces_plain,
                "allreduces_total": len(apex.calls_named("ddp.allreduce")),
                "world": apex.calls_named("ddp.allreduce")[0]["world_size"],
            }
    finally:
        torch.distributed.destroy_process_group()


def test_apex_ddp_really_averages_grads_over_two_gloo_ranks(run_on_ranks) -> None:
    """Fake apex DDP broadcasts rank 0's params and all-reduces/averages grads (2 gloo ranks)."""
    results = run_on_ranks(_rank_body_ddp_averages, world_size=2)
    for result in results:
        assert result["broadcast_diff"] == 0.0
        assert result["plain_diff"] < 1e-6
        assert result["amp_diff"] < 1e-5
        assert result["allreduces_plain"] == 1
        assert result["allreduces_total"] == 2
        assert result["world"] == 2


def _rank_body_disable_allreduce() -> dict[str, Any]:
    torch.distributed.init_process_group("gloo", init_method="env://")
    try:
        rank = torch.distributed.get_rank()
        world = torch.distributed.get_world_size()
        with use_fake_apex("legacy"):
            import apex
            from apex.parallel import DistributedDataParallel

            model = _model(seed=5)
            reference = _model(seed=5)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                ddp = DistributedDataParallel(model)
            first = [_batch(200 + r) for r in range(world)]
            second = [_batch(300 + r) for r in range(world)]

            ddp.disable_allreduce()
            _loss(ddp, first[rank]).backward()
            local = _plain_grads(reference, [first[rank]])
            local_diff = _max_diff([p.grad for p in model.parameters()], local)
            allreduces_while_disabled = len(apex.calls_named("ddp.allreduce"))

            ddp.enable_allreduce()
            _loss(ddp, second[rank]).backward()
            per_rank = [_plain_grads(reference, [first[r], second[r]]) for r in range(world)]
            expected = [sum(gs) / world for gs in zip(*per_rank, strict=True)]
            return {
                "local_diff": local_diff,
                "allreduces_while_disabled": allreduces_while_disabled,
                "accumulated_diff": _max_diff([p.grad for p in model.parameters()], expected),
                "allreduces": len(apex.calls_named("ddp.allreduce")),
                "switches": [n for n, _ in apex.CALLS if n.endswith("able_allreduce")],
                "first_grad": model[0].weight.grad.clone(),
            }
    finally:
        torch.distributed.destroy_process_group()


def test_apex_ddp_disable_allreduce_keeps_grads_local(run_on_ranks) -> None:
    """Fake apex DDP: disabled -> local grads; next enabled backward averages the accumulation."""
    results = run_on_ranks(_rank_body_disable_allreduce, world_size=2)
    for result in results:
        assert result["local_diff"] < 1e-6
        assert result["allreduces_while_disabled"] == 0
        assert result["accumulated_diff"] < 1e-6
        assert result["allreduces"] == 1
        assert result["switches"] == ["ddp.disable_allreduce", "ddp.enable_allreduce"]
    assert torch.equal(results[0]["first_grad"], results[1]["first_grad"])


# --------------------------------------------------------------------------- SyncBatchNorm


def test_convert_syncbn_model_replaces_nested_batchnorm() -> None:
    """Fake convert_syncbn_model swaps every nested BatchNorm for the fake SyncBatchNorm."""
    with use_fake_apex("legacy"):
        import apex
        from apex.parallel import SyncBatchNorm, convert_syncbn_model

        torch.manual_seed(0)
        inner = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        model = nn.Sequential(
            inner, nn.Flatten(), nn.Linear(4 * 6 * 6, 8), nn.BatchNorm1d(8, momentum=0.3)
        )
        with torch.no_grad():
            for module in model.modules():
                if isinstance(module, nn.modules.batchnorm._BatchNorm):
                    module.weight.uniform_(0.5, 1.5)
                    module.bias.uniform_(-0.5, 0.5)
                    module.running_mean.uniform_(-1, 1)
        original = copy.deepcopy(model)
        running_mean = model[0][1].running_mean

        converted = convert_syncbn_model(model)
        assert converted is model
        bns = [m for m in converted.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        assert len(bns) == 2 and all(type(m) is SyncBatchNorm for m in bns)
        assert not any(isinstance(m, nn.SyncBatchNorm) for m in converted.modules())
        assert converted[3].momentum == 0.3 and converted[0][1].num_features == 4
        assert converted[0][1].running_mean is running_mean  # shared, as real apex
        assert torch.equal(converted[0][1].weight, original[0][1].weight)
        x = torch.randn(5, 3, 8, 8)
        assert torch.allclose(converted.train()(x), original.train()(x), atol=1e-6)
        assert apex.calls_named("parallel.convert_syncbn_model") == [
            {"replaced": 2, "channel_last": False}
        ]

        lone = convert_syncbn_model(nn.BatchNorm1d(3))
        assert type(lone) is SyncBatchNorm
        with pytest.raises(AttributeError, match="channel_last"):
            convert_syncbn_model(nn.BatchNorm1d(3), channel_last=True)


# --------------------------------------------------------------------------- fused optimizers


@pytest.mark.parametrize(
    ("fused_name", "fused_kwargs", "torch_cls", "torch_kwargs"),
    [
        (
            "FusedAdam",
            {"lr": 0.01, "weight_decay": 0.1, "adam_w_mode": False},
            torch.optim.Adam,
            {"lr": 0.01, "weight_decay": 0.1},
        ),
        (
            "FusedAdam",
            {"lr": 0.01, "weight_decay": 0.1},
            torch.optim.AdamW,
            {"lr": 0.01, "weight_decay": 0.1},
        ),
        (
            "FusedSGD",
            {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01},
            torch.optim.SGD,
            {"lr": 0.05, "momentum": 0.9, "weight_decay": 0.01},
        ),
        (
            "FusedSGD",
            {"lr": 0.05, "momentum": 0.9, "nesterov": True},
            torch.optim.SGD,
            {"lr": 0.05, "momentum": 0.9, "nesterov": True},
        ),
        (
            "FusedLAMB",
            {"lr": 0.01, "weight_decay": 0.0, "max_grad_norm": 1e9, "eps": 1e-8},
            torch.optim.Adam,
            {"lr": 0.01, "eps": 1e-8},
        ),
    ],
)
@pytest.mark.parametrize("kind", ["legacy", "modern"])
def test_fused_optimizers_match_torch(
    kind: str, fused_name: str, fused_kwargs: dict, torch_cls: type, torch_kwargs: dict
) -> None:
    """The fake fused optimizers follow torch's Adam / AdamW / SGD math and state keys."""
    with use_fake_apex(kind):
        import apex
        import apex.optimizers

        fused_model, torch_model = _model(), _model()
        fused = getattr(apex.optimizers, fused_name)(fused_model.parameters(), **fused_kwargs)
        reference = torch_cls(torch_model.parameters(), foreach=False, **torch_kwargs)
        for step in range(6):
            for model, optimizer in ((fused_model, fused), (torch_model, reference)):
                optimizer.zero_grad()
                _loss(model, _batch(step)).backward()
                optimizer.step()
        assert _max_diff(list(fused_model.parameters()), list(torch_model.parameters())) < 1e-6
        fused_state = fused.state_dict()["state"]
        torch_state = reference.state_dict()["state"]
        assert fused_state.keys() == torch_state.keys()
        for key in torch_state:
            assert set(fused_state[key]) == set(torch_state[key])
        assert [name for name, _ in apex.CALLS] == [f"optimizers.{fused_name}"]


def test_fused_lamb_applies_trust_ratio_and_clipping() -> None:
    """The fake FusedLAMB scales each update by ||p|| / ||update|| when weight decay is on."""
    with use_fake_apex("legacy"):
        from apex.optimizers import FusedLAMB

        param = nn.Parameter(torch.tensor([3.0, 4.0]))
        optimizer = FusedLAMB([param], lr=0.1, weight_decay=0.01, bias_correction=True)
        param.grad = torch.tensor([100.0, 0.0])  # global norm 100 > max_grad_norm 1
        optimizer.step()
        # first step: update = sign(g) + wd * p (after bias correction), trust ratio ||p||/||u||
        update = torch.tensor([1.0, 0.0]) / (1 + 1e-6 / 1.0) + 0.01 * torch.tensor([3.0, 4.0])
        expected = torch.tensor([3.0, 4.0]) - 0.1 * (5.0 / update.norm()) * update
        assert torch.allclose(param.detach(), expected, atol=1e-5)


def test_fused_optimizer_details_like_real_apex() -> None:
    """Fake fused optimizers: no-argument zero_grad, AMSGrad refused, lr required for SGD."""
    with use_fake_apex("legacy"):
        from apex.optimizers import FusedAdam, FusedSGD

        model = _model()
        adam = FusedAdam(model.parameters())
        _loss(model, _batch(0)).backward()
        adam.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        with pytest.raises(TypeError):
            adam.zero_grad(set_to_none=True)  # real apex's zero_grad takes no argument
        with pytest.raises(RuntimeError, match="AMSGrad"):
            FusedAdam(model.parameters(), amsgrad=True)
        with pytest.raises(RuntimeError, match="FusedAdam has been updated"):
            adam.step(scale=1.0)
        with pytest.raises(ValueError, match="Nesterov momentum requires"):
            FusedSGD(model.parameters(), lr=0.1, nesterov=True)


# --------------------------------------------------------------------------- normalization


def test_fused_norms() -> None:
    """Fake FusedLayerNorm equals nn.LayerNorm; fake FusedRMSNorm normalises by the RMS."""
    with use_fake_apex("modern"):
        import apex
        from apex.normalization import FusedLayerNorm, FusedRMSNorm

        x = torch.randn(4, 6)
        layer = FusedLayerNorm(6)
        assert isinstance(layer, nn.LayerNorm)
        assert torch.allclose(layer(x), nn.LayerNorm(6)(x), atol=1e-6)
        rms = FusedRMSNorm(6, eps=0.0)
        expected = x / x.pow(2).mean(dim=-1, keepdim=True).sqrt()
        assert torch.allclose(rms(x), expected, atol=1e-6)
        assert set(rms.state_dict()) == {"weight"}
        assert [n for n, _ in apex.CALLS] == [
            "normalization.FusedLayerNorm",
            "normalization.FusedRMSNorm",
        ]


# --------------------------------------------------------------------------- generations


def test_modern_apex_has_no_amp_parallel_or_fp16_utils() -> None:
    """The modern fake (apex >= 25.07) lacks amp/parallel/fp16_utils like the real one."""
    with use_fake_apex("modern"):
        import apex

        assert apex.__fake_apex__ == "modern"
        for name in ("amp", "parallel", "fp16_utils"):
            with pytest.raises(ModuleNotFoundError, match=f"No module named 'apex.{name}'"):
                importlib.import_module(f"apex.{name}")
            assert importlib.util.find_spec(f"apex.{name}") is None
            assert not hasattr(apex, name)
        with pytest.raises(ImportError, match="cannot import name 'amp' from 'apex'"):
            from apex import amp  # noqa: F401
        from apex.normalization import FusedLayerNorm  # noqa: F401
        from apex.optimizers import FusedAdam, FusedLAMB, FusedSGD  # noqa: F401


def test_legacy_apex_has_every_generation_one_module() -> None:
    """The legacy fake exposes amp, parallel, fp16_utils, optimizers and normalization."""
    with use_fake_apex("legacy"):
        import apex

        for name in ("amp", "parallel", "fp16_utils", "optimizers", "normalization"):
            assert importlib.util.find_spec(f"apex.{name}") is not None
            assert hasattr(apex, name)
        assert callable(apex.amp.initialize) and callable(apex.parallel.convert_syncbn_model)
        assert isinstance(apex.amp._amp_state, apex.amp._amp_state.__class__)
        assert type(apex.amp._amp_state).__name__ == "AmpState"


def test_impostor_apex_fails_on_pyramid_and_lacks_nvidia_modules() -> None:
    """The PyPI-apex fake: found by find_spec, but every import dies on pyramid_mailer."""
    with use_fake_apex("impostor") as directory:
        assert importlib.util.find_spec("apex") is not None
        assert importlib.metadata.version("apex") == "0.9.10.dev0"
        assert "Pyramid" in importlib.metadata.metadata("apex")["Summary"]
        for statement in ("import apex", "from apex import amp", "import apex.parallel"):
            with pytest.raises(ModuleNotFoundError) as excinfo:
                exec(statement, {})
            assert excinfo.value.name == "pyramid_mailer"
        assert "apex" not in sys.modules
        package = directory / "apex"
        for name in ("amp", "parallel", "optimizers", "normalization", "fp16_utils"):
            assert not (package / name).exists() and not (package / f"{name}.py").exists()
        for name in ("views.py", "models.py", "forms.py", "lib", "scaffolds"):
            assert (package / name).exists()
