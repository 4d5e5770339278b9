"""Two Trainers in one task, with different collective timeouts (a sweep under srun/mpirun).

    SLURM_PROCID=r SLURM_NTASKS=2 ... python -m tests.support.job_scripts.sweep_job OUT

The job's rendezvous store is made once per process; the second Trainer must reuse it,
whatever its timeout, not host a second store on the same port. Each rank writes
``OUT/rank<r>.txt`` with the two fits' final losses.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from torch import nn

import distkit
from tests.support.workloads import make_dataset, make_mlp


def main(out: Path) -> None:
    losses = []
    for timeout in (60.0, 120.0):
        model = make_mlp()
        with distkit.Trainer("auto", batch_size=4, progress=False,
                             collective_timeout=timeout) as trainer:  # fmt: skip
            result = trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                 make_dataset(16), loss_fn=nn.functional.cross_entropy)  # fmt: skip
            losses.append(result.history[-1]["train_loss"])
            rank = trainer.rank
    (out / f"rank{rank}.txt").write_text(" ".join(map(str, losses)))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
