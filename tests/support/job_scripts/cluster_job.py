"""A user script run by every cluster launcher the tests simulate on this machine.

    srun-style:  SLURM_PROCID=r SLURM_NTASKS=2 ... \
        python -m tests.support.job_scripts.cluster_job auto 4 OUT
    mpirun -np 2 python -m tests.support.job_scripts.cluster_job ddp 4 OUT
    torchrun --nnodes 2 --node-rank R ... -m tests.support.job_scripts.cluster_job auto 4 OUT
    horovodrun -np 2 -H localhost:1,127.0.0.1:1 --gloo \
        python -m tests.support.job_scripts.cluster_job horovod 4 OUT

Trains the shared workload (61 samples: uneven at 2 ranks) for 2 epochs with a checkpoint per
epoch in ``OUT/ckpt`` (written by rank 0), then a new Trainer resumes from the folder
(``resume="auto"``: every rank, every "node", reads rank 0's file) and trains a third epoch.
Each rank writes ``OUT/rank<r>.pt``: its full final weights, the strategy and the world size.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

import distkit
from tests.support.exactness import DTYPE
from tests.support.workloads import make_dataset, make_mlp


def train(strategy: str, batch_size: int, out: Path) -> None:
    # float64: the launches' weights are compared (tests/support/exactness.py)
    data = make_dataset(61, dtype=DTYPE)
    for max_epochs in (2, 3):  # the second Trainer resumes from the first one's checkpoint
        model = make_mlp(dtype=DTYPE)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        with distkit.Trainer(strategy, batch_size=batch_size, max_epochs=max_epochs, seed=3,
                             progress=False, checkpoint_dir=out / "ckpt",
                             resume="auto") as trainer:  # fmt: skip
            trainer.fit(model, optimizer, data, loss_fn=nn.functional.cross_entropy)
            state = trainer.full_state_dict()
            facts = {"strategy": trainer.strategy.name, "world_size": trainer.world_size}
            rank = trainer.rank
    torch.save({"state": state, **facts}, out / f"rank{rank}.pt")


if __name__ == "__main__":
    train(sys.argv[1], int(sys.argv[2]), Path(sys.argv[3]))
