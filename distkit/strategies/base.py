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

1. **Start** (``Trainer(...)``): :meth:`connect` (the Trainer's options), then
   :meth:`setup_environment`: the launcher's variables are read and the process group joined
   (*collective* where a group forms: ddp, fsdp, apex; ``hvd.init()`` for horovod), which
   fixes :attr:`topology` (rank, world size, device).
2. **Set-up**, once per model and optimizer: :meth:`setup` (the model onto this rank's
   device, :meth:`convert_sync_batchnorm` when asked, then the backend's wrapping:
   *collective* on ddp and apex (the wrapper broadcasts rank 0's weights), on fsdp (rank
   0's weights broadcast, then ``fully_shard``) and on horovod (``broadcast_parameters``);
   dp wraps locally), then
   :meth:`compile_model` when ``compile=`` is given, and :meth:`setup_optimizer` for a
   further optimizer on a set-up model. A resume loads the checkpoint afterwards, through
   :meth:`load_model_state_dict`, :meth:`load_optimizer_state_dict` and
   :meth:`load_state_dict` (the scaler).
3. **Each step**, per micro-batch: :meth:`no_sync` around every micro-batch but the step's
   last, :meth:`autocast` around the forward pass and the loss, :meth:`reduce_loss`, then
   :meth:`backward` (*collective* on the last micro-batch: ddp and apex all-reduce in their
   hooks, fsdp reduce-scatters, horovod starts its asynchronous all-reduces); then once per
   step, :meth:`step` with the step's decisions (clip, skip non-finite): by default, only
   when clipping, :meth:`finalize_gradients` (fp16: unscales) and :meth:`clip_gradients`
   (fsdp: *collective*, the norm sums every rank's slice), then :meth:`optimizer_step`;
   horovod's :meth:`step` is *collective* (it waits for its all-reduces, once, before
   clipping or in its optimizer's step); then, on an elastic backend, :meth:`commit`.
4. **Evaluation**: :meth:`eval_model` gives the module to run, :meth:`eval_rounds` how many
   forward passes every rank makes (a backend with collectives in its forward needs the same
   number on every rank); the sums are combined with :meth:`all_reduce` (*collective*).
5. **Checkpoints**: :meth:`checkpoint_state` (fsdp: *collective*, a gather to rank 0, or
   every rank writing its shards) and :meth:`state_dict` (the scaler, in ``GradScaler`` form
   whatever the backend).
6. **The fit as a whole** runs inside :meth:`run_training` (horovod elastic: its retry loop
   and the syncs after a group change, *collective*).
7. **End** (``trainer.close()``): :meth:`teardown` leaves the process group (when this
   strategy formed it) and undoes what the backend changed outside the model.

The collectives of :class:`~distkit.strategies._collectives.Collectives` (``all_reduce``,
``broadcast``, ``all_gather``, ``all_gather_object``, ``barrier``) are collective on every
backend.
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from torch import nn
from typing_extensions import override

from distkit.diagnosis import MachineFacts, StrategyReport
from distkit.errors import ConfigurationError, DistkitError
from distkit.faults import _channel
from distkit.faults._channel import SideChannel
from distkit.launch import LaunchRequest
from distkit.launch._env import LaunchEnv
from distkit.launch._registry_view import auto_strategy_name
from distkit.launchers import TORCH_LAUNCHERS, LauncherFamily
from distkit.strategies._collectives import Collectives
from distkit.strategies._placement import place
from distkit.strategies._steps import (
    GradientClip,
    StepOutcome,
    clip_,
    gradients_finite,
    local_norm,
    step_gradients,
)
from distkit.strategies.precision import Precision, normalize_precision


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

    def __init__(self) -> None:
        self.options = TrainOptions()
        self._topology: Topology | None = None
        self._precision: Precision | None = None

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
    def connect(self, options: TrainOptions) -> None:
        """Receive the trainer's options; call before :meth:`setup_environment`."""
        if self._topology is not None and options != self.options:
            raise ConfigurationError(
                f"strategy {self.name!r} is already set up with {self.options}; it cannot be "
                f"reconfigured to {options}. Create a new strategy (or Trainer) instead."
            )
        normalize_precision(options.precision)
        self.options = options

    def setup_environment(self) -> None:
        """Initialise the backend once; later calls do nothing."""
        if self._topology is None:
            self._topology = self._setup_environment()
            self._precision = Precision(self._precision_name(), self._topology.device)

    def _precision_name(self) -> str:
        """The precision the default autocast/GradScaler hooks run in (default: the trainer's)."""
        return self.options.precision

    def teardown(self) -> None:
        """Release what :meth:`setup_environment` acquired (default: nothing)."""
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
        self.setup_environment()
        place(model, self.device, self.name, self.placement_refusal)
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

    def convert_sync_batchnorm(self, model: nn.Module) -> nn.Module:
        """Replace BatchNorm layers with ones that use statistics of the global batch."""
        if self.world_size == 1:
            return model  # one process sees the whole batch: plain BatchNorm is already global
        instead = auto_strategy_name(LaunchEnv(launcher="torchrun"))
        raise ConfigurationError(
            f"strategy {self.name!r} does not support sync_batchnorm=True; use "
            f"strategy={instead!r} (under torchrun), or sync_batchnorm=False"
        )

    # ------------------------------------------------------------------ topology
    @property
    def topology(self) -> Topology:
        if self._topology is None:
            raise DistkitError(
                f"strategy {self.name!r} is not set up yet: call setup_environment() first "
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
    def precision(self) -> Precision:
        if self._precision is None:
            self.setup_environment()
        assert self._precision is not None
        return self._precision

    # ------------------------------------------------------------------ training hooks
    def autocast(self) -> contextlib.AbstractContextManager[None]:
        """Context for the forward pass and loss."""
        return self.precision.autocast()

    def backward(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        """Backpropagate ``loss`` (scaled for fp16)."""
        self.precision.scale(loss).backward()

    def step(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        clip: GradientClip | None = None,
        skip_nonfinite: bool = False,
    ) -> tuple[StepOutcome, torch.Tensor | None]:
        """One optimizer step with the step's decisions: what happened, and the gradients'
        total norm before clipping (None without ``clip``). The loop calls only this.

        Default: :meth:`finalize_gradients` and :meth:`clip_gradients` when clipping, then
        :meth:`optimizer_step`. A backend whose steps need another order overrides this one
        hook instead of passing flags between those three (Horovod: all-reduce once, then
        clip, then step without a second all-reduce).
        """
        norm = None
        if clip is not None:
            # averaged and unscaled first, so that every rank clips the same gradients,
            # those one process would have
            self.finalize_gradients(optimizer)
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

    # ------------------------------------------------------------------ elastic hooks
    @property
    def elastic(self) -> bool:
        """Whether processes may join or leave a running fit (default: no).

        Then ``fit`` skips the collectives a joining process could not meet (the ranks'
        agreement, set-up broadcasts), and :meth:`run_training` synchronises the state.
        """
        return False

    def run_training(self, body: Callable[[], None], snapshot: Any) -> None:
        """Run ``body`` (a fit's epochs) once (default).

        An elastic backend runs it again whenever its group changed, after restoring the
        last committed ``snapshot`` (a :class:`distkit.runtime._snapshot.RunSnapshot`: ``save()``,
        ``restore()``, ``sync(strategy)``) and sending rank 0's to every rank.
        """
        body()

    def commit(self) -> None:
        """A point where an elastic backend saves the run and may take in a changed group
        (every ``checkpoint_every`` steps, or each epoch's end). Default: nothing."""

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

    def announce_failure(self, message: str) -> bool:
        """Tell the other ranks this one failed; True if no other rank had announced first."""
        return _channel.announce_failure(self.side_channel(), message)

    def peer_failure(self) -> str | None:
        """The first failure notice any rank left, if any (polled by the watchdog during fit)."""
        return _channel.peer_failure(self.side_channel())

    def is_peer_loss(self, exc: BaseException) -> bool:
        """Whether ``exc`` only reports that another rank went away (not this rank's fault)."""
        text = str(exc)
        return isinstance(exc, RuntimeError) and any(
            sign in text for sign in ("Connection reset by peer", "Connection closed by peer")
        )

    # ------------------------------------------------------------------ model and optimizer state
    def model_state_dict(
        self, model: nn.Module, *, rank0_only: bool = False
    ) -> dict[str, torch.Tensor]:
        """The full (unsharded) state of the user's ``model`` as CPU tensors, its own keys.

        A collective where the strategy shards the model: call it on every rank. With
        ``rank0_only`` the other ranks may get ``{}`` (they need not hold a copy).
        """
        if rank0_only and not self.is_main:
            return {}
        return {
            key: value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value
            for key, value in model.state_dict().items()
        }

    def optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, *, rank0_only: bool = False
    ) -> dict[str, Any]:
        """The optimizer's full state in torch's own form (keyed by parameter order).

        A collective where the strategy shards it; ``rank0_only`` as in :meth:`model_state_dict`.
        """
        if rank0_only and not self.is_main:
            return {}
        return optimizer.state_dict()

    def load_model_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None:
        """Load a full state (as :meth:`model_state_dict` returns) into the user's ``model``,
        set up or not. Every rank holds ``state``; no collective."""
        model.load_state_dict(state)

    def load_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """Load a full optimizer state (torch's form) into the user's ``optimizer``."""
        optimizer.load_state_dict(state)

    def checkpoint_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, path: Path
    ) -> dict[str, Any]:
        """The ``model`` and ``optimizer`` entries of the checkpoint about to go to ``path``.

        Called on every rank; rank 0's result is written, the others may return ``{}``.
        Default: :meth:`model_state_dict` (reduced-precision floats as fp32) and
        :meth:`optimizer_state_dict`, on rank 0.
        """
        model_state = self.model_state_dict(model, rank0_only=True)
        optimizer_state = self.optimizer_state_dict(optimizer, rank0_only=True)
        if not self.is_main:
            return {}
        return {"model": _fp32(model_state), "optimizer": optimizer_state}

    def state_dict(self) -> dict[str, Any]:
        """Backend state to checkpoint beside the model (default: the precision's scaler).

        The loss scaler goes under ``"scaler"`` in torch ``GradScaler.state_dict()`` form, the
        checkpoint's neutral form: a backend with a scaler of its own converts it here.
        """
        return {"scaler": self.precision.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned (or any strategy's, in the neutral form)."""
        self.precision.load_state_dict(state.get("scaler", {}))

    @override
    def __repr__(self) -> str:
        where = (
            "not set up"
            if self._topology is None
            else (f"rank={self.rank}/{self.world_size}, device={self.device}")
        )
        return f"{type(self).__name__}({where})"


def _fp32(state: dict[str, Any]) -> dict[str, Any]:
    half = (torch.float16, torch.bfloat16)
    return {
        key: value.float() if isinstance(value, torch.Tensor) and value.dtype in half else value
        for key, value in state.items()
    }
