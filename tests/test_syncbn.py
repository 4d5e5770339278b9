"""GlobalBatchNorm equals plain BatchNorm over the global batch, in one process and over two."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distkit.syncbn import GlobalBatchNorm, convert_to_global_batchnorm

pytestmark = pytest.mark.timeout(60)

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
