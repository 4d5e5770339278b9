"""Precision: names, autocast dtypes, and fp16 loss scaling (on CPU)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from distkit.errors import ConfigurationError
from distkit.strategies.precision import Precision, normalize_precision

pytestmark = pytest.mark.timeout(60)

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ("32", "32"),
        (32, "32"),
        ("fp32", "32"),
        ("bf16", "bf16"),
        ("bfloat16", "bf16"),
        (" BF16 ", "bf16"),
        ("16", "fp16"),
        (16, "fp16"),
        ("fp16", "fp16"),
        ("FP16", "fp16"),
    ],
)
def test_normalize_precision_accepts_aliases(given, expected):
    assert normalize_precision(given) == expected


@pytest.mark.parametrize("bad", ["64", 64, "half", "", "fp8"])
def test_normalize_precision_bad_value_lists_allowed(bad):
    with pytest.raises(ConfigurationError) as info:
        normalize_precision(bad)

    message = str(info.value)
    assert f"unknown precision {bad!r}" in message
    assert "Allowed: '32', 'bf16', 'fp16'" in message
    assert isinstance(info.value, ValueError)


def test_precision_rejects_bad_name():
    with pytest.raises(ConfigurationError, match="unknown precision 'fp64'"):
        Precision("fp64", CPU)


@pytest.mark.parametrize(
    ("name", "dtype"),
    [("bf16", torch.bfloat16), ("32", torch.float32), ("fp16", torch.float16)],
)
def test_precision_autocast_sets_linear_output_dtype(name, dtype):
    layer = nn.Linear(4, 3)
    x = torch.randn(2, 4)

    with Precision(name, CPU).autocast():
        out = layer(x)

    assert out.dtype == dtype
    assert layer(x).dtype == torch.float32, "autocast ends with the block"


@pytest.mark.parametrize("name", ["32", "bf16"])
def test_precision_without_scaler_leaves_loss_alone(name):
    precision = Precision(name, CPU)
    loss = torch.tensor(2.5)

    assert precision.scaler is None
    assert precision.scale(loss) is loss
    assert precision.state_dict() == {}


def _param_with_grad(value):
    param = nn.Parameter(torch.ones(3))
    param.grad = torch.full((3,), value)
    return param


def test_precision_fp16_scale_multiplies_loss():
    precision = Precision("fp16", CPU)
    factor = precision.scaler.get_scale()

    scaled = precision.scale(torch.tensor(1.5))

    assert factor > 1
    assert scaled.item() == pytest.approx(1.5 * factor)


def test_precision_fp16_step_skips_on_inf_gradient():
    precision = Precision("fp16", CPU)
    param = _param_with_grad(float("inf"))
    optimizer = torch.optim.SGD([param], lr=1.0)
    precision.scale(torch.tensor(1.0))  # the scaler starts its scale on first use
    scale_before = precision.scaler.get_scale()

    stepped = precision.step(optimizer)

    assert stepped is False
    assert torch.equal(param.detach(), torch.ones(3)), "a skipped step leaves weights alone"
    assert precision.scaler.get_scale() == scale_before / 2


def test_precision_fp16_step_applies_finite_unscaled_gradient():
    precision = Precision("fp16", CPU)
    factor = precision.scale(torch.tensor(1.0)).item()
    param = _param_with_grad(0.5 * factor)  # as if backward ran on a scaled loss
    optimizer = torch.optim.SGD([param], lr=1.0)

    stepped = precision.step(optimizer)

    assert stepped is True
    torch.testing.assert_close(param.detach(), torch.full((3,), 0.5))


def test_precision_fp16_counts_each_skipped_step():
    precision = Precision("fp16", CPU)
    precision.scale(torch.tensor(1.0))
    outcomes = []
    for value in (float("nan"), 1.0, float("inf")):
        param = _param_with_grad(value)
        outcomes.append(precision.step(torch.optim.SGD([param], lr=0.1)))

    assert outcomes == [False, True, False]


def test_precision_32_step_always_steps():
    precision = Precision("32", CPU)
    param = _param_with_grad(1.0)

    assert precision.step(torch.optim.SGD([param], lr=0.5)) is True
    torch.testing.assert_close(param.detach(), torch.full((3,), 0.5))


def test_precision_fp16_state_dict_round_trip():
    source = Precision("fp16", CPU)
    source.scale(torch.tensor(1.0))
    source.step(torch.optim.SGD([_param_with_grad(float("inf"))], lr=0.1))  # halves the scale
    source.step(torch.optim.SGD([_param_with_grad(1.0)], lr=0.1))  # one good step tracked
    state = source.state_dict()

    restored = Precision("fp16", CPU)
    restored.load_state_dict(state)

    assert state["scale"] == source.scaler.get_scale() == 65536.0 / 2
    assert restored.scaler.get_scale() == state["scale"]
    assert restored.state_dict() == state
    assert restored.scale(torch.tensor(1.0)).item() == state["scale"]


def test_precision_load_empty_state_keeps_scaler():
    precision = Precision("fp16", CPU)

    precision.load_state_dict({})

    assert precision.scaler.get_scale() == 65536.0


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_refuses_a_float64_model_naming_its_parameters(precision):
    """autocast lowers float32 operations only: a float64 model would train at full precision
    with precision='bf16' and say nothing. The Runtime's set-up refuses it, and the fix."""
    import distkit

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2)).double()
    with (
        distkit.Runtime("dp", precision=precision) as rt,
        pytest.raises(ConfigurationError) as info,
    ):
        rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    message = str(info.value)
    assert f"precision={precision!r} with a float64 model (Sequential: '0.weight', " in message
    assert "'0.bias', '1.weight' and 1 more are float64)" in message
    assert "model.float()" in message and "precision='32'" in message
