"""The Strategy interface: a small abstract core and default hooks.

A strategy owns everything that differs between data-parallel backends: how processes find each
other, how the model and optimizer are wrapped, how gradients are synchronised, and how the
collectives run. The trainer talks to these hooks only and never asks which backend it has.

Contract every strategy keeps (the contract test suite checks it):
    * in :meth:`Strategy.optimizer_step`, the gradients that were used are the **mean** over
      ranks of each rank's gradients, so a per-rank mean loss gives a global mean gradient;
    * inside :meth:`Strategy.no_sync` no gradient communication happens;
    * :meth:`Strategy.unwrap` returns the user's own module.

The lifecycle, in the order the Trainer calls the hooks (every rank calls the same hooks in
the same order; a hook marked *collective* must be called on every rank, or the others wait):

1. **Start** (``Trainer(...)``): :meth:`start` with the Trainer's options: the launcher's
   variables are read and the process group joined (:meth:`_setup_environment`;
   *collective* where a group forms: ddp, fsdp, apex; ``hvd.init()`` for horovod), which
   fixes :attr:`topology` (rank, world size, device), and :meth:`_make_precision` gives the
   autocast, the loss scaler and the scaler's state (:attr:`precision`).
2. **Set-up**, once per model and optimizer: :meth:`setup` (the model onto this rank's
   device, :meth:`convert_sync_batchnorm` when asked, then the backend's wrapping:
   *collective* on ddp and apex (the wrapper broadcasts rank 0's weights), on fsdp (rank
   0's weights broadcast, then ``fully_shard``) and on horovod (``broadcast_parameters``);
   dp wraps locally), then
   :meth:`compile_model` when ``compile=`` is given, and :meth:`setup_optimizer` for a
   further optimizer on a set-up model. A resume loads the checkpoint afterwards, through
   :attr:`state_io` (``load_model_state_dict``, ``load_optimizer_state_dict``) and
   ``precision.load_state_dict`` (the scaler).
3. **Each step**, per micro-batch: :meth:`no_sync` around every micro-batch but the step's
   last, :meth:`autocast` around the forward pass and the loss, :meth:`reduce_loss`, then
   :meth:`backward` (*collective* on the last micro-batch: ddp and apex all-reduce in their
   hooks, fsdp reduce-scatters, horovod starts its asynchronous all-reduces); then once per
   step, :meth:`step` with the step's decisions (clip, skip non-finite, the callbacks'
   ``before_step``): by default, only when clipping or given ``before_step``,
   :meth:`finalize_gradients` (fp16: unscales), ``before_step()`` (the callbacks'
   ``on_before_optimizer_step``) and :meth:`clip_gradients` (fsdp: *collective*, the norm
   sums every rank's slice), then :meth:`optimizer_step`; horovod's :meth:`step` is
   *collective* (it waits for its all-reduces, once, before ``before_step`` and clipping,
   or in its optimizer's step); then, at each save point of an elastic backend,
   ``elastic.commit()`` (*collective*). A model with a pipeline (:meth:`pipeline_of` not
   None: ``FSDPStrategy(pipeline_parallel=...)``) runs each micro-batch's forward and
   backward as one step of its schedule in place of the forward and :meth:`backward`
   (*collective* over the pipeline's ranks); the per-step hooks are the same.
4. **Evaluation**: :meth:`eval_model` gives the module to run, :meth:`eval_rounds` how many
   forward passes every rank makes (a backend with collectives in its forward needs the same
   number on every rank); the sums are combined with :meth:`all_reduce` (*collective*).
5. **Checkpoints**: ``state_io.checkpoint_state`` (fsdp: *collective*, a gather to rank 0,
   or every rank writing its shards) and ``precision.state_dict()`` (the scaler, in
   ``GradScaler`` form whatever the backend).
6. **The fit as a whole** runs once, or, where :attr:`elastic` is not None, inside
   ``elastic.run`` (horovod elastic: its retry loop and the syncs after a group change,
   *collective*).
7. **End** (``trainer.close()``): :meth:`teardown` leaves the process group (when this
   strategy formed it) and undoes what the backend changed outside the model.

The collectives of :class:`~distkit.strategies._collectives.Collectives` (``all_reduce``,
``broadcast``, ``all_gather``, ``all_gather_object``, ``barrier``) are collective on every
backend.

What only some backends do differently is an object a strategy hands out
(:mod:`distkit.strategies.capabilities`): :attr:`state_io` (FSDP gathers and scatters
shards) and :attr:`elastic` (Horovod elastic); the loss scaler's state is
:attr:`precision`'s (legacy apex converts amp's form there). Hooks of distkit 0.1 that these
replaced are forwarded with a DeprecationWarning when called, and refused at class creation
when a plugin overrides one that is no longer called (see ``docs/plugins.md``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import warnings
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn
from typing_extensions import override

from distkit.errors import ConfigurationError, DistkitError, UnsupportedFeatureError
from distkit.faults._channel import SideChannel
from distkit.launch import BUILTIN_CHOICES, LaunchRequest, StrategyChoices, native_alternative
from distkit.launch.diagnosis import MachineFacts, StrategyReport
from distkit.launch.families import TORCH_LAUNCHERS, LauncherFamily
from distkit.strategies._collectives import Collectives
from distkit.strategies._legacy_hooks import (
    FORWARDS,
    REPLACED,
    STATE_IO_HOOKS,
    LegacyStateIO,
    overrides,
)
from distkit.strategies._placement import NO_META, place
from distkit.strategies._steps import (
    GradientClip,
    StepOutcome,
    clip_,
    gradients_finite,
    local_norm,
    scale_,
    step_gradients,
)
from distkit.strategies.capabilities import Elastic, StateIO
from distkit.strategies.precision import Precision, normalize_precision

#: the keywords of the parallel layouts a strategy may take beside data parallelism; one a
#: strategy's constructor does not name is refused (see Strategy.__new__)
LAYOUT_OPTIONS = frozenset(
    {
        "tensor_parallel",
        "tensor_plan",
        "pipeline_parallel",
        "pipeline_split",
        "microbatches",
        "stages_per_rank",
    }
)


@dataclass(frozen=True)
class TrainOptions:
    """What the trainer asks of every strategy (set through :meth:`Strategy.connect`)."""

    precision: str = "32"
    grad_accum_steps: int = 1
    sync_batchnorm: bool = False
    find_unused_parameters: bool = False
    #: how long a collective may wait for the other ranks, in seconds (None: the backend's own)
    collective_timeout: float | None = None


@dataclass(frozen=True)
class Topology:
    """Where this process sits: torch's vocabulary."""

    rank: int
    local_rank: int
    world_size: int
    device: torch.device


class Strategy(Collectives, ABC):
    """One data-parallel backend.

    Subclasses implement the abstract core; the defaults of everything else suit a backend that
    averages gradients in ``backward`` (DDP) or in ``optimizer.step`` (Horovod).
    """

    #: the name it is registered under (``Trainer(strategy=name)``, ``distkit run --strategy``)
    name: ClassVar[str] = ""
    #: the step phase in which gradients are all-reduced ("backward", "optimizer" or "none")
    comm_phase: ClassVar[str] = "backward"
    #: how its processes are started and recognised (:mod:`distkit.launchers`)
    launcher: ClassVar[LauncherFamily] = TORCH_LAUNCHERS
    #: whether ``strategy="auto"`` picks it when its launcher family started the process
    auto_select: ClassVar[bool] = False
    #: the distributions it runs on beyond torch; checkpoints record their versions
    libraries: ClassVar[tuple[str, ...]] = ()
    #: why it cannot train a model the user placed on devices of their own (several GPUs, or
    #: one that is not this rank's; see :mod:`distkit.strategies._placement`); None: it keeps such a
    #: model where it is (ddp, horovod)
    placement_refusal: ClassVar[str | None] = (
        "this strategy does not declare that it keeps a model where the user placed it (a "
        "Strategy subclass that can sets placement_refusal = None)"
    )

    #: why it cannot train a model built wholly on the meta device (no values yet); None:
    #: its set-up materialises and initialises such a model itself (fsdp, and DeepSpeed at
    #: stage 3: shard by shard); an instance may set its own (it may depend on its options)
    meta_refusal: str | None = NO_META
    #: promises of the contract suite (:mod:`distkit.testing`) that cannot hold as written on
    #: this backend -> why, and what checks the guarantee instead; the suite reports them as
    #: skipped with that reason (default: none)
    contract_exceptions: ClassVar[Mapping[str, str]] = {}
    #: which strategies its messages name ("use strategy='ddp'"): the registry's answers,
    #: given by ``make_strategy`` (the Runtime's and the Trainer's strategies all hold them);
    #: one built and set up by hand names the built-in table's (see :mod:`distkit.launch._choices`)
    choices: StrategyChoices = BUILTIN_CHOICES

    def __new__(cls, *args: Any, **kwargs: Any) -> Strategy:
        """Refuse a parallel layout this backend does not take (``DDPStrategy(
        tensor_parallel=2)``), naming the one that does, before a keyword catch-all passes
        it on to the backend's wrapper, which would fail at set-up, or never."""
        asked = sorted(LAYOUT_OPTIONS.intersection(kwargs))
        if asked:
            taken = inspect.signature(cls.__init__).parameters
            refused = [name for name in asked if name not in taken]
            if refused:
                kind = (
                    "pipeline" if refused[0] not in ("tensor_parallel", "tensor_plan") else "tensor"
                )
                raise UnsupportedFeatureError(
                    f"{cls.__name__}({refused[0]}=...): {cls.__name__} takes no {kind} "
                    "parallelism; distkit splits layers and models over ranks inside "
                    "FSDPStrategy only (on one device mesh with its sharding). Use "
                    f"distkit.FSDPStrategy({refused[0]}=...) under torchrun, or drop the option"
                )
        return super().__new__(cls)

    def __init__(self) -> None:
        self.options = TrainOptions()
        self._topology: Topology | None = None
        self._precision: Precision | None = None

    @override
    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Plugins written against distkit 0.1's hooks: the state hooks still work (with a
        DeprecationWarning naming :attr:`state_io`); a hook that is no longer called is
        refused here, naming what replaced it, rather than silently ignored."""
        super().__init_subclass__(**kwargs)
        for name, replacement in REPLACED.items():
            if name not in vars(cls):
                continue
            where = f"{cls.__module__}.{cls.__qualname__}.{name}"
            if name in STATE_IO_HOOKS:
                warnings.warn(
                    f"{where} overrides a Strategy hook that distkit replaced by {replacement} "
                    "(a StateIO your strategy's state_io property returns; see "
                    "docs/plugins.md); it is still called in this release",
                    DeprecationWarning,
                    stacklevel=2,
                )
            else:
                raise TypeError(
                    f"{where} overrides Strategy.{name}, which distkit no longer calls: use "
                    f"{replacement} instead (see docs/plugins.md)"
                )

    if not TYPE_CHECKING:  # for the type checker, a removed name is an error, not an Any

        def __getattr__(self, name: str) -> Any:
            """The names distkit 0.1 had on every strategy, forwarded with a warning."""
            forward = FORWARDS.get(name)
            if forward is None:
                raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
            warnings.warn(
                f"strategy.{name} is deprecated: use {REPLACED[name]}",
                DeprecationWarning,
                stacklevel=2,
            )
            return functools.partial(forward, self)

    # ------------------------------------------------------------------ the class's facts
    @classmethod
    def launch_command(
        cls, request: LaunchRequest, *, python: str, tools: Mapping[str, str]
    ) -> list[str]:
        """The argv ``distkit run`` starts for ``request`` (default: :attr:`launcher`'s)."""
        return cls.launcher.command(request, python=python, tools=tools)

    @classmethod
    def diagnose(cls, machine: MachineFacts) -> StrategyReport:
        """``distkit doctor``'s verdict: usable here, why not, and the fix.

        Probe what the backend needs without importing it where that can fail or take long
        (the doctor must survive a broken install). Default: :attr:`launcher`'s check.
        """
        return cls.launcher.diagnose(cls.name, machine)

    # ------------------------------------------------------------------ abstract core
    @abstractmethod
    def _setup_environment(self) -> Topology:
        """Initialise the backend (process group, device) and say where this process sits."""

    @abstractmethod
    def _setup_model_and_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Wrap a model that is already on :attr:`device` (and its optimizer) for training."""

    # ------------------------------------------------------------------ lifecycle
    def start(self, options: TrainOptions | None = None) -> None:
        """Take the Trainer's ``options`` (None: keep those it has), then initialise the
        backend once (:meth:`_setup_environment`); later calls with the same options do
        nothing, and different options once started are refused."""
        if options is not None:
            if self._topology is not None and options != self.options:
                raise ConfigurationError(
                    f"strategy {self.name!r} is already set up with {self.options}; it cannot "
                    f"be reconfigured to {options}. Create a new strategy (or Trainer) instead."
                )
            normalize_precision(options.precision)
            self.options = options
        if self._topology is None:
            self._topology = self._setup_environment()
            try:
                self._precision = self._make_precision(self._topology.device)
            except BaseException:
                # a refused precision: release the group (and what else the backend took)
                # now, or it outlives the error and a retry in this process finds it
                self.teardown()
                raise

    def _make_precision(self, device: torch.device) -> Precision:
        """The autocast, loss scaler and scaler state the default hooks use (default: the
        Trainer's precision on ``device``). A backend that casts or scales its own way
        returns a :class:`~distkit.strategies.precision.Precision` that says so (FSDP's bf16
        policy autocasts nothing; legacy apex's scaler state is amp's)."""
        if overrides(type(self), "_precision_name"):  # a plugin of distkit 0.1
            return Precision(self._precision_name(), device)  # type: ignore[attr-defined]
        return Precision(self.options.precision, device)

    def teardown(self) -> None:
        """Release what :meth:`start` acquired (default: nothing)."""
        self._topology = None
        self._precision = None

    def setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Move the model to this rank's device, convert BatchNorm if asked, and wrap both.

        The user's ``model`` keeps its parameter objects, so it holds the trained weights.
        A model the user placed on devices of their own stays there where the strategy keeps
        such models (:attr:`placement_refusal` is None) and is refused otherwise.
        """
        self.start()
        place(
            model,
            self.device,
            self.name,
            self.placement_refusal,
            self.meta_refusal,
            choices=self.choices,
        )
        if self.options.sync_batchnorm:
            model = self.convert_sync_batchnorm(model)
        return self._setup_model_and_optimizer(model, optimizer)

    def compile_model(
        self, model: nn.Module, compiler: Callable[[nn.Module], nn.Module]
    ) -> nn.Module:
        """Compile what :meth:`setup` returned with ``compiler``, in the order this backend needs.

        ``compiler`` is ``torch.compile`` with the user's arguments (or a compiled model's
        own settings). The result runs the training forward passes; every other hook still
        receives the set-up model. Default: compile the set-up model itself (DDP's documented
        order: the DDP wrapper, so its optimizer splits the graph at bucket boundaries).
        """
        return compiler(model)

    def setup_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> torch.optim.Optimizer:
        """Prepare another optimizer for a model :meth:`setup` already wrapped (default: as is)."""
        return optimizer

    @property
    def sets_up_together(self) -> bool:
        """Whether this backend sets every model and optimizer of a loop up in one call
        (:meth:`setup_together`), as legacy apex's ``amp.initialize`` must; a user's loop
        then sets them up at its first forward. Default: False (one at a time)."""
        return False

    def setup_together(
        self, entries: Sequence[tuple[nn.Module, Sequence[torch.optim.Optimizer]]]
    ) -> list[tuple[nn.Module, list[torch.optim.Optimizer]]]:
        """Set several models up at once, each with its optimizers (possibly none): the
        wrapped model and the strategy's optimizers, in the order given.

        Default: each model with :meth:`setup` (its first optimizer) and
        :meth:`setup_optimizer` (the others); a model without optimizers is placed only.
        """
        out: list[tuple[nn.Module, list[torch.optim.Optimizer]]] = []
        for model, optimizers in entries:
            if not optimizers:
                self.start()
                place(model, self.device, self.name, self.placement_refusal, choices=self.choices)
                out.append((model, []))
                continue
            wrapped, first = self.setup(model, optimizers[0])
            rest = [self.setup_optimizer(wrapped, opt) for opt in optimizers[1:]]
            out.append((wrapped, [first, *rest]))
        return out

    def convert_sync_batchnorm(self, model: nn.Module) -> nn.Module:
        """Replace BatchNorm layers with ones that use statistics of the global batch."""
        if self.world_size == 1:
            return model  # one process sees the whole batch: plain BatchNorm is already global
        instead = native_alternative(self.choices)
        raise ConfigurationError(
            f"strategy {self.name!r} does not support sync_batchnorm=True; use "
            f"strategy={instead!r} (under torchrun), or sync_batchnorm=False"
        )

    def agreed_options(self) -> str:
        """The strategy's own options that every rank must hold alike, in words (the fit's
        agreement compares them before the first collective of the set-up; ranks that
        differ fail at once). Default: none beyond :class:`TrainOptions`."""
        return ""

    # ------------------------------------------------------------------ topology
    @property
    def topology(self) -> Topology:
        if self._topology is None:
            raise DistkitError(
                f"strategy {self.name!r} is not set up yet: call start() first "
                "(distkit.Trainer does this when it is created)"
            )
        return self._topology

    @property
    def rank(self) -> int:
        return self.topology.rank

    @property
    def local_rank(self) -> int:
        return self.topology.local_rank

    @override
    @property
    def world_size(self) -> int:
        return self.topology.world_size

    @property
    def device(self) -> torch.device:
        return self.topology.device

    @override
    @property
    def is_main(self) -> bool:
        """Whether this is global rank 0 (the one that logs, prints and saves)."""
        return self.topology.rank == 0

    @property
    def data_rank(self) -> int:
        """Which share of the data this rank loads: its place among the data-parallel ranks
        (default: :attr:`rank`). The ranks of one tensor-parallel group share it: they split
        each layer of one model copy and see the same samples."""
        return self.rank

    @property
    def data_world_size(self) -> int:
        """How many shares the data is cut into: the data-parallel ranks (default:
        :attr:`world_size`; under tensor parallelism, ``world_size / tensor_parallel``).
        Batch sizes are per data-parallel rank, and gradients are the mean over these."""
        return self.world_size

    @property
    def data_ranks(self) -> list[int]:
        """Every rank's :attr:`data_rank`, in rank order (default: ``0 .. world_size - 1``).
        Known from the layout on every rank: no collective."""
        return list(range(self.world_size))

    @property
    def data_groups(self) -> list[list[int]]:
        """The ranks of each data-parallel rank, in order: under tensor parallelism its
        group's (derived from :attr:`data_ranks`: no collective)."""
        groups: list[list[int]] = [[] for _ in range(self.data_world_size)]
        for rank, share in enumerate(self.data_ranks):
            groups[share].append(rank)
        return groups

    @property
    def data_leader(self) -> bool:
        """Whether this rank counts for its data share in sums over the world (default:
        True). The other ranks of a tensor-parallel group compute the same losses, counts and
        outputs as its first: they take part in every collective, contributing nothing to a
        count, so that each sample counts once."""
        return True

    @property
    def precision(self) -> Precision:
        if self._precision is None:
            self.start()
        assert self._precision is not None
        return self._precision

    # ------------------------------------------------------------------ training hooks
    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """Context for the forward pass and loss."""
        return self.precision.autocast()

    def backward(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        """Backpropagate ``loss`` (scaled for fp16)."""
        self.precision.scale(loss).backward()

    def check_step_settings(
        self, *, before_step: bool, clip: GradientClip | None, skip_nonfinite: bool
    ) -> None:
        """Refuse, before anything is set up, step settings this backend cannot honour: a
        callback's ``before_step`` hook, ``clip``, ``nonfinite="skip"`` (a fit calls it on
        every rank with its own settings; :meth:`step` later gets the same). Default: every
        setting is honoured."""

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        clip: GradientClip | None = None,
        skip_nonfinite: bool = False,
        before_step: Callable[[], None] | None = None,
    ) -> tuple[StepOutcome, torch.Tensor | None]:
        """One optimizer step with the step's decisions: what happened, and the gradients'
        total norm before clipping (None without ``clip``). The loop calls only this.

        Default: when clipping or given ``before_step``, :meth:`finalize_gradients`, then
        ``before_step()`` (the callbacks' ``on_before_optimizer_step``: it may read or change
        the final gradients), then :meth:`clip_gradients` when clipping; then
        :meth:`optimizer_step`. A backend whose steps need another order overrides this one
        hook instead of passing flags between those three (Horovod: all-reduce once, then
        ``before_step`` and clip, then step without a second all-reduce); it calls
        ``before_step`` once, on the finalized gradients, before clipping. (The loop passes
        ``before_step`` only when a callback uses it: a plugin's ``step`` without the
        keyword keeps working for every other fit.)
        """
        norm = None
        if clip is not None or before_step is not None:
            # averaged and unscaled first, so that every rank clips (and shows the
            # callbacks) the same gradients, those one process would have
            self.finalize_gradients(optimizer)
            if before_step is not None:
                before_step()
            if clip is not None:
                norm = self.clip_gradients(optimizer, clip)
        # every rank sees the same averaged gradients, so every rank decides alike
        return self.optimizer_step(optimizer, skip_nonfinite=skip_nonfinite), norm

    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, *, skip_nonfinite: bool = False
    ) -> StepOutcome:
        """Finish an optimizer step on the gradients averaged over ranks; say what happened.

        Args:
            optimizer: what :meth:`setup` returned.
            skip_nonfinite: skip the step when the averaged gradients hold NaN/inf. Every rank
                sees the same averaged gradients, so every rank decides alike. With a loss
                scaler (fp16) the scaler decides, and lowers its scale.
        """
        if skip_nonfinite and self.precision.scaler is None and not gradients_finite(optimizer):
            return StepOutcome.SKIPPED_NONFINITE
        return StepOutcome.of(self.precision.step(optimizer))

    def finalize_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        """Bring the gradients the next :meth:`optimizer_step` applies into their final form,
        in place: averaged over ranks and unscaled (fp16).

        Called at most once per step, before :meth:`optimizer_step`, when something must read
        or change them (clipping); :meth:`optimizer_step` then neither averages nor unscales
        again. Default: the loss scaler's ``unscale_`` (gradients were averaged in backward).
        """
        self.precision.unscale_(optimizer)

    def clip_gradients(self, optimizer: torch.optim.Optimizer, clip: GradientClip) -> torch.Tensor:
        """Clip the finalized gradients in place; returns their total 2-norm before clipping.

        The norm is over the whole model (every rank's shard, where the backend shards) and
        the same on every rank; it stays a device tensor (no host synchronisation).
        """
        grads = step_gradients(optimizer)
        return clip_(grads, clip, local_norm(grads, self.device))

    def scale_gradients(
        self, optimizer: torch.optim.Optimizer, factor: float | torch.Tensor
    ) -> None:
        """Multiply the finalized gradients in place by ``factor`` (a number, or a scalar
        device tensor: never read on the host). Token-exact losses divide the step's summed
        gradients by its global item count here, from the step's ``before_step``, so on the
        gradients :meth:`clip_gradients` would see (every rank's shard, where the backend
        shards). Default: every gradient the optimizer applies."""
        scale_(step_gradients(optimizer), factor)

    # ------------------------------------------------------------------ capabilities
    @property
    def elastic(self) -> Elastic | None:
        """How a fit runs while processes join or leave, or None (default: they cannot).

        With one, ``fit`` skips the collectives a joining process could not meet (the ranks'
        agreement, set-up broadcasts) and runs its epochs through :meth:`Elastic.run`.
        """
        return None

    @property
    def state_io(self) -> StateIO:
        """How this backend reads and writes the model's and optimizer's full state, and a
        checkpoint's entries (default: the module's and optimizer's own; FSDP's gathers)."""
        if any(overrides(type(self), name) for name in STATE_IO_HOOKS):
            return LegacyStateIO(self)  # a plugin written against the hooks before it
        return StateIO(self)

    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        """Context in which ``backward`` accumulates locally without communicating."""
        return contextlib.nullcontext()

    def reduce_loss(self, loss: torch.Tensor, batch_size: int) -> torch.Tensor:
        """The scalar loss of one local batch; refuses anything but a scalar by default."""
        if loss.ndim != 0:
            raise ConfigurationError(
                f"the loss must be a scalar tensor (the mean over the batch), got shape "
                f"{tuple(loss.shape)}. Return loss.mean() from loss_fn / step_fn."
            )
        return loss

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside whatever wrapper :meth:`setup` added (default: none)."""
        return model

    @property
    def place(self) -> str | None:
        """Where this rank sits in a parallel layout, for the messages that name it when it
        fails (``"pipeline stage 1 of 2"``); None (default): its rank says it all."""
        return None

    def pipeline_of(self, model: nn.Module) -> Any:
        """The pipeline that trains the set-up ``model`` (its schedule runs each batch's
        forward and backward as one: see ``FSDPStrategy(pipeline_parallel=...)``), or None
        (default): the model's forward is called, then the loss's backward."""
        return None

    def eval_model(self, model: nn.Module) -> nn.Module:
        """What to run evaluation forward passes on (see :meth:`eval_rounds` for collectives)."""
        return self.unwrap(model)

    def eval_rounds(self, batches: int) -> int:
        """How many evaluation forward passes this rank runs, given its own ``batches``.

        Ranks evaluate shards of different sizes. Default: its own batches, for a forward
        pass that communicates nothing. Where the forward pass communicates (FSDP gathers
        parameters), return the most any rank has: the passes beyond its own run on a spare
        sample and count for nothing, so no rank waits for a pass another never runs.
        """
        return batches

    def side_channel(self) -> SideChannel | None:
        """A key-value channel beside the collectives, or None (default: none).

        distkit uses it for failure notices, progress heartbeats and the stacks of stuck
        ranks; it is only touched from the watchdog thread and on failure, never per step.
        """
        return None

    def is_peer_loss(self, exc: BaseException) -> bool:
        """Whether ``exc`` only reports that another rank went away (not this rank's fault)."""
        text = str(exc)
        return isinstance(exc, RuntimeError) and any(
            sign in text for sign in ("Connection reset by peer", "Connection closed by peer")
        )

    @override
    def __repr__(self) -> str:
        where = (
            "not set up"
            if self._topology is None
            else (f"rank={self.rank}/{self.world_size}, device={self.device}")
        )
        return f"{type(self).__name__}({where})"
