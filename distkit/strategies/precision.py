"""Mixed precision: autocast, and loss scaling for fp16, as one small object."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from distkit.errors import ConfigurationError

#: full precision's autocast: a do-nothing context (reusable, it holds no state)
_NO_AUTOCAST = contextlib.nullcontext()

PRECISIONS = ("32", "bf16", "fp16")
_ALIASES = {
    "32": "32",
    "fp32": "32",
    "bf16": "bf16",
    "bfloat16": "bf16",
    "fp16": "fp16",
    "16": "fp16",
}


def normalize_precision(precision: str | int) -> str:
    """Canonical precision name (``"32"``, ``"bf16"`` or ``"fp16"``) for a user's spelling."""
    key = str(precision).strip().lower()
    if key not in _ALIASES:
        raise ConfigurationError(
            f"unknown precision {precision!r}. Allowed: {', '.join(repr(p) for p in PRECISIONS)} "
            "(bf16 autocast runs on CPU and recent GPUs; fp16 adds a GradScaler)"
        )
    return _ALIASES[key]


def float64_parameters(model: torch.nn.Module) -> str:
    """The names of ``model``'s float64 parameters for an error message: the first three and
    how many more ("" when there are none)."""
    wide = [n for n, p in model.named_parameters() if p.dtype == torch.float64]
    more = f" and {len(wide) - 3} more" if len(wide) > 3 else ""
    return ", ".join(repr(n) for n in wide[:3]) + more


def check_model_dtype(precision: str | int, model: torch.nn.Module) -> None:
    """Refuse mixed precision for a model with float64 parameters: autocast lowers float32
    operations only, so such a model would train at full float64 precision, silently."""
    name = normalize_precision(precision)
    if name == "32":
        return
    shown = float64_parameters(model)
    if not shown:
        return
    raise ConfigurationError(
        f"precision={precision!r} with a float64 model ({type(model).__name__}: {shown} are "
        "float64): autocast lowers float32 operations only, so this model would train in "
        "float64 at full precision, silently. For mixed precision convert the model first "
        "(model.float()); to train in float64 use precision='32'"
    )


class Precision:
    """Autocast context and (for fp16) a ``GradScaler`` for one device.

    Args:
        precision: ``"32"``, ``"bf16"`` or ``"fp16"``.
        device: the device the model trains on; its type selects the autocast and scaler kind.
        loss_scaling: fp16's ``GradScaler``; False where the backend scales losses itself
            (DeepSpeed's engine).
    """

    def __init__(
        self, precision: str | int, device: torch.device, *, loss_scaling: bool = True
    ) -> None:
        self.name = normalize_precision(precision)
        self.device_type = device.type
        self._dtype = {"32": None, "bf16": torch.bfloat16, "fp16": torch.float16}[self.name]
        self.scaler: torch.amp.GradScaler | None = (
            torch.amp.GradScaler(self.device_type) if self.name == "fp16" and loss_scaling else None
        )

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        """Run the enclosed forward pass (and loss) in the reduced precision, if any."""
        if self._dtype is None:
            return _NO_AUTOCAST  # every micro-batch enters it: no generator per call
        return torch.autocast(self.device_type, dtype=self._dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call ``backward`` on (scaled for fp16)."""
        return loss if self.scaler is None else self.scaler.scale(loss)

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the gradients by the loss scale in place (no-op without a scaler)."""
        if self.scaler is not None:
            self.scaler.unscale_(optimizer)

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer; returns ``False`` when fp16 found inf/NaN grads and skipped it."""
        if self.scaler is None:
            optimizer.step()
            return True
        before = self.scaler.get_scale()
        self.scaler.step(optimizer)
        self.scaler.update()
        return self.scaler.get_scale() >= before  # GradScaler lowers its scale when it skips

    def state_dict(self) -> dict[str, Any]:
        """The scaler state in torch's ``GradScaler`` form (empty without a scaler)."""
        return {} if self.scaler is None else self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""
        if self.scaler is not None and state:
            self.scaler.load_state_dict(state)
