"""The trainer every strategy shares. It talks to strategy hooks only."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from typing_extensions import override

from distkit import checkpoint as ckpt
from distkit.callbacks import Callback
from distkit.callbacks._list import CallbackList
from distkit.errors import ConfigurationError, TrainerClosedError
from distkit.faults._preempt import Preemption, finish
from distkit.loggers import Logger
from distkit.runtime import (
    DEFAULT_MAX_SHARD_SIZE,
    ActivationCheckpointing,
    LossFn,
    Metrics,
    PredictFn,
    Profiler,
    Proposal,
    Runtime,
    RuntimeOptions,
    compile_plan,
    exchange,
    guarded,
    require_open,
    save_weights,
)
from distkit.strategies._placement import check_claims
from distkit.strategies._steps import GradientClip
from distkit.strategies.base import Strategy
from distkit.trainer import _checkpoint_save, _resume
from distkit.trainer._config import Setting, TrainerConfig
from distkit.trainer._epoch_loop import StopRequest
from distkit.trainer._fit import train
from distkit.trainer._fit_call import FitCall
from distkit.trainer._logging import LogSink, checked_loggers
from distkit.trainer._prepare import FitPlan, prepare_fit
from distkit.trainer._resume import LatestFit
from distkit.trainer._step_loop import StepFn


@dataclass
class FitResult:
    """What :meth:`Trainer.fit` returns.

    Attributes:
        history: one dict per epoch, ``{"epoch", "train_loss", "skipped_steps", "val_loss",
            "val_<metric>"...}`` with the timing (``time_*``, ``samples_per_s``) and peak
            memory (``peak_mem_mib``, ``peak_mem_rank``, ``peak_mem_min_mib``; on CUDA
            ``peak_reserved_mib``) entries of the Performance page, identical on every rank.
        validations: one dict per validation, ``{"step", "epoch", "val_loss",
            "val_<metric>"...}`` (every ``val_every_n_steps`` steps and at each epoch's end).
        stopped_early: ``should_stop`` (e.g. :class:`~distkit.callbacks.EarlyStopping`)
            ended training before ``max_epochs`` / ``max_steps``.
    """

    history: list[dict[str, float]] = field(default_factory=list)
    validations: list[dict[str, float]] = field(default_factory=list)
    stopped_early: bool = False


#: Trainer(...)'s arguments that are not settings (objects, or the strategy to resolve)
_NOT_SETTINGS = frozenset({"self", "strategy", "callbacks", "loggers", "runtime"})


def _folder_of(
    folder: str | os.PathLike[str] | None, keep_last: int, options: dict[str, Any] | None
) -> ckpt.CheckpointFolder | None:
    """``checkpoint_dir``'s folder (a local one, or on a store for a URL; None: none)."""
    return None if folder is None else ckpt.checkpoint_folder(folder, keep_last, options)


class Trainer:
    """Train and evaluate a model with any data-parallel strategy.

    Args:
        strategy: ``"auto"``, a registered name (:func:`distkit.available_strategies` lists
            them, plugins included) or a :class:`~distkit.Strategy` instance. ``"auto"`` follows the
            launcher.
        max_epochs: epochs :meth:`fit` trains (in total, counting resumed ones).
        batch_size: samples per process per micro-batch (a DataLoader's own batch size wins).
            N processes with ``batch_size=b`` train like one process with ``N * b``.
        precision: ``"32"``, ``"bf16"`` or ``"fp16"`` (autocast; fp16 adds a GradScaler).
        grad_accum_steps: micro-batches per optimizer step; gradients are synchronised only
            on the last one.
        seed: the data order is seeded with ``seed + epoch`` (same on every rank); each rank's
            torch/numpy/random generators with ``seed + rank`` (augmentation, dropout).
        shuffle: shuffle the training data each epoch (for a Dataset; a DataLoader says itself).
        sync_batchnorm: BatchNorm statistics over the global batch (works on CPU too).
        find_unused_parameters: for models whose forward skips some parameters (DDP).
        num_workers: DataLoader worker processes per rank (for a Dataset).
        progress: a progress bar (on a terminal) and an epoch summary line, on rank 0 only.
        drop_last: drop a last global batch smaller than ``world_size * batch_size``.
        scheduler_interval: step the LR scheduler every ``"epoch"`` or every optimizer ``"step"``.
        max_steps: stop after this many optimizer steps in total (``None``: no limit). A
            stop on an epoch's last step still ends that epoch (its validation, history
            record, ``on_epoch_end`` and checkpoint); with data left in the epoch it does
            not (a stream's end is not known in advance: a stream's epoch is left open).
        checkpoint_dir: save checkpoints here (a folder every rank can read), or on an object
            store: an fsspec URL such as ``"s3://bucket/run1"`` (``pip install
            'distkit[s3]'``, ``'distkit[gcs]'`` for ``gs://``; see ``docs/checkpoints.md``).
        checkpoint_every: ``"epoch"``, or a number of optimizer steps.
        checkpoint_async: True: a checkpoint is staged (copied off the training tensors)
            and training goes on while rank 0 persists it in the background; the next save,
            and the fit's end, wait for it (the fit's end logs the time waited as
            ``checkpoint_wait_s``). A checkpoint counts (``resume="auto"``, ``keep_last``)
            only once it is complete. False (default): every rank waits for the write.
        keep_last: checkpoints to keep in ``checkpoint_dir``.
        resume: ``"auto"`` (latest checkpoint in ``checkpoint_dir`` if any), a path, or None.
        nonfinite: a NaN/inf loss ``"raise"``s (naming step and rank) or, with ``"skip"``, the
            step is skipped on every rank; either way skips are counted in the history.
        fault_timeout: seconds within which every rank stops after one fails: the failing
            rank re-raises its error after telling its peers, which raise
            :class:`~distkit.PeerFailureError`; a rank still stuck after this long exits
            (None: no watchdog exit; errors still propagate).
        hang_warning: seconds without progress after which rank 0 names a rank that holds the
            others up (its step, phase and stack); a warning only (None: off).
        collective_timeout: seconds a collective may wait for the other ranks before it fails
            (the hard bound for a hung rank); None: the backend's default (30 minutes for
            torch.distributed), or the strategy instance's own ``timeout``. Horovod has no
            collective timeout and refuses it.
        gradient_clip_norm: clip the gradients to this total 2-norm before each optimizer
            step: the averaged, unscaled gradients of the whole model (after Horovod's
            synchronize, the GradScaler's unscale, on apex's master parameters; over every
            shard with fsdp). The norm before clipping is in the step logs (``grad_norm``).
        gradient_clip_value: clamp every gradient element into ``[-value, value]`` (after
            norm clipping, when both are given).
        callbacks: :class:`~distkit.Callback` instances, called on every rank (the same
            kinds, in the same order, on every rank).
        loggers: :class:`~distkit.loggers.Logger` instances; only rank 0 writes.
        log_every_n_steps: how often the step values (training loss over every rank, lr,
            gradient norm) are gathered and sent to the loggers; nothing is synchronised
            between these points.
        val_every_n_steps: validate every this many optimizer steps as well as at the end of
            each epoch (None: only at the end of each epoch).
        compile: ``torch.compile`` the model in the order the strategy needs (after DDP's
            wrapper, after fsdp's sharding); True, or a dict of ``torch.compile`` arguments;
            ``"blocks"`` compiles each repeated block (a transformer's layers) in place
            instead, with ``{"blocks": True, ...}`` for arguments.
        input_device: where each batch's inputs go for a model you placed on devices of
            your own (ddp and horovod keep it there; see the DDP page); None: the device of
            its first parameter. A model distkit places itself (one built on the CPU) takes
            its inputs on this rank's device and refuses this argument.
        cudnn_benchmark: on CUDA, set ``torch.backends.cudnn.benchmark = True`` (cuDNN times
            its convolution algorithms for each new input shape and keeps the fastest: faster
            for fixed shapes, slower while shapes vary, and not bitwise reproducible). False
            (the default) leaves ``torch.backends.cudnn`` as you set it.
        deterministic: True: ``torch.use_deterministic_algorithms(True)`` (an operation
            without a deterministic implementation raises), ``cudnn.deterministic = True``,
            ``cudnn.benchmark = False`` and ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` where unset,
            from the Runtime's start (before any CUDA work) until it closes, then put back
            as they were; ``"warn"``: the same, but such an operation warns. Refuses
            ``cudnn_benchmark=True``. See the Determinism section of the docs.
        activation_checkpointing: module classes (``[Block]``) or a predicate
            ``fn(module) -> bool``: each matching module keeps no activations for backward
            and recomputes them there (torch's non-reentrant checkpointing, applied before
            the strategy wraps the model; the weights are those without it). None: off.
        runtime: a :class:`~distkit.Runtime` to train on (its strategy, process group and
            set-up models), kept open when this Trainer closes: a sweep of fits in one
            process joins the group once. Its strategy and the settings it started with are the
            Trainer's (``strategy``, and each of :attr:`RuntimeOptions.STARTED_WITH
            <distkit.RuntimeOptions.STARTED_WITH>`: ``precision``, ``grad_accum_steps``,
            ``sync_batchnorm``, ``find_unused_parameters``, ``collective_timeout``,
            ``activation_checkpointing`` and ``deterministic``, may be left out, or must equal
            the runtime's); ``seed``, ``fault_timeout`` and ``hang_warning`` are this
            Trainer's fits' own.
        preempt_signals: the signals that preempt a fit: every rank finishes its optimizer
            step, the ranks agree on the step they all stop after (the signal may reach some
            of them only, at different steps), the run is saved in ``checkpoint_dir`` there,
            the signal's previous handler (yours) runs, and ``fit`` raises
            :class:`~distkit.errors.TrainingPreempted`, which exits with status 128 + the
            signal's number (143 for SIGTERM, 138 for SIGUSR1). None (default): SIGTERM and
            SIGUSR1 whenever ``checkpoint_dir`` is set; ``()``: off (SIGTERM stops the job at
            once, as without a ``checkpoint_dir``). Signals need a ``checkpoint_dir``.
        requeue: after a preemption's checkpoint, rank 0 asks SLURM to requeue the job
            (``scontrol requeue $SLURM_JOB_ID``; submit it with ``sbatch --requeue``); the next
            start resumes with ``resume="auto"``. Outside SLURM it says so and does nothing.
        profiler: ``torch.profiler`` over a window of optimizer steps, with ``distkit/data``,
            ``distkit/forward``, ``distkit/backward``, ``distkit/optimizer`` and
            ``distkit/allreduce_probe`` ranges: True (or ``"pytorch"``) for the defaults, or
            a :class:`~distkit.Profiler` (folder, window, ranks, shapes, memory, stacks).
            Each chosen rank writes a Chrome trace per cycle,
            ``<dir>/rank<r>/rank<r>.<step>.pt.trace.json`` (TensorBoard's profiler plugin reads
            them too). None (default): off, at no cost.
        storage_options: for a ``checkpoint_dir``, ``resume`` or weights path that is an
            fsspec URL: the filesystem's options (credentials, endpoint), as
            :class:`~distkit.Runtime` takes them (None: the store's standard configuration).

    ``trainer.config`` holds every setting but the strategy, the callbacks and the loggers as
    one frozen, validated value (the Runtime's settings among them as one
    :class:`~distkit.RuntimeOptions`, ``trainer.config.runtime_options``, which the Trainer's
    Runtime starts from); ``trainer.max_epochs = 5`` (and the like) replaces it, validated as
    ``Trainer(...)`` validates its arguments. A setting the strategy started with
    (``trainer.grad_accum_steps``) cannot change: create a new Trainer. A fit reads it once, when it
    starts (every rank agrees on those values): a setting changed during a fit applies from
    the next one.
    """

    # settings, read from (and written through) self.config
    max_epochs: Setting[int] = Setting()
    batch_size: Setting[int] = Setting()
    seed: Setting[int] = Setting()
    shuffle: Setting[bool] = Setting()
    num_workers: Setting[int] = Setting()
    progress: Setting[bool] = Setting()
    drop_last: Setting[bool] = Setting()
    scheduler_interval: Setting[str] = Setting()
    grad_accum_steps: Setting[int] = Setting()
    max_steps: Setting[int | None] = Setting()
    nonfinite: Setting[str] = Setting()
    checkpoint_every: Setting[int | str] = Setting()
    resume: Setting[str | os.PathLike[str] | None] = Setting()
    fault_timeout: Setting[float | None] = Setting()
    hang_warning: Setting[float | None] = Setting()
    log_every_n_steps: Setting[int] = Setting()
    val_every_n_steps: Setting[int | None] = Setting()
    preempt_signals: Setting[Any] = Setting()
    requeue: Setting[bool] = Setting()

    def __init__(
        self,
        strategy: str | Strategy = "auto",
        *,
        max_epochs: int = 1,
        batch_size: int = 32,
        precision: str = "32",
        grad_accum_steps: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        sync_batchnorm: bool = False,
        find_unused_parameters: bool = False,
        num_workers: int = 0,
        progress: bool = True,
        drop_last: bool = False,
        scheduler_interval: str = "epoch",
        max_steps: int | None = None,
        checkpoint_dir: str | os.PathLike[str] | None = None,
        checkpoint_every: int | str = "epoch",
        checkpoint_async: bool = False,
        keep_last: int = 3,
        resume: str | os.PathLike[str] | None = None,
        nonfinite: str = "raise",
        fault_timeout: float | None = 10.0,
        hang_warning: float | None = 300.0,
        collective_timeout: float | None = None,
        gradient_clip_norm: float | None = None,
        gradient_clip_value: float | None = None,
        callbacks: list[Callback] | None = None,
        loggers: list[Logger] | None = None,
        log_every_n_steps: int = 50,
        val_every_n_steps: int | None = None,
        compile: bool | Literal["blocks"] | dict[str, Any] = False,
        input_device: str | int | torch.device | None = None,
        cudnn_benchmark: bool = False,
        deterministic: bool | str = False,
        activation_checkpointing: ActivationCheckpointing = None,
        runtime: Runtime | None = None,
        preempt_signals: Any = None,
        requeue: bool = False,
        profiler: bool | str | Profiler | None = None,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        #: every setting above but strategy, callbacks and loggers: one frozen, validated
        #: value (assigning ``trainer.max_epochs`` etc. replaces it, validated again)
        self.config = TrainerConfig.of(
            {k: v for k, v in locals().items() if k not in _NOT_SETTINGS}
        )
        self.callbacks = CallbackList(callbacks)
        self.loggers = checked_loggers(loggers)  # rank 0 writes
        self._stop = StopRequest()
        self._sink: LogSink | None = None  # the current fit's (None outside fit)
        self.checkpoints = _folder_of(checkpoint_dir, keep_last, storage_options)
        #: the strategy, started, and what lives as long as it does (models set up once, ...)
        self.runtime: Runtime
        self._owns_runtime = runtime is None
        if runtime is None:
            self.runtime = Runtime(strategy, **self.config.runtime_options.keywords())
        else:
            self.runtime = _checked_runtime(runtime, strategy, self.config.runtime_options)
            # what the runtime started with is the Trainer's: the config says it as it is
            held = runtime.options
            started = {name: getattr(held, name) for name in held.STARTED_WITH}
            self.config = self.config.replace(**started)
        self._closed = False
        self.strategy = self.runtime.strategy
        self._run: LatestFit | None = None
        self._pending: _resume.LoadedCheckpoint | None = (
            None  # a loaded checkpoint for the next fit
        )
        if self.config.profiling is not None:  # a rank out of range fails here, not in fit
            try:
                self.config.profiling.check_world(self.world_size)
            except ConfigurationError:
                self.close()
                raise
        if cudnn_benchmark and self.strategy.device.type == "cuda":
            torch.backends.cudnn.benchmark = True

    # ------------------------------------------------------------------ topology
    @property
    def rank(self) -> int:
        return self.runtime.rank

    @property
    def world_size(self) -> int:
        return self.runtime.world_size

    @property
    def data_rank(self) -> int:
        """This process's share of the data (:attr:`rank`, but under tensor parallelism the
        share of its tensor-parallel group): see ``Runtime.data_rank``."""
        return self.runtime.data_rank

    @property
    def data_world_size(self) -> int:
        """How many shares the data is cut into; ``batch_size`` is per share (the global
        batch is ``data_world_size * batch_size``)."""
        return self.runtime.data_world_size

    @property
    def is_main(self) -> bool:
        return self.runtime.is_main

    @property
    def device(self) -> torch.device:
        return self.runtime.device

    # ------------------------------------------------------------------ derived settings
    @property
    def compile(self) -> dict[str, Any] | None:
        """``compile=`` as ``torch.compile``'s arguments (None: off)."""
        return self.config.compile_options

    @property
    def input_device(self) -> torch.device | None:
        """``input_device=`` as a device (None: the model's own)."""
        return self.config.input_device_override

    @property
    def gradient_clip(self) -> GradientClip | None:
        """The clipping ``gradient_clip_norm`` / ``gradient_clip_value`` ask for (None)."""
        return self.config.clip

    @property
    def should_stop(self) -> bool:
        """Set it to True (from a callback, on any rank) to stop every rank after this step."""
        return self._stop.requested

    @should_stop.setter
    def should_stop(self, value: bool) -> None:
        self._stop.requested = value

    @property
    def global_step(self) -> int:
        """Optimizer steps taken by the latest ``fit`` (resumed ones included)."""
        return 0 if self._run is None else self._run.state.global_step

    @property
    def epoch(self) -> int:
        """The epoch in progress (0-based), or the next one between epochs."""
        return 0 if self._run is None else self._run.state.epoch

    @property
    def model(self) -> nn.Module | None:
        """The latest ``fit``'s model, as the user passed it (unwrapped), or None."""
        return None if self._run is None else self._run.model

    @property
    def optimizer(self) -> torch.optim.Optimizer | None:
        """The latest ``fit``'s optimizer, as the user passed it, or None."""
        return None if self._run is None else self._run.optimizer

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        """Send ``metrics`` to the loggers, in the row of ``step`` (default: the current one).

        Call it from a callback during ``fit``, on any rank: only rank 0's values are written
        (so log values that are the same on every rank, or rank 0's own). Tensor values are
        read (a host synchronisation). Outside ``fit`` it does nothing.
        """
        if not isinstance(metrics, dict):
            raise ConfigurationError(
                f"log_metrics takes a dict of name -> number, got {type(metrics).__name__}"
            )
        if self._sink is not None:
            self._sink.log(metrics, self.global_step if step is None else step)

    @property
    def closed(self) -> bool:
        """Whether the trainer was closed (``close()``, or a failed multi-process ``fit``).

        A closed trainer cannot fit, evaluate or save: create a new one.
        """
        return self._closed or self.runtime.closed

    def close(self) -> None:
        """Tear the strategy down (and the process group distkit created, once no other
        Trainer or Runtime of the process uses it: see ``Runtime.close``); a Runtime you
        gave (``Trainer(runtime=rt)``) stays open for your next Trainer. Idempotent."""
        self._closed = True
        if self._owns_runtime:
            self.runtime.close()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ fit
    def fit(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_data: Any,
        loss_fn: LossFn | None = None,
        val_data: Any = None,
        metrics: Metrics | None = None,
        scheduler: Any = None,
        step_fn: StepFn | None = None,
        eval_step_fn: StepFn | None = None,
    ) -> FitResult:
        """Train ``model`` in place up to ``max_epochs``; returns the per-epoch history.

        Args:
            model: the user's module; it holds the trained weights afterwards.
            optimizer: an optimizer over ``model``'s parameters.
            train_data: a map-style Dataset or a DataLoader yielding ``(inputs, target)``.
            loss_fn: ``loss_fn(model(inputs), target)`` -> batch-mean loss.
            val_data: evaluated after every epoch (every sample exactly once).
            metrics: :class:`~distkit.metrics.Metric` objects, by name or in a list.
            scheduler: an LR scheduler, stepped per ``scheduler_interval``.
            step_fn: ``step_fn(model, batch)`` -> loss, for batches of any other layout
                (dicts): the batch-mean loss, a :class:`~distkit.Loss` ``(total, count)``
                for a token-exact loss (N processes then train exactly like one on any
                padding), or the model's output with ``.loss`` / ``["loss"]``. Without a
                ``loss_fn`` it also runs validation (under ``torch.no_grad``).
            eval_step_fn: validation's step function, where it differs from ``step_fn``
                (see :meth:`evaluate`'s ``step_fn``).
        """
        self._require_open("fit")
        if self._sink is not None:  # only a fit's own callbacks run while it does
            raise ConfigurationError(
                "fit() called while this trainer's fit is running (from a callback?): a fit "
                "cannot start inside another. Train a second model with a Trainer of its "
                "own after this fit returns, or call trainer.evaluate(...) from the callback"
            )
        self.should_stop = False
        sink = self._sink = LogSink(self.loggers, is_main=self.is_main)
        # a model the user compiled: train its module, compiled in the backend's order
        model, compiler = compile_plan(model, self.compile)
        call = FitCall(
            model,
            optimizer,
            train_data,
            loss_fn,
            val_data,
            metrics,
            scheduler,
            step_fn,
            compiler,
            eval_step_fn=eval_step_fn,
        )
        try:
            result = self._fit(call)
        except BaseException as exc:
            self.callbacks.call_on_exception(self, exc)
            sink.finalize("interrupted" if isinstance(exc, KeyboardInterrupt) else "failed")
            raise
        finally:
            self._sink = None
        sink.finalize("success")
        return result

    def _fit(self, call: FitCall) -> FitResult:
        runtime, strategy = self.runtime, self.strategy
        config = self.config  # the fit's settings: those it started with, on every rank

        # every rank checks its arguments and finds its checkpoint, then all agree (or all
        # raise) before the first collective of the set-up
        def prepare() -> Proposal[FitPlan]:
            return prepare_fit(
                config,
                runtime,
                call,
                checkpoints=self.checkpoints,
                pending=self._pending,
                callbacks=self.callbacks,
                owner=self,
            )

        if strategy.elastic:  # a process joining later could not meet this collective
            prepared = prepare().local
        else:
            prepared, claims = exchange(strategy, "fit", prepare)
            check_claims(claims)  # every rank holds every claim: all raise, or none
        self._pending = None
        payload = None if prepared.found is None else prepared.found.payload
        if payload is not None:
            _resume.load_weights(strategy, payload, call.model, call.optimizer)
        # The wrapped model lives only in frames below this one: on a failure they are
        # cleared, so the process group's connections close at once (see distkit.faults._faults).
        preempt = Preemption(config.preempt, requeue=config.requeue) if config.preempt else None
        with guarded(
            runtime,
            fault_timeout=config.runtime_options.fault_timeout,
            hang_warning=config.runtime_options.hang_warning,
            preempt=preempt,
        ):
            assert self._sink is not None  # fit() opened it
            run = train(
                config,
                runtime,
                prepared,
                payload,
                call,
                callbacks=self.callbacks,
                checkpoints=self.checkpoints,
                sink=self._sink,
                stop=self._stop,
                owner=self,
                keep=self._keep,
                preempt=preempt,
            )
            if run.preempted is not None:  # saved: the timeline, handlers, requeue, raise
                assert preempt is not None and self.checkpoints is not None
                run.preempted.checkpoint = str(self.checkpoints.path_for(run.preempted.step))
                finish(preempt, run.preempted, rank=self.rank)
            result = FitResult(
                history=[dict(record) for record in run.state.history],
                validations=[dict(v) for v in run.validations],
                stopped_early=run.stopped_early,
            )
            self.callbacks.call("on_fit_end", self, result)
        return result

    def _keep(self, run: LatestFit) -> None:
        self._run = run  # trainer.model, .global_step, ... and save_checkpoint read it

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(
        self, path: str | os.PathLike[str], extra: dict[str, Any] | None = None
    ) -> None:
        """Save the latest ``fit``'s run to ``path`` (atomically, by rank 0).

        A collective: call it on every rank (each rank's RNG state is gathered into the file,
        which rank 0 writes). Called on some ranks only, it raises
        :class:`~distkit.errors.RankDisagreementError` there instead of hanging. ``extra``
        holds your own tensors/numbers/strings (no arbitrary objects: the file loads
        weights-only).
        """
        self._require_open("save_checkpoint")
        options = self.config.runtime_options.storage_options
        _checkpoint_save.save_to(
            self.strategy, self._run, self.callbacks, path, extra, storage_options=options
        )

    def load_checkpoint(self, path: str | os.PathLike[str]) -> dict[str, Any]:
        """Load a checkpoint onto this rank's device; the next ``fit`` continues from it.

        Model and optimizer states go into the latest ``fit``'s objects at once, if there are
        any. Returns ``{"producer", "progress", "extra"}`` from the file.
        """
        self._require_open("load_checkpoint")
        options = self.config.runtime_options.storage_options
        loaded = ckpt.load(path, map_location=self.strategy.device, storage_options=options)
        found = _resume.LoadedCheckpoint.of(path, loaded)
        if self._run is not None:
            run = self._run
            _resume.check_fits(found, run.model, run.optimizer, io=self.strategy.state_io)
            _resume.load_weights(self.strategy, found.payload, run.model, run.optimizer)
        self._pending = found
        return {key: found.payload.get(key) for key in ("producer", "progress", "extra")}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """The latest ``fit``'s model weights as full CPU tensors, the same on every rank.

        Keyed as the user's module keys its ``state_dict()``, whatever the strategy: for ddp,
        dp, horovod and apex it equals that ``state_dict()`` (copied to the CPU); fsdp gathers
        the shards, a collective, so call it on every rank (any strategy: the script then
        runs under each).
        """
        self._require_open("full_state_dict")
        if self._run is None:
            raise ConfigurationError("full_state_dict needs a model: call fit(...) first")
        return self.strategy.state_io.model_state_dict(self._run.model)

    def save_weights(
        self,
        path: str | os.PathLike[str],
        *,
        max_shard_size: int | str = DEFAULT_MAX_SHARD_SIZE,
    ) -> list[Path | str]:
        """Save the latest ``fit``'s model weights as safetensors (a ``.safetensors`` file, or
        a folder sharded at ``max_shard_size`` with a ``transformers`` model's configs), as
        :meth:`distkit.Runtime.save_weights` does. A collective: call it on every rank; rank
        0 writes. Returns the paths written."""
        self._require_open("save_weights")
        if self._run is None:
            raise ConfigurationError(
                "save_weights needs a model: call fit(...) first (or save a model of your own "
                "with distkit.Runtime.save_weights)"
            )
        written = save_weights(
            self.strategy,
            self._run.model,
            path,
            max_shard_size=max_shard_size,
            what="trainer.save_weights",
            options=self.config.runtime_options.storage_options,
        )
        return written.paths

    # ------------------------------------------------------------------ evaluate
    def evaluate(
        self,
        model: nn.Module,
        data: Any,
        loss_fn: LossFn | None = None,
        metrics: Metrics | None = None,
        step_fn: StepFn | None = None,
    ) -> dict[str, float]:
        """Loss and metrics over ``data``, each sample counted exactly once over all ranks.

        ``step_fn(model, batch)`` instead of ``loss_fn``, for dict batches and models that
        return their own loss: see :meth:`Runtime.evaluate <distkit.Runtime.evaluate>` (a
        :class:`~distkit.Loss` makes the loss the mean over every item: token-exact).

        A collective: call it on every rank, with the whole ``data`` (distkit shards it).
        Returns the same dict on every rank: ``{"loss": ..., <metric name>: ...}``, plain
        floats (a metric's numpy or tensor scalars are converted).
        """
        self._require_open("evaluate")
        return self.runtime.evaluate(
            model,
            data,
            loss_fn,
            metrics,
            step_fn=step_fn,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            seed=self.seed,
            input_device=self.input_device,
        )

    def predict(
        self,
        model: nn.Module,
        data: Any,
        predict_fn: PredictFn | None = None,
        gather: str | None = "all",
        *,
        write_to: str | os.PathLike[str] | None = None,
    ) -> list[Any]:
        """The model's output for every sample of ``data``, once, in the data's order.

        A collective: call it on every rank, with the whole ``data`` (distkit shards it), with
        this trainer's ``batch_size``, ``num_workers``, ``seed`` and ``input_device``. See
        :meth:`distkit.Runtime.predict` for ``predict_fn``, ``gather`` and ``write_to``.
        """
        self._require_open("predict")
        return self.runtime.predict(
            model,
            data,
            predict_fn,
            gather,
            batch_size=self.batch_size,
            num_workers=self.num_workers,
            seed=self.seed,
            input_device=self.input_device,
            write_to=write_to,
        )

    # ------------------------------------------------------------------ helpers
    def _require_open(self, call: str) -> None:
        if self.closed:
            raise TrainerClosedError(
                f"{call}() on a closed trainer: the trainer is closed; create a new Trainer (a "
                "trainer closes on close(), at the end of its with-block, and when a "
                "multi-process fit fails)"
            )

    @override
    def __repr__(self) -> str:
        return f"Trainer(strategy={self.strategy!r}, max_epochs={self.max_epochs})"


def _checked_runtime(runtime: object, strategy: object, given: RuntimeOptions) -> Runtime:
    """``Trainer(runtime=rt)``: an open Runtime, and no argument that contradicts it."""
    if not isinstance(runtime, Runtime):
        raise ConfigurationError(
            f"runtime must be a distkit.Runtime, got {type(runtime).__name__}; create one with "
            "distkit.Runtime(strategy=...) and pass it to each Trainer"
        )
    require_open(runtime, "Trainer")
    if not (isinstance(strategy, str) and strategy == "auto") and strategy is not runtime.strategy:
        raise ConfigurationError(
            f"Trainer(strategy={strategy!r}, runtime=...): the runtime already runs "
            f"{runtime.strategy.name!r}; leave strategy='auto' (the runtime's) or create the "
            "Trainer without a runtime"
        )
    for name, value, held in runtime.options.differences(given):
        raise ConfigurationError(
            f"Trainer({name}={value!r}, runtime=...): the runtime was created with "
            f"{name}={held!r}; pass {name} to distkit.Runtime(...), or leave it out here"
        )
    return runtime
