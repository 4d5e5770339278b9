"""A tiny language model on padded variable-length sequences, for the token-exact tests.

Each sample is a dict ``{"input_ids", "labels"}`` of length ``L``: its real length is drawn
from 1 to ``L`` and the rest is padding (labels -100), so batches hold very different
numbers of tokens, and a per-batch token mean weighted by samples is not the global mean.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset

import distkit
from tests.support.exactness import DTYPE

V, L, N = 11, 7, 21  # vocabulary, padded length, samples (global batches of 8: 8 + 8 + 5)


class Sequences(Dataset):
    """``n`` padded sequences (the same for a seed, at any world size)."""

    def __init__(self, n: int = N, seed: int = 0, *, empty: str | None = None) -> None:
        """``empty``: "all" (every label -100: no items at all), "odd" (the odd samples
        have none: one of two ranks gets no item with ``shuffle=False``), or None."""
        g = torch.Generator().manual_seed(seed)
        lengths = torch.randint(1, L + 1, (n,), generator=g)
        lengths[::3] = 2  # many short sequences beside long ones: uneven token counts
        lengths[5] = 1  # and one without any (a one-token sequence predicts nothing)
        if empty == "odd":
            lengths[0::2] = L  # the even samples full, the odd ones without items (below)
        ids = torch.randint(1, V, (n, L), generator=g)
        labels = ids.roll(-1, dims=1).clone()
        pad = torch.arange(L) >= lengths[:, None]
        labels[pad | (torch.arange(L) == L - 1)] = -100
        labels[lengths == 1] = -100  # a one-token sequence predicts nothing: 0 items
        if empty == "all":
            labels[:] = -100
        elif empty == "odd":
            labels[1::2] = -100
        ids[pad] = 0
        self.ids, self.labels = ids, labels

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def make_lm(dtype: torch.dtype = torch.float32) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(V, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(),
                         nn.Linear(16, V)).to(dtype)  # fmt: skip


def dtype_for(strategy: str, settings: dict[str, Any]) -> torch.dtype:
    """float64, where the runs are compared (tests/support/exactness.py); float32 where it
    is the point: mixed precision (it lowers float32 only) and apex (float32 master weights)."""
    if strategy == "apex" or str(settings.get("precision", "32")) not in ("32", "fp32"):
        return torch.float32
    return DTYPE


def token_sum(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, Any]:
    logits = model(batch["input_ids"])
    labels = batch["labels"]
    total = F.cross_entropy(
        logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    return total, (labels != -100).sum()


def token_step(model: nn.Module, batch: dict[str, torch.Tensor], count: str = "tensor") -> Any:
    """The token-exact loss (``count``: "tensor" keeps it on the device, "int" reads it;
    "negative" and "negative-on-rank-1" are a user's sign slip, a tensor count)."""
    total, n = token_sum(model, batch)
    return distkit.Loss(total, given_count(n, count))


def causal_lm_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> distkit.Loss:
    """A transformers causal LM's token-exact loss (labels are already the next token, -100
    where none: no shift inside), its logits kept as the output."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"]
    total = F.cross_entropy(
        logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    return distkit.Loss(total, (labels != -100).sum(), output=logits)


def given_count(n: torch.Tensor, count: str) -> Any:
    """The count a step gives for its ``n`` items (see token_step)."""
    if count == "int":
        return int(n)
    if count == "negative" or (count == "negative-on-rank-1" and _rank() == 1):
        return -n
    return n


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def batch_mean_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The per-batch token mean, which distkit weights by samples: not the global mean."""
    total, n = token_sum(model, batch)
    return total / n.clamp(min=1)


def reference(
    batch: int,
    epochs: int = 2,
    lr: float = 0.5,
    empty: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """One plain-torch process: global batches of ``batch`` in order, the mean over every
    token of each global batch (what token-exact training must equal)."""
    model = make_lm(dtype)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    data = Sequences(empty=empty)
    for _ in range(epochs):
        for start in range(0, len(data), batch):
            items = [data[i] for i in range(start, min(start + batch, len(data)))]
            merged = {k: torch.stack([item[k] for item in items]) for k in items[0]}
            total, n = token_sum(model, merged)
            optimizer.zero_grad()
            (total / n).backward()
            optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def fit_tokens(
    strategy: str,
    batch: int,
    accum: int,
    *,
    exact: bool = True,
    count: str = "tensor",
    epochs: int = 2,
    lr: float = 0.5,
    empty: str | None = None,
    **settings: Any,
) -> dict[str, Any]:
    """The Trainer's fit with a token-exact step_fn (or the batch-mean one)."""
    model = make_lm(dtype_for(strategy, settings))
    trainer = distkit.Trainer(strategy, batch_size=batch, grad_accum_steps=accum, seed=3,
                              max_epochs=epochs, progress=False, shuffle=False,
                              **settings)  # fmt: skip
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    if exact:

        def step(m: nn.Module, b: dict[str, torch.Tensor]) -> Any:
            return token_step(m, b, count)

    else:
        step = batch_mean_step
    result = trainer.fit(model, optimizer, Sequences(empty=empty), step_fn=step)
    state = trainer.full_state_dict()
    trainer.close()
    return {"state": state, "history": result.history}


def loop_tokens(
    strategy: str, batch: int, accum: int, *, count: str = "tensor", epochs: int = 2,
    lr: float = 0.5, empty: str | None = None, **settings: Any,
) -> dict[str, Any]:  # fmt: skip
    """A user's loop with ``rt.backward(total, count=n)``."""
    means = []
    with distkit.Runtime(strategy, grad_accum_steps=accum, seed=3, **settings) as rt:
        model = make_lm(dtype_for(strategy, settings))
        optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
        model, optimizer = rt.setup(model, optimizer)
        loader = rt.loader(Sequences(empty=empty), batch_size=batch, shuffle=False)
        for _ in range(epochs):
            for b in loader:
                total, n = token_sum(model, b)
                mean = rt.backward(total, count=given_count(n, count))
                means.append(float(mean))
                optimizer.step()
                optimizer.zero_grad()
        return {"state": rt.full_state_dict(model), "means": means}
