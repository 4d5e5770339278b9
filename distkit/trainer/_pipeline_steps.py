"""A ``step_fn`` under a pipeline: the model it calls stands in for the pipeline.

``step_fn(model, batch) -> loss`` calls the model itself, and under a pipeline no rank holds
the model: the schedule runs the stages. So distkit runs the ``step_fn`` twice over, each time
with a stand-in for the model:

1. on every rank, to find the first stage's input: the stand-in records what ``step_fn``
   calls it with (one tensor) and stops it there;
2. on the last stage, once per micro-batch, on that micro-batch's rows of the batch: the
   stand-in returns the stage's output, and ``step_fn`` computes the loss from it (a mean, or a
   ``distkit.Loss``), as it would from the model's output.

That holds for a ``step_fn`` that calls the model once, on one tensor of the batch's rows, and
computes its loss from the output and the batch, row by row (the usual ``model(x)`` then a
loss); what it does before calling the model runs once per micro-batch and once more.
Attribute reads (``model.config``) reach the user's model.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from distkit.errors import ConfigurationError
from distkit.runtime import training_loss


class _Found(Exception):  # not an error: how the capture stops step_fn
    """Raised by the stand-in at ``step_fn``'s model call: the input it was given."""

    def __init__(self, value: torch.Tensor) -> None:
        super().__init__("the model's input")
        self.value = value


class _StandIn:
    """The model as ``step_fn`` sees it under a pipeline (see the module's docstring)."""

    def __init__(self, module: nn.Module, output: Any = None) -> None:
        self.__dict__["_module"] = module
        self.__dict__["_output"] = output

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_module"], name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        output = self.__dict__["_output"]
        if output is not None:
            return output
        if kwargs or len(args) != 1 or not isinstance(args[0], torch.Tensor):
            given = [type(a).__name__ for a in args]
            raise ConfigurationError(
                f"under pipeline_parallel, step_fn called the model with {given} and keywords "
                f"{sorted(kwargs)}: the first stage takes one input, so step_fn must call "
                "model(x) with one tensor (the inputs of the batch's rows). Pass the other "
                "arguments inside the stages (pipeline_split=fn), or use loss_fn"
            )
        raise _Found(args[0])

    forward = __call__


def pipeline_inputs(step_fn: Callable[[Any, Any], Any], module: nn.Module, batch: Any) -> Any:
    """What ``step_fn`` hands the model for ``batch``: the first stage's input."""
    try:
        step_fn(_StandIn(module), batch)
    except _Found as found:
        return found.value
    raise ConfigurationError(
        "under pipeline_parallel, step_fn returned without calling the model: distkit finds "
        "the first stage's input where step_fn calls model(x). Call the model in step_fn, "
        "or use loss_fn"
    )


def pipeline_loss(
    step_fn: Callable[[Any, Any], Any], module: nn.Module
) -> Callable[[Any, Any], tuple[torch.Tensor, int | torch.Tensor | None]]:
    """The loss of one micro-batch from the last stage's ``output`` and its rows of the
    batch: ``step_fn`` with the output standing in for the model's."""

    def loss_of(output: Any, rows: Any) -> tuple[torch.Tensor, int | torch.Tensor | None]:
        return training_loss(step_fn(_StandIn(module, output), rows), "step_fn")

    return loss_of
