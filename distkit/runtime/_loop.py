"""What a loop over a runtime holds, and how its losses go backward.

A :class:`LoopState` belongs to one :class:`~distkit.Runtime`: the models and optimizers
``rt.setup`` set up (and the Trainer's running fit), the micro-batch the loop holds now (from
``rt.loader``: where its accumulation window ends, its weight), legacy apex's models waiting
to be set up together, and the backward of each loss: checked, weighted by the micro-batch's
share of its global batch (or, token-exact, scaled and its items counted), without gradient
synchronisation mid-window. The Runtime's public methods check their arguments and call it;
the Trainer's step loop calls :meth:`LoopState.propagate` itself.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from distkit.data import MicroBatch
from distkit.errors import ConfigurationError, TrainerClosedError
from distkit.faults._progress import Progress
from distkit.loss import check_count, check_total, mean_of
from distkit.runtime._compile import Compiler
from distkit.runtime._input_check import SameBatchCheck
from distkit.runtime._runtime_arguments import check_loss
from distkit.runtime._set_up import SetUpModel, SetUpOptimizer
from distkit.runtime._setups import SetupCache
from distkit.runtime._step_result import training_loss
from distkit.runtime._unused import UnusedCheck
from distkit.strategies._graph import graph_leaves
from distkit.strategies._placement import Placement
from distkit.strategies.base import Strategy


class LoopState:
    """The set-up models and optimizers of a runtime's loop, the micro-batch it holds, and
    the backward of its losses (see the module's docstring)."""

    def __init__(
        self,
        strategy: Strategy,
        setups: SetupCache,
        progress: Progress,
        *,
        same_batches: SameBatchCheck | None = None,
        first_backward: Callable[[], None] = lambda: None,
    ) -> None:
        self.strategy = strategy
        #: the ranks' first batches outside rt.loader, compared at the first backward
        self.same_batches = same_batches or SameBatchCheck(strategy, enabled=False)
        self._first_backward: Callable[[], None] | None = first_backward
        self.setups = setups
        self.progress = progress  # where this rank is, for the watchdog's hang reports
        self.micro: MicroBatch | None = None  # the micro-batch the loop holds now
        #: the user's module -> what rt.setup returned
        self.modules: weakref.WeakKeyDictionary[nn.Module, SetUpModel]
        self.modules = weakref.WeakKeyDictionary()
        #: the set-up optimizers, in set-up order, each with its model
        self.owners: dict[SetUpOptimizer, SetUpModel] = {}
        #: the model and optimizer of the Trainer's fit running on this runtime (see
        #: :meth:`set_up_fit`): one at a time, so a sweep of fits holds none of the last
        self.fit: tuple[SetUpModel, SetUpOptimizer] | None = None
        # legacy apex: models set up but not yet initialised (see ready)
        self._pending: list[
            tuple[nn.Module, list[torch.optim.Optimizer], Placement, SetUpModel, list[Any]]
        ] = []
        self._together_done = False
        self.backwards = 0  # backward calls so far (a step checks it had one)
        self.unused = UnusedCheck()  # DDP parameters a loss did not reach, at the first ones

    def add(
        self,
        model: nn.Module,
        optimizers: Sequence[torch.optim.Optimizer],
        placement: Placement,
    ) -> Any:
        """``rt.setup``'s set-up, once the ranks agreed: the set-up model, or it and its
        optimizers."""
        strategy = self.strategy
        if strategy.sets_up_together:  # legacy apex: every model at the first use
            set_up = SetUpModel(
                strategy, model, model, self.current_micro, self.ready, observe=self._observer()
            )
            wrappers = [
                SetUpOptimizer(
                    strategy,
                    opt,
                    opt,
                    self.current_micro,
                    self.ready,
                    self.backwards_done,
                    model=model,
                )
                for opt in optimizers
            ]
            self._pending.append((model, list(optimizers), placement, set_up, wrappers))
            if self._together_done:
                self.ready()  # the backend refuses a second set-up, saying why
        else:
            inners = [self.setups.setup(model, opt, placement)[1] for opt in optimizers]
            wrapped = self.setups.wrapped(model)
            set_up = SetUpModel(
                strategy, model, wrapped, self.current_micro, self.ready, observe=self._observer()
            )
            wrappers = [
                SetUpOptimizer(
                    strategy,
                    opt,
                    inner,
                    self.current_micro,
                    self.ready,
                    self.backwards_done,
                    model=model,
                )
                for opt, inner in zip(optimizers, inners, strict=True)
            ]
        self.modules[model] = set_up
        for wrapper in wrappers:
            self.owners[wrapper] = set_up
        return (set_up, *wrappers) if optimizers else set_up

    def set_up_fit(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        placement: Placement,
        compiler: Compiler | None,
    ) -> tuple[SetUpModel, SetUpOptimizer]:
        """The Trainer's fit as a user loop of this runtime: ``model`` and ``optimizer`` set
        up (once per runtime: a later fit of the same model reuses them, as a sweep does)
        and wrapped like :meth:`setup`'s, the forward compiled when ``compiler`` says so.
        They are this runtime's running fit until :meth:`end_fit`."""
        wrapped, inner = self.setups.setup(model, optimizer, placement)
        forward = self.setups.compiled(model, compiler)
        set_up = SetUpModel(
            self.strategy, model, wrapped, self.current_micro, self.ready, forward=forward
        )
        opt = SetUpOptimizer(
            self.strategy,
            optimizer,
            inner,
            self.current_micro,
            self.ready,
            self.backwards_done,
            model=model,
        )
        self.fit = (set_up, opt)
        return set_up, opt

    def end_fit(self) -> None:
        """The fit is over: its model and optimizer are no longer this runtime's."""
        self.fit, self.micro = None, None

    def hold(self, micro: MicroBatch | None, epoch: int) -> None:
        """The loop now holds ``micro`` (a loader's ``enter`` for the Trainer's fit, whose
        step loop keeps this rank's progress itself; :meth:`enter` keeps it for a user's
        loop): where it ends its window, its weight."""
        self.micro = micro

    def ready(self) -> None:
        """Before a set-up model's forward or optimizer's step: refuse them once the Runtime
        closed (their backend's state is gone: a DDP forward would meet a destroyed group,
        or run as a plain module without a word); set the pending models up, where the
        backend sets every model up together (legacy apex: one ``amp.initialize`` for all)."""
        if self.setups.closed:
            raise TrainerClosedError(
                "a set-up model or optimizer was used on a closed Runtime: the Runtime was "
                "closed (close(), the end of its with-block, or a failed multi-process run) "
                "and its backend state with it. Use the model you passed to rt.setup (its "
                "weights are the trained ones), or set it up again on a new distkit.Runtime"
            )
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        self._together_done = True
        done = self.setups.setup_together(
            [(model, opts, placement) for model, opts, placement, _, _ in pending]
        )
        for (_, _, _, set_up, wrappers), (wrapped, inners) in zip(pending, done, strict=True):
            set_up.rewrap(wrapped)
            for wrapper, inner in zip(wrappers, inners, strict=True):
                wrapper._inner = inner

    def check_items(self) -> None:
        """Token-exact losses: raise if a step since the last check had zero items on every
        rank, where only the device knew (at each loader epoch's end and each save)."""
        for optimizer in self.owners:
            optimizer.check_items()

    def backward(
        self,
        loss: torch.Tensor,
        *,
        optimizer: Any = None,
        count: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``rt.backward``'s work (see :meth:`distkit.Runtime.backward`)."""
        # (the optimizers' dict first: a weak dictionary's len is a Python call per backward)
        if not self.owners and not self.modules and self.fit is None:
            raise ConfigurationError(
                "rt.backward(loss) before rt.setup(model, optimizer): set the model up first, "
                "so that its gradients are synchronised over the ranks"
            )
        micro = self.micro
        if count is not None:
            check_total(loss, "rt.backward's total (with count=)")
            check_count(count, "rt.backward's count=")
        else:
            check_loss(loss, "rt.backward's loss")
            if micro is None and loss.ndim != 0:
                raise ConfigurationError(
                    f"rt.backward got a loss of shape {tuple(loss.shape)} outside rt.loader's "
                    "batches: one value per DataParallel replica is weighted by the batch's "
                    "samples, known only for rt.loader's batches. Pass the batch-mean loss "
                    "(a scalar), or iterate rt.loader(data)"
                )
        self._start_backward(micro)
        owners = self._owners_of(loss, optimizer, items=count is not None)
        if owners:
            target = owners[0].strategy_optimizer
        else:
            target = next((opt.strategy_optimizer for opt in self.owners), None)
        return self.propagate(loss, target, count=count, owners=owners)

    def forward_backward(
        self,
        model: Any,
        inputs: Any,
        target: Any,
        loss_fn: Callable[[Any, Any], Any],
        *,
        optimizer: Any = None,
    ) -> torch.Tensor:
        """``rt.forward_backward``'s work (see :meth:`distkit.Runtime.forward_backward`)."""
        if not isinstance(model, SetUpModel) or model not in self.modules.values():
            raise ConfigurationError(
                f"rt.forward_backward takes the model rt.setup returned, got "
                f"{type(model).__name__}: pass what rt.setup(model, optimizer) gave back"
            )
        if not callable(loss_fn):
            raise ConfigurationError(
                f"rt.forward_backward's loss_fn must be callable as loss_fn(output, target), "
                f"got {type(loss_fn).__name__}"
            )
        source = "rt.forward_backward's loss_fn"
        pipeline = self.strategy.pipeline_of(model.wrapped)
        if pipeline is None:  # the forward, then the backward of its loss, as rt.backward's
            value, items = training_loss(loss_fn(model(inputs), target), source)
            return self.backward(value, optimizer=optimizer, count=items)
        self._start_backward(self.micro)
        owners = [opt for opt, owner in self.owners.items() if owner is model]
        if optimizer is not None:
            owners = self._owners_of(torch.zeros(()), optimizer, items=False)

        def loss_of(output: Any, target: Any) -> tuple[torch.Tensor, int | torch.Tensor | None]:
            return training_loss(loss_fn(output, target), source)

        value, _ = self.propagate_pipeline(pipeline, inputs, target, loss_of, owners=owners)
        return value

    def propagate(
        self,
        loss: torch.Tensor,
        optimizer: Any,
        *,
        count: int | torch.Tensor | None = None,
        owners: Sequence[SetUpOptimizer] = (),
    ) -> torch.Tensor:
        """:meth:`backward`'s work on a loss already checked, for the strategy's ``optimizer``
        (the Trainer's step loop calls it; a user's loop calls :meth:`backward`): dp's
        per-replica losses reduced, the micro-batch's weight (with ``count``: the scale of a
        token-exact total, its items noted in each of ``owners``' windows), no gradient
        synchronisation mid-window, the backend's backward. Returns the reduced, unweighted
        loss (with ``count``: the micro-batch's mean per item, detached)."""
        micro = self.micro
        if count is None:
            for owner in owners:
                owner.items.note_mean("rt.backward")
            # dp may gather one loss per replica: weighted by the batch's samples
            loss = self.strategy.reduce_loss(loss, 0 if micro is None else micro.count)
            weight = 1.0 if micro is None else micro.weight
            returned = loss
        else:
            loss, count, weight = self._items_total(loss, count, owners)
            returned = mean_of(loss.detach(), count)
        self.backwards += 1
        if micro is None or micro.last_in_step:
            self.strategy.backward(loss if weight == 1.0 else loss * weight, optimizer)
            if self.unused.looking:  # the loop's first backwards only
                self.unused.after_backward(self._ddp_models())
            return returned
        with contextlib.ExitStack() as stack:  # mid-window: no gradient synchronisation
            for set_up in self.models():
                stack.enter_context(set_up.unsynced())
            self.strategy.backward(loss if weight == 1.0 else loss * weight, optimizer)
        return returned

    def _start_backward(self, micro: MicroBatch | None) -> None:
        """What every backward of a user's loop starts with (:meth:`backward`'s and
        :meth:`forward_backward`'s): accumulation needs rt.loader's batches; the loop's first
        backward settles the first-batch check (every rank's, alike); pending set-ups run."""
        if micro is None and self.strategy.options.grad_accum_steps > 1:
            raise ConfigurationError(
                f"grad_accum_steps={self.strategy.options.grad_accum_steps} needs the batches of "
                "rt.loader(...): it knows where each accumulation window ends. Iterate "
                "rt.loader(data) (or create the Runtime with grad_accum_steps=1)"
            )
        if self._first_backward is not None:  # the loop's first: every rank's, alike
            first, self._first_backward = self._first_backward, None
            for set_up in self.modules.values():  # their forwards need not call it any more
                set_up.stop_observing()
            self.same_batches.settle(outside_loader=micro is None)
            first()
        self.ready()

    def propagate_pipeline(
        self,
        pipeline: Any,
        inputs: Any,
        target: Any,
        loss_of: Callable[[Any, Any], tuple[torch.Tensor, int | torch.Tensor | None]],
        *,
        owners: Sequence[SetUpOptimizer] = (),
    ) -> tuple[torch.Tensor, int | torch.Tensor | None]:
        """:meth:`propagate` under a pipeline (see ``Strategy.pipeline_of``): the schedule
        runs the batch's forward and backward, ``loss_of(output, target)`` giving each
        micro-batch's loss on the last stage, weighted as :meth:`propagate` weights a batch's
        (a mean by the batch's share of the step, a token-exact total by the step's scale).
        Returns the batch's loss, unweighted (a token-exact one: its mean), and its items
        (None for a mean), the same on every rank of the pipeline."""
        micro = self.micro
        world = self.strategy.data_world_size
        scale = world / micro.step_samples if micro is not None and micro.step_samples else 1.0
        placeholder = micro is not None and micro.count == 0  # a stand-in: it counts nothing
        with self.strategy.autocast():
            value, items = pipeline.train_step(
                inputs,
                target,
                loss_of,
                mean_weight=1.0 if micro is None else micro.weight,
                item_weight=0.0 if placeholder else scale,
            )
        self.backwards += 1
        if items is None:
            for owner in owners:
                owner.items.note_mean("rt.backward")
            return value, None
        count: int | torch.Tensor = 0 if placeholder else items
        for owner in owners:
            owner.items.note_items(count, scale, "rt.backward(total, count=...)")
        return mean_of(value, count), count

    def _items_total(
        self,
        total: torch.Tensor,
        count: int | torch.Tensor,
        owners: Sequence[SetUpOptimizer],
    ) -> tuple[torch.Tensor, int | torch.Tensor, float]:
        """A token-exact total as backpropagated: summed (dp's per-replica totals), left out
        for a placeholder micro-batch, and its scale, the same for every micro-batch of the
        window on every rank (see distkit.runtime._items); its items noted in ``owners``."""
        micro = self.micro
        if total.ndim:
            total = total.sum()  # one partial sum per DataParallel replica
        if isinstance(count, torch.Tensor) and count.ndim:
            count = count.sum()
        if micro is not None and micro.count == 0:  # a stand-in sample: it counts for nothing
            count = 0
        world = self.strategy.data_world_size
        scale = world / micro.step_samples if micro is not None and micro.step_samples else 1.0
        for owner in owners:
            owner.items.note_items(count, scale, "rt.backward(total, count=...)")
        weight = 0.0 if micro is not None and micro.count == 0 else scale
        return total, count, weight

    def _ddp_models(self) -> Iterator[tuple[nn.Module, nn.Module, str]]:
        """What :class:`UnusedCheck` looks at: each model's wrapper, module and owner."""
        for set_up in self.modules.values():
            yield set_up.wrapped, set_up.module, "distkit.Runtime"
        if self.fit is not None:
            yield self.fit[0].wrapped, self.fit[0].module, "distkit.Trainer"

    def models(self) -> list[SetUpModel]:
        """Every set-up model: the user loop's, and the running fit's."""
        models = list(self.modules.values())
        if self.fit is not None:
            models.append(self.fit[0])
        return models

    def _owners_of(self, loss: torch.Tensor, given: Any, *, items: bool) -> list[Any]:
        """The set-up optimizers whose next step applies ``rt.backward(loss)``'s gradients
        (see :meth:`backward`): the one given, the only one, or (legacy apex, token-exact
        losses) those whose parameters the loss reaches; none where it does not matter."""
        if given is not None:
            if self.fit is not None and given is self.fit[1]:
                return [given]
            if not isinstance(given, SetUpOptimizer) or given not in self.owners:
                raise ConfigurationError(
                    f"rt.backward's optimizer= takes an optimizer this Runtime's rt.setup "
                    f"returned, got {type(given).__name__}: pass what "
                    "rt.setup(model, optimizer) gave back"
                )
            return [given]
        optimizers = list(self.owners)
        if len(optimizers) <= 1:
            return optimizers
        apex = self.strategy.sets_up_together
        if not (apex or items):
            return []  # the backend does not use it
        reached = _reached_models(loss, self.modules.values())
        owners = [opt for opt in optimizers if self.owners[opt] in reached]
        if not apex or len(owners) == 1:
            return owners
        names = ", ".join(repr(opt.optimizer).split("(")[0] for opt in owners) or "none"
        raise ConfigurationError(
            f"rt.backward(loss) on {self.strategy.name!r} (legacy apex amp) needs to know "
            "which optimizer steps on these gradients: amp unscales them for that "
            f"optimizer, with its own loss scale, and this loss reaches the parameters of "
            f"{len(owners)} set-up optimizers ({names}). Pass it: "
            "rt.backward(loss, optimizer=opt_g)"
        )

    @property
    def sync_gradients(self) -> bool:
        """Whether the batch the loop holds ends its accumulation window: its backward
        synchronises the gradients and ``optimizer.step()`` steps (always True outside
        ``rt.loader``'s batches). Save checkpoints where it is True."""
        micro = self.micro
        return micro is None or micro.last_in_step

    def backwards_done(self) -> int:
        return self.backwards

    def current_micro(self) -> MicroBatch | None:
        return self.micro

    def _observer(self) -> Callable[[tuple[Any, ...], dict[str, Any]], None] | None:
        """What a model set up now calls on its training forwards: :meth:`observe` while the
        ranks' first batches are still to compare, else nothing."""
        return self.observe if self.same_batches.pending else None

    def observe(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """A set-up model's training forward outside rt.loader's batches (see SetUpModel)."""
        if self.same_batches.pending and self.micro is None and self.fit is None:
            self.same_batches.observe(args, kwargs)

    def enter(self, micro: MicroBatch | None, epoch: int) -> None:
        progress = self.progress  # where this rank is, for the watchdog's hang reports
        done = self.micro
        if done is not None and done.last_in_step:
            progress.step += 1  # the window before this batch is over: steps taken so far
        self.micro = micro
        if micro is None:
            progress.phase = "user code"
        elif progress.phase != "training" or progress.epoch != epoch:
            progress.epoch, progress.phase = epoch, "training"


def _reached_models(loss: torch.Tensor, set_ups: Any) -> list[SetUpModel]:
    """The set-up models whose parameters ``loss``'s backward reaches (its graph's leaves)."""
    leaves = graph_leaves(loss)
    return [
        set_up for set_up in set_ups if any(id(p) in leaves for p in set_up.module.parameters())
    ]
