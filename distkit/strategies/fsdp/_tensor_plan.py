"""``FSDPStrategy(tensor_plan=...)``: which modules tensor parallelism splits, and how.

A plan is turned into torch's ``{module name: ParallelStyle}`` for ``parallelize_module``
(torch does the splitting: no tensor is cut here) and checked against the model first, on
every rank alike and before any collective: a pattern that matches no module, a style on a
module it cannot split, a dimension the tensor-parallel degree does not divide, a parameter
the split module shares with another (a tied embedding: splitting it would untie it silently)
are refused, naming the module, its shape and the degree.

A plan is a mapping of ``fnmatch`` patterns over ``model.named_modules()`` names to
``"colwise"``, ``"rowwise"``, ``"colwise_gather"`` (colwise, its output gathered whole: a
language model's head), ``"sequence"`` or a torch ``ParallelStyle``; a callable
``(model, tp_mesh) -> None`` that parallelises the model itself; or ``"auto"``: a transformers
model's own published plan (its ``_tp_plan``, else ``config.base_model_tp_plan`` under the
base model's prefix), whose styles are mapped to torch's.

With ``"sequence"`` anywhere in a plan (sequence parallelism, Megatron-style), the activations
between the split layers are split over the sequence (dim 1) instead of held whole on every
rank: a ``"sequence"`` module (a norm) runs on its rank's part of the sequence, every
``"colwise"`` layer gathers the sequence first, every ``"rowwise"`` layer (an embedding's too)
reduce-scatters its output over it. What runs between them must work position by position;
a plan whose layouts do not fit the model gives each rank of a group its own loss, which the
first backward finds (FSDPStrategy compares them).
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn

from distkit.errors import ConfigurationError

STYLES = ("colwise", "rowwise", "colwise_gather", "sequence")
#: transformers' style names -> distkit's spelling of the same split (transformers 5.x)
_TRANSFORMERS_STYLES = {
    "colwise": "colwise",
    "rowwise": "rowwise",
    "colwise_gather_output": "colwise_gather",
    "colwise_rep": "colwise_gather",
    "embedding_rowwise": "rowwise",
    "sequence_parallel": "sequence",
}
PlanFn = Callable[[nn.Module, Any], None]


@dataclass(frozen=True)
class TensorPlan:
    """A checked plan: the styles per module name (in model order), or the user's function."""

    styles: Mapping[str, Any]
    apply_fn: PlanFn | None = None

    def apply(self, model: nn.Module, tp_mesh: Any) -> None:
        """Split ``model`` over ``tp_mesh`` (a collective on the tensor-parallel ranks)."""
        if self.apply_fn is not None:
            self.apply_fn(model, tp_mesh)
            return
        from torch.distributed.tensor.parallel import parallelize_module

        parallelize_module(model, tp_mesh, dict(self.styles))


def checked_plan_option(plan: Any, degree: int) -> Any:
    """``tensor_plan=`` as given, refused at construction where its form is wrong."""
    if plan is None:
        if degree > 1:
            raise ConfigurationError(
                f"FSDPStrategy(tensor_parallel={degree}) needs tensor_plan=: which modules to "
                "split, e.g. tensor_plan={'blocks.*.up': 'colwise', 'blocks.*.down': "
                "'rowwise'}, 'auto' (a transformers model's own plan), or fn(model, tp_mesh)"
            )
        return None
    if degree == 1:
        raise ConfigurationError(
            f"FSDPStrategy(tensor_plan={plan!r}) with tensor_parallel=1: a plan splits modules "
            "over tensor-parallel ranks, and there are none. Pass tensor_parallel=2 (or more), "
            "or leave tensor_plan out"
        )
    if plan == "auto" or (callable(plan) and not isinstance(plan, Mapping)):
        return plan
    if isinstance(plan, Mapping) and plan:
        for pattern, style in plan.items():
            if not isinstance(pattern, str):
                raise ConfigurationError(
                    f"tensor_plan key {pattern!r}: keys are module-name patterns (str, fnmatch "
                    "over model.named_modules() names), e.g. 'blocks.*.up'"
                )
            _style_of(style, pattern)
        return dict(plan)
    raise ConfigurationError(
        f"tensor_plan={plan!r}; allowed: a non-empty dict of module-name patterns to "
        f"{', '.join(map(repr, STYLES))} or a torch ParallelStyle, 'auto' (a transformers "
        "model's published plan), or a callable fn(model, tp_mesh) -> None"
    )


def resolve(plan: Any, model: nn.Module, degree: int) -> TensorPlan:
    """The plan for ``model`` split ``degree`` ways, checked (see the module docstring)."""
    if callable(plan) and not isinstance(plan, Mapping):
        return TensorPlan({}, apply_fn=plan)
    if plan == "auto":
        plan = _published_plan(model, degree)
    modules = dict(model.named_modules())
    chosen: dict[str, tuple[str, Any]] = {}  # module name -> (pattern, style)
    for pattern, style in plan.items():
        matched = [name for name in modules if name and fnmatch.fnmatchcase(name, pattern)]
        if not matched:
            near = sorted(modules)[1:6]
            raise ConfigurationError(
                f"tensor_plan pattern {pattern!r} matches no module of "
                f"{type(model).__name__}; patterns are fnmatch over model.named_modules() "
                f"names, e.g. {', '.join(near)}{', ...' if len(modules) > 6 else ''}"
            )
        for name in matched:
            earlier = chosen.get(name)
            if earlier is not None and earlier[1] != style:
                raise ConfigurationError(
                    f"tensor_plan: module {name!r} is matched by {earlier[0]!r} "
                    f"({earlier[1]!r}) and by {pattern!r} ({style!r}); give each module one "
                    "style (narrow one pattern)"
                )
            chosen[name] = (pattern, style)
    _refuse_shared(model, set(chosen))
    sequence = any(style == "sequence" for _, style in chosen.values())
    styles = {}
    for name in modules:  # model order: parents before children, as torch applies them
        if name in chosen:
            style = chosen[name][1]
            styles[name] = _torch_style(style, name, modules[name], degree, sequence=sequence)
    return TensorPlan(styles)


def _style_of(style: Any, where: str) -> str | None:
    """A style string's name (checked), or None for a torch ParallelStyle."""
    if isinstance(style, str):
        if style in STYLES:
            return style
        raise ConfigurationError(
            f"tensor_plan[{where!r}] = {style!r}; allowed: {', '.join(map(repr, STYLES))}, or a "
            "torch.distributed.tensor.parallel.ParallelStyle (ColwiseParallel(...), ...)"
        )
    from torch.distributed.tensor.parallel import ParallelStyle

    if isinstance(style, ParallelStyle):
        return None
    raise ConfigurationError(
        f"tensor_plan[{where!r}] = {style!r} ({type(style).__name__}); allowed: "
        f"{', '.join(map(repr, STYLES))}, or a torch ParallelStyle instance"
    )


def _torch_style(style: Any, name: str, module: nn.Module, degree: int, *, sequence: bool) -> Any:
    """torch's ParallelStyle for ``style`` on ``module``, after the split is checked;
    ``sequence``: the plan splits the activations between layers over the sequence."""
    kind = _style_of(style, name)
    if kind is None:
        return style  # the user's own ParallelStyle: torch checks it
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        SequenceParallel,
    )

    if kind == "sequence":
        if not any(True for _ in module.parameters(recurse=False)) and not list(module.children()):
            raise ConfigurationError(
                f"tensor_plan[{name!r}] = 'sequence' on {type(module).__name__}, which holds no "
                "parameters; sequence parallelism keeps a norm's (LayerNorm, RMSNorm) "
                "parameters whole and splits its activations over the sequence"
            )
        # its rank's part of the sequence in and out, as a local tensor like every style here
        return SequenceParallel(use_local_output=True)
    colwise = kind in ("colwise", "colwise_gather")
    _check_split(module, name, colwise, degree)
    streamed = Shard(1) if sequence else None  # the layout between the split layers
    if isinstance(module, nn.Embedding):
        # token ids come whole to every rank: never read them as split over their last dim
        if colwise:
            return ColwiseParallel(input_layouts=Replicate(), output_layouts=streamed)
        return RowwiseParallel(input_layouts=Replicate(), output_layouts=streamed)
    if kind == "colwise_gather":
        return ColwiseParallel(input_layouts=streamed, output_layouts=Replicate())
    if colwise:
        return ColwiseParallel(input_layouts=streamed)
    return RowwiseParallel(output_layouts=streamed)


def _check_split(module: nn.Module, name: str, colwise: bool, degree: int) -> None:
    """Refuse a colwise/rowwise style where the module is not a Linear or an Embedding, or
    where the split dimension is not a multiple of ``degree``."""
    way = "colwise" if colwise else "rowwise"
    if isinstance(module, nn.Linear):
        if colwise:
            size, what = module.out_features, "out_features"
        else:
            size, what = module.in_features, "in_features"
    elif isinstance(module, nn.Embedding):
        size, what = (
            (module.embedding_dim, "embedding_dim")
            if colwise
            else (module.num_embeddings, "num_embeddings")
        )
    else:
        shapes = {n: tuple(p.shape) for n, p in module.named_parameters(recurse=False)}
        raise ConfigurationError(
            f"tensor_plan[{name!r}] = {way!r} on {type(module).__name__} (parameters "
            f"{shapes or 'none'}): distkit's 'colwise' and 'rowwise' split nn.Linear and "
            "nn.Embedding only (GPT-2's Conv1D is neither: write a plan of your own with "
            "torch ParallelStyles, or a callable tensor_plan). Match the Linear layers inside "
            f"it (e.g. '{name}.*'), or pass a torch ParallelStyle for this module"
        )
    if size % degree:
        weight = tuple(module.weight.shape)
        raise ConfigurationError(
            f"tensor_plan[{name!r}] = {way!r}: {type(module).__name__} {name!r} (weight "
            f"{weight}) has {what}={size}, which tensor_parallel={degree} does not divide; "
            f"every rank must hold an equal slice. Use a tensor_parallel that divides {size}, "
            "or leave this module out of the plan"
        )


def _refuse_shared(model: nn.Module, planned: set[str]) -> None:
    """A split module's parameter that another module also holds (tied weights) would be
    replaced for one of them only: refuse it."""
    owners: dict[int, list[str]] = {}
    for name, module in model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), []).append(name)
    for names in owners.values():
        split = [n for n in names if any(n == p or n.startswith(p + ".") for p in planned)]
        if split and len(names) > 1:  # each module's parameter is replaced on its own
            raise ConfigurationError(
                f"tensor_plan splits {split[0]!r}, which shares a parameter with "
                f"{', '.join(repr(n) for n in names if n != split[0])} (tied weights): "
                "splitting it (even with the other, each gets a parameter of its own) would "
                "untie them. Leave both out of the plan, or untie the weights "
                "(tie_word_embeddings=False)"
            )


def _published_plan(model: nn.Module, degree: int) -> dict[str, str]:
    """A transformers model's own plan, in distkit's style names (``"auto"``)."""
    config = getattr(model, "config", None)
    own = getattr(model, "_tp_plan", None)
    base = getattr(config, "base_model_tp_plan", None)
    if own:
        published = dict(own)
    elif base:
        prefix = getattr(model, "base_model_prefix", "")
        inner = prefix and isinstance(getattr(model, prefix, None), nn.Module)
        published = {(f"{prefix}.{k}" if inner else k): v for k, v in base.items()}
    else:
        raise ConfigurationError(
            f"tensor_plan='auto': {type(model).__name__} publishes no tensor-parallel plan "
            "(no config.base_model_tp_plan; transformers' Llama and Qwen2 have one, GPT-2 does "
            "not). Pass a plan of your own: a dict of module-name patterns to 'colwise' / "
            "'rowwise' / a torch ParallelStyle, or fn(model, tp_mesh)"
        )
    unknown = sorted({v for v in published.values() if v not in _TRANSFORMERS_STYLES})
    if unknown:
        raise ConfigurationError(
            f"tensor_plan='auto': {type(model).__name__}'s published plan uses the style(s) "
            f"{', '.join(map(repr, unknown))}, which distkit does not map to torch's (it maps "
            f"{', '.join(map(repr, _TRANSFORMERS_STYLES))}). Pass the plan yourself, with torch "
            "ParallelStyles for those modules"
        )
    _check_heads(model, config, degree)
    return {pattern: _TRANSFORMERS_STYLES[style] for pattern, style in published.items()}


def _check_heads(model: nn.Module, config: Any, degree: int) -> None:
    """Attention splits whole heads: their counts must be multiples of the degree."""
    for field in ("num_attention_heads", "num_key_value_heads"):
        heads = getattr(config, field, None)
        if isinstance(heads, int) and heads % degree:
            raise ConfigurationError(
                f"tensor_plan='auto': {type(model).__name__} has {field}={heads}, which "
                f"tensor_parallel={degree} does not divide: each rank must hold whole attention "
                f"heads. Use a tensor_parallel that divides {heads}"
            )
