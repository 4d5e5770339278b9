"""The promises every strategy keeps, in the order one launch runs their bodies."""

from __future__ import annotations

from distkit.errors import ConfigurationError
from distkit.testing._gradients import MEAN_GRADIENTS, NO_SYNC_IS_LOCAL
from distkit.testing._group import COLLECTIVES, MAIN_PROCESS_FIRST, TOPOLOGY
from distkit.testing._hooks import CALLBACK_STATE_ROUND_TRIP, CLIPPING, STOP_TOGETHER
from distkit.testing._promise import Promise
from distkit.testing._runtime_checkpoint import RUNTIME_CHECKPOINT_ROUND_TRIP
from distkit.testing._runtime_training import (
    RUNTIME_ACCUMULATION,
    RUNTIME_CLIPPING,
    RUNTIME_WORLD_SIZE_INVARIANCE,
)
from distkit.testing._runtime_two_models import RUNTIME_TWO_MODELS
from distkit.testing._setup import IDENTICAL_INITIAL_WEIGHTS, UNWRAP
from distkit.testing._training import CHECKPOINT_ROUND_TRIP, WORLD_SIZE_INVARIANCE

BY_NAME: dict[str, Promise] = {
    p.name: p
    for p in (
        TOPOLOGY,
        COLLECTIVES,
        MAIN_PROCESS_FIRST,
        IDENTICAL_INITIAL_WEIGHTS,
        UNWRAP,
        NO_SYNC_IS_LOCAL,
        MEAN_GRADIENTS,
        # a user's own loop on distkit.Runtime
        RUNTIME_WORLD_SIZE_INVARIANCE,
        RUNTIME_ACCUMULATION,
        RUNTIME_CLIPPING,
        RUNTIME_TWO_MODELS,
        RUNTIME_CHECKPOINT_ROUND_TRIP,
        # Trainer.fit
        WORLD_SIZE_INVARIANCE,
        CHECKPOINT_ROUND_TRIP,
        CLIPPING,
        STOP_TOGETHER,
        CALLBACK_STATE_ROUND_TRIP,
    )
}


def promise_named(name: str) -> Promise:
    """The promise called ``name``.

    Raises:
        ConfigurationError: no promise has that name; the message lists them.
    """
    try:
        return BY_NAME[name]
    except (KeyError, TypeError):
        raise ConfigurationError(
            f"unknown promise {name!r}. Allowed: {', '.join(BY_NAME)} (distkit.testing.PROMISES)"
        ) from None
