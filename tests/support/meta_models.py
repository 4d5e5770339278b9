"""A small model for the meta-device tests (fsdp and DeepSpeed stage 3): linear layers,
BatchNorm (buffers, an integer one among them) and LayerNorm, built normally or on meta."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import distkit
from distkit.errors import ConfigurationError
from tests.support.workloads import make_dataset

FEATURES = make_dataset(1).tensors[0].shape[1]


class Net(nn.Module):
    """Linear layers, BatchNorm (buffers; ``batch_norm=False``: none) and LayerNorm, built in
    ``dtype`` (initialised in it: a meta build's materialisation draws the same values)."""

    def __init__(self, batch_norm: bool = True, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        made = {"dtype": dtype}
        self.inp = nn.Linear(FEATURES, 16, **made)
        self.norm = nn.BatchNorm1d(16, **made) if batch_norm else nn.Identity()
        self.hidden = nn.Linear(16, 16, **made)
        self.layer_norm = nn.LayerNorm(16, **made)
        self.out = nn.Linear(16, 3, **made)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.norm(self.inp(x)))
        return self.out(self.layer_norm(torch.tanh(self.hidden(h))))


class NoReset(nn.Module):
    """A module with a parameter of its own and no reset_parameters()."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(3))
        self.linear = nn.Linear(FEATURES, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x) * self.scale


def build(meta: str, batch_norm: bool = True, dtype: torch.dtype = torch.float32) -> nn.Module:
    """``Net`` after ``torch.manual_seed(0)``: ``"normal"``, or on meta by ``"init_empty"``
    (distkit.init_empty()) or ``"torch"`` (torch.device("meta"))."""
    torch.manual_seed(0)
    if meta == "init_empty":
        with distkit.init_empty():
            return Net(batch_norm, dtype)
    if meta == "torch":
        with torch.device("meta"):
            return Net(batch_norm, dtype)
    return Net(batch_norm, dtype)


def fit_on_meta(strategy: Any, make: Any = Net) -> str:
    """Build ``make()`` on meta and fit it: the refusal's message, or ``"trained"``."""
    with torch.device("meta"):
        model = make()
    try:
        with distkit.Trainer(strategy, batch_size=4, progress=False) as trainer:
            trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), make_dataset(8),
                        loss_fn=nn.functional.cross_entropy)  # fmt: skip
    except ConfigurationError as exc:
        return str(exc)
    return "trained"
