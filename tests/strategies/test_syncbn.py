"""Sync BatchNorm equals plain BatchNorm over the global batch: one layer in one process and
over two, and whole fits with uneven last batches (placeholders) on 2 and 3 ranks.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distkit.strategies.syncbn import (
    GlobalBatchNorm,
    MaskedSyncBatchNorm,
    convert_to_global_batchnorm,
    convert_to_masked_sync_batchnorm,
    placeholder_batch,
)
from tests.support.gates import needs

pytestmark = pytest.mark.timeout(60)

#: GlobalBatchNorm (two-pass sums) against torch's BatchNorm kernel, one process, float32:
#: two algorithms' rounding. Measured 2026-12-03: at most 1.9e-6 absolute, 0.11 of
#: atol + rtol * |expected| with the rtol 1e-5 beside it (the far-from-zero test's own
#: tolerances: 0.22 of theirs). The float64 test below holds the same code to ~1e-15.
ATOL = 1e-5


def _identity(tensor):
    return tensor


def _randomise_affine(bn, seed):
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        bn.weight.copy_(torch.rand(bn.num_features, generator=gen) + 0.5)
        bn.bias.copy_(torch.randn(bn.num_features, generator=gen))


@pytest.mark.parametrize("momentum", [0.1, 0.3, None])
@pytest.mark.parametrize(
    ("bn_class", "shape"),
    [
        (nn.BatchNorm1d, (8, 3)),
        (nn.BatchNorm1d, (6, 3, 5)),
        (nn.BatchNorm2d, (4, 3, 5, 6)),
        (nn.BatchNorm3d, (2, 3, 2, 3, 4)),
    ],
    ids=["1d-NC", "1d-NCL", "2d", "3d"],
)
def test_global_batchnorm_with_identity_reduce_equals_batchnorm(bn_class, shape, momentum):
    channels = shape[1]
    reference = bn_class(channels, momentum=momentum)
    _randomise_affine(reference, seed=0)
    layer = GlobalBatchNorm(channels, _identity, momentum=momentum)
    layer.load_state_dict(reference.state_dict())
    gen = torch.Generator().manual_seed(1)

    for step in range(3):  # several steps: running averages and momentum=None's cumulative mean
        x = torch.randn(shape, generator=gen) * (step + 1) + step
        upstream = torch.randn(shape, generator=gen)
        x_ref, x_new = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_ref, out_new = reference(x_ref), layer(x_new)
        (out_ref * upstream).sum().backward()
        (out_new * upstream).sum().backward()

        torch.testing.assert_close(out_new, out_ref, atol=ATOL, rtol=1e-5)
        torch.testing.assert_close(x_new.grad, x_ref.grad, atol=ATOL, rtol=1e-5)
        torch.testing.assert_close(layer.weight.grad, reference.weight.grad, atol=ATOL, rtol=1e-5)
        torch.testing.assert_close(layer.bias.grad, reference.bias.grad, atol=ATOL, rtol=1e-5)
        torch.testing.assert_close(layer.running_mean, reference.running_mean, atol=ATOL, rtol=0)
        torch.testing.assert_close(layer.running_var, reference.running_var, atol=ATOL, rtol=1e-5)
        assert layer.num_batches_tracked.item() == reference.num_batches_tracked.item() == step + 1

    reference.eval()
    layer.eval()
    x = torch.randn(shape, generator=gen)
    torch.testing.assert_close(layer(x), reference(x), atol=ATOL, rtol=1e-5)
    assert layer.num_batches_tracked.item() == 3, "eval does not count batches"


def test_global_batchnorm_computes_a_float64_model_in_float64():
    """Statistics in float32 at least, never below the input's dtype: a float64 model's were
    once computed in float32 (7e-8 off one process after a fit, where float64 is ~1e-16)."""
    reference = nn.BatchNorm2d(3).double()
    _randomise_affine(reference, seed=0)
    layer = GlobalBatchNorm(3, _identity).double()
    layer.load_state_dict(reference.state_dict())
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(4, 3, 5, 6, generator=gen, dtype=torch.float64) * 3 + 1).requires_grad_()
    x_ref = x.detach().clone().requires_grad_()
    out, out_ref = layer(x), reference(x_ref)
    out.sum().backward()
    out_ref.sum().backward()
    assert out.dtype == torch.float64
    # two summation orders of float64 (torch's kernel, this two-pass one): ~1e-15
    for ours, theirs in ((out, out_ref), (x.grad, x_ref.grad),
                         (layer.running_mean, reference.running_mean),
                         (layer.running_var, reference.running_var)):  # fmt: skip
        torch.testing.assert_close(ours, theirs, atol=1e-12, rtol=1e-12)


def test_global_batchnorm_features_far_from_zero_equal_batchnorm():
    # Tabular inputs such as a year, a price or a raw pixel value are often batch-normalised raw.
    gen = torch.Generator().manual_seed(0)
    scale, offset = torch.tensor([10.0, 1.0, 5.0]), torch.tensor([2000.0, 100.0, 500.0])
    x = torch.randn(512, 3, generator=gen) * scale + offset
    reference = nn.BatchNorm1d(3)
    layer = GlobalBatchNorm(3, _identity)

    out_ref, out_new = reference(x), layer(x)

    torch.testing.assert_close(out_new, out_ref, atol=2e-4, rtol=0)
    torch.testing.assert_close(layer.running_var, reference.running_var, atol=0, rtol=1e-4)


def test_global_batchnorm_without_running_stats_uses_batch_stats_in_eval():
    reference = nn.BatchNorm2d(3, track_running_stats=False, affine=False).eval()
    layer = GlobalBatchNorm(3, _identity, track_running_stats=False, affine=False).eval()
    x = torch.randn(4, 3, 2, 2, generator=torch.Generator().manual_seed(2)) * 3 + 1

    torch.testing.assert_close(layer(x), reference(x), atol=ATOL, rtol=1e-5)
    assert layer.running_mean is None


def test_global_batchnorm_rejects_one_dimensional_input():
    with pytest.raises(ValueError, match="at least 2 dimensions, got 1D"):
        GlobalBatchNorm(3, _identity)(torch.randn(3))


class _Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(1, 4, 3), nn.BatchNorm2d(4), nn.ReLU())
        self.blocks = nn.ModuleList([nn.BatchNorm2d(4), nn.Identity()])
        self.head = _Head()


def test_convert_to_global_batchnorm_replaces_nested_layers_in_place():
    model = _Net()
    model.blocks[0].eval()
    before = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    converted = convert_to_global_batchnorm(model, _identity)

    assert converted is model
    norms = [model.features[1], model.blocks[0], model.head.norm]
    assert all(type(norm) is GlobalBatchNorm for norm in norms)
    assert [norm.training for norm in norms] == [True, False, True]
    assert not any(type(module) in (nn.BatchNorm1d, nn.BatchNorm2d) for module in model.modules())
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[name] is before[name] for name in before)
    optimized = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert optimized == {id(p) for p in model.parameters()}
    after_buffers = dict(model.named_buffers())
    assert after_buffers.keys() == buffers.keys()
    assert all(after_buffers[name] is buffers[name] for name in buffers)


def test_convert_to_global_batchnorm_training_updates_shared_state():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    original = model[1]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    convert_to_global_batchnorm(model, _identity)
    weight_before = original.weight.detach().clone()

    model(torch.randn(8, 3)).pow(2).sum().backward()
    optimizer.step()

    assert not torch.equal(original.weight.detach(), weight_before), "optimizer moved the weight"
    assert original.num_batches_tracked.item() == 1
    assert original.running_mean.abs().sum() > 0


def test_convert_to_global_batchnorm_top_level_returns_new_layer():
    bn = nn.BatchNorm2d(5, eps=1e-3, momentum=0.2, affine=True).eval()

    converted = convert_to_global_batchnorm(bn, _identity)

    assert type(converted) is GlobalBatchNorm
    assert converted is not bn
    assert converted.weight is bn.weight and converted.running_var is bn.running_var
    assert (converted.eps, converted.momentum, converted.training) == (1e-3, 0.2, False)


def test_convert_to_global_batchnorm_leaves_converted_layers_alone():
    layer = GlobalBatchNorm(3, _identity)

    assert convert_to_global_batchnorm(layer, lambda t: t * 2) is layer


# ---------------------------------------------------------------------------- two processes

GLOBAL_BATCH = 16


def _model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 3, 3, padding=1), nn.BatchNorm2d(3))
    _randomise_affine(model[1], seed=5)
    return model


def _global_batch():
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(GLOBAL_BATCH, 2, 4, 4, generator=gen) * 2 + 1
    upstream = torch.randn(GLOBAL_BATCH, 3, 4, 4, generator=gen)
    return x, upstream


def _on_rank_global_batchnorm_step():
    import torch.distributed as dist

    from distkit.strategies._torch_dist import differentiable_all_reduce_sum

    dist.init_process_group("gloo", init_method="env://")
    try:
        rank, world = dist.get_rank(), dist.get_world_size()
        model = convert_to_global_batchnorm(_model(), differentiable_all_reduce_sum)
        x, upstream = _global_batch()
        part = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
        x_local = x[part].clone().requires_grad_()
        out = model(x_local)
        # Each rank's share of (out_full * upstream).sum() / 16, so the gradients summed over
        # ranks are the full-batch gradients.
        ((out * upstream[part]).sum() / GLOBAL_BATCH).backward()
        bn = model[1]
        return {
            "out": out.detach().tolist(),
            "x_grad": x_local.grad.tolist(),
            "weight_grad": bn.weight.grad.tolist(),
            "bias_grad": bn.bias.grad.tolist(),
            "conv_grad": model[0].weight.grad.tolist(),
            "running_mean": bn.running_mean.tolist(),
            "running_var": bn.running_var.tolist(),
            "num_batches_tracked": int(bn.num_batches_tracked),
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_global_batchnorm_two_ranks_equals_full_batch_batchnorm(run_on_ranks):
    results = run_on_ranks(_on_rank_global_batchnorm_step, world_size=2, timeout=50)

    model = _model()
    x, upstream = _global_batch()
    x = x.clone().requires_grad_()
    out = model(x)
    ((out * upstream).sum() / GLOBAL_BATCH).backward()
    bn = model[1]

    def summed(key):
        return sum(torch.tensor(result[key]) for result in results)

    def concatenated(key):
        return torch.cat([torch.tensor(result[key]) for result in results])

    torch.testing.assert_close(concatenated("out"), out.detach(), atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(concatenated("x_grad"), x.grad, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(summed("weight_grad"), bn.weight.grad, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(summed("bias_grad"), bn.bias.grad, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(summed("conv_grad"), model[0].weight.grad, atol=ATOL, rtol=1e-5)
    for result in results:
        assert result["num_batches_tracked"] == 1
        torch.testing.assert_close(
            torch.tensor(result["running_mean"]), bn.running_mean, atol=ATOL, rtol=0
        )
        torch.testing.assert_close(
            torch.tensor(result["running_var"]), bn.running_var, atol=ATOL, rtol=1e-5
        )
    # The halves really differ, so a layer normalising each half alone would fail the above.
    assert not torch.allclose(
        torch.tensor(results[0]["weight_grad"]), torch.tensor(results[1]["weight_grad"])
    )


def test_placeholder_batch_marks_sync_layers_only_and_always_unmarks():
    model = nn.Sequential(GlobalBatchNorm(3, _identity), MaskedSyncBatchNorm(3), nn.BatchNorm1d(3))

    with pytest.raises(RuntimeError, match="inside"), placeholder_batch(model):
        assert model[0].placeholder and model[1].placeholder
        assert not hasattr(model[2], "placeholder")
        raise RuntimeError("inside")

    assert not (model[0].placeholder or model[1].placeholder)


def test_convert_to_masked_sync_batchnorm_replaces_nested_layers_sharing_state():
    model = _Net()
    before = dict(model.named_parameters())
    buffers = dict(model.named_buffers())

    assert convert_to_masked_sync_batchnorm(model) is model

    norms = [model.features[1], model.blocks[0], model.head.norm]
    assert all(type(norm) is MaskedSyncBatchNorm for norm in norms)
    assert all(param is before[name] for name, param in model.named_parameters())
    assert all(buffer is buffers[name] for name, buffer in model.named_buffers())


REAL = 6  # rank 0's samples; rank 1 holds only a placeholder


def _on_rank_placeholder_step():
    import contextlib

    import torch.distributed as dist

    from distkit.strategies._torch_dist import differentiable_all_reduce_sum

    dist.init_process_group("gloo", init_method="env://")
    try:
        rank = dist.get_rank()
        model = convert_to_global_batchnorm(_model(), differentiable_all_reduce_sum)
        x, upstream = _global_batch()
        # rank 1's placeholder: a copy of a real sample, trained with loss weight 0
        x_local = (x[:REAL] if rank == 0 else x[:1]).clone().requires_grad_()
        empty = placeholder_batch(model) if rank == 1 else contextlib.nullcontext()
        with empty:
            out = model(x_local)
        weight = 1.0 if rank == 0 else 0.0
        ((out * upstream[: len(x_local)]).sum() * weight / REAL).backward()
        bn = model[1]
        return {
            "out": out.detach(),
            "x_grad": x_local.grad,
            "weight_grad": bn.weight.grad,
            "conv_grad": model[0].weight.grad,
            "running_mean": bn.running_mean.clone(),
            "running_var": bn.running_var.clone(),
        }
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(60)
def test_global_batchnorm_placeholder_rank_adds_nothing(run_on_ranks):
    real, placeholder = run_on_ranks(_on_rank_placeholder_step, world_size=2, timeout=50)

    model = _model()
    x, upstream = _global_batch()
    x = x[:REAL].clone().requires_grad_()
    out = model(x)
    ((out * upstream[:REAL]).sum() / REAL).backward()
    bn = model[1]
    torch.testing.assert_close(real["out"], out.detach(), atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(real["x_grad"], x.grad, atol=ATOL, rtol=1e-5)
    for key, want in (("weight_grad", bn.weight.grad), ("conv_grad", model[0].weight.grad)):
        torch.testing.assert_close(real[key] + placeholder[key], want, atol=ATOL, rtol=1e-5)
    for result in (real, placeholder):
        torch.testing.assert_close(result["running_mean"], bn.running_mean, atol=ATOL, rtol=0)
        torch.testing.assert_close(result["running_var"], bn.running_var, atol=ATOL, rtol=1e-5)
    assert torch.isfinite(placeholder["out"]).all()
    assert not placeholder["x_grad"].any()


# ------------------------------------------------------- uneven last batches (placeholders)
# A rank with no real sample in a short last global batch trains on a placeholder sample of
# loss weight 0. Sync BatchNorm must leave it out of the mean, the variance and the running
# statistics, or the run differs from one process with the global batch.


def _conv_bn_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(),
        nn.Linear(4 * 4 * 4, 3),
    )  # fmt: skip


def _images(n: int):
    from torch.utils.data import TensorDataset

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(n, 1, 4, 4, generator=gen) * 2 + 1
    return TensorDataset(x, (x.mean(dim=(1, 2, 3)) > 1).long() + (x[:, 0, 0, 0] > 2).long())


def fit_bn_model(
    strategy: str, batch_size: int, n: int, model: str, grad_accum_steps: int = 1,
    sync_batchnorm: bool = True,
) -> dict:  # fmt: skip
    """Per rank (or in one process): fit a BatchNorm model, return its state and history."""
    import distkit
    from tests.support.workloads import make_bn_model, make_dataset, state_of, without_timing

    torch.backends.cudnn.allow_tf32 = False  # CUDA: TF32 convolutions are not 1e-5 exact
    torch.backends.cuda.matmul.allow_tf32 = False
    net = _conv_bn_model() if model == "conv" else make_bn_model()
    data = _images(n) if model == "conv" else make_dataset(n)
    with distkit.Trainer(
        strategy, batch_size=batch_size, max_epochs=2, grad_accum_steps=grad_accum_steps,
        sync_batchnorm=sync_batchnorm, progress=False, seed=3,
    ) as trainer:  # fmt: skip
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        result = trainer.fit(
            net, optimizer, data, loss_fn=nn.functional.cross_entropy, val_data=data
        )
        return {"state": state_of(net), "history": without_timing(result.history)}


# (world, batch per rank, samples, model, grad_accum_steps); each ends with a global batch
# smaller than the world, so some rank holds a placeholder
UNEVEN = {
    "3-ranks-bn1d": (3, 4, 14, "bn1d", 1),  # 12 + 2: rank 2 has no sample
    "3-ranks-conv": (3, 4, 14, "conv", 1),
    "3-ranks-bn1d-accum": (3, 2, 14, "bn1d", 2),  # 6 + 6 | 2: rank 2 empty in a 1-micro step
    "2-ranks-conv": (2, 4, 17, "conv", 1),  # 8 + 8 + 1: rank 1 has no sample
    "2-ranks-conv-accum": (2, 4, 25, "conv", 2),  # 8 + 8 | 8 + 1: placeholder in a 2-micro step
}


def _assert_matches_one_process(results: list, case: str, atol: float = ATOL) -> None:
    """Every rank's parameters, running statistics and history equal plain BatchNorm's."""
    from tests.support.horovod_runner import RankError
    from tests.support.workloads import max_abs_diff

    world, batch, n, model, accum = UNEVEN[case]
    one = fit_bn_model("ddp", world * batch, n, model, accum, sync_batchnorm=False)
    assert len(results) == world
    for result in results:
        if isinstance(result, RankError):
            raise AssertionError(str(result))
        assert max_abs_diff(result["state"], one["state"]) <= atol  # running stats included
        for got, want in zip(result["history"], one["history"], strict=True):
            assert got.keys() == want.keys()
            for key in want:  # train_loss, val_loss, ...
                assert abs(got[key] - want[key]) <= atol, (key, got[key], want[key])


@pytest.mark.timeout(120)
@pytest.mark.parametrize("case", list(UNEVEN))
def test_sync_batchnorm_leaves_placeholders_out_under_ddp(case, run_on_ranks):
    world, batch, n, model, accum = UNEVEN[case]

    results = run_on_ranks(fit_bn_model, "ddp", batch, n, model, accum, world_size=world)

    _assert_matches_one_process(results, case)


@pytest.fixture(scope="module")
def horovod_uneven(tmp_path_factory):
    """{case: per-rank results} from one horovodrun launch per world size."""
    from tests.support.horovod_runner import run_with_horovodrun

    out: dict[str, list] = {}
    for world in sorted({spec[0] for spec in UNEVEN.values()}):
        cases = [case for case, spec in UNEVEN.items() if spec[0] == world]
        calls = [(__name__, "fit_bn_model", ("horovod", *UNEVEN[case][1:]), {}) for case in cases]
        workdir = tmp_path_factory.mktemp(f"horovod{world}")
        per_rank = run_with_horovodrun(calls, workdir, np=world, timeout=240)
        for i, case in enumerate(cases):
            out[case] = [per_rank[rank][i] for rank in range(world)]
    return out


@pytest.mark.timeout(600)
@needs("horovod")
@pytest.mark.parametrize("case", list(UNEVEN))
def test_sync_batchnorm_leaves_placeholders_out_under_horovod(case, horovod_uneven):
    _assert_matches_one_process(horovod_uneven[case], case)


# CUDA: DDP and apex use torch's SyncBatchNorm fed an empty batch for a placeholder, Horovod
# uses GlobalBatchNorm over hvd.allreduce. Same cases, 2 ranks; a looser tolerance, as CUDA
# reductions run in another order than one process's.
CUDA_CASES = [case for case, spec in UNEVEN.items() if spec[0] == 2]
CUDA_ATOL = 1e-4
needs_two_gpus = needs("2 gpus", because="one per rank")


@needs_two_gpus
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CUDA_CASES)
def test_sync_batchnorm_on_cuda_leaves_placeholders_out_under_ddp(case, run_on_ranks):
    world, batch, n, model, accum = UNEVEN[case]

    results = run_on_ranks(fit_bn_model, "ddp", batch, n, model, accum, world_size=world)

    _assert_matches_one_process(results, case, atol=CUDA_ATOL)


@needs("2 gpus", "apex")
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CUDA_CASES)
def test_sync_batchnorm_on_cuda_leaves_placeholders_out_under_apex(case, run_on_ranks):
    world, batch, n, model, accum = UNEVEN[case]

    results = run_on_ranks(fit_bn_model, "apex", batch, n, model, accum, world_size=world)

    _assert_matches_one_process(results, case, atol=CUDA_ATOL)


@needs("2 gpus", "horovod")
@pytest.mark.timeout(600)
def test_sync_batchnorm_on_cuda_leaves_placeholders_out_under_horovod(tmp_path):
    from tests.support.horovod_runner import run_with_horovodrun

    calls = [(__name__, "fit_bn_model", ("horovod", *UNEVEN[case][1:]), {}) for case in CUDA_CASES]
    per_rank = run_with_horovodrun(calls, tmp_path, np=2, timeout=300)

    for i, case in enumerate(CUDA_CASES):
        _assert_matches_one_process([per_rank[0][i], per_rank[1][i]], case, atol=CUDA_ATOL)
