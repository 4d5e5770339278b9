"""A job whose checkpoints persist in the background, killed (SIGKILL) while one does.

    python -m tests.support.job_scripts.async_save_job FOLDER OUT_DIR [--kill-at SAVE:POINT]

Trains ddp (torchrun x2, or one process) for 3 epochs of 4 steps each at world size 2,
``checkpoint_dir=FOLDER`` (a local path or an ``s3://`` URL), ``checkpoint_async=True``,
``checkpoint_every=4``, ``resume="auto"``. ``--kill-at SAVE:POINT``: rank 0 sends itself
SIGKILL from its writer thread during the SAVE-th checkpoint's persist (1-based), at POINT:
``write`` (halfway through writing the file: a local temp file, or the staged copy of an
upload) or ``upload`` (the file written and checked, its upload not done). The kill runs in
the real code path; this script only chooses the moment. Rank 0 writes the final parameters
to OUT_DIR/final.pt when training ends.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from pathlib import Path

import torch
from torch import nn

import distkit
from distkit.checkpoint import _digest, _storage, _writes
from tests.support.exactness import DTYPE
from tests.support.workloads import make_dataset

#: how many checkpoints rank 0 began to persist
_SAVES = {"n": 0}


def _kill_during(save: int, point: str) -> None:
    """Rank 0 kills itself at ``point`` of the ``save``-th persist (in the writer thread)."""

    def in_writer() -> bool:
        return threading.current_thread().name.startswith("distkit-save")

    real_save_new, real_write, real_put = _writes.save_new, _digest.HashingWriter.write, None

    def counting_save_new(*args, **kwargs):
        if in_writer():
            _SAVES["n"] += 1
        return real_save_new(*args, **kwargs)

    def write(self, data):
        if point == "write" and in_writer() and _SAVES["n"] == save and self.size > 0:
            os.kill(os.getpid(), signal.SIGKILL)  # the file is partly written
        return real_write(self, data)

    real_put = _storage.Remote.put

    def put(self, local, url):
        if point == "upload" and in_writer() and _SAVES["n"] == save:
            os.kill(os.getpid(), signal.SIGKILL)  # the staged file complete, not uploaded
        return real_put(self, local, url)

    _writes.save_new = counting_save_new
    _digest.HashingWriter.write = write
    _storage.Remote.put = put


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("folder")
    parser.add_argument("out", type=Path)
    parser.add_argument("--kill-at", default=None)
    args = parser.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    if args.kill_at is not None and rank == 0:
        save, point = args.kill_at.split(":")
        _kill_during(int(save), point)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    trainer = distkit.Trainer(
        "ddp", batch_size=16 // world, max_epochs=3, seed=5, progress=False,
        checkpoint_dir=args.folder, checkpoint_async=True, checkpoint_every=4, resume="auto",
    )  # fmt: skip
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 3))
    model = model.to(DTYPE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    data = make_dataset(64, dtype=DTYPE)
    trainer.fit(model, optimizer, data, loss_fn=nn.functional.cross_entropy)
    state = trainer.full_state_dict()
    if trainer.is_main:
        args.out.mkdir(parents=True, exist_ok=True)
        torch.save(state, args.out / "final.pt")
    trainer.close()


if __name__ == "__main__":
    main()
