"""FSDPStrategy's options that need torch's FSDP2 or DeviceMesh: the HSDP mesh, a user's
mixed precision policy."""

from __future__ import annotations

from typing import Any

import torch

from distkit.errors import ConfigurationError
from distkit.strategies.base import Topology


def hybrid_mesh(topology: Topology, replicate: int) -> Any:
    """The (replicate, shard) DeviceMesh of HSDP: rows of consecutive ranks shard."""
    world = topology.world_size
    if world % replicate:
        raise ConfigurationError(
            f"FSDPStrategy(replicate={replicate}) needs a world size it divides; this job has "
            f"{world} ranks. Use a divisor of {world} (the number of nodes, typically), or "
            "replicate=1"
        )
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(
        topology.device.type, (replicate, world // replicate), mesh_dim_names=("replicate", "shard")
    )


def checked_policy(policy: Any) -> Any:
    """``mp_policy=``: None or a ``MixedPrecisionPolicy`` whose parameters are not fp16 (FSDP2
    has no loss scaler for them: fp16 gradients underflow)."""
    if policy is None:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if not isinstance(policy, MixedPrecisionPolicy):
        raise ConfigurationError(
            f"FSDPStrategy(mp_policy={policy!r}); allowed: a "
            "torch.distributed.fsdp.MixedPrecisionPolicy, or None (distkit's, from precision=)"
        )
    if policy.param_dtype == torch.float16:
        raise ConfigurationError(
            "FSDPStrategy(mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16)): fp16 "
            "compute needs a loss scaler, which a policy does not bring. Use "
            "param_dtype=torch.bfloat16, or Trainer(precision='fp16') (autocast and a "
            "GradScaler) without mp_policy"
        )
    return policy
