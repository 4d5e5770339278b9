"""Call recorder of the FAKE apex packages (test double, not NVIDIA code).

Every fake API call appends ``(name, details)`` to ``CALLS``; ``apex.CALLS`` is this very list
and ``apex.reset_calls()`` empties it in place (so references taken earlier stay valid).
Names are dotted like the API: ``"amp.initialize"``, ``"amp.scale_loss"``, ``"amp.overflow"``,
``"amp.skip_step"``, ``"amp.state_dict"``, ``"amp.load_state_dict"``,
``"parallel.DistributedDataParallel"``, ``"ddp.broadcast"``, ``"ddp.allreduce"``,
``"ddp.disable_allreduce"``, ``"ddp.enable_allreduce"``, ``"parallel.convert_syncbn_model"``,
``"optimizers.FusedAdam"``, ``"optimizers.FusedSGD"``, ``"optimizers.FusedLAMB"``,
``"normalization.FusedLayerNorm"``, ``"normalization.FusedRMSNorm"``.

The list lives as long as the imported fake package: activating a fake again (which drops every
``apex.*`` module) starts a new, empty list. In a multi-process test each rank has its own list.
"""

from __future__ import annotations

from typing import Any

CALLS: list[tuple[str, dict[str, Any]]] = []


def record(name: str, **details: Any) -> None:
    """Append one call to ``CALLS``."""
    CALLS.append((name, dict(details)))


def reset_calls() -> None:
    """Forget every recorded call (in place)."""
    CALLS.clear()


def calls_named(name: str) -> list[dict[str, Any]]:
    """The details of every recorded call called ``name``, oldest first."""
    return [details for call, details in CALLS if call == name]
