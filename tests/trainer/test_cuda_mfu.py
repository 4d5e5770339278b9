"""tokens/s and MFU (issue 46) on one CUDA GPU, against the device's published peak (issue 50).

On CPU machines the peak is measured (a matmul timed at fit start); on a GPU it is looked up
by the device's name in ``distkit.trainer._throughput.GPU_PEAKS``, in the dtype the matmuls
run in. Here a matmul-bound model (four 4096 x 4096 layers) trains on the GPU at fp32 and
under bf16 autocast, and the epoch record's MFU must be the counted FLOPs per sample times
samples/s over that published peak, and a plausible share of it: above 1 is impossible (the
wrong peak, or FLOPs counted twice), below 2% on such a model means a peak or a count off by
an order of magnitude. The figures go to the junit XML (``record_property``), which
``scripts/gpu_check.sh`` keeps. Needs a CUDA GPU; skips without one (CI has none).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import distkit
from distkit.trainer._throughput import device_peak, matmul_kind
from tests.support.gates import needs

pytestmark = [needs("cuda"), pytest.mark.timeout(300)]
IN, WIDTH, LAYERS, CLASSES, BATCH, STEPS = 256, 4096, 4, 10, 2048, 16
#: FlopCounterMode's count (matmuls only): each hidden layer's forward, input gradient and
#: weight gradient (6 W^2 per sample); the first layer's input needs no gradient (4 IN W)
FLOPS_PER_SAMPLE = 4 * IN * WIDTH + LAYERS * 6 * WIDTH * WIDTH + 6 * WIDTH * CLASSES


def _wide() -> nn.Module:
    torch.manual_seed(0)
    hidden = [m for _ in range(LAYERS) for m in (nn.ReLU(), nn.Linear(WIDTH, WIDTH))]
    return nn.Sequential(nn.Linear(IN, WIDTH), *hidden, nn.ReLU(), nn.Linear(WIDTH, CLASSES))


@pytest.mark.parametrize("precision", ["32", "bf16"])
def test_cuda_mfu_is_against_the_devices_published_peak(precision, record_property, capsys):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH * STEPS, IN, generator=generator)
    data = TensorDataset(x, torch.randint(0, CLASSES, (len(x),), generator=generator))
    model = _wide()
    with distkit.Trainer("dp", batch_size=BATCH, max_epochs=2, precision=precision) as trainer:
        result = trainer.fit(model, torch.optim.SGD(model.parameters(), lr=1e-3), data,
                             loss_fn=nn.functional.cross_entropy)  # fmt: skip
    out = "".join(capsys.readouterr())
    record = result.history[-1]  # the second epoch: no first-step set-up in its time
    device = torch.device("cuda", 0)
    kind = matmul_kind(precision, torch.float32)
    peak = device_peak(device, kind)
    name = torch.cuda.get_device_name(device)
    record_property("device", name)
    record_property("samples_per_s", round(record["samples_per_s"]))
    assert record["flops_per_sample"] == FLOPS_PER_SAMPLE
    if peak is None:  # a GPU the table does not know: no MFU, and the fit says why
        assert "mfu" not in record and "MFU: no peak known for this device" in out, out
        pytest.skip(f"{name} is not in GPU_PEAKS: no published peak to measure MFU against")
    record_property("peak", peak.text())
    record_property("mfu", f"{record['mfu']:.4f}")
    assert peak.source == f"published: {name}, {kind}" or (
        precision == "32" and peak.source.endswith(", tf32")  # torch's TF32 switch is on
    )
    expected = FLOPS_PER_SAMPLE * record["samples_per_s"] / peak.flops
    assert record["mfu"] == pytest.approx(expected, rel=1e-9)
    assert 0.02 < record["mfu"] <= 1.0, (record["mfu"], peak.text())
    assert f"(published: {name}" in out, out
