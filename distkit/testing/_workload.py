"""The workload every training promise trains, and the one process it is compared with.

Small and deterministic: 61 samples (so the last global batch is short and splits unevenly
over two ranks), an MLP, SGD with momentum (optimizer state that a checkpoint must carry).
The reference is one plain CPU process of the strategy ``"auto"`` picks there.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.data import TensorDataset

from distkit.launch._env import LaunchEnv, Launcher
from distkit.registry import auto_strategy_name

#: the largest parameter difference the training promises allow
TOLERANCE = 1e-5
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


def dataset() -> TensorDataset:
    """61 samples of 6 features, 3 classes."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(61, 6, generator=generator)
    y = (x[:, :3].argmax(dim=1) + (x[:, -1] > 1).long()) % 3
    return TensorDataset(x, y)


def model(seed: int) -> nn.Module:
    """The MLP, its initial weights drawn from ``seed``."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def optimizer(module: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum over ``module``'s parameters: state a checkpoint must carry."""
    return torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
