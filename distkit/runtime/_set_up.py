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
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, SupportsIndex

import torch
from torch import nn
from typing_extensions import override

from distkit.data import MicroBatch
from distkit.errors import ConfigurationError, UnsupportedFeatureError
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
        observe: Callable[[tuple[Any, ...], dict[str, Any]], None] | None = None,
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
        #: sees a training forward's inputs outside rt.loader's batches (the loop's check
        #: that the ranks do not all train the same batch)
        self.__dict__["_observe"] = observe

    def stop_observing(self) -> None:
        """The loop's check of the ranks' first batches is over: forwards skip it."""
        self.__dict__["_observe"] = None

    @property
    def module(self) -> nn.Module:
        """The user's own module (the one passed to ``rt.setup``)."""
        module: nn.Module = self.__dict__["_module"]
        return module

    @override
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        self.__dict__["_ready"]()
        observe = self.__dict__["_observe"]
        if observe is not None and self.training and torch.is_grad_enabled():
            observe(args, kwargs)
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


class SetUpOptimizer(torch.optim.Optimizer):
    """The user's optimizer as the strategy set it up, for a user's own loop.

    It **is** a ``torch.optim.Optimizer``, and an instance of the user's optimizer's class
    (``isinstance(opt, torch.optim.AdamW)`` holds, as for Horovod's ``DistributedOptimizer``):
    torch's, transformers' and timm's LR schedulers take it. Its ``param_groups``, ``state``
    and ``defaults`` are the user's optimizer's own objects, so a scheduler, a warm-up that
    writes ``param_groups[i]["lr"]`` or ``defaults["lr"]``, or hooks registered on it act on
    the optimizer that steps. Any other attribute is read from, and written to, the user's
    optimizer too (a method of the user's class runs against the same state).

    ``step()`` steps only where the loop's current micro-batch ends its accumulation window
    (always, outside ``rt.loader``'s batches); ``zero_grad()`` clears only there.
    """

    # set in __init__, in the instance's own dict (see __setattr__)
    _strategy: Strategy
    optimizer: torch.optim.Optimizer
    _inner: torch.optim.Optimizer
    _micro: Callable[[], MicroBatch | None]
    _ready: Callable[[], None]
    _backwards: Callable[[], int]
    _backwards_at_step: int
    _clip: GradientClip | None
    last_outcome: StepOutcome | None
    last_grad_norm: torch.Tensor | None
    items: ItemWindow
    _takes_before_step: bool | None
    _model: nn.Module | None

    def __new__(cls, *args: Any, **kwargs: Any) -> SetUpOptimizer:
        optimizer = kwargs.get("optimizer", args[1] if len(args) > 1 else None)
        if cls is SetUpOptimizer and isinstance(optimizer, torch.optim.Optimizer):
            cls = _set_up_class(type(optimizer))
        return object.__new__(cls)

    def __init__(
        self,
        strategy: Strategy,
        optimizer: torch.optim.Optimizer,
        inner: torch.optim.Optimizer,
        micro: Callable[[], MicroBatch | None],
        ready: Callable[[], None] = lambda: None,
        backwards: Callable[[], int] = lambda: 0,
        model: nn.Module | None = None,
    ) -> None:
        # (torch.optim.Optimizer.__init__ is not called: the state is the user's optimizer's)
        own = self.__dict__
        own["_strategy"] = strategy
        own["optimizer"] = optimizer  # the user's
        #: the strategy's (Horovod's DistributedOptimizer, ...); the user's until a backend
        #: that sets everything up together (legacy apex) did so at the first use
        own["_inner"] = inner
        own["_micro"] = micro
        own["_ready"] = ready
        own["_backwards"] = backwards  # how many rt.backward calls the runtime made so far
        own["_backwards_at_step"] = 0  # ... when this optimizer last stepped
        own["_clip"] = None  # GradientClip | None: rt.clip_gradients's, for the next step
        #: what the last step did (stepped, or skipped on an fp16 overflow)
        own["last_outcome"] = None
        #: the total norm of the averaged gradients before the last clipping (a device
        #: tensor), when ``rt.clip_gradients`` asked for clipping
        own["last_grad_norm"] = None
        #: the items its window's token-exact losses sum (see distkit.runtime._items)
        own["items"] = ItemWindow()
        own["_takes_before_step"] = None  # whether the strategy's step takes it
        own["_model"] = model  # the user's module it steps (None: not known)
        _share_step_hooks(optimizer, inner)

    # -- the user's optimizer's state, shared ------------------------------------------------

    def __getattr__(self, name: str) -> Any:
        # only for what the wrapper lacks: param_groups, state, defaults, hooks, the user's
        # own attributes. (Not while copying or unpickling: nothing is set yet.)
        optimizer = self.__dict__.get("optimizer")
        if optimizer is None:
            raise AttributeError(name)
        return getattr(optimizer, name)

    @override
    def __setattr__(self, name: str, value: Any) -> None:
        if name in self.__dict__ or name in _OWN:
            object.__setattr__(self, name, value)
        else:  # defaults, param_groups, the user's attributes: where the step reads them
            setattr(self.__dict__["optimizer"], name, value)

    @override
    def __delattr__(self, name: str) -> None:
        if name in self.__dict__:
            object.__delattr__(self, name)
        else:
            delattr(self.__dict__["optimizer"], name)

    @override
    def __reduce_ex__(self, protocol: SupportsIndex) -> Any:
        raise TypeError(
            "a set-up optimizer cannot be copied or pickled (it holds the strategy and its "
            "process group): save its state with rt.save(path, {'optimizer': optimizer}) or "
            "optimizer.state_dict(), and copy the user's optimizer before rt.setup"
        )

    @override
    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the user's optimizer (its parameters must be the model's, set up
        already); refused where the strategy's optimizer is another object (Horovod's
        all-reduce hooks and DeepSpeed's partitions cover only the groups given at set-up)."""
        inner: torch.optim.Optimizer = self.__dict__["_inner"]
        optimizer: torch.optim.Optimizer = self.__dict__["optimizer"]
        if inner is not optimizer:
            raise UnsupportedFeatureError(
                f"add_param_group on an optimizer set up by {type(self._strategy).__name__}: "
                "its optimizer covers only the parameter groups given at rt.setup. Build the "
                "optimizer with every group before rt.setup (a group with lr=0 can be "
                "unfrozen later by writing its lr)"
            )
        model = self._model
        params = param_group.get("params") if isinstance(param_group, Mapping) else None
        if model is not None and params is not None:
            given = [params] if isinstance(params, torch.Tensor) else list(params)
            foreign = foreign_tensors(model, given)
            if foreign:
                raise ConfigurationError(
                    f"add_param_group: {foreign} of the group's {len(given)} tensor(s) are "
                    "not parameters of the set-up model (the strategy synchronises only the "
                    "model's gradients); add the model's own parameters, e.g. "
                    "optimizer.add_param_group({'params': model.head.parameters()})"
                )
            param_group = {**param_group, "params": given}
        optimizer.add_param_group(param_group)

    @property
    def strategy_optimizer(self) -> torch.optim.Optimizer:
        """The strategy's optimizer (Horovod's DistributedOptimizer, amp's, ...), which
        :meth:`Runtime.propagate` and the strategy's step take."""
        inner: torch.optim.Optimizer = self.__dict__["_inner"]
        return inner

    def _window_open(self) -> bool:
        micro = self._micro()
        return micro is not None and not micro.last_in_step

    def clip_at_step(self, clip: GradientClip) -> None:
        """Clip the averaged, unscaled gradients at the next real step (``rt.clip_gradients``)."""
        self._clip = clip

    @override
    def step(self, closure: None = None) -> None:  # type: ignore[override]
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
        own = self.__dict__  # (written directly: this class's __setattr__ routes names)
        own["last_outcome"], own["last_grad_norm"] = outcome, norm
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
            self.__dict__["_backwards_at_step"] = done  # (see step_now)
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

    @override
    def state_dict(self) -> dict[str, Any]:
        self._ready()
        return self.optimizer.state_dict()

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._ready()
        self.optimizer.load_state_dict(state_dict)
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


def foreign_tensors(model: nn.Module, tensors: Iterable[Any]) -> int:
    """How many of ``tensors`` are not parameters of ``model``."""
    owned = {id(p) for p in model.parameters()}
    return sum(1 for tensor in tensors if id(tensor) not in owned)


#: what a set-up optimizer keeps as its own (all else is the user's optimizer's). ``step``
#: and ``_opt_called``: an LR scheduler built on it wraps its step to record the call
_OWN = frozenset({"step", "_opt_called"})
#: per user optimizer class, its set-up class (a subclass of both)
_CLASSES: dict[type[torch.optim.Optimizer], type[SetUpOptimizer]] = {}


def _set_up_class(kind: type[torch.optim.Optimizer]) -> type[SetUpOptimizer]:
    """The class of a set-up ``kind``: SetUpOptimizer's methods first, then ``kind``'s (so
    ``isinstance(opt, kind)`` holds and class attributes of ``kind`` read as usual)."""
    made = _CLASSES.get(kind)
    if made is None:
        namespace = {"__module__": SetUpOptimizer.__module__, "__doc__": SetUpOptimizer.__doc__}
        made = type(f"SetUp{kind.__name__}", (SetUpOptimizer, kind), namespace)
        _CLASSES[kind] = made
    return made


def _share_step_hooks(optimizer: torch.optim.Optimizer, inner: torch.optim.Optimizer) -> None:
    """Hooks registered on the set-up optimizer (so on the user's) run where the strategy's
    own optimizer object steps (Horovod's ``DistributedOptimizer`` is a second instance)."""
    if inner is optimizer or not isinstance(inner, torch.optim.Optimizer):
        return
    for name in ("_optimizer_step_pre_hooks", "_optimizer_step_post_hooks"):
        hooks = getattr(optimizer, name, None)
        if hooks is not None and hasattr(inner, name):
            setattr(inner, name, hooks)


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
