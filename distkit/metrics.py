"""Metrics whose state is a tensor of sums, so reducing over ranks is one all-reduce.

A metric accumulates on the device (no host sync per batch). The trainer sums every rank's
state and calls :meth:`Metric.compute` on the total, so the value is that of the whole
dataset, whatever the number of processes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any

import torch
from typing_extensions import override

from distkit.errors import ConfigurationError


class Metric(ABC):
    """Base class: implement :meth:`batch_state` (a tensor of sums) and :meth:`compute`."""

    def __init__(self) -> None:
        self._state: torch.Tensor | None = None

    @abstractmethod
    def batch_state(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The sums one batch contributes (same shape for every batch)."""

    @abstractmethod
    def compute(self, state: torch.Tensor) -> float | dict[str, float]:
        """The metric from summed state; a dict reports several values."""

    def reset(self) -> None:
        self._state = None

    def update(self, output: torch.Tensor, target: torch.Tensor) -> None:
        """Add one batch. With an evaluation ``step_fn``, ``output`` is what the step gave
        (``Loss(..., output=...)``, or the model's output) and ``target`` the whole batch (a
        dict, for dict batches): write :meth:`batch_state` for those."""
        contribution = self.batch_state(_detached(output), _detached(target)).double()
        self._state = contribution if self._state is None else self._state + contribution

    def state(self, device: torch.device) -> torch.Tensor:
        """The local sums (zeros when this rank saw no batch)."""
        if self._state is None:
            return torch.zeros(self.state_shape(), dtype=torch.float64, device=device)
        return self._state.to(device)

    @abstractmethod
    def state_shape(self) -> tuple[int, ...]:
        """Shape of :meth:`batch_state` (needed for ranks that saw no batch)."""


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def check_tensors(metric: Metric, output: object, target: object) -> None:
    """Refuse what a built-in metric cannot read, naming it and the fix: it takes the
    model's scores and the targets as tensors (a model that returns a dict, a dict batch
    under a step function, give it other things)."""
    name = type(metric).__name__
    for what, value, key in (("output", output, "logits"), ("target", target, "labels")):
        if isinstance(value, torch.Tensor):
            continue
        if isinstance(value, Mapping):
            keys = list(value)
            pick = key if key in keys else (keys[0] if keys else key)
            given = f"a {type(value).__name__} with keys {keys}"
        else:
            pick, given = key, f"{type(value).__name__} {value!r:.60}"
        source = "the model returns" if what == "output" else "the batch holds"
        raise ConfigurationError(
            f"{name} reads the {what} as a tensor ((N, C, ...) class scores for the output, "
            f"(N, ...) class indices for the target), got {given}: {source} more than one "
            f"value. Give {name} the tensor: a subclass whose batch_state reads it, "
            f"`class My{name}(distkit.{name}): def batch_state(self, output, target): return "
            f"super().batch_state({_picked(what, pick)})`, or a model that returns the scores "
            "alone"
        )


def _picked(what: str, key: str) -> str:
    return f"output[{key!r}], target" if what == "output" else f"output, target[{key!r}]"


class Accuracy(Metric):
    """Top-k classification accuracy; ``output`` holds class scores along ``dim=1``.

    Targets equal to ``ignore_index`` are not counted (useful for per-pixel accuracy).
    """

    def __init__(self, top_k: int = 1, ignore_index: int | None = None) -> None:
        super().__init__()
        if top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {top_k}")
        self.top_k = top_k
        self.ignore_index = ignore_index

    @override
    def batch_state(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        check_tensors(self, output, target)
        topk = output.topk(self.top_k, dim=1).indices  # (N, k, ...)
        hit = (topk == target.unsqueeze(1)).any(dim=1)
        valid = torch.ones_like(hit) if self.ignore_index is None else target != self.ignore_index
        return torch.stack([(hit & valid).sum(), valid.sum()]).double()

    @override
    def state_shape(self) -> tuple[int, ...]:
        return (2,)

    @override
    def compute(self, state: torch.Tensor) -> float:
        correct, total = state.tolist()
        return correct / total if total else float("nan")


class ConfusionMatrix(Metric):
    """``num_classes x num_classes`` counts (rows: target, columns: prediction).

    ``output`` is class scores ``(N, C, ...)`` or predicted labels ``(N, ...)``.
    """

    def __init__(self, num_classes: int, ignore_index: int | None = None) -> None:
        super().__init__()
        if num_classes < 2:
            raise ValueError(f"num_classes must be >= 2, got {num_classes}")
        self.num_classes = num_classes
        self.ignore_index = ignore_index

    @override
    def batch_state(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        check_tensors(self, output, target)
        pred = output.argmax(dim=1) if output.dim() == target.dim() + 1 else output
        pred, target = pred.reshape(-1).long(), target.reshape(-1).long()
        keep = (target >= 0) & (target < self.num_classes)
        if self.ignore_index is not None:
            keep &= target != self.ignore_index
        index = target[keep] * self.num_classes + pred[keep]
        counts = torch.bincount(index, minlength=self.num_classes**2)
        return counts.reshape(self.num_classes, self.num_classes)

    @override
    def state_shape(self) -> tuple[int, ...]:
        return (self.num_classes, self.num_classes)

    @override
    def compute(self, state: torch.Tensor) -> dict[str, float]:
        return {"matrix_total": float(state.sum())}


class MeanIoU(ConfusionMatrix):
    """Mean intersection-over-union and pixel accuracy from a confusion matrix.

    Classes that appear neither in targets nor predictions are left out of the mean.
    Reports ``{"miou": ..., "pixel_acc": ...}``.
    """

    @override
    def compute(self, state: torch.Tensor) -> dict[str, float]:
        matrix = state.double()
        tp = matrix.diag()
        union = matrix.sum(0) + matrix.sum(1) - tp
        present = union > 0
        miou = (tp[present] / union[present]).mean().item() if present.any() else float("nan")
        total = matrix.sum().item()
        return {"miou": miou, "pixel_acc": tp.sum().item() / total if total else float("nan")}
