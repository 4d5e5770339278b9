"""FAKE ``apex.amp._amp_state`` (test double): the global amp state object.

As in real apex, ``apex.amp._amp_state`` is the ``AmpState`` *object* (``apex/amp/__init__.py``
re-binds the name), so ``apex.amp._amp_state.loss_scalers[0].loss_scale()`` reads the current
loss scale, exactly like code written for real apex. ``loss_scalers`` exists only after an
``amp.initialize(..., enabled=True)``; before that, reading it raises ``AttributeError`` (which is
why real ``amp.state_dict()`` crashes when amp was initialised with ``enabled=False``).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch


class AmpState:
    """Attribute stash shared by the amp modules (``opt_properties``, ``loss_scalers``, ...)."""

    def __init__(self) -> None:
        self.hard_override = False
        self.allow_incoming_model_not_fp32 = False
        self.verbosity = 1


_amp_state = AmpState()


def warn_or_err(msg: str) -> None:
    """Raise ``RuntimeError(msg)``; print a warning instead when ``hard_override`` is set."""
    if _amp_state.hard_override:
        print("Warning:  " + msg)
    else:
        raise RuntimeError(msg)


def maybe_print(msg: str, rank0: bool = False) -> None:
    """Print when ``verbosity > 0`` (only on rank 0 of a multi-process job when ``rank0``)."""
    if _amp_state.verbosity <= 0:
        return
    dist = torch.distributed
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if rank0 and distributed and dist.get_rank() != 0:
        return
    print(msg)


def master_params(optimizer: Any) -> Iterator[torch.Tensor]:
    """Iterate over the params owned by ``optimizer`` (the fake has no separate masters)."""
    for group in optimizer.param_groups:
        yield from group["params"]
