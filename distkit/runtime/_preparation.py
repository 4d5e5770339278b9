"""What the runtime's collective calls check before they start, and what must match.

Each ``prepare_*`` runs on every rank before the call's first collective and changes nothing:
it validates the arguments (so a wrong one fails at the call, not in torch later), finds what
the call needs, and says which values every rank must agree on (see
:mod:`distkit.runtime._agreement`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import nn

from distkit.data import LoaderSpec
from distkit.data._stream_spec import StreamSpec
from distkit.errors import ConfigurationError
from distkit.metrics import Metric
from distkit.runtime import _agreement
from distkit.runtime._evaluation import LossFn, Metrics, named_metrics
from distkit.runtime._runtime_arguments import check_model
from distkit.strategies._placement import Placement

if TYPE_CHECKING:
    from distkit.runtime._setups import SetupCache


def checked_placement(
    setups: SetupCache, model: nn.Module, input_device: torch.device | None
) -> Placement:
    """Where ``model`` is against this rank's device, with ``input_device`` (the Trainer's
    ``input_device=``); raises where the strategy cannot train it there, or where
    ``input_device`` is given for a model distkit places itself."""
    strategy = setups.strategy
    placement = setups.placement(model)
    placement.check(
        strategy.name,
        strategy.placement_refusal,
        strategy.meta_refusal,
        choices=strategy.choices,
    )
    if input_device is not None and not placement.user_placed:
        raise ConfigurationError(
            f"input_device={str(input_device)!r} is for a model you placed on devices "
            f"of your own; this model is on {placement.describe()}, so distkit moves it and "
            f"its inputs to this rank's device ({strategy.device}). Leave input_device=None, "
            "or place the model yourself (e.g. its layers on cuda:0 and cuda:1)"
        )
    return dataclasses.replace(placement, override=input_device)


def samples_of(spec: LoaderSpec | StreamSpec) -> int | None:
    """The samples of an epoch, where known ahead (None: a stream)."""
    return None if isinstance(spec, StreamSpec) else len(spec)


def describe_data(spec: LoaderSpec | StreamSpec) -> str:
    return spec.describe() if isinstance(spec, StreamSpec) else str(len(spec))


def prepare_evaluate(
    setups: SetupCache,
    model: nn.Module,
    read: Callable[[], LoaderSpec | StreamSpec],
    loss_fn: LossFn | None,
    metrics: Metrics | None,
    input_device: torch.device | None,
    *,
    step_fn: object = None,
) -> _agreement.Proposal[tuple[dict[str, Metric], LoaderSpec | StreamSpec, Placement]]:
    """``evaluate``'s checks; ``read()`` describes its data (after the other checks)."""
    check_model(model)
    placement = checked_placement(setups, model, input_device)
    named = named_metrics(metrics)
    for name, fn in (("loss_fn", loss_fn), ("step_fn", step_fn)):
        if fn is not None and not callable(fn):
            raise ConfigurationError(f"evaluate's {name} must be callable, got {type(fn).__name__}")
    if loss_fn is not None and step_fn is not None:
        raise ConfigurationError(
            "evaluate takes a loss_fn (loss_fn(model(inputs), target)) or a step_fn "
            "(step_fn(model, batch)), not both: pass one"
        )
    if loss_fn is None and step_fn is None and not named:
        raise ConfigurationError(
            "evaluate needs a loss_fn, a step_fn, metrics, or a mix: e.g. "
            "step_fn=lambda model, batch: model(**batch) for a model that returns its loss"
        )
    spec = read()
    agreed = {"data samples": describe_data(spec), "metrics": ", ".join(named) or "none"}
    return _agreement.Proposal(agreed, (named, spec, placement))
