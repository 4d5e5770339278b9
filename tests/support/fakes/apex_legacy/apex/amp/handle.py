"""FAKE ``apex.amp.scale_loss`` / ``disable_casts`` (test double, CPU).

``scale_loss`` follows real apex step by step: it refuses to run before ``amp.initialize``;
yields ``loss`` untouched when amp was initialised with ``enabled=False``; yields
``loss.float()`` and does nothing else for a static scale of 1.0 without master weights (O0 and
O3 defaults); otherwise stashes existing grads, yields ``loss.float() * loss_scale`` and, on exit
(unless ``delay_unscale``), unscales the new grads, adds the stashed ones, and, for a dynamic
scale, checks for inf/NaN. On overflow (and unless ``delay_overflow_check``) the loss scale is
halved and each optimizer's *next* ``step()`` is replaced by a one-shot no-op that restores the
real ``step`` (exactly how real apex patches ``optimizer.step``). Recorded as
``"amp.scale_loss"``, ``"amp.overflow"`` and ``"amp.skip_step"``.

``AmpHandle`` stands in for real apex's O1 handle (``apex/amp/handle.py``): real O1 replaces
torch functions with casting wrappers and saves the originals in the handle
(``_all_wrappers``), which ``_deactivate`` puts back. The fake wraps ``F.linear`` in a
pass-through the same way, so a test sees whether O1's patches outlive the Trainer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from apex._common.recorder import record

from ._amp_state import _amp_state, maybe_print


@contextlib.contextmanager
def scale_loss(
    loss: torch.Tensor,
    optimizers: Any,
    loss_id: int = 0,
    model: Any = None,
    delay_unscale: bool = False,
    delay_overflow_check: bool = False,
) -> Iterator[torch.Tensor]:
    """``with amp.scale_loss(loss, optimizer) as scaled_loss: scaled_loss.backward()``."""
    if not hasattr(_amp_state, "opt_properties"):
        raise RuntimeError(
            "Invoked 'with amp.scale_loss`, but internal Amp state has not been initialized.  "
            "model, optimizer = amp.initialize(model, optimizer, opt_level=...) must be called "
            "before `with amp.scale_loss`."
        )
    if not _amp_state.opt_properties.enabled:
        record("amp.scale_loss", loss_id=loss_id, loss_scale=None, enabled=False)
        yield loss
        return

    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]

    loss_scaler = _amp_state.loss_scalers[loss_id]
    loss_scale = loss_scaler.loss_scale()
    record(
        "amp.scale_loss",
        loss_id=loss_id,
        loss_scale=loss_scale,
        enabled=True,
        delay_unscale=delay_unscale,
        delay_overflow_check=delay_overflow_check,
    )

    if (
        not _amp_state.opt_properties.master_weights
        and not loss_scaler.dynamic
        and loss_scale == 1.0
    ):
        yield loss.float()
        return

    if not delay_unscale and isinstance(optimizers, list):
        for optimizer in optimizers:
            if not optimizer._amp_stash.params_have_scaled_gradients:
                optimizer._prepare_amp_backward()

    yield loss.float() * loss_scale

    if delay_unscale:
        for optimizer in optimizers:
            optimizer._amp_stash.params_have_scaled_gradients = True
        return

    loss_scaler.clear_overflow_state()
    for optimizer in optimizers:
        optimizer._post_amp_backward(loss_scaler)
        optimizer._amp_stash.params_have_scaled_gradients = False
    should_skip = False if delay_overflow_check else loss_scaler.update_scale()
    if not should_skip:
        return
    record("amp.overflow", loss_id=loss_id, new_loss_scale=loss_scaler.loss_scale())
    for optimizer in optimizers:
        if optimizer._amp_stash.already_patched:
            continue
        optimizer.step = _skip_next_step(optimizer, loss_scaler, loss_id)
        optimizer._amp_stash.already_patched = True


def _skip_next_step(optimizer: Any, loss_scaler: Any, loss_id: int) -> Any:
    real_step = optimizer.step

    def skip_step(closure: Any = None) -> None:
        if closure is not None:
            raise RuntimeError("Currently, Amp does not support closure use with optimizers.")
        maybe_print(
            f"Gradient overflow.  Skipping step, loss scaler {loss_id} reducing loss scale to "
            f"{loss_scaler.loss_scale()}"
        )
        record("amp.skip_step", loss_id=loss_id, loss_scale=loss_scaler.loss_scale())
        optimizer.step = real_step
        optimizer._amp_stash.already_patched = False

    return skip_step


class AmpHandle:
    """FAKE O1 handle: saves what it patched; ``_deactivate`` restores it (as real apex)."""

    def __init__(self) -> None:
        self._cache: dict[Any, Any] = {}
        self._all_wrappers: list[tuple[Any, str, Any]] = []

    def _save_func(self, mod: Any, fn: str, func: Any) -> None:
        self._all_wrappers.append((mod, fn, func))

    def _deactivate(self) -> None:
        for mod, fn, func in self._all_wrappers:
            setattr(mod, fn, func)
        self._all_wrappers = []
        record("amp.deactivate")

    def _clear_cache(self) -> None:
        self._cache.clear()


def patch_torch_functions() -> AmpHandle:
    """FAKE O1: wrap ``torch.nn.functional.linear`` (pass-through), saved in a new handle."""
    handle = AmpHandle()
    functional = torch.nn.functional
    original = functional.linear

    def linear(*args: Any, **kwargs: Any) -> Any:
        return original(*args, **kwargs)

    handle._save_func(functional, "linear", original)
    functional.linear = linear
    _amp_state.handle = handle
    return handle


@contextlib.contextmanager
def disable_casts() -> Iterator[None]:
    """No-op in the fake (it never patches torch functions for casting)."""
    yield
