"""Horovod: ``DistributedOptimizer`` all-reduces gradients in ``optimizer.step``."""

from __future__ import annotations

import contextlib
import uuid
import weakref
from collections.abc import Callable
from types import ModuleType
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from distkit._imports import require
from distkit.errors import ConfigurationError, LauncherMismatchError, UnsupportedFeatureError
from distkit.faults._channel import SideChannel
from distkit.launch import StrategyChoices, native_alternative
from distkit.launch._env import LaunchEnv
from distkit.launch.diagnosis import MachineFacts, StrategyReport
from distkit.strategies._collectives import PendingSum
from distkit.strategies._steps import GradientClip
from distkit.strategies.base import StepOutcome, Strategy, Topology
from distkit.strategies.capabilities import Elastic
from distkit.strategies.horovod import _doctor as _horovod_doctor
from distkit.strategies.horovod._channel import HorovodKVChannel
from distkit.strategies.horovod._elastic import HorovodElastic
from distkit.strategies.horovod._horovodrun import HOROVODRUN
from distkit.strategies.syncbn import convert_to_global_batchnorm


def _horovod_hint(choices: StrategyChoices) -> str:
    return (
        "PyPI's horovod 0.28.1 does not build against torch >= 2.1 as shipped; build it for "
        "the installed torch with `python -m distkit.horovod_build` (patches, builds, caches "
        f"and checks it), or use strategy={native_alternative(choices)!r}."
    )


COMPRESSIONS = ("none", "fp16")
OPS = ("average", "adasum")


class HorovodStrategy(Strategy):
    """One process per device under ``horovodrun`` (or ``mpirun``); Horovod averages gradients.

    The learning rate is never scaled: N processes with ``batch_size=b`` train like one
    process with ``N * b`` at the same learning rate, as with every other strategy.

    Args:
        compression: ``"none"`` or ``"fp16"`` (gradients travel as fp16).
        op: ``"average"`` (default) or ``"adasum"``.
    """

    name = "horovod"
    comm_phase = "optimizer"  # DistributedOptimizer waits for its all-reduce in step()
    launcher = HOROVODRUN
    auto_select = True
    libraries = ("horovod",)
    placement_refusal = None  # broadcast and all-reduce each tensor where it lives

    @override
    @classmethod
    def diagnose(cls, machine: MachineFacts) -> StrategyReport:
        """The installed Horovod (not imported) and ``horovodrun --check-build``, a few seconds."""
        return _horovod_doctor.verdict(cls.name, machine, _horovod_doctor.probe(machine))

    def __init__(self, *, compression: str = "none", op: str = "average") -> None:
        super().__init__()
        if compression not in COMPRESSIONS:
            raise ConfigurationError(
                f"compression={compression!r}; allowed: {', '.join(COMPRESSIONS)}"
            )
        if op not in OPS:
            raise ConfigurationError(f"op={op!r}; allowed: {', '.join(OPS)}")
        self.compression = compression
        self.op = op
        self._hvd_module: ModuleType | None = None
        self._channel: HorovodKVChannel | None = None
        self._elastic = False  # horovodrun --min-np/--max-np (HOROVOD_ELASTIC=1)
        self._elastic_runner: HorovodElastic | None = None  # set up in an elastic job
        self._models_set_up = 0  # models set up so far (their all-reduces' names differ)
        self._prefixes: dict[int, str] = {}  # a set-up model (by id) -> its names' prefix
        #: parameters a DistributedOptimizer hooks, by id (held weakly: the id of a freed
        #: model's parameter gets reused, and a live one is the same object)
        self._hooked: dict[int, weakref.ref[torch.Tensor]] = {}

    @property
    def _hvd(self) -> Any:
        if self._hvd_module is None:
            raise ConfigurationError("HorovodStrategy is not set up: call setup_environment()")
        return self._hvd_module

    @override
    def _setup_environment(self) -> Topology:
        env = LaunchEnv.detect()
        if env.is_torch_launcher:
            raise LauncherMismatchError(
                f"strategy='horovod' runs under horovodrun (or mpirun), but this process was "
                f"started by {env.launcher}. Either launch with `horovodrun -np N python "
                f"script.py`, or keep torchrun and use strategy={self.choices.auto_name(env)!r}."
            )
        hvd = require(
            "horovod.torch", feature="strategy='horovod'", hint=_horovod_hint(self.choices)
        )
        self._refuse_collective_timeout()
        hvd.init()
        self._elastic = env.elastic
        if env.launcher == "mpirun" and hvd.size() != env.world_size:
            raise LauncherMismatchError(
                f"mpirun started {env.world_size} processes but Horovod sees {hvd.size()}: this "
                f"Horovod was built without MPI (mpi_built()={hvd.mpi_built()}), so each process "
                "would train alone. Launch with `horovodrun -np N --gloo python script.py`, or "
                "keep mpirun and use strategy='ddp', or rebuild Horovod with HOROVOD_WITH_MPI=1."
            )
        self._hvd_module = hvd
        if self._elastic:
            self._elastic_runner = HorovodElastic(hvd, self, on_reset=self._after_reset)
        if not self._elastic:  # elastic: no collective a joining process could not meet
            # one scope per Horovod group in the launcher's key-value server (rank 0's uuid)
            scope = hvd.broadcast_object(uuid.uuid4().hex, root_rank=0, name="distkit.scope")
            self._channel = HorovodKVChannel.from_env(f"distkit-{scope}")
        if torch.cuda.is_available():
            device = torch.device("cuda", hvd.local_rank())
            torch.cuda.set_device(device)
        else:
            device = torch.device("cpu")
        return Topology(hvd.rank(), hvd.local_rank(), hvd.size(), device)

    def _refuse_collective_timeout(self) -> None:
        if self.options.collective_timeout is not None:
            raise UnsupportedFeatureError(
                f"collective_timeout={self.options.collective_timeout:g}: Horovod has no "
                "per-collective timeout. Its stall check (HOROVOD_STALL_CHECK_TIME_SECONDS / "
                "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS) did not stop a stalled allreduce in our "
                "tests (horovod 0.28.1, gloo, with or without the response cache). Drop "
                "collective_timeout; hang_warning still names a stuck rank, and a job time "
                "limit (your scheduler's, or `timeout` around horovodrun) bounds the wait."
            )

    @override
    def side_channel(self) -> SideChannel | None:
        return self._channel

    @override
    def teardown(self) -> None:
        self._channel = None
        # Horovod stays initialised for the next Trainer in this process, whose hvd.init() is
        # then a no-op; Horovod shuts itself down at exit. A fresh hvd.init() after
        # hvd.shutdown() meets in horovodrun's rendezvous server, which in Horovod 0.28.1 as
        # released can still hold the last init's addresses (it loses track of some finished
        # scopes), and then gloo aborts with "Connection refused" (2 in 8 jobs of 20 Trainers
        # here). distkit.horovod_build patches the server; other installs keep the bug.
        self._hvd_module = None
        self._elastic_runner = None
        super().teardown()

    @override
    def _setup_model_and_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        hvd = self._hvd
        if not self._elastic:  # elastic: the elastic run's first sync sends rank 0's weights
            hvd.broadcast_parameters(model.state_dict(), root_rank=0)
        # Horovod matches all-reduces by name: a second model (a GAN's discriminator, whose
        # parameters one backward reaches together with the generator's) gets names of its own
        prefix = f"model{self._models_set_up}." if self._models_set_up else ""
        self._models_set_up += 1
        self._prefixes[id(model)] = prefix
        return model, self._distributed(model, optimizer, prefix)

    def _distributed(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, prefix: str
    ) -> torch.optim.Optimizer:
        """``optimizer`` as a DistributedOptimizer (its parameters named after ``model``'s),
        with resumed state broadcast from rank 0."""
        hvd = self._hvd
        distributed = hvd.DistributedOptimizer(
            optimizer,
            named_parameters=[(prefix + name, p) for name, p in model.named_parameters()],
            compression=hvd.Compression.fp16
            if self.compression == "fp16"
            else hvd.Compression.none,
            backward_passes_per_step=self.options.grad_accum_steps,
            op=hvd.Adasum if self.op == "adasum" else hvd.Average,
        )
        self._hooked.update((id(p), weakref.ref(p)) for p in _params_of(optimizer))
        # Horovod builds a new optimizer over the same param_groups (so LR schedulers bound to
        # the user's optimizer still work); share the state too, so the user's optimizer
        # object holds the trained state afterwards.
        distributed.state = optimizer.state
        _collect_before_zero_grad(distributed)
        # A fresh optimizer has no state to broadcast. Horovod would initialise it with a
        # zero-gradient step, which advances Adam's step count and applies AdamW's weight decay
        # once: the run would then differ from DDP's. Only resumed state is broadcast.
        if self._elastic:
            return distributed
        has_state = self.all_reduce(torch.tensor([float(bool(optimizer.state))]), op="sum")
        if has_state.item() > 0:
            hvd.broadcast_optimizer_state(distributed, root_rank=0)
        return distributed

    # ------------------------------------------------------------------ elastic (horovodrun)
    @override
    @property
    def elastic(self) -> Elastic | None:
        return self._elastic_runner

    def _after_reset(self) -> None:
        """Horovod re-formed the group: this process's rank and the world size changed."""
        hvd, device = self._hvd, self.device
        self._topology = Topology(hvd.rank(), hvd.local_rank(), hvd.size(), device)

    @override
    def setup_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> torch.optim.Optimizer:
        """Another optimizer for a model set up already: a DistributedOptimizer of its own
        over its own parameters (a model trained in parts: ``rt.setup(model, opt_a,
        opt_b)``). Parameters another DistributedOptimizer hooks already are refused: its
        gradient hooks cannot be removed, and two would all-reduce them twice."""
        hooked = self._hooked
        shared = [p for p in _params_of(optimizer) if id(p) in hooked and hooked[id(p)]() is p]
        if shared:
            raise UnsupportedFeatureError(
                f"Horovod's DistributedOptimizer registers gradient hooks on the model's "
                f"parameters that cannot be removed, and {len(shared)} parameter(s) of this "
                f"{type(optimizer).__name__} belong to an optimizer set up before: a "
                "parameter trains with one optimizer per process. Keep the first optimizer "
                "(change its param_groups' lr etc. instead), give each optimizer its own "
                "parameters (rt.setup(model, opt_a, opt_b) over disjoint parts), or start a "
                "new process for the new optimizer."
            )
        return self._distributed(model, optimizer, self._prefixes[id(model)])

    @override
    def backward(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        try:
            super().backward(loss, optimizer)
        except AssertionError as exc:  # raised by DistributedOptimizer's gradient hook
            if "backward_passes_per_step" not in str(exc):
                raise
            raise UnsupportedFeatureError(_more_backwards(self.options.grad_accum_steps)) from None

    @override
    def step(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        clip: GradientClip | None = None,
        skip_nonfinite: bool = False,
        before_step: Callable[[], None] | None = None,
    ) -> tuple[StepOutcome, torch.Tensor | None]:
        plain = clip is None and before_step is None and not skip_nonfinite
        if plain and self.precision.scaler is None:
            return super().optimizer_step(optimizer), None  # DistributedOptimizer.step all-reduces
        # Clipping, the callbacks, the finiteness check and the scaler must see averaged
        # gradients: all-reduce once now (Horovod's documented sequence for clipping and for
        # GradScaler), then step without a second synchronisation.
        optimizer.synchronize()  # type: ignore[attr-defined]
        norm = None
        if clip is not None or before_step is not None:
            self.precision.unscale_(optimizer)
            if before_step is not None:
                before_step()
            if clip is not None:
                norm = self.clip_gradients(optimizer, clip)
        try:
            with optimizer.skip_synchronize():  # type: ignore[attr-defined]
                return super().optimizer_step(optimizer, skip_nonfinite=skip_nonfinite), norm
        finally:
            # a skipped step never reached DistributedOptimizer.step, which clears this flag;
            # left set, the next step would warn and not synchronise
            optimizer._synchronized = False  # type: ignore[attr-defined]

    @override
    def finalize_gradients(self, optimizer: torch.optim.Optimizer) -> None:
        raise UnsupportedFeatureError(
            "HorovodStrategy.finalize_gradients: Horovod averages in its optimizer's step, so "
            "its steps run through strategy.step(optimizer, clip=..., skip_nonfinite=...), "
            "which all-reduces once before clipping; call that instead"
        )

    @override
    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, *, skip_nonfinite: bool = False
    ) -> StepOutcome:
        return self.step(optimizer, skip_nonfinite=skip_nonfinite)[0]

    @override
    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        # backward_passes_per_step = grad_accum_steps already keeps gradients local until
        # the last micro-batch of a step (or until step() on a short last step).
        return contextlib.nullcontext()

    @override
    def convert_sync_batchnorm(self, model: nn.Module) -> nn.Module:
        # GlobalBatchNorm on CUDA too: hvd.SyncBatchNorm cannot leave a placeholder sample out
        # (it takes no empty batch), and it refuses CPU tensors. Horovod's allreduce is
        # differentiable, so GlobalBatchNorm's backward sums the gradients over ranks.
        return convert_to_global_batchnorm(model, self._allreduce_sum_differentiable)

    def _allreduce_sum_differentiable(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._hvd.allreduce(tensor, op=self._hvd.Sum)

    @override
    def is_peer_loss(self, exc: BaseException) -> bool:
        return type(exc).__name__ == "HorovodInternalError" or super().is_peer_loss(exc)

    @override
    def _all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        work = tensor.detach().to(self.device)
        hvd_op = self._hvd.Average if op == "mean" else self._hvd.Sum
        return self._hvd.allreduce(work, op=hvd_op).to(tensor.device)

    @override
    def all_reduce_async(self, tensor: torch.Tensor, *, name: str) -> PendingSum:
        if tensor.device.type != "cpu" or self.world_size == 1:
            return super().all_reduce_async(tensor, name=name)
        # Horovod's background thread sums it (CPU ops, beside the gradients' allreduces)
        handle = self._hvd.allreduce_async(tensor.detach().clone(), op=self._hvd.Sum, name=name)
        return _HorovodPending(self._hvd, handle)

    @override
    def _broadcast(self, obj: Any, src: int) -> Any:
        # every rank must pass the same name, or non-root ranks passing None hang
        return self._hvd.broadcast_object(obj, root_rank=src, name="distkit.broadcast")

    @override
    def _all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        work = tensor.detach().to(self.device).unsqueeze(0)
        return self._hvd.allgather(work).to(tensor.device)

    @override
    def _all_gather_object(self, obj: Any) -> list[Any]:
        return list(self._hvd.allgather_object(obj, name="distkit.allgather_object"))

    @override
    def barrier(self) -> None:
        self._hvd.barrier()


class _HorovodPending:
    """A Horovod ``allreduce_async`` handle; :meth:`wait` synchronises it."""

    def __init__(self, hvd: Any, handle: Any) -> None:
        self._hvd, self._handle = hvd, handle

    def wait(self) -> torch.Tensor:
        result: torch.Tensor = self._hvd.synchronize(self._handle)
        return result

    def done(self) -> bool:
        return bool(self._hvd.poll(self._handle))


def _collect_before_zero_grad(optimizer: Any) -> None:
    """Let ``optimizer.zero_grad()`` follow a backward that no step of it follows.

    A backward starts Horovod's all-reduces of every parameter it reaches; a GAN's generator
    loss reaches the discriminator's parameters, whose optimizer only clears them before its
    next step. Horovod refuses ``zero_grad()`` while those all-reduces are in flight (a race
    with the background thread). Every rank ran the same backward, so collecting them
    (``synchronize()``) meets on every rank; the gradients are then cleared, and the next
    step synchronises its own. Reads Horovod 0.28's ``_handles`` (the in-flight all-reduces)
    and resets ``_synchronized``, as ``step()`` does, since nothing of it is stepped.
    """
    clear = optimizer.zero_grad

    def zero_grad(*args: Any, **kwargs: Any) -> Any:
        if getattr(optimizer, "_handles", None):
            optimizer.synchronize()
            optimizer._synchronized = False
        return clear(*args, **kwargs)

    optimizer.zero_grad = zero_grad


def _params_of(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p for group in optimizer.param_groups for p in group["params"]]


def _more_backwards(accum: int) -> str:
    return (
        "Horovod's DistributedOptimizer all-reduces each gradient after exactly "
        f"backward_passes_per_step backward passes between optimizer steps (distkit sets it "
        f"to grad_accum_steps={accum}: one rt.backward per batch), and this loop ran more "
        "rt.backward calls that reach the same parameters before the step: the extra "
        "gradients cannot be averaged, so it stops here rather than train on a partial "
        "average. Give each batch one rt.backward per optimizer (add the losses: "
        "rt.backward(loss_a + loss_b) gives the same gradients), or use strategy='ddp' "
        "(or 'fsdp'), which averages any number of backward passes per batch exactly"
    )
