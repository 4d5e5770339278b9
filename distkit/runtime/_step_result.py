"""What a training step function returned, as the loss to backpropagate.

A ``step_fn`` (or ``loss_fn``) returns a batch-mean loss tensor, a :class:`~distkit.Loss`
(a sum and its item count: token-exact), or what a model that computes its own loss returns
(an object with ``.loss``, or a dict with ``"loss"``: a Hugging Face ``ModelOutput`` is
both), whose loss is then taken as the batch's mean.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from distkit.errors import ConfigurationError
from distkit.loss import Loss
from distkit.runtime._runtime_arguments import check_loss


def model_loss(result: Any) -> Any:
    """``result.loss`` / ``result["loss"]`` of a model's own output, else ``result``."""
    if isinstance(result, torch.Tensor | Loss):
        return result
    if isinstance(result, Mapping) and "loss" in result:
        return result["loss"]
    loss = getattr(result, "loss", None)
    return result if loss is None else loss


def training_loss(result: Any, source: str) -> tuple[torch.Tensor, int | torch.Tensor | None]:
    """``(loss, count)``: a token-exact total and its count, or a mean loss and None;
    checked as a loss to backpropagate (a tensor reaching the model)."""
    if type(result) is torch.Tensor:  # the usual batch-mean loss: no other kind to look for
        check_loss(result, source)
        return result, None
    result = model_loss(result)
    if isinstance(result, Loss):
        check_loss(result.total, f"{source} (its Loss.total)")
        return result.total, result.count
    if isinstance(result, Mapping) or (result is not None and hasattr(result, "logits")):
        keys = list(result) if isinstance(result, Mapping) else None
        given = (
            f"a {type(result).__name__} with keys {keys}"
            if keys is not None
            else f"a {type(result).__name__} whose .loss is None"
        )
        raise ConfigurationError(
            f"{source} returned {given} and no loss: the model computes no loss of its own "
            "here (a transformers model needs labels= for that). Return the loss: compute "
            "it from the output (F.cross_entropy(out['logits'], labels)), pass the labels to "
            "the model, or return distkit.Loss(total, count) for a token-exact loss"
        )
    check_loss(result, source)
    return result, None
