"""DataParallelStrategy: loss reduction over replicas, autocast in replicas, honest refusals."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import distkit
from distkit.strategies.dp import DataParallelStrategy, replica_loss_mean
from tests.support.gates import needs

pytestmark = pytest.mark.timeout(60)

needs_two_gpus = needs("2 gpus", because="nn.DataParallel replicas")


def test_replica_loss_mean_weights_uneven_chunks():
    # a batch of 10 over 3 replicas is chunked 4, 4, 2
    loss = torch.tensor([1.0, 2.0, 3.0])
    assert replica_loss_mean(loss, 10, 3).item() == pytest.approx((4 + 8 + 6) / 10)


def test_replica_loss_mean_batch_smaller_than_replicas():
    # a batch of 2 over 3 replicas uses only 2 of them
    assert replica_loss_mean(torch.tensor([1.0, 3.0]), 2, 3).item() == pytest.approx(2.0)
    with pytest.raises(distkit.ConfigurationError, match=r"one value per DataParallel replica"):
        replica_loss_mean(torch.tensor([1.0, 2.0, 3.0]), 2, 3)


class _AutocastProbe(nn.Module):
    """Records whether autocast is on where the forward pass actually runs."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 2)
        self.autocast_seen: list[bool] = []
        self.dtypes: list[torch.dtype] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.autocast_seen.append(torch.is_autocast_enabled(x.device.type))
        out = self.linear(x)
        self.dtypes.append(out.dtype)
        return out


def _fit_probe(precision: str) -> _AutocastProbe:
    trainer = distkit.Trainer("dp", precision=precision, batch_size=4, progress=False)
    model = _AutocastProbe()
    data = TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer.fit(model, optimizer, data, loss_fn=nn.functional.cross_entropy)
    return model


def test_dp_autocast_reaches_the_forward_pass():
    probe = _fit_probe("bf16")
    assert probe.autocast_seen == [True, True]
    assert probe.dtypes == [torch.bfloat16, torch.bfloat16]
    assert _fit_probe("32").dtypes == [torch.float32, torch.float32]


def test_dp_on_cpu_runs_the_plain_module():
    trainer = distkit.Trainer("dp", progress=False)
    model = nn.Linear(2, 2)
    wrapped, _ = trainer.strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    if torch.cuda.device_count() < 2:
        assert wrapped is model
    assert trainer.strategy.unwrap(wrapped) is model


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_dp_device_ids_without_gpus_are_refused():
    with pytest.raises(distkit.ConfigurationError, match=r"device_ids=\[0\].*has 0"):
        distkit.Trainer(DataParallelStrategy(device_ids=[0]), progress=False)


@needs_two_gpus
def test_dp_replicas_autocast_and_loss_reduction_on_gpus():
    probe = _fit_probe("fp16")
    assert probe.autocast_seen and all(probe.autocast_seen)
    assert set(probe.dtypes) == {torch.float16}


@needs_two_gpus
def test_dp_sync_batchnorm_over_replicas_is_refused():
    trainer = distkit.Trainer("dp", sync_batchnorm=True, progress=False)
    model = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    with pytest.raises(distkit.UnsupportedFeatureError, match="strategy='ddp'"):
        trainer.strategy.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
