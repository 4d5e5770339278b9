"""A model cut into pipeline stages: by the names where each stage begins, or by the user.

``pipeline_split=["blocks.2"]`` cuts the model's execution order at those modules: the root's
children in registration order, a container holding a cut expanded into its own children (so
``"blocks.2"`` cuts a ``ModuleList`` of blocks), each resulting *unit* run on the previous
one's output. That holds for a model whose ``forward`` runs its children in order and nothing
between them; :class:`ChainCheck` proves it on the first batch, on a copy of the model on the
meta device (no memory, no values), and a model whose forward does more is refused, naming the
first unit where the chain breaks. ``pipeline_split=fn`` hands the cut to the user: ``fn(model)``
returns the stage modules (each run on the previous one's output), built from the model's own
parameters.

The stages' parameters must be the model's (a checkpoint keys them by the model's names), each
in one stage only: a weight tied across stages would be two copies trained apart.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from distkit.errors import ConfigurationError

#: what to do instead when distkit cannot cut a model by names
CALLABLE_HINT = (
    "pass pipeline_split=fn, where fn(model) returns the stage modules (each run on the "
    "previous one's output, built from the model's own modules), or restructure forward as "
    "children run in order"
)


class Chain(nn.Module):
    """Units of a model run one after another: one pipeline stage. Its children are the
    model's own modules (no copies), registered under indices; the parameters keep their
    names in the model."""

    def __init__(self, units: Sequence[nn.Module], names: Sequence[str]) -> None:
        super().__init__()
        self.units = nn.ModuleList(units)
        self.__dict__["unit_names"] = list(names)

    def forward(self, *args: Any) -> Any:
        # a stage receives the previous stage's outputs as separate arguments: a unit that
        # returned a tuple gets it back as one
        x = args[0] if len(args) == 1 else args
        for unit in self.units:
            x = unit(x)
        return x

    def extra_repr(self) -> str:
        return ", ".join(self.__dict__["unit_names"])


@dataclass
class Stages:
    """The stage modules in pipeline order, and where the model's state lives in them."""

    modules: list[nn.Module]
    #: the model's state_dict key -> the stage that holds it
    owner: dict[str, int]
    #: the check of the model's forward still to run on a first batch (None: nothing to
    #: check, the user cut the model)
    check: ChainCheck | None = None
    #: the units of each stage by their names in the model (names cut), for messages
    words: list[str] = field(default_factory=list)


def split_model(model: nn.Module, split: Any, stages: int) -> Stages:
    """``model`` cut into ``stages`` stage modules (see the module's docstring); checked on
    every rank alike, before any collective."""
    if callable(split):
        built = split(model)
        modules = list(built) if isinstance(built, list | tuple) else None
        if (
            modules is None
            or len(modules) != stages
            or not all(isinstance(m, nn.Module) for m in modules)
        ):
            raise ConfigurationError(
                f"pipeline_split={_name(split)} returned {_shown(built)}; it must return a "
                f"list of {stages} nn.Module stages (one per pipeline stage, in order)"
            )
        result = Stages(modules, {}, None, [type(m).__name__ for m in modules])
    else:
        units = _units(model, list(split))
        cuts = [0] + [next(i for i, (n, _) in enumerate(units) if n == c) for c in split]
        order = sorted(cuts)
        if order != cuts or len(set(cuts)) != len(cuts) or cuts[1] == 0:
            names = [n for n, _ in units]
            raise ConfigurationError(
                f"pipeline_split={list(split)} must name modules in the order the model runs "
                f"them, each after the first unit and after the previous cut; the model runs, "
                f"in order: {names}"
            )
        bounds = [*cuts, len(units)]
        parts = [units[a:b] for a, b in itertools.pairwise(bounds)]
        modules = [Chain([m for _, m in part], [n for n, _ in part]) for part in parts]
        check = ChainCheck(model, [n for n, _ in units])
        result = Stages(modules, {}, check, [_span(part) for part in parts])
    result.owner = _owners(model, result.modules, result.words)
    _refuse_batch_statistics(model)
    return result


def _units(model: nn.Module, cuts: list[str]) -> list[tuple[str, nn.Module]]:
    """The model's execution units: its children in order, a child holding a cut expanded."""
    known = dict(model.named_modules())
    for cut in cuts:
        if cut not in known or cut == "":
            near = [n for n in known if n][:12]
            raise ConfigurationError(
                f"pipeline_split names {cut!r}, which is no module of the model "
                f"({type(model).__name__}); its modules include: {near}"
            )

    def expand(module: nn.Module, prefix: str) -> list[tuple[str, nn.Module]]:
        own = [n for n, _ in module.named_parameters(recurse=False)]
        own += [n for n, _ in module.named_buffers(recurse=False)]
        if own:
            where = prefix or type(module).__name__
            raise ConfigurationError(
                f"pipeline_split cuts inside {where!r}, which holds {own} itself: its forward "
                f"uses them between its children, so distkit cannot cut it by names; "
                f"{CALLABLE_HINT}"
            )
        out: list[tuple[str, nn.Module]] = []
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if any(c.startswith(full + ".") for c in cuts):
                out += expand(child, full)
            else:
                out.append((full, child))
        return out

    return expand(model, "")


def _span(part: list[tuple[str, nn.Module]]) -> str:
    return part[0][0] if len(part) == 1 else f"{part[0][0]} .. {part[-1][0]}"


def _owners(model: nn.Module, modules: list[nn.Module], words: list[str]) -> dict[str, int]:
    """The model's state_dict keys -> the stage holding each; every key in one stage."""
    names = {id(t): k for k, t in model.state_dict(keep_vars=True).items()}
    # a buffer outside the state dict (persistent=False: recomputed, never saved) may sit in
    # any stage, or in several
    unsaved = {id(b) for b in model.buffers()} - set(names)
    all_names: dict[int, list[str]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        all_names.setdefault(id(tensor), []).append(key)
    owner: dict[str, int] = {}
    for index, module in enumerate(modules):
        for tensor in (*module.parameters(), *module.buffers()):
            if id(tensor) in unsaved:
                continue
            if id(tensor) not in names:
                raise ConfigurationError(
                    f"pipeline stage {index} ({words[index]}) holds a tensor of shape "
                    f"{tuple(tensor.shape)} that is not the model's: the stage modules must be "
                    "built from the model's own modules, so that checkpoints keep its names"
                )
            for key in all_names[id(tensor)]:
                seen = owner.setdefault(key, index)
                if seen != index:
                    others = [k for k in all_names[id(tensor)] if k != key] or [key]
                    raise ConfigurationError(
                        f"{key!r} (tied with {others}) would be in pipeline stages {seen} and "
                        f"{index}: each stage would train its own copy, and they would drift "
                        "apart. Untie the weights, or cut so that both users of it are in "
                        "one stage"
                    )
    missing = [k for k, t in model.state_dict(keep_vars=True).items() if k not in owner]
    if missing:
        raise ConfigurationError(
            f"no pipeline stage holds {missing[:6]}{' ...' if len(missing) > 6 else ''}: the "
            "stages must hold every parameter and buffer of the model (each trains on one "
            "stage's ranks), or a checkpoint would lose them"
        )
    return owner


def _refuse_batch_statistics(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):  # batch statistics in training
            raise ConfigurationError(
                f"{name!r} is a {type(module).__name__}: under a pipeline each micro-batch "
                "runs alone, so its batch statistics would be a micro-batch's, not the "
                "batch's (not what one process computes). Use LayerNorm or GroupNorm, or "
                "train without pipeline_parallel"
            )


class ChainCheck:
    """That the model's forward is its units run in order, each on the previous one's
    output and nothing between: proved once, on a first batch, with a copy of the model on
    the meta device (its tensors hold no memory) whose units record their calls."""

    def __init__(self, model: nn.Module, names: list[str]) -> None:
        memo: dict[int, Any] = {}
        for tensor in (*model.parameters(), *model.buffers()):
            meta = torch.empty_like(tensor, device="meta")
            if isinstance(tensor, nn.Parameter):
                meta = nn.Parameter(meta, requires_grad=tensor.requires_grad)
            memo[id(tensor)] = meta
        self.model = copy.deepcopy(model, memo)
        self.names = names

    def run(self, inputs: Any) -> None:
        """Raise where the model's forward on ``inputs`` is not its units in order."""
        modules = dict(self.model.named_modules())
        calls: list[tuple[str, tuple[Any, ...], dict[str, Any], Any]] = []
        handles = [
            modules[name].register_forward_hook(
                lambda _m, args, kwargs, out, name=name: calls.append((name, args, kwargs, out)),
                with_kwargs=True,
            )
            for name in self.names
        ]
        given = _on_meta(inputs)
        try:
            with torch.no_grad():
                output = self.model(given)
        except Exception as exc:  # the check cannot run: say so, and train on
            import warnings

            warnings.warn(
                f"distkit could not check on the meta device that the model's forward runs "
                f"its children in order ({type(exc).__name__}: {exc}); the pipeline assumes "
                f"it does: {' -> '.join(self.names)}",
                UserWarning,
                stacklevel=3,
            )
            return
        finally:
            for handle in handles:
                handle.remove()
            self.model = nn.Module()  # its copy is no longer needed
        expected = given
        for index, name in enumerate(self.names):
            if index >= len(calls) or calls[index][0] != name:
                ran = [c[0] for c in calls]
                raise _broken(name, f"the forward ran the units {ran}, not each once in order")
            _, args, kwargs, out = calls[index]
            if kwargs or len(args) != 1 or args[0] is not expected:
                before = (
                    "the model's input" if index == 0 else f"{self.names[index - 1]!r}'s output"
                )
                raise _broken(
                    name,
                    f"it was called on something other than {before} alone (the forward "
                    "computes something between them, or passes more arguments)",
                )
            expected = out
        if len(calls) != len(self.names):
            raise _broken(self.names[-1], "the forward ran some units more than once")
        if output is not expected:
            raise _broken(
                self.names[-1],
                "the model's output is not its output (the forward computes something after it)",
            )


def _broken(name: str, why: str) -> ConfigurationError:
    return ConfigurationError(
        f"pipeline_split: distkit could not cut the model by names at {name!r}: {why}. A cut "
        f"by names needs a forward that runs its children in order; {CALLABLE_HINT}"
    )


def _on_meta(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return torch.empty_like(value, device="meta")
    if isinstance(value, tuple | list):
        return type(value)(_on_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: _on_meta(v) for k, v in value.items()}
    return value


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", type(fn).__name__)


def _shown(value: Any) -> str:
    if isinstance(value, list | tuple):
        return f"a {type(value).__name__} of {len(value)}: {[type(v).__name__ for v in value]}"
    return f"a {type(value).__name__}"
