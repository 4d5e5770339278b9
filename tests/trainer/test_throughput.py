"""tokens/s and MFU in the epoch record, the log points' rows and the progress bar: FLOPs
counted once, the peak measured or looked up."""

from __future__ import annotations

import io
import sys

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import distkit
from distkit.loggers import Logger
from distkit.trainer import _throughput
from distkit.trainer._throughput import (
    Peak,
    RateWindow,
    count_flops,
    device_peak,
    matmul_kind,
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
    logged = [row for row in rows.rows if "flops_per_sample" in row]  # the epochs' rows
    assert len(logged) == 2 and all("mfu" in row for row in logged)
    out = "".join(capsys.readouterr())
    assert "per sample; MFU " in out and "(measured: CPU fp32 matmul" in out
    assert "MFU 0.0%" not in out  # a small share in three significant digits
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
    """The peak is measured before the first epoch, after the fit's seed: it must not
    advance the global generator that the next epoch's dropout and shuffles draw from."""
    _throughput.cpu_matmul_peak.cache_clear()
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    _throughput.cpu_matmul_peak("32", torch.get_num_threads())
    assert torch.equal(torch.rand(3), expected)


def test_a_rate_window_gives_the_figures_since_the_last_log_point(monkeypatch):
    clock = iter([10.0, 12.0, 13.0])
    monkeypatch.setattr(_throughput.time, "perf_counter", lambda: next(clock))
    window = RateWindow()
    window.open(position=0, global_step=0)  # 10.0

    first = window.close(position=64, global_step=4, items=640.0, flops_per_sample=1e6,
                         peak_sum=2e9)  # 12.0: 64 samples in 2 s  # fmt: skip
    second = window.close(position=96, global_step=6, items=None, flops_per_sample=None,
                          peak_sum=0.0)  # 13.0: 32 samples in 1 s  # fmt: skip

    assert first == {"samples_per_s": 32.0, "tokens_per_s": 320.0, "mfu": 32.0 * 1e6 / 2e9}
    assert second == {"samples_per_s": 32.0}  # no items, no count: those figures left out


def test_a_rate_window_that_spans_an_epoch_s_end_gives_nothing(monkeypatch):
    clock = iter([0.0, 1.0, 5.0, 6.0, 7.0])
    monkeypatch.setattr(_throughput.time, "perf_counter", lambda: next(clock))
    window = RateWindow()
    window.open(position=0, global_step=0)
    window.close(position=24, global_step=3, items=None, flops_per_sample=None, peak_sum=0)
    # the epoch had 4 steps: step 4 trained after the log point, then the epoch ended
    window.open(position=0, global_step=4)  # 5.0: not clean
    spanning = window.close(position=8, global_step=6, items=None, flops_per_sample=None,
                            peak_sum=0)  # fmt: skip
    after = window.close(position=16, global_step=7, items=None, flops_per_sample=None,
                         peak_sum=0)  # fmt: skip

    assert spanning == {}  # the epoch's end inside it: no figures rather than wrong ones
    assert after == {"samples_per_s": 8.0}  # 8 samples from 6.0 to 7.0


def _token_step(model, batch):
    x, y = batch
    total = nn.functional.cross_entropy(model(x), y, reduction="sum")
    return distkit.Loss(total, 3 * len(y))  # three "tokens" per sample


class _Terminal(io.StringIO):
    """stderr as a terminal: the progress bar draws only where a person watches."""

    def isatty(self) -> bool:
        return True


def _postfixes(drawn: str) -> list[dict[str, str]]:
    """Every distinct postfix the bar drew, in order (``loss=..., samples/s=..., ...``)."""
    seen: list[dict[str, str]] = []
    for frame in drawn.replace("\r", "\n").splitlines():
        if "loss=" not in frame:
            continue
        tail = frame[frame.index("loss=") :].split("]")[0]
        fields = dict(part.strip().split("=", 1) for part in tail.split(", "))
        if not seen or seen[-1] != fields:
            seen.append(fields)
    return seen


def _number(text: str) -> float:
    return float(text.rstrip("%").replace(",", ""))


def test_the_bar_shows_loss_samples_tokens_and_mfu_at_log_points(monkeypatch):
    """8 steps an epoch, a log point every 3: steps 3, 6 | 9 (its window spans the first
    epoch's end: the loss alone), 12, 15."""
    screen = _Terminal()
    monkeypatch.setattr(sys, "stderr", screen)
    monkeypatch.setenv("COLUMNS", "200")  # a wide one: at 80 columns tqdm cuts the postfix
    losses = []

    class Losses(Logger):
        def log_metrics(self, metrics, step):
            if "lr" in metrics:  # a log point's row
                losses.append(metrics["train_loss"])

    with distkit.Trainer("dp", batch_size=BATCH, max_epochs=2, log_every_n_steps=3,
                         loggers=[Losses()]) as trainer:  # fmt: skip
        model = _mlp()
        trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), _data(),
                    step_fn=_token_step)  # fmt: skip

    shown = _postfixes(screen.getvalue())
    assert [float(fields["loss"]) for fields in shown] == pytest.approx(losses, rel=1e-3)
    with_rates = [i for i, fields in enumerate(shown) if "samples/s" in fields]
    assert with_rates == [0, 1, 3, 4]
    assert set(shown[2]) == {"loss"}  # across the epoch's end: no figures rather than wrong
    for i in with_rates:
        samples, tokens = _number(shown[i]["samples/s"]), _number(shown[i]["tokens/s"])
        assert abs(tokens - 3 * samples) <= 2  # three items per sample; each rounded to 1
        assert 0 < _number(shown[i]["MFU"]) < 100


def test_without_a_terminal_the_bar_draws_nothing_and_no_window_closes(monkeypatch, capsys):
    with distkit.Trainer("dp", batch_size=BATCH, max_epochs=1, log_every_n_steps=2) as trainer:
        model = _mlp()
        trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), _data(),
                    step_fn=_token_step)  # fmt: skip
    assert "samples/s=" not in "".join(capsys.readouterr())  # piped: the epoch lines only


def test_the_peak_is_the_dtype_the_matmuls_run_in():
    assert matmul_kind("bf16", torch.float32) == "bf16"  # the autocast's
    assert matmul_kind("32", torch.float64) == "64"  # a float64 model: no autocast
    assert matmul_kind("32", torch.bfloat16) == "bf16"  # a model cast to bf16
    assert matmul_kind("32", None) == "32"  # no floating parameter
    peak = device_peak(torch.device("cpu"), "64")
    assert peak is not None and peak.source.startswith("measured: CPU fp64 matmul")


def test_a_float64_fit_is_measured_against_the_fp64_peak(capsys):
    with distkit.Trainer("dp", batch_size=BATCH, max_epochs=1) as trainer:
        model = _mlp().double()
        x, y = _data().tensors
        data = TensorDataset(x.double(), y)
        result = trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                             loss_fn=nn.functional.cross_entropy)  # fmt: skip

    peak = device_peak(torch.device("cpu"), "64")
    assert peak is not None
    record = result.history[0]
    assert record["mfu"] == pytest.approx(MLP_FLOPS * record["samples_per_s"] / peak.flops)
    assert "(measured: CPU fp64 matmul" in "".join(capsys.readouterr())
