"""A user script for elastic torchrun: a fixed global batch, checkpoints every 2 steps.

    torchrun --nnodes 1:2 --max-restarts 3 --rdzv-backend c10d --rdzv-endpoint HOST:PORT \\
        -m tests.support.job_scripts.elastic_job OUT [STEP_SECONDS]

Each (re)start resumes from the latest checkpoint in ``OUT/ckpt`` at whatever world size the
rendezvous gave, with ``batch_size = GLOBAL_BATCH // world_size``: the global batch stays the
same, so by the world-size rule the training is the same at any process count. Rank 0 writes
``OUT/progress`` (the world size and global step of every step) and, at the end,
``OUT/final.pt`` with the full weights.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

import distkit
from tests.support.exactness import DTYPE
from tests.support.workloads import make_dataset, make_mlp

GLOBAL_BATCH = 8


class Progress(distkit.Callback):
    """Rank 0 notes every step; a pause per step gives the test time to change the nodes."""

    stops_training = False

    def __init__(self, out: Path, pause: float) -> None:
        self.out, self.pause = out, pause

    def on_train_step_end(self, trainer, logs):
        if trainer.is_main:
            with open(self.out / "progress", "a") as handle:
                handle.write(f"{trainer.world_size} {logs['step']}\n")
        time.sleep(self.pause)


def main(out: Path, pause: float) -> None:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    model = make_mlp(dtype=DTYPE)  # float64: the runs are compared (tests/support/exactness.py)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with distkit.Trainer("auto", batch_size=GLOBAL_BATCH // world, max_epochs=3, seed=3,
                         progress=False, checkpoint_dir=out / "ckpt", checkpoint_every=2,
                         resume="auto", fault_timeout=5,
                         callbacks=[Progress(out, pause)]) as trainer:  # fmt: skip
        data = make_dataset(64, dtype=DTYPE)
        trainer.fit(model, optimizer, data, loss_fn=nn.functional.cross_entropy)
        state = trainer.full_state_dict()
        if trainer.is_main:
            torch.save(state, out / "final.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 0.0)
