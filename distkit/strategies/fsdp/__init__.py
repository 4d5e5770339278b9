"""Fully sharded data parallel: torch's FSDP2 (``torch.distributed.fsdp.fully_shard``)."""

from __future__ import annotations

import contextlib
import inspect
import warnings
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from typing_extensions import override

from distkit.checkpoint import _pending_weights, _shard_files
from distkit.errors import (
    ConfigurationError,
    MissingDependencyError,
    RankDisagreementError,
    UnsupportedFeatureError,
)
from distkit.launch.diagnosis import MachineFacts, StrategyReport
from distkit.launch.families import TORCH_LAUNCHERS
from distkit.strategies import _meta_init, _torch_dist, _torch_group
from distkit.strategies._steps import GradientClip, clip_, local_norm, scale_, step_gradients
from distkit.strategies.base import StepOutcome, Strategy, Topology
from distkit.strategies.capabilities import StateIO
from distkit.strategies.fsdp import _layout, _meta, _pipeline_options, _pipeline_split, _tensor_plan
from distkit.strategies.fsdp import _pipeline_state as _pp_state
from distkit.strategies.fsdp import _state as _fsdp_state
from distkit.strategies.fsdp._options import checked_policy, hybrid_mesh
from distkit.strategies.fsdp._state_io import SHARDED
from distkit.strategies.fsdp._units import ShardPolicy, default_units, policy_of
from distkit.strategies.precision import Precision

CHECKPOINTS = ("full", "sharded")
FSDP_HINT = "Upgrade torch (distkit's fsdp is tested on torch 2.13): pip install -U torch"


class FSDPStrategy(_torch_dist.TorchDistributedCollectives, Strategy):
    """One process per device; parameters, gradients and optimizer state sharded over ranks.

    Each rank keeps a 1/N slice of every parameter. A sharded module's parameters are
    all-gathered just before its forward (and again for its backward), and its gradients
    are averaged and reduce-scattered right after. In a world of one nothing is sharded:
    the module trains as it is.

    Args:
        shard: the submodules sharded as units of their own, each all-gathered and freed in
            turn: ``None`` (each top-level child that holds parameters; where one shares a
            parameter with the rest of the model, as a language model's output layer tied
            to its embedding does, the blocks of its module lists instead), a tuple of module
            classes (every instance, e.g. your transformer block), or ``fn(name, module) ->
            bool``. The root module is sharded last and holds what is left.
        reshard_after_forward: free a unit's gathered parameters after its forward (``True``:
            less memory, one more all-gather in backward) or keep them (``False``);
            ``None``: torch's default (``True`` for the units, ``False`` for the root).
        checkpoint: ``"full"``: checkpoints hold the full model and optimizer state in
            distkit's one format, which every strategy resumes; ``"sharded"``: every rank
            writes its own slices (torch.distributed.checkpoint) to a folder beside the
            checkpoint file, and no rank gathers the model. Both resume at any world size.
        backend: torch.distributed backend; ``None`` picks nccl on CUDA and gloo on CPU.
        timeout: how long a collective may wait for the other ranks (seconds or timedelta);
            ``None``: the Trainer's ``collective_timeout``, else 30 minutes.
        replicate: hybrid sharding (HSDP): the ranks form ``replicate`` groups of
            ``world_size // replicate`` consecutive ranks (one node each, typically); each
            group shards the model over its ranks, and the groups hold replicas whose
            gradients are averaged across them. 1 (default): one group, plain sharding.
            Needs a world size it divides.
        tensor_parallel: tensor parallelism (TP) inside FSDP: each layer the plan names is
            split over ``T`` consecutive ranks (torch's ``parallelize_module``), and the world
            becomes the mesh ``(replicate, shard, tensor)``, of ``replicate x shard x T`` ranks:
            the world size must be a multiple of ``replicate * T``. The ``T`` ranks of one
            tensor-parallel group see the same samples: batch sizes are per data-parallel
            rank, and every data path (samplers, streams, evaluation, predict) shards by the
            data-parallel rank. 1 (default): no tensor parallelism.
        tensor_plan: which modules are split, and how: a dict of ``fnmatch`` patterns over
            ``model.named_modules()`` names to ``"colwise"``, ``"rowwise"``, ``"sequence"``
            or a torch ``ParallelStyle`` (``{"blocks.*.up": "colwise", "blocks.*.down":
            "rowwise"}``); ``"auto"``: a transformers model's own published plan; or
            ``fn(model, tp_mesh) -> None``, which parallelises the model itself. Checked on
            every rank before any collective (a pattern matching nothing, a style on a module
            it cannot split, a dimension ``T`` does not divide, a tied weight: refused).
        pipeline_parallel: pipeline parallelism (PP): the model cut into ``P`` stages (times
            ``stages_per_rank``), each on its own block of ranks, micro-batches flowing through
            them on torch.distributed.pipelining's ``schedule``; the world becomes the mesh
            ``(pipeline, replicate, shard, tensor)``, pipeline outermost. As under tensor
            parallelism, batch sizes are per data-parallel rank, and the ranks of one model
            copy see the same samples. 1 (default): no pipeline.
        pipeline_split: where each stage after the first begins: module names of the model as
            built (``["blocks.2"]``; the model's forward must run its children in order,
            checked on the first batch), or ``fn(model) -> list of stage modules``.
        microbatches: micro-batches per batch (default: the number of stages); must divide the
            batch of each data-parallel group. A shorter last batch is padded, not dropped.
        schedule: ``"1F1B"`` (default), ``"gpipe"`` or ``"interleaved1F1B"``.
        stages_per_rank: stages on each rank (``"interleaved1F1B"``: 2 by default).
        **fsdp_kwargs: passed to every ``fully_shard`` call (``offload_policy``,
            ``shard_placement_fn``, ...); ``mesh`` is set by distkit. ``mp_policy``: your
            ``MixedPrecisionPolicy`` instead of the one distkit derives from
            ``Trainer(precision="bf16")`` (then leave the Trainer's precision at ``"32"``).
    """

    name = "fsdp"
    launcher = TORCH_LAUNCHERS
    placement_refusal = (
        "fully_shard splits every parameter over the ranks' devices, one device per rank, so "
        "the model must sit whole on this rank's device"
    )
    auto_select = False  # strategy="auto" under torchrun stays ddp
    meta_refusal = None  # a meta model is sharded, then materialised slice by slice (_meta)

    @override
    @classmethod
    def diagnose(cls, machine: MachineFacts) -> StrategyReport:
        report = super().diagnose(machine)
        missing = missing_fsdp2()
        if missing is None or not report.usable:
            return report
        fix = f"{machine.python} -m pip install -U torch"
        return StrategyReport(cls.name, False, f"torch {machine.torch_version}", [missing], fix)

    def __init__(
        self,
        *,
        shard: tuple[type[nn.Module], ...] | ShardPolicy | None = None,
        reshard_after_forward: bool | None = None,
        checkpoint: str = "full",
        backend: str | None = None,
        timeout: timedelta | float | None = None,
        replicate: int = 1,
        tensor_parallel: int = 1,
        tensor_plan: Any = None,
        pipeline_parallel: int = 1,
        pipeline_split: Any = None,
        microbatches: int | None = None,
        schedule: str = "1F1B",
        stages_per_rank: int | None = None,
        **fsdp_kwargs: Any,
    ) -> None:
        super().__init__()
        if isinstance(replicate, bool) or not isinstance(replicate, int) or replicate < 1:
            raise ConfigurationError(
                f"FSDPStrategy(replicate={replicate!r}); allowed: an int >= 1, the number of "
                "replica groups (HSDP: replicate=2 on 2 nodes shards inside each node)"
            )
        self.replicate = replicate
        if (
            isinstance(tensor_parallel, bool)
            or not isinstance(tensor_parallel, int)
            or tensor_parallel < 1
        ):
            raise ConfigurationError(
                f"FSDPStrategy(tensor_parallel={tensor_parallel!r}); allowed: an int >= 1, the "
                "ranks that split each layer (tensor_parallel=2 with a tensor_plan)"
            )
        self.tensor_parallel = tensor_parallel
        self.tensor_plan = _tensor_plan.checked_plan_option(tensor_plan, tensor_parallel)
        self.pipeline_parallel, self.microbatches, self.stages_per_rank = (
            _pipeline_options.checked_options(
                pipeline_parallel, pipeline_split, microbatches, schedule, stages_per_rank
            )
        )
        self.pipeline_split = pipeline_split
        self.schedule = schedule
        self._pipeline: Any = None  # the set-up model's pipeline (a _pipeline.Pipeline)
        self._pp_state: _pp_state.PipelineState | None = None
        self._mesh: Any = None  # the (replicate, shard) DeviceMesh under HSDP
        self._layout: _layout.Layout | None = None  # with tensor_parallel > 1
        self._losses_compared = False  # a tensor-parallel group's first losses (backward)
        self._copies: _layout.CopyCount | None = None  # which gradient slices a norm counts
        #: checkpoint state loaded into a meta model (or its optimizer) before its set-up,
        #: by id of the model or optimizer: applied (and dropped) once the set-up
        #: materialised it (a plain dict: a strategy is pickled to spawned processes)
        self._before_setup: dict[int, dict[str, Any]] = {}
        if checkpoint not in CHECKPOINTS:
            raise ConfigurationError(
                f"checkpoint={checkpoint!r}; allowed: {', '.join(CHECKPOINTS)} ('sharded' "
                "for models whose full state does not fit one process)"
            )
        _check_fully_shard_keywords(fsdp_kwargs)
        reserved = {"mesh", "module"} & set(fsdp_kwargs)
        if reserved:
            raise ConfigurationError(
                f"FSDPStrategy sets {', '.join(sorted(reserved))} itself: it shards over every "
                "rank of the process group (or, with replicate=R, inside R groups of ranks: "
                "HSDP)"
            )
        self.mp_policy = checked_policy(fsdp_kwargs.pop("mp_policy", None))
        self.shard = _shard_policy(shard)
        self._default_shard = shard is None  # refined per model (see _units)
        self.reshard_after_forward = reshard_after_forward
        self.checkpoint = checkpoint
        self.backend = backend
        self.timeout = _torch_group.as_timeout(timeout)
        self._fsdp_kwargs = fsdp_kwargs

    @override
    def agreed_options(self) -> str:
        return (
            f"replicate={self.replicate}, tensor_parallel={self.tensor_parallel}, "
            f"tensor_plan={_plan_words(self.tensor_plan)}, checkpoint={self.checkpoint}, "
            f"pipeline_parallel={self.pipeline_parallel}, "
            f"pipeline_split={_plan_words(self.pipeline_split)}, "
            f"microbatches={self.microbatches}, schedule={self.schedule}, "
            f"stages_per_rank={self.stages_per_rank}, "
            f"reshard_after_forward={self.reshard_after_forward}, mp_policy={self.mp_policy}"
        )

    @override
    def _setup_environment(self) -> Topology:
        missing = missing_fsdp2()
        if missing is not None:
            raise MissingDependencyError(f"strategy='fsdp': {missing}. {FSDP_HINT}")
        topology = self._join_group()
        if topology.world_size > 1:  # before the mesh's groups, which every rank must build alike
            everyone: list[Any] = [None] * topology.world_size
            mine = (self.replicate, self.tensor_parallel, self.pipeline_parallel)
            torch.distributed.all_gather_object(everyone, mine)
            if len(set(everyone)) > 1:
                replicas, degrees, stages = ([e[i] for e in everyone] for i in (0, 1, 2))
                raise RankDisagreementError(
                    f"the ranks disagree on FSDPStrategy(replicate=...): {replicas}, "
                    f"(tensor_parallel=...): {degrees}, (pipeline_parallel=...): {stages} "
                    "(rank 0 first); every rank must build the same mesh. Pass the same "
                    "values on every rank"
                )
        if self.tensor_parallel > 1 or self.pipeline_parallel > 1:
            self._layout = _layout.layout_for(
                topology, self.replicate, self.tensor_parallel, self.pipeline_parallel
            )
        elif self.replicate > 1:
            self._mesh = hybrid_mesh(topology, self.replicate)
        return topology

    @property
    @override
    def data_rank(self) -> int:
        return self.rank if self._layout is None else self._layout.data_rank

    @property
    @override
    def data_world_size(self) -> int:
        return self.world_size if self._layout is None else self._layout.data_world_size

    @property
    @override
    def data_ranks(self) -> list[int]:
        if self._layout is None:
            return list(range(self.world_size))
        return [self._layout.data_rank_of(rank) for rank in range(self.world_size)]

    @property
    @override
    def data_leader(self) -> bool:
        layout = self._layout
        return layout is None or (layout.tensor_rank == 0 and layout.pipeline_rank == 0)

    @property
    @override
    def place(self) -> str | None:
        layout = self._layout
        if layout is None or layout.pipeline == 1:
            return None
        count = layout.pipeline * self.stages_per_rank
        mine = ", ".join(str(s) for s in range(layout.pipeline_rank, count, layout.pipeline))
        return f"pipeline stage {mine} (of stages 0-{count - 1})"

    @override
    def teardown(self) -> None:
        self._mesh = None
        self._layout = None
        self._copies = None
        self._losses_compared = False
        self._pipeline = None
        self._pp_state = None
        self._leave_group()
        super().teardown()

    def _sharded(self) -> bool:
        """Whether fully_shard shards the model: more than one data-parallel rank."""
        return self.data_world_size > 1

    def _split(self) -> bool:
        """Whether any collective runs in the model's forward (sharded or split)."""
        return self.world_size > 1

    @override
    def _make_precision(self, device: torch.device) -> Precision:
        if self.mp_policy is not None and self.options.precision != "32":
            raise ConfigurationError(
                f"FSDPStrategy(mp_policy=...) and precision={self.options.precision!r} both "
                "set the mixed precision: keep your policy and leave precision='32', or drop "
                "mp_policy and let distkit derive it from precision"
            )
        # bf16 is FSDP's MixedPrecisionPolicy (bf16 compute, fp32 gradient reduction) when
        # sharded; autocast on top would only cast again
        bf16_policy = self.options.precision == "bf16" and self._sharded()
        return Precision("32" if bf16_policy else self.options.precision, device)

    @override
    def _setup_model_and_optimizer(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        meta = _meta.on_meta(model)
        if self._layout is not None:
            return self._setup_split(model, optimizer, self._layout, meta=meta)
        if not self._sharded():  # a world of one: nothing to shard or synchronise
            if self.mp_policy is not None:
                warnings.warn(
                    "FSDPStrategy(mp_policy=...) applies to sharded units, and in a world of "
                    "one fsdp shards nothing: this process trains in the model's own dtype. "
                    "For mixed precision in a world of one, use precision='bf16'",
                    UserWarning,
                    stacklevel=2,
                )
            if meta:
                self._materialize(model, optimizer, dict(model.named_parameters()))
            return model, optimizer
        if not meta:  # a meta model has no values yet: each rank makes rank 0's (below)
            _broadcast_module(model)  # every rank starts from rank 0's weights, as under DDP
        originals = dict(model.named_parameters())
        # HSDP: shard inside a group, replicate across; else one mesh over the world for
        # every unit (fully_shard without one builds a mesh of its own per call)
        self._shard_units(model, self._mesh if self._mesh is not None else _world_mesh(self.device))
        return self._after_wrapping(model, optimizer, originals, meta=meta)

    def _setup_split(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        layout: _layout.Layout,
        *,
        meta: bool,
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """Tensor parallel: the plan's modules split over the tensor dimension, and the
        pipeline's stages cut (both checked first, on every rank alike), then FSDP over the
        data-parallel ranks, if several."""
        plan = None
        if layout.tensor > 1:
            plan = _tensor_plan.resolve(self.tensor_plan, model, layout.tensor)
        stages = None
        if layout.pipeline > 1:
            stages = self._cut(model, meta=meta)
        if not meta:
            _broadcast_module(model)  # every rank splits and shards rank 0's weights
        originals = dict(model.named_parameters())
        if plan is not None:
            plan.apply(model, layout.tp_mesh())
        if stages is not None:
            return self._setup_pipeline(model, optimizer, stages, layout, originals)
        if self._sharded():
            self._shard_units(model, layout.dp_mesh())
        return self._after_wrapping(model, optimizer, originals, meta=meta)

    def _cut(self, model: nn.Module, *, meta: bool) -> _pipeline_split.Stages:
        """The model's stages, checked (every rank alike, before any collective)."""
        if meta:
            raise UnsupportedFeatureError(
                "a model on the meta device (distkit.init_empty) under pipeline_parallel: "
                "distkit materialises meta models whole-model at once, and a pipeline keeps "
                "only its stages. Build the model on the CPU (each rank frees the other "
                "stages' weights at the set-up), or train without pipeline_parallel"
            )
        if self._pipeline is not None:
            raise UnsupportedFeatureError(
                "a second model set up under pipeline_parallel: one pipeline schedule runs "
                "one model. Set up one model per Runtime (a Trainer fit sets up one)"
            )
        if self.precision.scaler is not None:
            raise UnsupportedFeatureError(
                f"precision={self.options.precision!r} (a loss scaler) under pipeline_parallel: "
                "torch's schedule runs each micro-batch's backward itself, unscaled. Use "
                "precision='bf16', which needs no scaler"
            )
        stages = self.pipeline_parallel * self.stages_per_rank
        return _pipeline_split.split_model(model, self.pipeline_split, stages)

    def _setup_pipeline(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        stages: _pipeline_split.Stages,
        layout: _layout.Layout,
        originals: dict[str, Any],
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """This rank's stages kept (the others' state on the meta device), each sharded as
        a root of its own over the data-parallel ranks, the optimizer over them alone, and
        the schedule that runs them (see _pipeline)."""
        from distkit.strategies.fsdp._pipeline import Pipeline, PipelineModule

        size = layout.stage_size
        mine = set(range(layout.pipeline_rank, len(stages.modules), layout.pipeline))
        state = _pp_state.PipelineState(
            stages.owner,
            mine,
            stage_root=layout.rank == layout.stage_root,
            roots=[(s % layout.pipeline) * size for s in range(len(stages.modules))],
        )
        _pp_state.drop_other_stages(model, state)
        names = {id(m): n for n, m in model.named_modules()}
        units = default_units(model)
        for index in sorted(mine):
            module = stages.modules[index]
            if self._sharded():
                named = [(names[id(m)], m) for m in module.modules() if id(m) in names]
                self._shard_units(module, layout.dp_mesh(), named=(named, units))
        current = dict(model.named_parameters())
        replaced = {id(p): current[name] for name, p in originals.items()}
        local = {id(current[key]) for key in current if state.local(key)}
        _pp_state.bind_optimizer(optimizer, replaced, local, state)
        self._pp_state = state
        self._pipeline = Pipeline(
            stages.modules, layout, self.device, self.schedule, self.microbatches, stages.check
        )
        return PipelineModule(model, self._pipeline), optimizer

    @override
    def unwrap(self, model: nn.Module) -> nn.Module:
        from distkit.strategies.fsdp._pipeline import PipelineModule

        return model.module if isinstance(model, PipelineModule) else model

    @override
    def eval_model(self, model: nn.Module) -> nn.Module:
        from distkit.strategies.fsdp._pipeline import PipelineModule

        return model if isinstance(model, PipelineModule) else self.unwrap(model)

    @override
    def pipeline_of(self, model: nn.Module) -> Any:
        return getattr(model, "__dict__", {}).get("pipeline")

    @override
    def compile_model(self, model: nn.Module, compiler: Any) -> nn.Module:
        if self.pipeline_of(model) is not None:
            raise UnsupportedFeatureError(
                "compile under pipeline_parallel: the schedule runs each stage's forward on "
                "its own, outside the set-up model's forward that compile wraps. Train "
                "without compile=, or without pipeline_parallel"
            )
        return super().compile_model(model, compiler)

    def _shard_units(
        self,
        model: nn.Module,
        mesh: Any,
        named: tuple[list[tuple[str, nn.Module]], set[str]] | None = None,
    ) -> None:
        """``fully_shard`` on the policy's units, bottom-up, then on the root, over ``mesh``
        (``named``: where the root is a pipeline stage, the modules under it by their names
        in the user's model, and the default units of that model)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kwargs: dict[str, Any] = {"reshard_after_forward": self.reshard_after_forward}
        kwargs["mesh"] = mesh
        if self.mp_policy is not None:
            kwargs["mp_policy"] = self.mp_policy
        elif self.options.precision == "bf16":  # bf16 compute, fp32 reduction and output
            kwargs["mp_policy"] = MixedPrecisionPolicy(
                param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
            )
        kwargs.update(self._fsdp_kwargs)
        # the default: top-level children, but none that shares a parameter (tied weights)
        if named is None:
            modules, units = list(model.named_modules())[1:], default_units(model)
        else:
            modules, units = named
        policy = policy_of(units) if self._default_shard else self.shard
        # bottom-up, as fully_shard requires: a unit's children before the unit
        for name, module in reversed(modules):
            if module is not model and policy(name, module):
                fully_shard(module, **kwargs)
        fully_shard(model, **kwargs)

    def _after_wrapping(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        originals: dict[str, Any],
        *,
        meta: bool,
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        """A meta model materialised, or the optimizer pointed at the wrapped parameters."""
        if meta:
            self._materialize(model, optimizer, originals)
            return model, optimizer
        current = dict(model.named_parameters())
        replaced = {id(p): current[name] for name, p in originals.items()}
        _fsdp_state.rebind_optimizer(optimizer, replaced)
        return model, optimizer

    def _materialize(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, originals: dict[str, Any]
    ) -> None:
        """A meta model: this rank's slices made and initialised from rank 0's random state,
        or read from the weights load_weights recorded (see _meta); the optimizer pointed at
        them; a checkpoint loaded before the set-up (kept aside: meta tensors hold no values)
        loaded into them."""
        state = self.broadcast(_meta_init.rng_at_build(model) if self.is_main else None, src=0)
        stored = _pending_weights.take(model)
        _meta.materialize(model, self.device, state, main=self.is_main, stored=stored)
        current = dict(model.named_parameters())
        names = {id(p): name for name, p in originals.items()}
        for group in optimizer.param_groups:  # the meta parameters it was built with
            group["params"] = [current[_name_of(p, names)] for p in group["params"]]
        pending = self._before_setup.pop(id(model), None)
        if pending is not None and SHARDED in pending:  # each rank reads its own slices
            _shard_files.load(pending[SHARDED], model, optimizer)
        elif pending is not None:
            _fsdp_state.load_full_model_state(model, pending)
        saved = self._before_setup.pop(id(optimizer), None)
        if saved is not None:
            _fsdp_state.load_full_optimizer_state(optimizer, saved)

    @override
    def backward(self, loss: torch.Tensor, optimizer: torch.optim.Optimizer) -> None:
        if self._layout is not None and not self._losses_compared:
            self._losses_compared = True
            self._compare_group_losses(loss)
        super().backward(loss, optimizer)

    def _compare_group_losses(self, loss: torch.Tensor) -> None:
        """The first backward under tensor parallelism (a collective, once): the ranks of a
        group split one model copy over the same samples, so they compute the same loss,
        bitwise (every sum between them is an all-reduce, whose result every rank shares).
        A plan whose layouts do not fit the model (a sequence-split stream pooled over the
        sequence, a style that leaves an output split) or inputs that differ give each rank
        its own loss and gradients that mean nothing: every rank raises, before any step."""
        value = loss.detach().reshape(-1)[:1].to(torch.float64)
        everyone = self.all_gather(value).reshape(-1).tolist()
        for ranks in self.data_groups:
            values = [everyone[r] for r in ranks]
            if all(v == values[0] or (v != v and values[0] != values[0]) for v in values):
                continue
            shown = ", ".join(f"rank {r}: {everyone[r]:.6g}" for r in ranks)
            raise ConfigurationError(
                f"the ranks of one tensor-parallel group computed different losses in their "
                f"first backward ({shown}); they split one model copy over the same samples, "
                "so their losses must be equal. The tensor_plan's layouts do not fit the model "
                "(a module after a 'sequence'-split stream that mixes positions, e.g. a mean "
                "over the sequence; a ParallelStyle that leaves an output split), or the "
                "group's ranks got different inputs. Nothing has been trained yet"
            )

    @override
    def convert_sync_batchnorm(self, model: nn.Module) -> nn.Module:
        return _torch_dist.convert_sync_batchnorm(model, self.device)

    @override
    def no_sync(self, model: nn.Module) -> contextlib.AbstractContextManager[None]:
        if hasattr(model, "set_requires_gradient_sync"):  # sharded (an FSDPModule)
            return _local_gradients(model)
        return contextlib.nullcontext()

    @override
    def optimizer_step(
        self, optimizer: torch.optim.Optimizer, *, skip_nonfinite: bool = False
    ) -> StepOutcome:
        if skip_nonfinite and self.precision.scaler is None and not self._finite(optimizer):
            return StepOutcome.SKIPPED_NONFINITE
        return super().optimizer_step(optimizer)

    @override
    def clip_gradients(self, optimizer: torch.optim.Optimizer, clip: GradientClip) -> torch.Tensor:
        # each rank holds slices of the gradients: the norm sums the squares of every slice
        # once, however many ranks hold a copy of it (HSDP's replicas; a tensor-parallel
        # group's copies of the parameters it does not split)
        if self._layout is not None:
            _layout.reduce_partial_gradients(optimizer)
        grads = step_gradients(optimizer)
        if self.world_size == 1:
            return clip_(grads, clip, local_norm(grads, self.device))
        if self._copies is None or self._copies.rank != self.rank:
            root = 0 if self._layout is None else self._layout.stage_root
            self._copies = _layout.CopyCount(self.rank, root)
        counted = [_local(g) for g in grads if self._copies(g)]
        # in one dtype on every rank, whichever slices it counts (none: a zero of that dtype)
        wide = any(g.dtype == torch.float64 for g in grads)
        dtype = torch.float64 if wide else torch.float32
        squares = local_norm(counted, self.device).square().reshape(1).to(dtype)
        total = self.all_reduce(squares, op="sum").sqrt().reshape(())
        return clip_([_local(g) for g in grads], clip, total)

    @override
    def scale_gradients(
        self, optimizer: torch.optim.Optimizer, factor: float | torch.Tensor
    ) -> None:
        scale_([_local(g) for g in step_gradients(optimizer)], factor)  # each rank's slice

    def _finite(self, optimizer: torch.optim.Optimizer) -> bool:
        # each rank holds a slice of every gradient: all ranks must hear of a bad slice
        params = [p for group in optimizer.param_groups for p in group["params"]]
        local = [_local(p.grad) for p in params if p.grad is not None]
        bad = sum(int(not bool(g.isfinite().all())) for g in local)
        return self.all_reduce(torch.tensor([float(bad)]), op="sum").item() == 0

    @override
    def eval_rounds(self, batches: int) -> int:
        if not self._split():
            return batches
        # every forward all-gathers parameters: each rank runs as many as the busiest one
        return int(self.all_gather(torch.tensor([batches])).max().item())

    # ------------------------------------------------------------------ state
    @property
    @override
    def state_io(self) -> StateIO:
        from distkit.strategies.fsdp._state_io import FSDPStateIO  # it names this class

        return FSDPStateIO(self)


def _shard_policy(shard: tuple[type[nn.Module], ...] | ShardPolicy | None) -> ShardPolicy:
    if shard is None:
        return _top_level_with_parameters
    if isinstance(shard, tuple) and all(
        isinstance(c, type) and issubclass(c, nn.Module) for c in shard
    ):
        classes = shard
        return lambda name, module: isinstance(module, classes)
    if callable(shard) and not isinstance(shard, type):
        return shard
    raise ConfigurationError(
        f"shard={shard!r}; allowed: None (each top-level child with parameters), a tuple of "
        "nn.Module classes, e.g. shard=(TransformerBlock,), or fn(name, module) -> bool"
    )


def _top_level_with_parameters(name: str, module: nn.Module) -> bool:
    return "." not in name and any(True for _ in module.parameters())


def _broadcast_module(model: nn.Module) -> None:
    with torch.no_grad():
        for value in model.state_dict().values():
            if isinstance(value, torch.Tensor):
                torch.distributed.broadcast(value, src=0)


@contextlib.contextmanager
def _local_gradients(model: Any) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def missing_fsdp2() -> str | None:
    """What this torch lacks of what FSDPStrategy uses, or None."""
    try:
        from torch.distributed.fsdp import fully_shard  # noqa: F401
        from torch.distributed.tensor import distribute_tensor
    except ImportError as exc:
        return f"torch {torch.__version__} has no FSDP2 ({exc})"
    if "src_data_rank" not in inspect.signature(distribute_tensor).parameters:
        return f"torch {torch.__version__}'s distribute_tensor takes no src_data_rank"
    return None


def _local(grad: torch.Tensor) -> torch.Tensor:
    to_local = getattr(grad, "to_local", None)
    return grad if to_local is None else to_local()


def _name_of(param: Any, names: dict[int, str]) -> str:
    if id(param) in names:
        return names[id(param)]
    raise ConfigurationError(
        "the optimizer holds a parameter that is not the model's: pass the model's own "
        "parameters (optimizer = SGD(model.parameters(), ...)) to the optimizer"
    )


def _check_fully_shard_keywords(given: dict[str, Any]) -> None:
    """Refuse, at construction, a keyword ``fully_shard`` does not take (before, a typo
    failed only at set-up, inside ``fully_shard``), naming the nearest it does."""
    if not given:
        return
    import difflib
    import inspect

    from torch.distributed.fsdp import fully_shard

    taken = [
        name
        for name, parameter in inspect.signature(fully_shard).parameters.items()
        if parameter.kind is inspect.Parameter.KEYWORD_ONLY
    ]
    own = [
        "shard",
        "reshard_after_forward",
        "checkpoint",
        "backend",
        "timeout",
        "replicate",
        "tensor_parallel",
        "tensor_plan",
        "pipeline_parallel",
        "pipeline_split",
        "microbatches",
        "schedule",
        "stages_per_rank",
    ]
    for name in given:
        if name not in taken and name not in ("mesh", "module"):  # those: refused below
            near = difflib.get_close_matches(name, taken + own, n=1)
            hint = f" Did you mean {near[0]!r}?" if near else ""
            raise ConfigurationError(
                f"FSDPStrategy({name}=...): neither FSDPStrategy nor torch's fully_shard "
                f"takes {name!r}.{hint} FSDPStrategy takes {', '.join(own)}, and passes on to "
                f"fully_shard: {', '.join(n for n in taken if n != 'mesh')}"
            )


def _world_mesh(device: torch.device) -> Any:
    """The 1-D DeviceMesh of every rank that FSDP shards over without HSDP."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(device.type, (torch.distributed.get_world_size(),))


def _plan_words(plan: Any) -> str:
    """A plan as every rank can compare it: a function by its qualified name."""
    if plan is None or isinstance(plan, str):
        return repr(plan)
    if isinstance(plan, dict):  # a style object by its repr, unless that is its address
        return repr({k: _plan_words(v) if not isinstance(v, str) else v for k, v in plan.items()})
    text = repr(plan)
    if " at 0x" not in text and not callable(plan):
        return text
    name = getattr(plan, "__qualname__", type(plan).__name__)
    return f"{getattr(plan, '__module__', '?')}.{name}"
