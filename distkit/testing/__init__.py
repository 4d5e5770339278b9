"""The strategy contract, for any strategy: distkit's own and plugins'.

Every strategy keeps the same promises (:data:`PROMISES`): mean gradients, no gradient
communication inside ``no_sync``, ``unwrap``, the collectives, world-size invariance, a
checkpoint round trip, and more. distkit's CI checks them for its own strategies with these
functions; a plugin's CI checks its strategy the same way::

    import distkit.testing

    distkit.testing.check_promise("mean_gradients", "my-strategy")

Each check launches real processes (forked processes joined by gloo on loopback, with
torchrun's variables; or horovodrun), runs the promise's body on every rank, and verifies
the results in the calling process: an AssertionError names the promise, the strategy and
what differed. Nothing here needs pytest; any test runner works.

The promises drive the layers users call. The ``runtime_*`` promises run a user's own loop
on :class:`distkit.Runtime` (``rt.setup``, ``rt.loader``, ``rt.backward``,
``rt.clip_gradients``, ``rt.save`` / ``rt.load``): world-size invariance, accumulation with a
short last window, clipping, two models with two optimizers, and the checkpoint round trip.
``world_size_invariance``, ``checkpoint_round_trip`` and ``clipping`` keep their names and
their meaning: they drive ``Trainer.fit``, which reaches hooks a user loop does not (the
Trainer's checkpoint goes through ``state_io.checkpoint_state``, sharded where the strategy
shards it; its clipping promise also checks the validation cadence), so both kinds stay.
``stop_together`` and ``callback_state_round_trip`` concern only the Trainer.

``import distkit`` does not import this package: import it as ``import distkit.testing``.
"""

from distkit.testing._contract import (
    LAUNCHERS,
    PROMISES,
    ContractRun,
    PromiseSkipped,
    check_promise,
    run_promises,
)
from distkit.testing._processes import run_on_ranks

__all__ = [
    "LAUNCHERS",
    "PROMISES",
    "ContractRun",
    "PromiseSkipped",
    "check_promise",
    "run_on_ranks",
    "run_promises",
]
