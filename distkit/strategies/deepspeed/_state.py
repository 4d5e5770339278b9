"""ZeRO's partitioned state to and from distkit's neutral form (torch's own ``state_dict``s).

ZeRO keeps the fp32 master weights and the optimizer state as flat partitions, one slice per
rank (stage 3: the module's parameters too). distkit's checkpoints hold full tensors keyed as
the user's model and optimizer key them, so that a deepspeed run resumes under ddp, fsdp or
one process and back. DeepSpeed's public ``deepspeed.utils.safe_get_full_*`` /
``safe_set_full_*`` read and write one parameter's full tensor (collectives: every rank calls
them for every parameter, in the same order).

ZeRO creates its optimizer state at the first step; a checkpoint loaded before that (a resumed
fit) first gets zero tensors of the flat partitions' shapes, as ``torch.optim`` would have
made them, which the full tensors then overwrite.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from typing_extensions import override

from distkit.strategies import _meta_init
from distkit.strategies.capabilities import StateIO
from distkit.strategies.deepspeed import _shards

if TYPE_CHECKING:
    from distkit.strategies.deepspeed import DeepSpeedStrategy


class Engine:
    """One ``deepspeed.initialize`` result and what distkit needs to map it back: the user's
    parameters per optimizer group, in the order the user's optimizer held them."""

    def __init__(self, engine: Any, groups: list[list[nn.Parameter]], stage: int) -> None:
        self.engine = engine
        self.groups = groups
        self.stage = stage
        #: whether its module ran a forward since its own last backward (a loss through it
        #: may then be another engine's: DeepSpeed runs its hooks in any backward)
        self.forwarded = False
        engine.module.register_forward_pre_hook(self._ran)

    def _ran(self, *_: Any) -> None:
        self.forwarded = True

    @property
    def zero(self) -> Any:
        """DeepSpeed's ZeRO optimizer (it steps the user's torch optimizer on partitions)."""
        return self.engine.optimizer

    def params(self) -> Iterator[nn.Parameter]:
        for group in self.groups:
            yield from group

    def flat_partitions(self) -> list[torch.Tensor]:
        """This rank's fp32 partition of each group, as the inner torch optimizer keys them."""
        for name in (
            "fp32_partitioned_groups_flat",  # stage 3
            "single_partition_of_fp32_groups",  # stages 1 and 2
            "fp32_groups_flat_partition",  # stage 1 with bf16 (DeepSpeed's BF16_Optimizer)
        ):
            flats = getattr(self.zero, name, None)
            if flats is not None:
                return list(flats)
        raise RuntimeError(
            f"distkit does not know where {type(self.zero).__name__} keeps its fp32 partitions "
            "(a DeepSpeed version distkit was not tested with: see the deepspeed extra's pin)"
        )

    def inner_state(self) -> dict[Any, dict[str, Any]]:
        state: dict[Any, dict[str, Any]] = self.zero.optimizer.state
        return state


def full_weight(param: nn.Parameter) -> torch.Tensor:
    """One parameter's full fp32 master weight on the CPU (a collective)."""
    from deepspeed.utils import safe_get_full_fp32_param

    value = safe_get_full_fp32_param(param)
    if value is None:  # not trained (requires_grad=False): ZeRO keeps no master copy
        value = _gathered(param)
    return value.detach().to("cpu", torch.float32, copy=True)


def _gathered(param: nn.Parameter) -> torch.Tensor:
    if hasattr(param, "ds_id"):  # stage 3 partitions it anyway
        import deepspeed

        with deepspeed.zero.GatheredParameters([param], modifier_rank=None):
            return param.detach().clone()
    return param.detach()


def set_full_weight(param: nn.Parameter, value: torch.Tensor) -> None:
    """Write one parameter's full weight: the master copy and the module's (a collective)."""
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param

    value = value.detach()
    if hasattr(param, "ds_id"):
        _set_stage3(param, value, None)
    else:
        safe_set_full_fp32_param(param, value.to(param.device, torch.float32))
    if hasattr(param, "ds_id"):
        with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
            param.data.copy_(value.to(param.device, param.dtype))
    else:
        with torch.no_grad():
            param.copy_(value.to(param.device, param.dtype))


class DeepSpeedStateIO(StateIO):
    """Full weights and optimizer state in torch's form, gathered from ZeRO's partitions."""

    collective = True  # the full state is gathered from every rank's shard

    strategy: DeepSpeedStrategy

    @override
    def model_state_dict(
        self, model: nn.Module, *, rank0_only: bool = False
    ) -> dict[str, torch.Tensor]:
        if self.strategy.engine_of_model(model) is None:
            return super().model_state_dict(model, rank0_only=rank0_only)
        full: dict[int, torch.Tensor] = {}
        out: dict[str, torch.Tensor] = {}
        for key, value in model.state_dict(keep_vars=True).items():
            if isinstance(value, nn.Parameter):
                if id(value) not in full:  # a tied weight: gathered once
                    full[id(value)] = full_weight(value)
                out[key] = full[id(value)]
            elif isinstance(value, torch.Tensor):
                out[key] = value.detach().to("cpu", copy=True)
            else:
                out[key] = value
        return {} if rank0_only and not self.strategy.is_main else out

    @override
    def optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, *, rank0_only: bool = False
    ) -> dict[str, Any]:
        engine = self.strategy.engine_of_optimizer(optimizer)
        if engine is None:
            return super().optimizer_state_dict(optimizer, rank0_only=rank0_only)
        from deepspeed.utils import safe_get_full_optimizer_state

        flats = engine.flat_partitions()
        inner = engine.inner_state()
        state: dict[int, dict[str, Any]] = {}
        index = 0
        for number, params in enumerate(engine.groups):
            flat_state = _group_state(inner, flats, number, engine)
            keys = sorted(flat_state)
            for param in params:
                entry: dict[str, Any] = {}
                for key in keys:
                    value = flat_state[key]
                    if isinstance(value, torch.Tensor) and value.ndim > 0:
                        full = safe_get_full_optimizer_state(param, key)
                        entry[key] = full.detach().to("cpu", copy=True).reshape(_shape(param))
                    elif isinstance(value, torch.Tensor):  # per group ("step"): torch keeps
                        entry[key] = value.detach().to("cpu", copy=True)  # it per parameter
                    else:
                        entry[key] = value
                if entry:
                    state[index] = entry
                index += 1
        if rank0_only and not self.strategy.is_main:
            return {}
        return {"state": state, "param_groups": torch_groups(engine, optimizer)}

    @override
    def shapes(self, model: nn.Module) -> dict[str, torch.Size | None]:
        shapes = super().shapes(model)
        for key, value in model.state_dict(keep_vars=True).items():
            if isinstance(value, torch.Tensor) and hasattr(value, "ds_shape"):
                shapes[key] = value.ds_shape  # stage 3: partitioned, its data empty
        return shapes

    @override
    def param_groups(self, optimizer: torch.optim.Optimizer) -> list[list[torch.Tensor]]:
        engine = self.strategy.engine_of_optimizer(optimizer)
        if engine is None:
            return super().param_groups(optimizer)
        return [list(group) for group in engine.groups]  # ZeRO re-pointed it at partitions

    @override
    def checkpoint_state(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, path: Path | str
    ) -> dict[str, Any]:
        record = self.strategy.engine_of_model(model)
        if self.strategy.checkpoint == "full" or record is None:
            return super().checkpoint_state(model, optimizer, path)
        groups = torch_groups(record, optimizer)
        return _shards.save(self.strategy, record.engine, model, path, groups)

    @override
    def load_sharded(
        self, payload: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> None:
        if _shards.MARK in payload:  # DeepSpeed's own folder: its engine reads it
            _shards.check_loadable(payload, self.strategy.stage, self.strategy.world_size)
            record = self.strategy.engine_of_model(model)
            if record is None:  # at the set-up, once the engine exists
                self.strategy._before_setup[id(model)] = payload
            else:
                _shards.load(record.engine, payload)
            return
        if self.strategy.engine_of_model(model) is None and not _meta_init.on_meta(model):
            super().load_sharded(payload, model, optimizer)  # plain tensors: taken at set-up
            return
        # ZeRO keeps its own fp32 master weights and optimizer partitions: written into the
        # module's tensors alone, the next step would overwrite them with the old ones
        from distkit.checkpoint import _shard_files

        weights, optimizer_state = _shard_files.read_full(payload)
        self.load_model_state_dict(model, weights)
        if optimizer_state is not None:
            self.load_optimizer_state_dict(optimizer, optimizer_state)

    @override
    def load_model_state_dict(self, model: nn.Module, state: dict[str, Any]) -> None:
        if self.strategy.engine_of_model(model) is None:
            if _meta_init.on_meta(model):  # no values to load into yet: at the set-up
                self.strategy._before_setup[id(model)] = state
            else:
                model.load_state_dict(state)
            return
        missing = set(model.state_dict()) - set(state)
        unexpected = set(state) - set(model.state_dict())
        if missing or unexpected:
            raise RuntimeError(
                f"the checkpoint's weights do not fit the model: missing {sorted(missing)}, "
                f"unexpected {sorted(unexpected)}"
            )
        done: set[int] = set()
        for key, value in model.state_dict(keep_vars=True).items():
            if isinstance(value, nn.Parameter):
                if id(value) not in done:
                    set_full_weight(value, state[key])
                    done.add(id(value))
            elif isinstance(value, torch.Tensor):
                with torch.no_grad():
                    value.copy_(state[key].to(value.device, value.dtype))

    @override
    def load_optimizer_state_dict(
        self, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        engine = self.strategy.engine_of_optimizer(optimizer)
        if engine is None:  # not set up yet: torch's form, taken over at the set-up
            params = [p for group in optimizer.param_groups for p in group["params"]]
            if params and all(p.is_meta for p in params):  # a meta model's: kept aside
                self.strategy._before_setup[id(optimizer)] = state
            else:
                optimizer.load_state_dict(state)
            return
        load_into_engine(engine, state)


def torch_groups(engine: Engine, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The optimizer's ``param_groups`` as torch's ``state_dict`` gives them: each group's
    settings and the indices of the user's parameters in it (ZeRO re-pointed the groups at
    its partitions)."""
    groups: list[dict[str, Any]] = []
    index = 0
    for number, params in enumerate(engine.groups):
        hyper = {k: v for k, v in optimizer.param_groups[number].items() if k != "params"}
        groups.append({**hyper, "params": list(range(index, index + len(params)))})
        index += len(params)
    return groups


def _group_state(
    inner: dict[Any, dict[str, Any]], flats: list[torch.Tensor], number: int, engine: Engine
) -> dict[str, Any]:
    """The inner optimizer's state for group ``number``'s partition (stage 3 may cut a group
    into sub-groups: their keys are the same)."""
    if engine.stage == 3:
        for flat in flats:
            if inner.get(flat):
                return inner[flat]
        return {}
    return inner.get(flats[number], {})


def load_into_engine(engine: Engine, saved: dict[str, Any]) -> None:
    """Torch's optimizer ``state_dict`` form into ZeRO's partitions (a collective)."""
    from deepspeed.utils import safe_set_full_optimizer_state

    params = list(engine.params())
    per_param = saved.get("state", {})
    sizes = [len(g["params"]) for g in saved.get("param_groups", [])]
    if sizes != [len(g) for g in engine.groups]:
        raise RuntimeError(
            f"the optimizer state holds parameter groups of sizes {sizes}; this optimizer's "
            f"are {[len(g) for g in engine.groups]}"
        )
    if not per_param:
        return
    first = next(iter(per_param.values()))
    inner = engine.inner_state()
    for flat in engine.flat_partitions():  # made as torch makes them, then overwritten
        entry = inner.setdefault(flat, {})
        for key, value in first.items():
            if isinstance(value, torch.Tensor) and value.ndim > 0:
                entry.setdefault(key, torch.zeros_like(flat))
            else:
                entry[key] = value.clone() if isinstance(value, torch.Tensor) else value
    # stages 1 and 2 map each parameter's slice of the optimizer state at the first step;
    # before it (a resumed fit) the state above is linked here
    link = getattr(engine.zero, "_lazy_init_hp_params_optimizer_state", None)
    if callable(link):
        link()
    for index, param in enumerate(params):
        for key, value in per_param.get(index, {}).items():
            if isinstance(value, torch.Tensor) and value.ndim > 0:
                full = value.to(param.device, torch.float32).reshape(_shape(param))
                if hasattr(param, "ds_id"):
                    _set_stage3(param, full, key)
                else:
                    safe_set_full_optimizer_state(param, full, key)


def _set_stage3(param: nn.Parameter, value: torch.Tensor, key: str | None) -> None:
    """This rank's slice of ``value`` into a stage-3 parameter's fp32 partition (``key``:
    None) or its optimizer state. DeepSpeed 0.19.8's own ``set_full_hp_param`` cuts the slice
    past the end of a parameter whose size the world size does not divide (the last rank's
    partition is padded); here the padding stays zero."""
    zero = param._z3_optimizer  # type: ignore[attr-defined]
    partition, _ = zero._get_fp32_opt_state_partition(
        param, release_swap_buffers=False, optim_state_key=key
    )
    size = partition.numel()
    start = size * zero._get_param_partition_rank(param)
    piece = value.flatten()[start : start + size]
    with torch.no_grad():
        partition.zero_()
        partition[: piece.numel()].copy_(piece.to(partition.device, partition.dtype))


def _shape(param: nn.Parameter) -> torch.Size:
    """A parameter's full shape (stage 3 partitions it: its data is empty)."""
    shape: torch.Size = getattr(param, "ds_shape", param.shape)
    return shape
