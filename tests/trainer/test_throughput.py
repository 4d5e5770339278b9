"""tokens/s and MFU in the epoch record: FLOPs counted once, the peak measured or looked up."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import distkit
from distkit.loggers import Logger
from distkit.trainer import _throughput
from distkit.trainer._throughput import (
    Peak,
    count_flops,
    device_peak,
    throughput_record,
    throughput_text,
)

pytestmark = pytest.mark.timeout(120)

IN, HIDDEN, OUT, BATCH = 12, 16, 3, 4


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


#: forward: 2 x (IN*HIDDEN + HIDDEN*OUT) per sample; backward: both weights' gradients and
#: the hidden activations' (the inputs need none): 2 x IN*HIDDEN + 4 x HIDDEN*OUT
MLP_FLOPS = 2 * (IN * HIDDEN + HIDDEN * OUT) + 2 * IN * HIDDEN + 4 * HIDDEN * OUT


def _data(samples: int = 32) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(samples, IN, generator=generator)
    return TensorDataset(x, torch.randint(0, OUT, (samples,), generator=generator))


class _Rows(Logger):
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def log_metrics(self, metrics, step):
        self.rows.append(dict(metrics))


def test_count_flops_counts_a_linear_forward_and_backward():
    layer = nn.Linear(IN, OUT)
    x = torch.randn(BATCH, IN)

    out, flops = count_flops(lambda: layer(x).sum().backward())

    assert out is None
    assert flops == 2 * BATCH * IN * OUT * 2  # forward and the weight's gradient


def test_a_fit_records_flops_per_sample_and_mfu_and_says_them(capsys):
    rows = _Rows()
    with distkit.Trainer("dp", batch_size=BATCH, max_epochs=2, loggers=[rows]) as trainer:
        model = _mlp()
        result = trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), _data(),
                             loss_fn=nn.functional.cross_entropy)  # fmt: skip

    for record in result.history:
        assert record["flops_per_sample"] == MLP_FLOPS  # counted once, kept for every epoch
        peak = device_peak(torch.device("cpu"), "32")
        assert peak is not None and peak.source.startswith("measured: CPU fp32 matmul")
        expected = MLP_FLOPS * record["samples_per_s"] / peak.flops
        assert record["mfu"] == pytest.approx(expected, rel=1e-9)  # the same cached peak
        assert 0 < record["mfu"] < 1
        assert "tokens_per_s" not in record  # a mean loss: no items to count
    logged = [row for row in rows.rows if "mfu" in row]
    assert len(logged) == 2 and logged[0]["flops_per_sample"] == MLP_FLOPS
    out = "".join(capsys.readouterr())
    assert "per sample; MFU " in out and "(measured: CPU fp32 matmul" in out
    assert "mfu=" not in out  # said in its own words, once


def test_a_token_exact_fit_records_tokens_per_s():
    def step_fn(model, batch):
        x, y = batch
        total = nn.functional.cross_entropy(model(x), y, reduction="sum")
        return distkit.Loss(total, 3 * len(y))  # three "tokens" per sample

    with distkit.Trainer("dp", batch_size=BATCH, max_epochs=1, progress=False) as trainer:
        model = _mlp()
        result = trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), _data(),
                             step_fn=step_fn)  # fmt: skip

    record = result.history[0]
    # the same epoch, the same wall time: three items per sample
    assert record["tokens_per_s"] == pytest.approx(3 * record["samples_per_s"], rel=1e-9)
    assert record["flops_per_sample"] == MLP_FLOPS


def _ddp_record() -> dict:
    trainer = distkit.Trainer("ddp", batch_size=BATCH, progress=False)
    model = _mlp()
    result = trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), _data(30),
                         loss_fn=nn.functional.cross_entropy)  # fmt: skip
    trainer.close()
    return result.history[0]


def test_mfu_under_ddp_counts_every_rank_and_its_device(run_on_ranks):
    """30 samples over 2 ranks x 4: the last global batch is short (6), but the count is
    the first micro-batch's, per sample; MFU divides by two devices' peaks."""
    records = run_on_ranks(_ddp_record, world_size=2)
    assert records[0] == records[1], "every rank reports the same figures"
    assert records[0]["flops_per_sample"] == MLP_FLOPS
    assert 0 < records[0]["mfu"] < 1


def test_a_gpu_peak_comes_from_the_table_in_the_training_precision(monkeypatch):
    """A fake of CUDA's device name only (no GPU here): the lookup reads nothing else."""
    names = iter(["NVIDIA H100 80GB HBM3", "NVIDIA H100 PCIe", "NVIDIA A100-SXM4-80GB",
                  "NVIDIA GeForce RTX 9090"])  # fmt: skip
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: next(names))
    cuda = torch.device("cuda", 0)
    tf32 = torch.backends.cuda.matmul.allow_tf32  # (a property: monkeypatch cannot undo it)
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        sxm = device_peak(cuda, "bf16")
        pcie = device_peak(cuda, "bf16")
        a100 = device_peak(cuda, "32")
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32

    assert sxm == Peak(989.4e12, "published: NVIDIA H100 80GB HBM3, bf16")
    assert pcie is not None and pcie.flops == 756e12  # the more specific marker first
    assert a100 is not None and a100.flops == 19.5e12 and "32" in a100.source
    assert device_peak(cuda, "bf16") is None  # not in the table: no MFU, said so


def test_the_record_and_its_line_without_a_peak_or_a_count():
    assert throughput_record(flops_per_sample=None, samples_per_s=10.0, peak_sum=0.0,
                             items=None, wall_s=1.0) == {}  # fmt: skip
    unknown = throughput_record(flops_per_sample=2e9, samples_per_s=10.0, peak_sum=0.0,
                                items=None, wall_s=1.0)  # fmt: skip
    assert unknown == {"flops_per_sample": 2e9}
    assert "no peak known for this device" in throughput_text(unknown, None)
    peak = Peak(1e12, "published: test")
    known = throughput_record(flops_per_sample=2e9, samples_per_s=100.0, peak_sum=2e12,
                              items=5000.0, wall_s=2.0)  # two devices of 1 TFLOP/s  # fmt: skip
    assert known == {"tokens_per_s": 2500.0, "flops_per_sample": 2e9, "mfu": 0.1}
    assert throughput_text(known, peak) == (
        "  2,500 tokens/s; 2 GFLOP per sample; MFU 10.0% of 1 TFLOP/s (published: test)"
    )


def test_the_cpu_peak_is_measured_once_per_precision_and_thread_count():
    _throughput.cpu_matmul_peak.cache_clear()
    first = _throughput.cpu_matmul_peak("32", torch.get_num_threads())
    again = _throughput.cpu_matmul_peak("32", torch.get_num_threads())

    assert first == again > 1e8  # a cached figure; any CPU does more than 0.1 GFLOP/s


def test_measuring_the_cpu_peak_leaves_torch_s_random_numbers_alone():
    """The peak is measured at an epoch's end, mid-fit: it must not advance the global
    generator that the next epoch's dropout and shuffles draw from."""
    _throughput.cpu_matmul_peak.cache_clear()
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    _throughput.cpu_matmul_peak("32", torch.get_num_threads())
    assert torch.equal(torch.rand(3), expected)
