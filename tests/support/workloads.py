"""Small deterministic models, data and per-rank training bodies shared by the tests."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import distkit
from tests.support.exactness import DTYPE


def make_dataset(
    n: int = 60,
    features: int = 6,
    classes: int = 3,
    seed: int = 1,
    dtype: torch.dtype = torch.float32,
) -> TensorDataset:
    """``n`` samples; the same draws (and labels) in any ``dtype``."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=generator)
    y = (x[:, :classes].argmax(dim=1) + (x[:, -1] > 1).long()) % classes
    return TensorDataset(x.to(dtype), y)


def make_mlp(
    features: int = 6, classes: int = 3, seed: int = 0, dtype: torch.dtype = torch.float32
) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(features, 16), nn.Tanh(), nn.Linear(16, classes)).to(dtype)


def make_bn_model(
    features: int = 6, classes: int = 3, seed: int = 0, dtype: torch.dtype = torch.float32
) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(features, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, classes)
    ).to(dtype)


class Block(nn.Module):
    """A residual block ``x + W2 tanh(W1 x)``: what a stack repeats."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.inner = nn.Linear(width, width)
        self.outer = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outer(torch.tanh(self.inner(x)))


class Stack(nn.Module):
    """A model as transformers are written: an input layer, a top-level ``nn.ModuleList`` of
    repeated blocks (``self.layers``), an output layer."""

    def __init__(self, features: int = 6, classes: int = 3, width: int = 16, depth: int = 3):
        super().__init__()
        self.inp = nn.Linear(features, width)
        self.layers = nn.ModuleList(Block(width) for _ in range(depth))
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x)
        return self.out(x)


def make_stack(seed: int = 0, dtype: torch.dtype = torch.float32, depth: int = 3) -> Stack:
    torch.manual_seed(seed)
    return Stack(depth=depth).to(dtype)


def without_timing(history: list[dict]) -> list[dict]:
    """History records without the run-dependent measurements: timing, peak memory, the
    rates (samples/s, tokens/s, MFU) and the FLOPs per sample (counted on a fit's first
    batch: a resumed fit's first batch of variable length is another)."""
    measured = ("time_", "peak_")
    rates = ("samples_per_s", "tokens_per_s", "mfu", "flops_per_sample")
    return [
        {k: v for k, v in record.items() if not k.startswith(measured) and k not in rates}
        for record in history
    ]


def state_of(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}


def max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), (sorted(a), sorted(b))
    # .cpu(): on a GPU machine one side may be the trained (CUDA) state, the other a CPU run
    return max((a[k].cpu().double() - b[k].cpu().double()).abs().max().item() for k in a)


def train_with_distkit(
    strategy: str,
    batch_size: int,
    *,
    n: int = 60,
    epochs: int = 2,
    grad_accum_steps: int = 1,
    model: str = "mlp",
    sync_batchnorm: bool = False,
    precision: str = "32",
    as_loader: bool = False,
    seed: int = 3,
    optimizer: str = "sgd",
    dtype: torch.dtype | None = None,
) -> dict[str, Any]:
    """Train the shared workload; returns final parameters, history and topology.

    ``dtype``: the model's and data's; by default float64 at ``precision="32"`` (the
    exactness tests compare runs: tests/support/exactness.py) and float32 for mixed precision
    (which lowers float32 only).
    """
    if dtype is None:
        dtype = DTYPE if precision in ("32", "fp32") else torch.float32
    builders = {"bn": make_bn_model, "stack": make_stack, "mlp": make_mlp}
    net = builders[model](dtype=dtype)
    dataset = make_dataset(n, dtype=dtype)
    data: Any = DataLoader(dataset, batch_size=batch_size, shuffle=True) if as_loader else dataset
    trainer = distkit.Trainer(
        strategy,
        batch_size=batch_size,
        max_epochs=epochs,
        grad_accum_steps=grad_accum_steps,
        sync_batchnorm=sync_batchnorm,
        precision=precision,
        progress=False,
        seed=seed,
    )
    if optimizer == "adamw":
        opt: torch.optim.Optimizer = torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.1)
    else:
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    result = trainer.fit(
        net,
        opt,
        data,
        loss_fn=nn.functional.cross_entropy,
        val_data=dataset,
        metrics={"acc": distkit.Accuracy()},
    )
    out = {
        "state": trainer.full_state_dict(),  # full tensors whatever the strategy (fsdp shards)
        "history": result.history,
        "rank": trainer.rank,
        "world_size": trainer.world_size,
    }
    trainer.close()
    return out


def train_by_hand(
    batch_size: int, *, n: int = 60, epochs: int = 2, seed: int = 3, dtype: torch.dtype = DTYPE
) -> dict:
    """The seeds' hand-written loop: DistributedSampler(+set_epoch), zero_grad/backward/step.

    Runs on one process or under DDP (when a process group exists, it wraps the model).
    """
    distributed = torch.distributed.is_initialized()
    world = torch.distributed.get_world_size() if distributed else 1
    rank = torch.distributed.get_rank() if distributed else 0
    net = make_mlp(dtype=dtype)
    model: nn.Module = nn.parallel.DistributedDataParallel(net) if distributed else net
    dataset = make_dataset(n, dtype=dtype)
    sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=seed)
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        for x, y in loader:
            optimizer.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
    return {"state": state_of(net)}


def hand_ddp_on_rank(batch_size: int, n: int, epochs: int) -> dict:
    torch.distributed.init_process_group("gloo", init_method="env://")
    try:
        return train_by_hand(batch_size, n=n, epochs=epochs)
    finally:
        torch.distributed.destroy_process_group()
