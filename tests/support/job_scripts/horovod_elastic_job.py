"""A user script for Horovod elastic: no checkpoint folder, commits every 2 steps.

    horovodrun -np 2 --min-np 1 --max-np 2 --host-discovery-script DISCOVER \\
        python -m tests.support.job_scripts.horovod_elastic_job OUT [STEP_SECONDS]

Nothing is written to disk by distkit: when hosts come or go, Horovod re-forms the group and
distkit continues from its last commit in memory, rank 0's state sent to every process (new
ones included). Every process notes ``world_size step`` per step in ``OUT/progress-<pid>``
and writes its final weights to ``OUT/final-<pid>.pt``; rank 0 writes ``OUT/done``: the
epochs it recorded, the world size and the global step at the end.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

import distkit
from tests.support.workloads import make_dataset, make_mlp


class Progress(distkit.Callback):
    stops_training = False

    def __init__(self, out: Path, pause: float) -> None:
        self.out, self.pause = out, pause

    def on_train_step_end(self, trainer, logs):
        with open(self.out / f"progress-{os.getpid()}", "a") as handle:
            handle.write(f"{trainer.world_size} {logs['step']}\n")
        time.sleep(self.pause)


def main(out: Path, pause: float) -> None:
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer = distkit.Trainer("horovod", batch_size=4, max_epochs=4, seed=3, progress=False,
                              checkpoint_every=2, callbacks=[Progress(out, pause)])  # fmt: skip
    result = trainer.fit(model, optimizer, make_dataset(64), loss_fn=nn.functional.cross_entropy)
    torch.save(trainer.full_state_dict(), out / f"final-{os.getpid()}.pt")
    if trainer.is_main:
        epochs = len(result.history)
        (out / "done").write_text(f"{epochs} {trainer.world_size} {trainer.global_step}\n")


if __name__ == "__main__":
    main(Path(sys.argv[1]), float(sys.argv[2]) if len(sys.argv) > 2 else 0.0)
