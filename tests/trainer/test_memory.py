"""Peak memory per rank in the epoch record: the largest named, the same on every rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import distkit
from distkit.loggers import Logger
from distkit.trainer._memory import memory_record, memory_text, peak_mib, reset_peak
from tests.support.gates import needs

pytestmark = pytest.mark.timeout(120)

_BIG_MIB = 200


class _Hold(distkit.Callback):
    """Keeps a touched ``_BIG_MIB`` MiB tensor alive on one rank through the fit."""

    def __init__(self, rank: int) -> None:
        self.rank, self.held = rank, None

    def on_fit_start(self, trainer) -> None:
        if trainer.rank == self.rank:
            self.held = torch.ones(_BIG_MIB * 2**20 // 4, device=trainer.device)


class _Rows(Logger):
    def __init__(self) -> None:
        self.rows: list[dict] = []

    def log_metrics(self, metrics, step):
        self.rows.append(dict(metrics))


def _data() -> TensorDataset:
    x = torch.randn(16, 4, generator=torch.Generator().manual_seed(0))
    return TensorDataset(x, x.sum(1, keepdim=True))


def _fit_holding(rank: int) -> dict:
    trainer = distkit.Trainer("ddp", batch_size=4, progress=False, callbacks=[_Hold(rank)])
    model = nn.Linear(4, 1)
    result = trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.01), _data(),
                         loss_fn=nn.functional.mse_loss)  # fmt: skip
    trainer.close()
    return result.history[0]


def test_memory_names_the_rank_with_the_largest_peak(run_on_ranks):
    records = run_on_ranks(_fit_holding, 1, world_size=2)
    assert records[0] == records[1], "the memory entries must be the same on every rank"
    record = records[0]
    assert record["peak_mem_rank"] == 1
    assert record["peak_mem_mib"] >= _BIG_MIB
    # rank 0 holds no such tensor: its peak is the smallest, by about the tensor
    assert record["peak_mem_mib"] - record["peak_mem_min_mib"] > 0.75 * _BIG_MIB
    assert "peak_reserved_mib" not in record  # CUDA's allocator only


def test_memory_in_one_process_goes_to_history_loggers_and_the_epoch_line(capsys):
    rows = _Rows()
    with distkit.Trainer("dp", batch_size=4, max_epochs=2, loggers=[rows]) as trainer:
        model = nn.Linear(4, 1)
        result = trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.01), _data(),
                             loss_fn=nn.functional.mse_loss)  # fmt: skip
    for record in result.history:
        assert record["peak_mem_rank"] == 0
        assert record["peak_mem_mib"] == record["peak_mem_min_mib"] > 0
    epoch_rows = [row for row in rows.rows if "peak_mem_mib" in row]
    assert len(epoch_rows) == 2 and all(row["peak_mem_rank"] == 0 for row in epoch_rows)
    out = "".join(capsys.readouterr())
    assert f"peak_mem={result.history[0]['peak_mem_mib']:.0f} MiB (rank 0)" in out
    assert "peak_mem_mib=" not in out  # said once, in its own words


def test_memory_record_takes_the_largest_and_says_reserved_on_cuda():
    per_rank = torch.tensor([[100.0, 0.0], [300.0, 0.0], [300.0, 0.0], [50.0, 0.0]])
    record = memory_record(per_rank, torch.device("cpu"))
    assert record == {"peak_mem_mib": 300.0, "peak_mem_rank": 1, "peak_mem_min_mib": 50.0}
    assert memory_text(record) == "peak_mem=300 MiB (rank 1)"
    cuda = memory_record(torch.tensor([[10.0, 64.0], [20.0, 32.0]]), torch.device("cuda", 0))
    assert cuda["peak_reserved_mib"] == 64.0
    assert memory_text(cuda) == "peak_mem=20 MiB (rank 1; reserved 64 MiB)"
    assert memory_text({"train_loss": 1.0}) == ""


@needs("cuda")
def test_memory_on_cuda_is_the_peak_since_the_reset():
    device = torch.device("cuda", torch.cuda.current_device())
    big = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
    del big
    reset_peak(device)
    small = torch.empty(2**20, dtype=torch.uint8, device=device)
    peak, reserved = peak_mib(device)
    assert 1 <= peak < 64, "the reset forgot the earlier 64 MiB"
    assert reserved >= peak
    del small
