"""What ``rt.setup(model, optimizer)`` returns: the model and optimizers a user's loop calls.

:class:`SetUpModel` runs the backend's wrapper (DDP, FSDP's sharded module, ...) under the
precision's autocast, and, while the loop holds a micro-batch that does not end its
accumulation window, without gradient synchronisation. It keeps the user's module's own
``state_dict`` keys. :class:`SetUpOptimizer` steps (through the strategy: Horovod's
all-reduce, the fp16 scaler, clipping) only at the end of each window of
``grad_accum_steps`` micro-batches, and ``zero_grad`` clears only there, so the loop body
stays the plain ``step(); zero_grad()``.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from distkit.data import MicroBatch
from distkit.errors import ConfigurationError
from distkit.runtime._items import ItemWindow
from distkit.strategies._legacy_hooks import takes_before_step
from distkit.strategies._steps import GradientClip, StepOutcome
from distkit.strategies.base import Strategy
from distkit.strategies.syncbn import placeholder_batch


class SetUpModel(nn.Module):
    """The user's model as the strategy set it up, for a user's own loop.

    Call it as the model itself; its parameters are the user's (so optimizers built before
    ``rt.setup`` keep working), and ``state_dict`` / ``load_state_dict`` use the user's
    module's own keys (no ``module.`` prefix).
    """

    def __init__(
        self,
        strategy: Strategy,
        module: nn.Module,
        wrapped: nn.Module,
        micro: Callable[[], MicroBatch | None],
        ready: Callable[[], None] = lambda: None,
        *,
        forward: nn.Module | None = None,
    ) -> None:
        super().__init__()
        #: a submodule: .train()/.eval()/.to() reach it. The user's module itself until a
        #: backend that sets every model up together (legacy apex) did so at the first use
        self.wrapped = wrapped
        # not submodules (the user's module is inside ``wrapped`` already)
        self.__dict__["_strategy"] = strategy
        self.__dict__["_module"] = module
        self.__dict__["_micro"] = micro
        self.__dict__["_ready"] = ready  # sets pending models up (see Runtime._ready)
        #: what the forward runs: ``wrapped`` compiled (a Trainer's ``compile=``), or None
        self.__dict__["_forward"] = forward
        self.__dict__["_wrapped_now"] = wrapped  # ``wrapped``, for the per-step lookup
        self.__dict__["_unsynced"] = False  # inside unsynced() (see there)

    @property
    def module(self) -> nn.Module:
        """The user's own module (the one passed to ``rt.setup``)."""
        module: nn.Module = self.__dict__["_module"]
        return module

    @override
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.__dict__["_ready"]()
        strategy: Strategy = self.__dict__["_strategy"]
        with self.local_context(), strategy.autocast():
            output = self.forward_module(*args, **kwargs)
        # the loss is computed outside the autocast: in float32, as the Trainer's loss_fn
        # runs (autocast computes losses in float32), and as Fabric and Accelerate do
        return _to_float32(output)

    @property
    def forward_module(self) -> nn.Module:
        """What the forward runs: the backend's wrapper, or it compiled (read per step: from
        the instance's dict, not through nn.Module's attribute lookup)."""
        forward: nn.Module | None = self.__dict__["_forward"]
        if forward is None:  # (not `or`: a compiled module's truth is its len(), refused)
            wrapped: nn.Module = self.__dict__["_wrapped_now"]
            return wrapped
        return forward

    def rewrap(self, wrapped: nn.Module) -> None:
        """The backend set the model up anew (legacy apex, at the loop's first use)."""
        self.wrapped = wrapped
        self.__dict__["_wrapped_now"] = wrapped

    def local_context(self) -> contextlib.AbstractContextManager[None]:
        """While the loop holds a micro-batch that does not end its window: no gradient
        synchronisation; for a placeholder micro-batch: sync BatchNorm leaves it out."""
        micro: MicroBatch | None = self.__dict__["_micro"]()
        if (
            micro is None
            or (micro.last_in_step and micro.count)
            or not (self.training and torch.is_grad_enabled())
        ):
            return _NOTHING  # the usual case: nothing to enter
        return self._local(micro)

    @contextlib.contextmanager
    def _local(self, micro: MicroBatch) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if not micro.last_in_step:
                stack.enter_context(self.unsynced())
            if micro.count == 0:
                stack.enter_context(placeholder_batch(self.wrapped))
            yield

    @contextlib.contextmanager
    def unsynced(self) -> Iterator[None]:
        """No gradient synchronisation in the block while the loop holds a micro-batch that
        does not end its window (else nothing). Re-entrant: a loop that holds the model out
        of sync over a whole micro-batch (the Trainer's forward and backward) enters the
        backend's ``no_sync`` once (legacy apex toggles its DDP's allreduce once)."""
        micro: MicroBatch | None = self.__dict__["_micro"]()
        if micro is None or micro.last_in_step or self.__dict__["_unsynced"]:
            yield
            return
        strategy: Strategy = self.__dict__["_strategy"]
        self.__dict__["_unsynced"] = True
        try:
            with strategy.no_sync(self.wrapped):
                yield
        finally:
            self.__dict__["_unsynced"] = False

    @override
    def state_dict(self, *args: Any, **kwargs: Any) -> Any:
        return self.module.state_dict(*args, **kwargs)

    @override
    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)

    @override
    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_module")
            if module is None:
                raise
            return getattr(module, name)  # the user's own attributes


class SetUpOptimizer:
    """The user's optimizer as the strategy set it up, for a user's own loop.

    ``step()`` steps only where the loop's current micro-batch ends its accumulation window
    (always, outside ``rt.loader``'s batches); ``zero_grad()`` clears only there. Its
    ``param_groups`` and ``state`` are the user's optimizer's (LR schedulers built on the
    user's optimizer keep working).
    """

    def __init__(
        self,
        strategy: Strategy,
        optimizer: torch.optim.Optimizer,
        inner: torch.optim.Optimizer,
        micro: Callable[[], MicroBatch | None],
        ready: Callable[[], None] = lambda: None,
        backwards: Callable[[], int] = lambda: 0,
    ) -> None:
        self._strategy = strategy
        self.optimizer = optimizer  # the user's
        #: the strategy's (Horovod's DistributedOptimizer, ...); the user's until a backend
        #: that sets everything up together (legacy apex) did so at the first use
        self._inner = inner
        self._micro = micro
        self._ready = ready
        self._backwards = backwards  # how many rt.backward calls the runtime made so far
        self._backwards_at_step = 0  # ... when this optimizer last stepped
        self._clip: GradientClip | None = None
        #: what the last step did (stepped, or skipped on an fp16 overflow)
        self.last_outcome: StepOutcome | None = None
        #: the total norm of the averaged gradients before the last clipping (a device
        #: tensor), when ``rt.clip_gradients`` asked for clipping
        self.last_grad_norm: torch.Tensor | None = None
        #: the items its window's token-exact losses sum (see distkit.runtime._items)
        self.items = ItemWindow()
        self._takes_before_step: bool | None = None  # whether the strategy's step takes it

    @property
    def strategy_optimizer(self) -> torch.optim.Optimizer:
        """The strategy's optimizer (Horovod's DistributedOptimizer, amp's, ...), which
        :meth:`Runtime.propagate` and the strategy's step take."""
        return self._inner

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.optimizer.param_groups

    @property
    def state(self) -> Any:
        return self.optimizer.state

    def _window_open(self) -> bool:
        micro = self._micro()
        return micro is not None and not micro.last_in_step

    def clip_at_step(self, clip: GradientClip) -> None:
        """Clip the averaged, unscaled gradients at the next real step (``rt.clip_gradients``)."""
        self._clip = clip

    def step(self, closure: Callable[[], Any] | None = None) -> None:
        """Step at the end of an accumulation window (mid-window: nothing, the gradients
        keep accumulating)."""
        if closure is not None:
            raise TypeError(
                "a set-up optimizer's step() takes no closure: compute the loss, call "
                "rt.backward(loss), then optimizer.step()"
            )
        self._ready()
        if self._window_open():
            return
        clip, self._clip = self._clip, None
        self.step_now(clip=clip)

    def step_now(
        self,
        *,
        clip: GradientClip | None = None,
        skip_nonfinite: bool = False,
        before_step: Callable[[], None] | None = None,
    ) -> tuple[StepOutcome, torch.Tensor | None]:
        """Step now (the loop knows its window ended), through the strategy's one step
        hook: what the step did, and the gradients' norm before clipping (with ``clip``).
        ``before_step`` runs on the final gradients (a Trainer's callbacks). A window of
        token-exact losses first divides them by the step's global item count."""
        self._check_backward()
        before_step = self._normalized(before_step)
        self.items.reset()
        if before_step is None:  # the hook's old form: plugins' step may not take it
            outcome, norm = self._strategy.step(
                self._inner, clip=clip, skip_nonfinite=skip_nonfinite
            )
        else:
            outcome, norm = self._strategy.step(
                self._inner, clip=clip, skip_nonfinite=skip_nonfinite, before_step=before_step
            )
        self.last_outcome, self.last_grad_norm = outcome, norm
        if self._inner is not self.optimizer:
            # torch's LR schedulers watch the user's optimizer's step (see mark_stepped)
            self.optimizer._opt_called = True  # type: ignore[attr-defined]
        return outcome, norm

    def _normalized(self, before_step: Callable[[], None] | None) -> Callable[[], None] | None:
        """``before_step``, preceded by the division of a token-exact window's gradients by
        its global item count (a collective: see ItemWindow.factor)."""
        factor = self.items.factor(self._strategy)
        if factor is None:
            return before_step
        strategy, inner = self._strategy, self._inner
        if self._takes_before_step is None:  # read once: its signature does not change
            self._takes_before_step = takes_before_step(strategy)
        if not self._takes_before_step:
            name = type(strategy).__qualname__
            raise ConfigurationError(
                f"token-exact losses (distkit.Loss / rt.backward(total, count=n)) divide the "
                f"averaged gradients by the step's item count inside the step, but "
                f"{name}.step(optimizer, clip=..., skip_nonfinite=...) takes no before_step. "
                f"Add the keyword to {name}.step and call before_step() once the gradients "
                "are averaged and unscaled (see Strategy.step), or return mean losses"
            )

        def normalize() -> None:
            strategy.scale_gradients(inner, factor)
            if before_step is not None:
                before_step()

        return normalize

    def check_items(self) -> None:
        """Raise if a step since the last check had zero items on every rank, found on the
        device (a host read; see ItemWindow.check)."""
        self.items.check()

    def _check_backward(self) -> None:
        """Refuse a step on gradients that no ``rt.backward`` made (``loss.backward()``
        called directly): they lack the weight that makes N processes equal one (an uneven
        last batch, accumulation) and fp16's scaling, and with it the step would be a silent
        wrong one at some world sizes only."""
        done = self._backwards()
        if done != self._backwards_at_step:
            self._backwards_at_step = done
            return
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if any(p.grad is not None for p in params):
            raise ConfigurationError(
                "optimizer.step() on gradients that rt.backward did not make: call "
                "rt.backward(loss), not loss.backward(). rt.backward weights the loss by "
                "this rank's share of the global batch (so N processes train like one with "
                "N times the batch, uneven last batches and accumulation included), skips "
                "the gradient sync mid-accumulation and scales fp16; a direct "
                "loss.backward() does none of it"
            )

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the gradients at the end of an accumulation window (mid-window: keep
        them, they are still accumulating)."""
        self._ready()
        if self._window_open():
            return
        self.clear(set_to_none)

    def clear(self, set_to_none: bool = True) -> None:
        """Clear the gradients now (the loop knows a new window starts)."""
        self.items.reset()
        if self._inner is self.optimizer:
            self.optimizer.zero_grad(set_to_none=set_to_none)
        else:
            self._inner.zero_grad()  # Horovod's takes no argument (it sets to None)

    def state_dict(self) -> dict[str, Any]:
        self._ready()
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._ready()
        self.optimizer.load_state_dict(state)
        self.follow_loaded_state()

    def follow_loaded_state(self) -> None:
        """After the user's optimizer loaded a state (torch replaces its ``state`` and
        ``param_groups`` objects), the strategy's optimizer (Horovod's, built over the same
        groups) uses the new ones too."""
        if self._inner is not self.optimizer:
            self._inner.state = self.optimizer.state
            self._inner.param_groups = self.optimizer.param_groups

    @override
    def __repr__(self) -> str:
        return f"SetUpOptimizer({self.optimizer!r})"


_REDUCED = (torch.float16, torch.bfloat16)
#: the context of a batch that needs none (reusable: it holds no state)
_NOTHING = contextlib.nullcontext()


def _to_float32(value: Any) -> Any:
    """``value`` with its reduced-precision float tensors as float32 (also inside lists,
    tuples, namedtuples and dicts); anything else as it is."""
    if isinstance(value, torch.Tensor):
        return value.float() if value.dtype in _REDUCED else value
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a namedtuple
        return type(value)(*(_to_float32(v) for v in value))
    if type(value) in (list, tuple):
        return type(value)(_to_float32(v) for v in value)
    if type(value) in (dict, collections.OrderedDict):
        return type(value)((k, _to_float32(v)) for k, v in value.items())
    return value  # another container type: as the model returned it
