"""FAKE of real apex's optimizer patching in ``amp.initialize`` (test double).

Real apex attaches ``optimizer._amp_stash`` plus ``_prepare_amp_backward`` /
``_post_amp_backward`` to every optimizer it processes, refuses an optimizer processed twice,
and, before each ``scale_loss`` backward, stashes the existing ``.grad`` tensors (setting them to
None) so that, on exit, only the new gradients are unscaled and checked for overflow and are then
added to the stashed ones (gradient accumulation across several ``scale_loss`` blocks stays
correct). The fake does the same, treating every parameter as its own master (it never casts a
model to fp16, so the O2 master-weight copies of real apex do not exist here).
"""

from __future__ import annotations

import types
from typing import Any

import torch

from .scaler import LossScaler

_ACCEPTED_DTYPES = (torch.float32, torch.float16)


class AmpOptimizerState:
    """The ``optimizer._amp_stash`` attribute stash."""


def _lazy_init(self: Any) -> None:
    stash = self._amp_stash
    if stash.lazy_init_called:
        return
    stash.all_params = []
    for group in self.param_groups:
        for param in group["params"]:
            if param.dtype not in _ACCEPTED_DTYPES:
                raise TypeError(
                    "Optimizer's parameters must be either torch.cuda.FloatTensor or "
                    f"torch.cuda.HalfTensor. Received {param.type()}"
                )
            stash.all_params.append(param)
    stash.all_grad_stash = [None for _ in stash.all_params]
    stash.lazy_init_called = True


def _prepare_backward(self: Any) -> None:
    stash = self._amp_stash
    self._amp_lazy_init()
    for i, param in enumerate(stash.all_params):
        stash.all_grad_stash[i] = param.grad
        param.grad = None


def _post_backward(self: Any, scaler: LossScaler) -> None:
    stash = self._amp_stash
    self._amp_lazy_init()
    fresh: list[torch.Tensor] = []
    fresh_with_stash: list[torch.Tensor] = []
    stashed: list[torch.Tensor] = []
    for param, stashed_grad in zip(stash.all_params, stash.all_grad_stash, strict=True):
        if param.grad is None and stashed_grad is not None:
            param.grad = stashed_grad
        elif param.grad is not None and stashed_grad is None:
            fresh.append(param.grad)
        elif param.grad is not None and stashed_grad is not None:
            fresh_with_stash.append(param.grad)
            stashed.append(stashed_grad)
    if fresh:
        scaler.unscale(fresh, fresh, None, models_are_masters=True)
    if fresh_with_stash:
        scaler.unscale_with_stashed(fresh_with_stash, stashed, fresh_with_stash)
    for i in range(len(stash.all_grad_stash)):
        stash.all_grad_stash[i] = None


def _process_optimizer(optimizer: Any, properties: Any) -> Any:
    if hasattr(optimizer, "_amp_stash"):
        raise RuntimeError("A given optimizer should only be passed through amp.initialize once.")
    optimizer._amp_stash = AmpOptimizerState()
    optimizer._amp_stash.lazy_init_called = False
    optimizer._amp_stash.already_patched = False
    optimizer._amp_stash.params_have_scaled_gradients = False
    for name in ("_prepare_amp_backward", "_post_amp_backward", "_amp_lazy_init"):
        if hasattr(optimizer, name):
            raise RuntimeError(f"Incoming optimizer already has {name} defined.")
    optimizer._amp_lazy_init = types.MethodType(_lazy_init, optimizer)
    optimizer._prepare_amp_backward = types.MethodType(_prepare_backward, optimizer)
    optimizer._post_amp_backward = types.MethodType(_post_backward, optimizer)

    old_add_param_group = optimizer.add_param_group

    def new_add_param_group(self: Any, new_group: dict[str, Any]) -> None:
        old_add_param_group(new_group)
        if self._amp_stash.lazy_init_called:
            for param in self.param_groups[-1]["params"]:
                self._amp_stash.all_params.append(param)
                self._amp_stash.all_grad_stash.append(None)

    optimizer.add_param_group = types.MethodType(new_add_param_group, optimizer)
    return optimizer
