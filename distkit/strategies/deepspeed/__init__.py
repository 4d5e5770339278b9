"""DeepSpeed ZeRO (stages 1, 2, 3): optimizer state, gradients and parameters sharded over ranks.

Runs under the torch launchers (torchrun, ``python -m torch.distributed.launch``, plain
``python`` for a world of one), on the process group distkit joins (gloo on CPU, nccl on
CUDA). DeepSpeed is imported only when the strategy starts.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from distkit._imports import require
from distkit.checkpoint import _pending_weights
from distkit.errors import ConfigurationError, UnsupportedFeatureError
from distkit.launch.diagnosis import MachineFacts, StrategyReport
from distkit.launch.families import TORCH_LAUNCHERS
from distkit.strategies import _meta_init, _torch_dist, _torch_group
from distkit.strategies._graph import graph_leaves
from distkit.strategies._steps import GradientClip, StepOutcome
from distkit.strategies.base import Strategy, Topology
from distkit.strategies.capabilities import StateIO
from distkit.strategies.deepspeed import _doctor, _engine_step, _lifecycle, _meta, _shards
from distkit.strategies.deepspeed._engine_config import (
    check_known_keys,
    engine_config,
    resolve_stage,
)
from distkit.strategies.deepspeed._state import DeepSpeedStateIO, Engine, load_into_engine
from distkit.strategies.precision import Precision, float64_parameters

HINT = (
    "Install it after the pinned torch: `pip install 'distkit[deepspeed]'` (or `pip install "
    "deepspeed`; installed before torch, pip may pull a CUDA build of torch)"
)


CHECKPOINTS = ("full", "sharded")
STAGES_NEED_VALUES = (
    "ZeRO stages 1 and 2 keep the whole model on every rank: use DeepSpeedStrategy(stage=3), "
    "which partitions a meta model module by module"
)


class DeepSpeedStrategy(_torch_dist.TorchDistributedCollectives, Strategy):
    """DeepSpeed's ZeRO engine: each rank holds a shard of the optimizer state (stage 1), and
    of the gradients (stage 2), and of the parameters (stage 3).

    distkit keeps its guarantees on it: N processes with ``batch_size=b`` train like one
    process with ``N * b`` (uneven last batches and accumulation included), evaluation counts
    every sample once, clipping is DeepSpeed's own (on the averaged gradients, across the
    shards), checkpoints hold the full weights and optimizer state (they resume under ddp,
    fsdp or one process, and back).

    Args:
        stage: the ZeRO stage, 1, 2 or 3; None takes the config's
            ``zero_optimization.stage``, else 2.
        config: a DeepSpeed config dict, honoured as it is (``zero_optimization``'s other
            keys, ``communication_data_type``, ...). The keys distkit sets from the Trainer
            or Runtime (batch sizes, accumulation, clipping, precision, optimizer, scheduler)
            are refused there, naming the distkit argument instead.
        checkpoint: ``"full"`` (default): checkpoints hold the full weights and optimizer
            state in torch's form, which every strategy resumes at any world size;
            ``"sharded"``: each rank writes its own ZeRO partitions with DeepSpeed's
            ``save_checkpoint`` to a folder beside the checkpoint file, and no rank gathers
            the model; DeepSpeed reads it back at the same stage and world size only.
        backend: torch.distributed backend; None picks nccl on CUDA and gloo on CPU.
        timeout: how long a collective may wait for the other ranks (seconds or timedelta).
    """

    name = "deepspeed"
    launcher = TORCH_LAUNCHERS
    contract_exceptions = {
        "mean_gradients": (
            "ZeRO keeps the averaged gradients in its partitions and frees them in "
            "engine.step(), so no parameter holds one after the step; world_size_invariance "
            "and runtime_accumulation check what they did"
        ),
        "runtime_two_models": (
            "DeepSpeed gives each model its own engine, and a loss that runs through two "
            "engines (a GAN's generator loss through the discriminator) is refused, naming "
            "the way out (tests/strategies/test_deepspeed.py)"
        ),
    }
    libraries = ("deepspeed",)
    placement_refusal = (
        "DeepSpeed's engine puts the whole model on this rank's device itself (and, at "
        "stage 3, partitions it there)"
    )

    @override
    @classmethod
    def diagnose(cls, machine: MachineFacts) -> StrategyReport:
        """Installed (found, not imported), and a C++ compiler for the ops DeepSpeed JIT-builds."""
        report = super().diagnose(machine)
        return _doctor.verdict(cls.name, machine, report)

    def __init__(
        self,
        *,
        stage: int | None = None,
        config: Mapping[str, Any] | None = None,
        checkpoint: str = "full",
        backend: str | None = None,
        timeout: timedelta | float | None = None,
    ) -> None:
        super().__init__()
        if config is not None and not isinstance(config, Mapping):
            raise ConfigurationError(
                f"DeepSpeedStrategy(config={type(config).__name__}); allowed: a dict (a "
                "DeepSpeed config; read a JSON file with json.load first) or None"
            )
        if checkpoint not in CHECKPOINTS:
            raise ConfigurationError(
                f"DeepSpeedStrategy(checkpoint={checkpoint!r}); allowed: "
                f"{', '.join(map(repr, CHECKPOINTS))} ('sharded': DeepSpeed's own folder of "
                "partitions, for models whose full state does not fit one process)"
            )
        self.checkpoint = checkpoint
        zero = (config or {}).get("zero_optimization") or {}
        self.stage = resolve_stage(stage, zero.get("stage"))
        self.config = dict(config or {})
        engine_config(self.config, stage=self.stage, precision="32")  # refuse clashes now
        self.backend = backend
        self.timeout = _torch_group.as_timeout(timeout)
        #: each set-up engine's record, by id of the user's model, its optimizer and the
        #: engine (a plain dict: a strategy is pickled to spawned processes); released at
        #: teardown
        self._engines: dict[int, Engine] = {}
        #: a checkpoint loaded into a meta model before its set-up, by id of the model or
        #: optimizer: loaded once the set-up has given it values
        self._before_setup: dict[int, dict[str, Any]] = {}
        self.meta_refusal = None if self.stage == 3 else STAGES_NEED_VALUES
        self._holds_local_rank = False  # whether it holds the LOCAL_RANK distkit may set

    @override
    def agreed_options(self) -> str:
        config = json.dumps(self.config, sort_keys=True, default=repr)
        return f"stage={self.stage}, checkpoint={self.checkpoint}, config={config}"

    # ------------------------------------------------------------------ lifecycle
    @override
    def _setup_environment(self) -> Topology:
        cuda = torch.cuda.is_available() and self.backend != "gloo"
        if not cuda:  # else DeepSpeed guesses, and warns that it found no GPU
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        require("deepspeed", feature="strategy='deepspeed'", hint=HINT)
        topology = self._join_group()
        _lifecycle.hold_local_rank(topology.local_rank)
        self._holds_local_rank = True
        return topology

    @override
    def _make_precision(self, device: torch.device) -> Precision:
        precision = self.options.precision
        if precision == "fp16" and device.type != "cuda":
            raise UnsupportedFeatureError(
                "strategy='deepspeed' with precision='fp16' needs CUDA: DeepSpeed's CPU "
                "accelerator has no fp16 training. Use precision='bf16' (or '32') here"
            )
        # the forward runs under torch's autocast (fp32 inputs meet DeepSpeed's bf16/fp16
        # weights); DeepSpeed keeps fp32 master weights and scales fp16 losses itself
        return Precision(precision, device, loss_scaling=False)

    @override
    def teardown(self) -> None:
        for record in self._records():
            destroy = getattr(record.engine, "destroy", None)
            if callable(destroy):
                destroy()
        self._engines.clear()
        self._before_setup.clear()
        # when the world goes (the last lease on it), DeepSpeed's clones of it go with it
        self._leave_group(before_destroy=_lifecycle.forget_groups)
        if self._holds_local_rank:
            _lifecycle.release_local_rank()
            self._holds_local_rank = False
        super().teardown()

    # ------------------------------------------------------------------ set-up
    @override
    def _setup_model_and_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        if id(optimizer) in self._engines:
            raise ConfigurationError(
                "this optimizer is already set up with a model under strategy='deepspeed'; "
                "DeepSpeed gives each model its own engine and optimizer"
            )
        _refuse_float64(model)
        deepspeed = require("deepspeed", feature="strategy='deepspeed'", hint=HINT)
        _lifecycle.skip_inference_op_build()
        meta = _meta_init.on_meta(model)
        # a checkpoint loaded before the set-up (a resumed fit) is in torch's form, keyed by
        # the user's parameters: ZeRO re-binds the optimizer to its flat partitions (a meta
        # model's was kept aside: meta tensors hold no values)
        saved = optimizer.state_dict() if optimizer.state and not meta else None
        saved = self._before_setup.pop(id(optimizer), saved)
        groups = [list(group["params"]) for group in optimizer.param_groups]
        config = engine_config(
            self.config,
            stage=self.stage,
            precision=self.options.precision,
            parameters=sum(p.numel() for p in model.parameters()),  # meta ones too
            world_size=self.world_size,
        )
        check_known_keys(config, deepspeed.runtime.config.DeepSpeedConfig)
        if meta:  # stage 3 (else refused before): partitioned module by module
            rng = self.broadcast(_meta_init.rng_at_build(model) if self.is_main else None, src=0)
            stored = _pending_weights.take(model)  # load_weights' into the meta model
            _meta.partition(model, config, self.device, rng, main=self.is_main, stored=stored)
        engine, _, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=config, dist_init_required=False
        )
        record = Engine(engine, groups, self.stage)
        for key in (id(model), id(optimizer), id(engine)):
            self._engines[key] = record
        weights = self._before_setup.pop(id(model), None)
        if weights is not None and _shards.MARK in weights:  # DeepSpeed's own folder
            _shards.load(engine, weights)
        elif weights is not None:
            DeepSpeedStateIO(self).load_model_state_dict(model, weights)
        if saved is not None:
            load_into_engine(record, saved)
        return engine, optimizer

    @override
    def setup_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> torch.optim.Optimizer:
        raise UnsupportedFeatureError(
            "strategy='deepspeed' gives each model one optimizer (DeepSpeed's engine owns "
            "it); set up a second optimizer with a model of its own, or use ddp/fsdp for two "
            "optimizers over one model"
        )

    @override
    def compile_model(
        self, model: nn.Module, compiler: Callable[[nn.Module], nn.Module]
    ) -> nn.Module:
        raise UnsupportedFeatureError(
            "compile= with strategy='deepspeed' is not supported by distkit yet (DeepSpeed "
            "compiles through its own engine.compile()); train uncompiled, or use ddp/fsdp "
            "with compile="
        )

    def _records(self) -> list[Engine]:
        """Every live engine's record, once each."""
        return list({id(r): r for r in self._engines.values()}.values())

    def engine_of_model(self, model: nn.Module) -> Engine | None:
        """The engine set up for the user's ``model`` (or the engine itself), or None."""
        return self._engines.get(id(model))

    def engine_of_optimizer(self, optimizer: Any) -> Engine | None:
        return self._engines.get(id(optimizer))

    def _engine(self, optimizer: Any) -> Any:
        record = self._engines.get(id(optimizer))
        if record is None:
            raise ConfigurationError(
                "this optimizer was not set up by strategy='deepspeed': pass the one "
                "fit/rt.setup returned"
            )
        return record.engine

    # ------------------------------------------------------------------ steps
    @override
    def backward(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        engine = self._engine(optimizer)
        records = self._records()
        mine = self._engines[id(optimizer)]
        if len(records) == 1:
            # distkit already weighted the loss by the micro-batch's share of the step
            engine.backward(loss, scale_wrt_gas=False)
            mine.forwarded = False
            return
        reached = graph_leaves(loss)
        others = [record for record in records if record is not mine]
        if any(id(p) in reached for record in others for p in record.params()):
            raise UnsupportedFeatureError(_engine_step.CROSSING)
        try:
            engine.backward(loss, scale_wrt_gas=False)
        except (IndexError, AssertionError, RuntimeError) as exc:
            if not any(record.forwarded for record in others):
                raise  # no other engine ran a forward this loss could have gone through
            # another engine's backward hook ran inside this one (the loss went through its
            # forward with its parameters frozen): DeepSpeed's state is no longer sound
            why = f"{_engine_step.CROSSING} ({type(exc).__name__}: {exc})"
            raise UnsupportedFeatureError(why) from exc
        mine.forwarded = False

    @override
    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, *, skip_nonfinite: bool = False
    ) -> StepOutcome:
        return self.step(optimizer, skip_nonfinite=skip_nonfinite)[0]

    @override
    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        # backward accumulates; engine.step() is the boundary (stages 2/3 reduce in each
        # backward all the same: their gradients live as shards)
        return contextlib.nullcontext()

    @override
    def check_step_settings(
        self, *, before_step: bool, clip: GradientClip | None, skip_nonfinite: bool
    ) -> None:
        why = _engine_step.refusal(
            before_step=before_step,
            clip=clip,
            skip_nonfinite=skip_nonfinite,
            precision=self.options.precision,
        )
        if why is not None:
            raise UnsupportedFeatureError(why)

    @override
    def step(
        self,
        optimizer: torch.optim.Optimizer,
        *,
        clip: GradientClip | None = None,
        skip_nonfinite: bool = False,
        before_step: Callable[[], None] | None = None,
    ) -> tuple[StepOutcome, torch.Tensor | None]:
        engine = self._engine(optimizer)
        self.check_step_settings(
            before_step=before_step is not None, clip=clip, skip_nonfinite=skip_nonfinite
        )
        _engine_step.set_clip(engine, clip.max_norm if clip is not None else None)
        skipped = engine.skipped_steps
        engine.step()
        stepped = engine.skipped_steps == skipped  # fp16: DeepSpeed's scaler skipped it
        outcome = StepOutcome.STEPPED if stepped else StepOutcome.SKIPPED_OVERFLOW
        if clip is None:
            return outcome, None
        norm = engine.get_global_grad_norm()
        return outcome, torch.as_tensor(0.0 if norm is None else norm, dtype=torch.float32)

    # ------------------------------------------------------------------ models
    @override
    def unwrap(self, model: nn.Module) -> nn.Module:
        record = self._engines.get(id(model))
        return record.engine.module if record is not None else model

    @override
    def eval_rounds(self, batches: int) -> int:
        if self.stage < 3 or self.world_size == 1:
            return batches
        # a stage-3 forward all-gathers parameters: every rank runs as many as the busiest
        return int(self.all_gather(torch.tensor([batches])).max().item())

    @override
    def convert_sync_batchnorm(self, model: nn.Module) -> nn.Module:
        return _torch_dist.convert_sync_batchnorm(model, self.device)

    @property
    @override
    def state_io(self) -> StateIO:
        return DeepSpeedStateIO(self)


def _refuse_float64(model: nn.Module) -> None:
    """ZeRO's optimizer keeps float32 master weights (``.float()`` of each partition) and
    steps those: a float64 model would train in float32 and come back float32, silently."""
    shown = float64_parameters(model)
    if shown:
        raise UnsupportedFeatureError(
            f"strategy='deepspeed' cannot train a float64 model ({type(model).__name__}: "
            f"{shown} are float64): ZeRO keeps float32 master weights and steps those, so the "
            "model would train in float32 and come back float32, silently. Convert it "
            "(model.float()), or train float64 with strategy='ddp' or 'fsdp'"
        )
