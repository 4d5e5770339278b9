"""The workload every training promise trains, and the one process it is compared with.

Small and deterministic: 61 samples (so the last global batch is short and splits unevenly
over two ranks), an MLP, SGD with momentum (optimizer state that a checkpoint must carry).
The reference is one plain CPU process of the strategy ``"auto"`` picks there.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn
from torch.utils.data import TensorDataset

from distkit.launch._env import LaunchEnv, Launcher
from distkit.registry import auto_strategy_name

#: the dtype the training promises train in unless ``run_promises(dtype=...)`` says otherwise.
#: In float64, N processes and one process differ by their summation order alone: measured on
#: this workload (2 epochs, 2 processes against one, 2026-12-03, x86_64) at 1.2e-16 at most
#: for ddp, fsdp and horovod, in every training promise; on any CPU that order moves a
#: float64 weight by ~1e-16 per step. A real bug (a sample counted twice, a wrong divisor, a
#: missing all-reduce) moves the weights by 1e-3 or more.
DTYPE = torch.float64
#: the largest parameter difference the training promises allow, per dtype. float64: ten
#: million times the floor above, a million times below a real bug. float32 (for a strategy
#: that cannot train float64, such as DeepSpeed, whose ZeRO steps float32 master weights): the
#: same runs differ by 6e-8 to 8.9e-8 (ddp, fsdp, horovod and deepspeed, same day), and other
#: CPUs sum in other orders, so 1e-5 leaves a factor of 100 and still sits 100 times below a
#: real bug.
TOLERANCES: dict[torch.dtype, float] = {torch.float64: 1e-9, torch.float32: 1e-5}
#: the default dtype's tolerance, for messages
TOLERANCE = TOLERANCES[DTYPE]
#: samples per process per micro-batch
BATCH_SIZE = 4
#: the seed of the data order (``seed + epoch``)
DATA_SEED = 3
#: the launcher of the reference run, "one process at N * batch size": plain python, whose
#: strategy "auto" picks from the registry
REFERENCE_LAUNCHER: Launcher = "none"


def reference_strategy() -> str:
    """The strategy of the reference run (``"dp"`` on a CPU machine)."""
    return auto_strategy_name(LaunchEnv(launcher=REFERENCE_LAUNCHER))


def check_dtype(dtype: object) -> torch.dtype:
    """``dtype`` if the promises can train in it, else a ConfigurationError naming them."""
    if dtype not in TOLERANCES:
        from distkit.errors import ConfigurationError

        allowed = ", ".join(str(d) for d in TOLERANCES)
        raise ConfigurationError(
            f"dtype={dtype!r}: the training promises train in {allowed} (float64 unless a "
            "strategy cannot: then torch.float32, with its looser tolerance)"
        )
    assert isinstance(dtype, torch.dtype)
    return dtype


def dtype_of(weights: Mapping[str, torch.Tensor]) -> torch.dtype:
    """The dtype ``weights`` were trained in (their first floating-point tensor's)."""
    for value in weights.values():
        if value.is_floating_point():
            return value.dtype
    return torch.float32


def tolerance_of(weights: Mapping[str, torch.Tensor]) -> float:
    """The tolerance for results in the dtype of ``weights`` (the bodies check that the
    weights come back in the dtype they were given: :func:`trained_in`)."""
    return TOLERANCES.get(dtype_of(weights), TOLERANCES[torch.float32])


def trained_in(weights: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """``weights``, once checked to be in ``dtype``: a strategy that trains a float64 model
    in another dtype breaks the promise (and its looser tolerance must not hide it)."""
    found = dtype_of(weights)
    if found != dtype:
        raise AssertionError(
            f"the model was given in {dtype} and its trained weights came back in {found}: the "
            "strategy changed the model's dtype"
        )
    return weights


def dataset(dtype: torch.dtype = DTYPE) -> TensorDataset:
    """61 samples of 6 features in ``dtype``, 3 classes (the same draws in any dtype)."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(61, 6, generator=generator, dtype=torch.float64).to(dtype)
    y = (x[:, :3].argmax(dim=1) + (x[:, -1] > 1).long()) % 3
    return TensorDataset(x, y)


def model(seed: int, dtype: torch.dtype = DTYPE) -> nn.Module:
    """The MLP in ``dtype``, its initial weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(dtype)


def optimizer(module: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum over ``module``'s parameters: state a checkpoint must carry."""
    return torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
