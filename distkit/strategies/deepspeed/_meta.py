"""A model built on the meta device, partitioned module by module under DeepSpeed stage 3.

Each module is given the initial values of the normal build (:mod:`distkit.strategies.
_meta_init`): its own tensors, full size for a moment, filled by its ``reset_parameters()``
from rank 0's random state, or read from the weights ``load_weights`` recorded for it. Its
parameters are then handed to ZeRO stage 3's partitioner (what ``deepspeed.zero.Init`` does
to each module built inside it), which keeps this rank's slice and frees the rest before the
next module: no rank holds the whole model. The parameter
objects stay those the user's optimizer holds (``torch.utils.swap_tensors``).

``deepspeed.initialize`` then finds a model that ZeRO already partitioned and takes it as it
is, as it takes one built inside ``deepspeed.zero.Init``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from distkit.checkpoint._pending_weights import StoredTensor
from distkit.strategies import _meta_init


def partition(
    model: nn.Module,
    config: dict[str, Any],
    device: torch.device,
    rng_state: torch.Tensor,
    *,
    main: bool,
    stored: Mapping[str, StoredTensor] | None = None,
) -> None:
    """Materialise and partition every module of the meta ``model`` (a collective: every rank
    in the same order). ``config`` is the engine's (its precision picks the parameters'
    dtype, as ``deepspeed.zero.Init`` would); ``rng_state`` is rank 0's; ``stored``: the
    weights load_weights recorded (each rank reads a module's whole tensors, as
    ``deepspeed.zero.Init`` holds a module's whole parameters, and keeps its partition)."""
    import deepspeed

    partitioner = deepspeed.zero.Init(config_dict_or_path=config)
    convert = getattr(partitioner, "_convert_to_zero_parameters", None)
    if not callable(convert):
        raise RuntimeError(
            "distkit does not know how this DeepSpeed partitions an existing parameter (a "
            "version distkit was not tested with: see the deepspeed extra's pin); build the "
            "model on the CPU instead of on meta"
        )
    dtype: torch.dtype = partitioner.dtype

    def keep(module: nn.Module, own: dict[str, torch.Tensor], values: dict[str, Any]) -> None:
        params = []
        for name, stored_or_made in values.items():
            value = _meta_init.full(stored_or_made)
            target = own[name]
            if name not in module._parameters:  # a buffer: never partitioned, kept whole
                module._buffers[name] = value.to(device, target.dtype)
                continue
            cast = dtype if value.is_floating_point() else value.dtype
            made = nn.Parameter(value.to(device, cast), requires_grad=target.requires_grad)
            torch.utils.swap_tensors(target, made)  # the optimizer's object, now with values
            params.append(target)
        convert(params)

    _meta_init.initialise(model, rng_state, keep, main=main, stored=stored or None)
