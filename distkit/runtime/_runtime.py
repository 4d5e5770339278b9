"""One process's part of a distributed job, whatever loop runs on it.

A :class:`Runtime` resolves and connects the strategy, keeps each model and optimizer set up
once, knows this rank's place (rank, world size, device) and where it is in its work (for the
watchdog's hang reports), turns a Dataset, DataLoader or stream into the loader description
every rank agrees on, evaluates with every sample counted once, and runs work under the
fail-fast guard. It is the user's own loop's API (``distkit.Runtime``); the Trainer holds one
and runs its loop over it. It takes no Trainer and knows no loop.
"""

from __future__ import annotations

import contextlib
import os
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, NoReturn

import torch
from torch import nn
from typing_extensions import override

from distkit._validate import check_flags, check_ints, check_positive
from distkit.data import LoaderSpec
from distkit.data._batch_plan import batch_plan
from distkit.data._feed import eval_batches, train_feed
from distkit.data._stream_spec import StreamSpec, is_stream
from distkit.errors import ConfigurationError, DistkitError, TrainerClosedError
from distkit.faults._faults import fail_fast
from distkit.faults._preempt import Preemption
from distkit.faults._progress import Progress
from distkit.registry import make_strategy
from distkit.runtime import _agreement, _weights
from distkit.runtime._background_save import PendingSave
from distkit.runtime._call_tags import tagged_sum
from distkit.runtime._checkpointing import ActivationCheckpointing
from distkit.runtime._determinism import Determinism, apply_determinism
from distkit.runtime._empty import init_empty
from distkit.runtime._evaluation import EvalStepFn, LossFn, Metrics, as_score, evaluate_shard
from distkit.runtime._input_check import SameBatchCheck
from distkit.runtime._loader import RuntimeLoader
from distkit.runtime._loop import LoopState
from distkit.runtime._predict import PredictFn, PredictPlan, prepare_predict, run_predict
from distkit.runtime._preemption import LoopPreemption
from distkit.runtime._preparation import checked_placement, prepare_evaluate
from distkit.runtime._profiler import Profiler, ProfileRun, user_profile
from distkit.runtime._runtime_arguments import check_setup_args
from distkit.runtime._runtime_options import RuntimeOptions
from distkit.runtime._script import ScriptGuard, brief_if_uncaught
from distkit.runtime._seeding import RankSeeding
from distkit.runtime._set_up import SetUpModel, SetUpOptimizer
from distkit.runtime._setups import SetupCache
from distkit.runtime._user_checkpoint import load_state, save_state
from distkit.strategies import _group_lease
from distkit.strategies._placement import Placement
from distkit.strategies._steps import GradientClip
from distkit.strategies.base import Strategy, Topology


def _shutdown(setups: SetupCache, settings: Determinism | None) -> None:
    """A Runtime's close: the strategy torn down, then the global settings it changed."""
    try:
        setups.shutdown()
    finally:
        if settings is not None:
            settings.restore()


#: set on an exception a fail-fast guard handled (the peers know): outer guards let it pass
_HANDLED = "_distkit_failure_handled"


class Runtime:
    """One process's part of a data-parallel job: the strategy, started, and what lives as
    long as this process uses it. A :class:`~distkit.Trainer` runs its loop over one; give the
    same Runtime to several Trainers (``Trainer(runtime=rt)``) and a sweep of fits in one
    process joins the process group once.

    Args:
        strategy: ``"auto"``, a registered name or a :class:`~distkit.Strategy` instance.
        precision: ``"32"``, ``"bf16"`` or ``"fp16"``.
        grad_accum_steps: micro-batches per optimizer step.
        seed: seeds torch, numpy and random here, alike on every rank (a model built next
            starts from the same weights on one process and on N), and with ``seed + rank``
            from the loop's first :meth:`backward` on (each rank's own dropout and
            augmentations; a generator you seed yourself in between is left alone); the data
            order is seeded with ``seed + epoch`` (the same on every rank).
        sync_batchnorm: BatchNorm statistics over the global batch.
        find_unused_parameters: for models whose forward skips some parameters (DDP).
        fault_timeout: seconds within which every rank stops after one fails.
        hang_warning: seconds without progress after which rank 0 names a rank that holds
            the others up (None: off).
        collective_timeout: seconds a collective may wait for the other ranks (None: the
            backend's default).
        activation_checkpointing: module classes (``[Block]``) or a predicate
            ``fn(module) -> bool``: each matching module of a model set up here keeps no
            activations and recomputes them in backward (non-reentrant; None: off).
        preempt_signals: signals that preempt the ``with rt:`` block (None or ``()``: off, as
            the Runtime has no folder of its own to save in): they are noted, not raised;
            your loop calls :meth:`preempted` after each optimizer step and, once it is True
            (on every rank at the same step), saves and calls :meth:`finish_preemption`.
        requeue: :meth:`finish_preemption` asks SLURM to requeue the job (rank 0).
        same_data_on_every_rank: True: the loop feeds every rank the same batches on purpose
            (a replicated rollout, one synthetic batch). Off (False), the first
            :meth:`backward` of a batch that is not :meth:`loader`'s compares the ranks'
            first batches once and stops every rank when they are all the same: a plain
            DataLoader gives each rank all the data, N times the samples per step.
        deterministic: True or ``"warn"``: torch's deterministic algorithms, cuDNN and
            cuBLAS settings while this Runtime is open, put back as they were at
            :meth:`close`; False (default) leaves them as they are.
        storage_options: for checkpoint and weights paths that are fsspec URLs (``s3://``,
            ``gs://``): the filesystem's options (credentials, endpoint: ``{"key": ...,
            "secret": ..., "endpoint_url": ...}`` for S3), passed to fsspec as they are.
            None: the filesystem's standard configuration (for S3: the AWS environment and
            config files, ``AWS_ENDPOINT_URL``). See ``docs/checkpoints.md``.

    The arguments mean what :class:`~distkit.Trainer`'s arguments of the same names mean;
    ``rt.options`` holds them as one frozen :class:`~distkit.RuntimeOptions`
    (``Runtime(strategy, **options.keywords())`` starts another with the same settings).
    """

    def __init__(
        self,
        strategy: str | Strategy = "auto",
        *,
        precision: str = "32",
        grad_accum_steps: int = 1,
        seed: int = 0,
        sync_batchnorm: bool = False,
        find_unused_parameters: bool = False,
        fault_timeout: float | None = 10.0,
        hang_warning: float | None = 300.0,
        collective_timeout: float | None = None,
        activation_checkpointing: ActivationCheckpointing = None,
        preempt_signals: Any = None,
        requeue: bool = False,
        deterministic: bool | str = False,
        same_data_on_every_rank: bool = False,
        storage_options: dict[str, Any] | None = None,
    ) -> None:
        #: every setting above as one frozen, validated value
        self.options = RuntimeOptions(
            **{k: v for k, v in locals().items() if k not in ("self", "strategy")}
        )
        self._preemption: LoopPreemption | None = None
        #: rt.save(..., blocking=False)'s save in flight (None: none)
        self._pending_save: PendingSave | None = None
        before = apply_determinism(self.options.deterministic)  # before any CUDA work
        try:
            self.strategy = make_strategy(strategy)
            self.strategy.start(self.options.train_options())
        except BaseException as exc:
            if before is not None:
                before.restore()
            if isinstance(exc, DistkitError):  # one line, not a traceback from every rank
                brief_if_uncaught(exc)
            raise
        #: this rank's place; kept past close() (handlers after a failure still ask "am I
        #: rank 0?"), and renewed when an elastic strategy re-forms its group
        self.topology: Topology = self.strategy.topology
        self.setups = SetupCache(self.strategy, self.options.checkpointing)
        #: where this rank is (step, phase), for the watchdog's hang reports
        self.progress = Progress()
        self._failure_channel: Any = None
        self._finalizer = weakref.finalize(self, _shutdown, self.setups, before)
        #: what the loop over this runtime holds (a user's loop, or the Trainer's fit): its
        #: set-up models and optimizers, its micro-batch, its losses' backward
        #: torch, numpy and random: seeded alike now, per rank from the first rt.backward on
        seeding = RankSeeding(self.options.seed)
        self.loop = LoopState(
            self.strategy,
            self.setups,
            self.progress,
            same_batches=SameBatchCheck(
                self.strategy, enabled=not self.options.same_data_on_every_rank
            ),
            first_backward=lambda: seeding.split(self.data_rank),
        )
        self._block_guard: contextlib.AbstractContextManager[None] | None = None
        self._script: ScriptGuard | None = None  # guard_script()'s
        self._preempt_rounds = 0  # guarded blocks with preemption so far (same on every rank)

    def __enter__(self) -> Runtime:
        """The block runs under the fail-fast guard (see ``_guarded``): an error on one rank
        stops every rank within ``fault_timeout`` seconds, Ctrl-C and SIGTERM stop the whole
        job, and a collective stuck longer than ``hang_warning`` names the rank that
        holds it up. The Runtime closes at the block's end."""
        if self._block_guard is not None:
            raise ConfigurationError(
                "this Runtime is guarded already (with rt:, or rt.guard_script()): enter it "
                "once; the guard covers everything inside"
            )
        preempt = None
        if self.options.signals:
            preempt = Preemption(self.options.signals, requeue=self.options.requeue)
            self._preemption = LoopPreemption(preempt)
        guard = self._guarded(
            fault_timeout=self.options.fault_timeout,
            hang_warning=self.options.hang_warning,
            preempt=preempt,
        )
        guard.__enter__()
        self._block_guard = guard
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: Any
    ) -> None:
        guard, self._block_guard = self._block_guard, None
        self._preemption = None
        try:
            if exc_type is None and not self.closed:
                self._wait_for_save()  # every rank learns how a background save went
            if guard is not None:
                guard.__exit__(exc_type, exc, tb)  # raises what replaces ``exc``, if anything
        finally:
            self.close()

    def guard_script(self) -> Runtime:
        """The guard of ``with rt:`` for the rest of a script that has no block to indent:
        ``rt = distkit.Runtime("ddp").guard_script()`` at the top of a flat script. An error
        the script does not catch stops every rank within ``fault_timeout`` seconds (its
        traceback printed once, by the rank that raised), Ctrl-C and SIGTERM stop the whole
        job in one line, and the Runtime closes when the script ends. Returns the runtime."""
        self._require_open("guard_script")
        self._script = ScriptGuard(self.__enter__, self._leave_script)
        return self

    def _leave_script(self, kind: Any, exc: Any, tb: Any) -> None:
        self._script = None
        self.__exit__(kind, exc, tb)

    def preempted(self) -> bool:
        """Whether a preempting signal stops the loop here: call it after each optimizer step,
        on every rank, inside ``with rt:``. False (one attribute read) until a signal reaches
        any rank; then True on every rank at the same call, the ranks having agreed on it
        (see ``Runtime(preempt_signals=...)``). Save then, and call :meth:`finish_preemption`.
        Always False without ``preempt_signals``."""
        if not self.options.signals:
            return False
        if self._preemption is None:
            raise ConfigurationError(
                "rt.preempted() outside `with rt:`: the preempt_signals are listened to only "
                "inside the runtime's with-block; run your loop in `with distkit.Runtime(...) "
                "as rt:`"
            )
        return self._preemption.preempted(self.strategy)

    def finish_preemption(self, checkpoint: str | os.PathLike[str] | None = None) -> NoReturn:
        """After :meth:`preempted` said True and the loop saved (``checkpoint``: where): print
        the timeline (rank 0), run the signal's previous handler, requeue (``requeue=True``,
        rank 0) and raise :class:`~distkit.errors.TrainingPreempted` (exit status 128 + the
        signal's number). Call it on every rank."""
        if self._preemption is None:
            raise ConfigurationError(
                "rt.finish_preemption() without a preemption: it ends a `with rt:` block whose "
                "rt.preempted() returned True"
            )
        self._preemption.finish(self.rank, checkpoint)

    @override
    def __repr__(self) -> str:
        return f"Runtime(strategy={self.strategy!r})"

    # ------------------------------------------------------------------ place
    @property
    def rank(self) -> int:
        """This process's global rank."""
        return self.topology.rank

    @property
    def world_size(self) -> int:
        """How many processes train together."""
        return self.topology.world_size

    @property
    def local_rank(self) -> int:
        """This process's rank on its node."""
        return self.topology.local_rank

    @property
    def data_rank(self) -> int:
        """Which share of the data this process loads: its place among the data-parallel
        ranks (its :attr:`rank`, but under tensor parallelism, where the ranks of one
        tensor-parallel group share one: ``rank // tensor_parallel``)."""
        return self.strategy.data_rank

    @property
    def data_world_size(self) -> int:
        """How many shares the data is cut into (:attr:`world_size`, but under tensor
        parallelism ``world_size // tensor_parallel``): batch sizes are per share."""
        return self.strategy.data_world_size

    @property
    def is_main(self) -> bool:
        """Whether this is global rank 0 (the one that logs, prints and saves)."""
        return self.topology.rank == 0

    @property
    def device(self) -> torch.device:
        """This rank's device (its GPU, or the CPU)."""
        return self.topology.device

    def _renew_topology(self) -> None:
        """Read the strategy's place again (an elastic group re-formed: new rank, new size)."""
        self.topology = self.strategy.topology

    # ------------------------------------------------------------------ life
    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran (or a failure closed it): nothing more can run on it."""
        return not self._finalizer.alive

    def _require_open(self, call: str) -> None:
        """Raise :class:`~distkit.errors.TrainerClosedError` if closed, naming ``call``."""
        if self.closed:
            raise TrainerClosedError(
                f"{call}() on a closed Runtime: it was closed (close(), the end of its "
                "with-block, or a failed multi-process run); create a new distkit.Runtime"
            )

    def close(self) -> None:
        """Tear the strategy down (and the process group distkit created, unless another
        Trainer or Runtime of this process still uses it). Idempotent.

        A Runtime dropped without close() is torn down when the garbage collector takes
        it; its process group, when it was the last to use it, is then kept for the next
        Runtime of the process (or the process's end): the collector runs at another point
        on each rank, and a group destroyed on one rank only would split the job (see
        ``strategies/_group_lease``)."""
        pending, self._pending_save = self._pending_save, None
        if pending is not None:
            pending.finish_here()  # a background save completes before the teardown
        with _group_lease.explicit_close():
            self._finalizer()

    def _close_after_failure(self) -> None:
        """Close, keeping the side channel alive while this runtime lives.

        For torch.distributed the side channel is the rendezvous store, which rank 0 hosts
        when no torchrun agent does: peers read the failure notice from it after our closed
        connections wake them up.
        """
        self._failure_channel = self.strategy.side_channel()
        self.close()

    @contextlib.contextmanager
    def _guarded(
        self,
        *,
        fault_timeout: float | None,
        hang_warning: float | None,
        preempt: Preemption | None = None,
    ) -> Iterator[None]:
        """Run the block under the fail-fast guard: an error on this rank stops every rank
        (see :mod:`distkit.faults._faults`); this runtime closes after a failure. With
        ``preempt``, its signals are noted instead (see :mod:`distkit.faults._preempt`): the
        loop asks ``preempt.due(step)`` at each step boundary.

        Nested (a Trainer's fit inside ``with distkit.Runtime(...)``), the inner guard
        handles a failure and the outer one lets that exception pass as it is: the peers
        were told once, and a loop that catches the fit's error goes on with them.
        """
        passed: BaseException | None = None
        if preempt is not None:  # its keys in the side channel: this block's own
            self._preempt_rounds += 1
            preempt.key = str(self._preempt_rounds)
        try:
            with fail_fast(
                self.strategy,
                fault_timeout=fault_timeout,
                hang_warning=hang_warning,
                progress=self.progress,
                on_failure=self._close_after_failure,
                preempt=preempt,
            ):
                try:
                    yield
                except BaseException as exc:
                    if not getattr(exc, _HANDLED, False):
                        raise
                    passed = exc  # an inner guard handled it
        except BaseException as exc:
            with contextlib.suppress(AttributeError, TypeError):
                setattr(exc, _HANDLED, True)
            raise
        if passed is not None:
            raise passed

    # ------------------------------------------------------------------ a user's own loop
    def setup(self, model: nn.Module, *optimizers: torch.optim.Optimizer) -> Any:
        """Set ``model`` (and its optimizers) up for training on this backend.

        Returns the set-up model, or ``(model, optimizer, ...)`` with optimizers: call the
        model as your own (it runs under the precision's autocast, and without gradient
        synchronisation mid-accumulation) and ``step()`` / ``zero_grad()`` the optimizers as
        usual (they act at the end of each ``grad_accum_steps`` window). A collective: every
        rank sets up the same model (the ranks agree on its shapes first; the backend then
        sends rank 0's weights to every rank). Call it once per model.
        """
        self._require_open("setup")
        check_setup_args(model, optimizers)
        if isinstance(model, SetUpModel):
            raise ConfigurationError(
                "this model is what rt.setup returned: it is set up already. Set up each "
                "model once, passing the nn.Module you built"
            )
        if model in self.loop.modules:
            raise ConfigurationError(
                f"{type(model).__name__} is set up already (rt.setup was called with it "
                "before): set up each model once, with all of its optimizers in one call: "
                "rt.setup(model, opt_a, opt_b)"
            )
        strategy = self.strategy

        def prepare() -> _agreement.Proposal[Placement]:
            placement = checked_placement(self.setups, model, None)
            kinds = ", ".join(type(o).__name__ for o in optimizers) or "none"
            agreed = {"model": _agreement.describe_model(model), "optimizers": kinds}
            details = {"model": lambda: _agreement.named_shapes(model)}
            return _agreement.Proposal(agreed, placement, details=details)

        if strategy.elastic:
            placement = prepare().local
        else:
            placement, _ = _agreement.exchange(strategy, "setup", prepare)
        return self.loop.add(model, optimizers, placement)

    def loader(
        self,
        data: Any,
        *,
        batch_size: int = 32,
        shuffle: bool = True,
        drop_last: bool = False,
        num_workers: int = 0,
    ) -> RuntimeLoader:
        """This rank's share of every global batch of ``data`` (a map-style Dataset, a
        DataLoader or a stream), on this rank's device.

        ``batch_size`` is per rank and per micro-batch (a DataLoader's own wins): N processes
        with ``batch_size=b`` see, together, the global batches one process sees with
        ``N * b``, in the same order (seeded with the runtime's ``seed + epoch``). Iterating
        the loader again gives the next epoch.
        """
        self._require_open("loader")
        check_ints(batch_size=(batch_size, 1), num_workers=(num_workers, 0))
        check_flags(shuffle=shuffle, drop_last=drop_last)
        strategy = self.strategy
        spec = self._loader_spec(
            data, "data", batch_size=batch_size, shuffle=shuffle, num_workers=num_workers
        )
        accum = strategy.options.grad_accum_steps
        plan = batch_plan(
            spec,
            world_size=self.data_world_size,
            rank=self.data_rank,
            grad_accum_steps=accum,
            seed=self.options.seed,
            drop_last=drop_last,
        )
        feed = train_feed(
            strategy,
            spec,
            plan,
            seed=self.options.seed,
            grad_accum_steps=accum,
            drop_last=drop_last,
        )
        return RuntimeLoader(
            feed,
            seed=self.options.seed,
            rank=self.data_rank,
            device=self.device,
            enter=self.loop.enter,
            agree=self._agree_on_epoch,
            ended=self.loop.check_items,
        )

    def _agree_on_epoch(self, epoch: int, position: int) -> None:
        """Every rank starts iterating a loader at the same epoch and place (one small
        collective per epoch; none in a world of one or under an elastic strategy)."""
        self._require_open("loader iteration")
        if self.world_size == 1 or self.strategy.elastic:
            return

        def prepare() -> _agreement.Proposal[None]:
            agreed = {"epoch": str(epoch), "samples already handed out": str(position)}
            return _agreement.Proposal(agreed, None)

        _agreement.exchange(self.strategy, "loader", prepare)

    def backward(
        self,
        loss: torch.Tensor,
        *,
        optimizer: Any = None,
        count: int | torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Backpropagate ``loss``, the mean loss of the batch the loop holds.

        Weighted by that batch's share of its global batch, so that N processes with batch
        ``b`` compute the gradients one process computes with ``N * b`` (an uneven last
        batch too); without gradient synchronisation mid-accumulation; scaled for fp16.
        Call it for every loss (a GAN calls it twice per batch); not ``loss.backward()``.

        ``count``: token-exact (item-exact) mode. ``loss`` is then the *sum* of the batch's
        per-item losses (tokens, pixels) and ``count`` how many items it sums (an int, or an
        integer tensor that may stay on the device). The optimizer's next step divides its
        summed gradients by the step's global count (every rank's, every micro-batch's):
        N processes with batch ``b`` and accumulation ``k`` then train exactly like one
        process with batch ``N * b * k``, whatever the padding. A rank whose count is 0
        contributes nothing; a step whose count is 0 on every rank is refused.

        ``optimizer``: the set-up optimizer whose next step applies these gradients. Legacy
        apex needs it (amp unscales them for that optimizer, with its own loss scale), and
        token-exact mode uses it (that optimizer's step divides by the count), where the
        loss reaches the parameters of several optimizers (a GAN's generator loss reaches
        the discriminator's too); left out, the optimizers whose parameters the loss
        reaches are found from its graph. Checked and otherwise unused anywhere else, so a
        loop that passes it runs on every backend.

        Returns the loss as it was backpropagated before its weight: one value (dp's
        per-replica losses reduced; with ``count``, the batch's mean per item), still on
        the device (reading it syncs the host).
        """
        self._require_open("backward")
        return self.loop.backward(loss, optimizer=optimizer, count=count)

    def forward_backward(
        self,
        model: nn.Module,
        inputs: Any,
        target: Any,
        loss_fn: Callable[[Any, Any], Any],
        *,
        optimizer: Any = None,
    ) -> torch.Tensor:
        """``loss_fn(model(inputs), target)`` and its backward in one call: what
        :meth:`backward` does for ``rt.backward(loss_fn(model(inputs), target))``, on every
        backend, and the one way to train a pipeline's model in your own loop
        (``FSDPStrategy(pipeline_parallel=...)``): there the schedule runs the batch's
        micro-batches through the stages, ``loss_fn`` on the last stage, and the loss
        reaches every rank.

        ``model``: what rt.setup returned. ``loss_fn(output, target)`` returns the batch's
        mean loss, or ``distkit.Loss(total, count)`` for a token-exact one. ``optimizer``: as
        in :meth:`backward`. Returns the loss as :meth:`backward` does (a token-exact one as
        its mean per item), on the device.
        """
        self._require_open("forward_backward")
        return self.loop.forward_backward(model, inputs, target, loss_fn, optimizer=optimizer)

    @property
    def sync_gradients(self) -> bool:
        """Whether the batch the loop holds ends its accumulation window: its backward
        synchronises the gradients and ``optimizer.step()`` steps (always True outside
        ``rt.loader``'s batches). Save checkpoints where it is True."""
        return self.loop.sync_gradients

    def clip_gradients(
        self,
        model: nn.Module,
        optimizer: Any,
        max_norm: float | None = None,
        max_value: float | None = None,
    ) -> None:
        """Clip ``optimizer``'s gradients at its next step: to a total 2-norm of
        ``max_norm`` and/or into ``[-max_value, max_value]``, on the averaged, unscaled
        gradients of the whole model (every rank's shard with fsdp), as the Trainer's
        ``gradient_clip_norm`` does. The norm before clipping is then
        ``optimizer.last_grad_norm``."""
        self._require_open("clip_gradients")
        self.loop.ready()
        if not isinstance(optimizer, SetUpOptimizer):
            raise ConfigurationError(
                f"clip_gradients takes the optimizer rt.setup returned, got "
                f"{type(optimizer).__name__}"
            )
        check_positive("max_norm", max_norm)
        check_positive("max_value", max_value)
        clip = GradientClip.from_settings(max_norm, max_value)
        if clip is None:
            raise ConfigurationError("clip_gradients needs max_norm=..., max_value=..., or both")
        optimizer.clip_at_step(clip)

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        """No gradient synchronisation for ``model`` in the block (forward and backward):
        for accumulating by hand, outside ``rt.loader``'s windows."""
        self._require_open("no_sync")
        self.loop.ready()
        if not isinstance(model, SetUpModel):
            raise ConfigurationError(
                f"no_sync takes the model rt.setup returned, got {type(model).__name__}"
            )
        with self.strategy.no_sync(model.wrapped):
            yield

    def save(
        self, path: str | os.PathLike[str], state: dict[str, Any], *, blocking: bool = True
    ) -> PendingSave | None:
        """Save what the loop holds to ``path``: ``{"model": model, "optimizer": optimizer,
        "loader": loader, "epoch": epoch}`` (set-up models and optimizers, loaders, plain
        values). A collective: call it on every rank (rank 0 writes, atomically; a sharded
        model is gathered). Called on some ranks only, it fails there instead of hanging.
        Save after ``optimizer.step()``: gradients mid-accumulation are not saved (a save
        where ``rt.sync_gradients`` is False warns so).

        ``path`` may be an fsspec URL (``"s3://bucket/run/step-100.pt"``; see
        ``storage_options``). ``blocking=False``: the state is staged (copied off the
        training tensors) and rank 0 writes it in the background while the loop goes on;
        returns a :class:`~distkit.runtime.PendingSave` (on every rank) whose ``wait()``
        (a collective) blocks until the file is complete and raises where the write failed.
        The next ``save``, ``load`` and the Runtime's close wait for it; the file appears
        only once complete. Returns None when blocking."""
        self._require_open("save")
        if not self.loop.sync_gradients and self.is_main:
            warnings.warn(
                f"rt.save({str(path)!r}) in the middle of an accumulation window (the batch "
                "the loop holds does not end it): the gradients accumulated so far are not "
                "saved, so a loop resumed from this file does not take the step this one "
                "will. Save where rt.sync_gradients is True (after optimizer.step())",
                UserWarning,
                stacklevel=2,
            )
        self.loop.ready()
        self.loop.check_items()
        pending = save_state(self, path, state, blocking=blocking)  # waits for the one before
        self._pending_save = pending
        return pending

    def _wait_for_save(self) -> float:
        """Wait for the save :meth:`save` left persisting (``blocking=False``), if any: a
        collective (every rank raises where it failed). Returns the seconds waited, which
        rank 0 reports when they held the loop up (a second or more)."""
        pending, self._pending_save = self._pending_save, None
        if pending is None:
            return 0.0
        waited = pending.wait()
        if waited >= 1.0 and self.is_main:
            print(
                f"distkit: waited {waited:.1f} s for {pending.what} to finish persisting",
                file=sys.stderr,
                flush=True,
            )
        return waited

    def load(self, path: str | os.PathLike[str], state: dict[str, Any]) -> dict[str, Any]:
        """Restore the objects of ``state`` in place from what :meth:`save` wrote (at any
        world size, on any backend); returns the file's plain values by name (``{"epoch":
        2}``). Call it after :meth:`setup`, on every rank (a save still persisting is waited
        for first)."""
        self._require_open("load")
        self.loop.ready()
        return load_state(self, path, state)

    # ------------------------------------------------------------------ collectives
    def all_reduce(self, tensor: torch.Tensor, op: str = "mean") -> torch.Tensor:
        """``tensor`` combined over every rank (``op``: ``"mean"`` or ``"sum"``); a new
        tensor, the same on every rank. A collective: call it on every rank."""
        self._require_open("all_reduce")
        return self.strategy.all_reduce(tensor, op=op)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's ``tensor`` (the same shape on each) stacked along a new first
        dimension, in rank order. A collective."""
        self._require_open("all_gather")
        return self.strategy.all_gather(tensor)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """``obj`` as rank ``src`` holds it, on every rank (any picklable object). A
        collective."""
        self._require_open("broadcast")
        return self.strategy.broadcast(obj, src=src)

    def barrier(self) -> None:
        """Wait until every rank got here. A collective."""
        self._require_open("barrier")
        # a tagged sum waits for every rank as a barrier does, and a rank that is in another
        # distkit call (a loader's epoch, a save) fails every rank instead of pairing with it
        tagged_sum(self.strategy, "barrier")

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (to download or cache), then the others. A
        collective: enter it on every rank."""
        self._require_open("main_process_first")
        with self.strategy.main_process_first():
            yield

    @contextlib.contextmanager
    def profile(self, settings: Profiler | None = None, /, **options: Any) -> Iterator[ProfileRun]:
        """Run ``torch.profiler`` over a window of your loop's steps; call ``.step()`` on
        what it yields after each optimizer step.

        ``options`` are :class:`~distkit.Profiler`'s fields (``dir``, ``wait``, ``warmup``,
        ``active``, ``repeat``, ``skip_first``, ``ranks``, ``record_shapes``,
        ``profile_memory``, ``with_stack``), or pass a ``Profiler`` (``options`` then
        replace its fields). Each chosen rank writes ``<dir>/rank<r>/rank<r>.<step>.pt.trace.json``
        per cycle (Chrome trace format, read by TensorBoard's profiler plugin too); the
        others run no profiler and their ``.step()`` does nothing. The profiler stops when
        the block ends, on an error too (a cycle cut short is still written whole).
        Not a collective.
        """
        self._require_open("profile")
        run = user_profile(
            settings, options, rank=self.rank, world_size=self.world_size, device=self.device
        )
        with run:
            yield run

    def print(self, *values: object, **kwargs: Any) -> None:
        """``print`` on rank 0 only (flushed, so it shows at once under a launcher)."""
        if self.is_main:
            kwargs.setdefault("flush", True)
            print(*values, **kwargs)

    @contextlib.contextmanager
    def init_module(self, *, empty: bool = True) -> Iterator[None]:
        """Build a model inside this block: ``empty=True`` on the meta device (no memory, no
        random draws; fsdp and DeepSpeed stage 3 make each rank's shard at ``rt.setup``, see
        :func:`distkit.init_empty`), ``empty=False`` straight on this rank's device."""
        check_flags(empty=empty)
        if empty:
            with init_empty():
                yield
            return
        with torch.device(self.device):
            yield

    def full_state_dict(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """``model``'s weights as full CPU tensors, the same on every rank, keyed as the
        user's own module keys its ``state_dict()`` (a wrapper's ``module.`` prefix never
        shows). A collective where the strategy shards the model (fsdp gathers): call it on
        every rank."""
        self._require_open("full_state_dict")
        self.loop.ready()
        if not isinstance(model, nn.Module):
            raise ConfigurationError(
                f"full_state_dict takes a torch.nn.Module, got {type(model).__name__}"
            )
        if isinstance(model, SetUpModel):
            model = model.module
        strategy = self.strategy
        if strategy.state_io.collective and strategy.world_size > 1:
            # a gather: every rank agrees first, so one that calls it alone fails at once
            agreed = {"model": _agreement.describe_model(model)}
            _agreement.exchange(
                strategy, "full_state_dict", lambda: _agreement.Proposal(agreed, None)
            )
        return strategy.state_io.model_state_dict(strategy.unwrap(model))

    def save_weights(
        self,
        model: nn.Module,
        path: str | os.PathLike[str],
        *,
        max_shard_size: int | str = _weights.DEFAULT_MAX_SHARD_SIZE,
    ) -> list[Path | str]:
        """Save ``model``'s full weights as safetensors, keyed as the user's module keys its
        ``state_dict()``, from any strategy (see ``docs/weights.md``).

        A path ending in ``.safetensors`` is one file; any other path is a folder holding
        ``model.safetensors``, or shards of at most ``max_shard_size`` (bytes, or ``"500MB"``,
        ``"2GB"``, ``"1GiB"``) with Hugging Face's ``model.safetensors.index.json``, and a
        ``transformers`` model's config files. Tied weights are saved once. A collective:
        call it on every rank; rank 0 writes (fsdp: one gathered shard at a time) and every
        rank returns once the files are complete. Returns the paths written. ``path`` may be
        an fsspec URL (``"s3://bucket/model"``): written locally, then uploaded (the URLs
        are returned)."""
        self._require_open("save_weights")
        self.loop.ready()
        written = _weights.save_weights(
            self.strategy,
            model,
            path,
            max_shard_size=max_shard_size,
            what="rt.save_weights",
            options=self.options.storage_options,
        )
        return written.paths

    # ------------------------------------------------------------------ data
    def _loader_spec(
        self, data: Any, what: str, *, batch_size: int, shuffle: bool, num_workers: int
    ) -> LoaderSpec | StreamSpec:
        """``data`` (a Dataset, a DataLoader or a stream) as what every rank will load."""
        pin_memory = self.device.type == "cuda"
        if is_stream(data):
            return StreamSpec.from_data(
                data,
                batch_size=batch_size,
                num_workers=num_workers,
                pin_memory=pin_memory,
                what=what,
            )
        return LoaderSpec.from_data(
            data,
            batch_size=batch_size,
            shuffle=shuffle,
            num_workers=num_workers,
            pin_memory=pin_memory,
            what=what,
        )

    # ------------------------------------------------------------------ evaluation
    def evaluate(
        self,
        model: nn.Module,
        data: Any,
        loss_fn: LossFn | None = None,
        metrics: Metrics | None = None,
        *,
        step_fn: EvalStepFn | None = None,
        batch_size: int = 32,
        num_workers: int = 0,
        seed: int | None = None,
        input_device: torch.device | None = None,
    ) -> dict[str, float]:
        """Loss and metrics over ``data``, every sample counted once over all ranks.

        A collective: call it on every rank, with the whole ``data`` (a Dataset, a DataLoader
        or a stream; distkit shards it). Returns the same dict on every rank:
        ``{"loss": ..., <metric name>: ...}``, plain floats.

        Args:
            model: the user's module (set up or not; it is placed on this rank's device).
            loss_fn: ``loss_fn(model(inputs), target)`` -> batch-mean loss.
            metrics: :class:`~distkit.metrics.Metric` objects, by name or in a list.
            step_fn: ``step_fn(model, batch)`` instead of ``loss_fn``, for batches of any
                layout (dicts) and models that return their own loss: it returns the
                batch-mean loss, a :class:`~distkit.Loss` (the loss is then the mean over
                every item of every rank: token-exact), or the model's output (its
                ``.loss`` / ``["loss"]`` is the batch mean). Metrics then get
                ``update(output, batch)``: ``Loss(total, count, output=out)``'s output, or
                the model's output the step returned.
            batch_size: samples per rank per batch, for a Dataset (a DataLoader's own wins).
            num_workers: DataLoader worker processes per rank, for a Dataset.
            seed: seeds a stream's shuffling (None: the runtime's ``seed``).
            input_device: where a model you placed on devices of your own takes its inputs.
        """
        self._require_open("evaluate")
        self.loop.ready()
        strategy = self.strategy
        seed = self.options.seed if seed is None else seed
        if isinstance(model, SetUpModel):
            model = model.module

        def prepare() -> _agreement.Proposal[Any]:
            def read() -> LoaderSpec | StreamSpec:
                return self._loader_spec(
                    data, "val_data", batch_size=batch_size, shuffle=False, num_workers=num_workers
                )

            return prepare_evaluate(
                self.setups, model, read, loss_fn, metrics, input_device, step_fn=step_fn
            )

        (named, spec, placement), _ = _agreement.exchange(strategy, "evaluate", prepare)
        scores = evaluate_shard(
            strategy,
            strategy.eval_model(self.setups.wrapped(model)),
            eval_batches(strategy, spec, seed),
            loss_fn,
            named,
            placement,
            step_fn,
        )
        return {key: as_score(key, value) for key, value in scores.items()}

    # ------------------------------------------------------------------ prediction
    def predict(
        self,
        model: nn.Module,
        data: Any,
        predict_fn: PredictFn | None = None,
        gather: str | None = "all",
        *,
        batch_size: int = 32,
        num_workers: int = 0,
        seed: int | None = None,
        input_device: torch.device | None = None,
        write_to: str | os.PathLike[str] | None = None,
    ) -> list[Any]:
        """The model's output for every sample of ``data``, once, in the data's order.

        A collective: call it on every rank, with the whole ``data`` (a Dataset, a DataLoader
        or a stream; distkit shards it as for :meth:`evaluate`). In eval mode, under
        ``torch.no_grad()`` and the strategy's autocast (the model's mode is restored after).
        Returns a list with one entry per sample, on the CPU: the batch's output split along
        its first dimension (a tensor's rows; dicts, tuples and lists split element-wise).
        ``torch.stack(outputs)`` makes one tensor of tensor outputs. See docs/predict.md.

        Args:
            model: the user's module (set up or not; it is placed on this rank's device).
            predict_fn: ``predict_fn(model, batch) -> output``, whose first dimension is the
                batch. Default: ``model(inputs)`` for ``(inputs, target)`` or ``(inputs,)``
                batches, ``model(**batch)`` for dicts, ``model(batch)`` for tensors.
            gather: ``"all"``: every rank returns every output; ``"main"``: rank 0 does, the
                others an empty list; ``None`` with ``write_to``: each rank writes its outputs
                to a file (read them with :func:`distkit.read_predictions`), and returns an
                empty list once every rank's file is written.
            batch_size: samples per rank per batch, for a Dataset (a DataLoader's own wins).
            num_workers: DataLoader worker processes per rank, for a Dataset.
            seed: seeds a stream's shuffling (None: the runtime's ``seed``).
            input_device: where a model you placed on devices of your own takes its inputs.
            write_to: the folder of ``gather=None``'s files (one per rank).
        """
        self._require_open("predict")
        self.loop.ready()
        strategy = self.strategy
        seed = self.options.seed if seed is None else seed
        if isinstance(model, SetUpModel):
            model = model.module

        def prepare() -> _agreement.Proposal[PredictPlan]:
            def read() -> LoaderSpec | StreamSpec:
                return self._loader_spec(
                    data,
                    "predict's data",
                    batch_size=batch_size,
                    shuffle=False,
                    num_workers=num_workers,
                )

            return prepare_predict(
                self.setups, model, read, predict_fn, gather, write_to, input_device
            )

        plan, _ = _agreement.exchange(strategy, "predict", prepare)
        return run_predict(strategy, strategy.eval_model(self.setups.wrapped(model)), plan, seed)
