"""A training job that a scheduler preempts (run with python, torchrun or horovodrun).

    python -m tests.support.job_scripts.preempt_job STRATEGY OUT_DIR \
        [--signal-at RANK:STEP ...] [--send TERM|USR1] [--second-signal] [--user-handler] \
        [--sharded] [--requeue] [--async-every N]

--signal-at RANK:STEP: rank RANK sends the signal to itself once it has completed optimizer
step STEP (once per OUT_DIR: a marker file remembers, so the resumed run trains on); give it
for several ranks, at different steps, to signal each at its own time. --second-signal: the
same signal again while the preemption checkpoint is being written (from a callback's
state_dict, which the save calls). --step-sleep S: each step takes S seconds more (time for
a test to signal from outside; each rank writes OUT_DIR/started-RANK, its pid, after its first
step). --async-every N: checkpoint_async=True, a checkpoint every N steps (one may be
persisting when the signal lands). --user-handler: a handler of the script's own for the
signal, installed before fit, which must run after the save. Every rank writes its pid to
OUT_DIR/pid-RANK (for a test that signals from outside) and, when preempted, what
TrainingPreempted said to OUT_DIR/preempted-RANK.json. Rank 0 writes the final parameters to
OUT_DIR/final.pt when training ends.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import distkit
from distkit.errors import TrainingPreempted
from tests.support.exactness import DTYPE
from tests.support.workloads import make_dataset


class SignalAt(distkit.Callback):
    """Sends ``signum`` to this process after the steps it was told (see the module doc)."""

    def __init__(
        self, out: Path, signum: int, points: dict[int, int], second: bool, sleep: float
    ) -> None:
        self.out, self.signum, self.points, self.second = out, signum, points, second
        self.sleep = sleep
        self.sent = False
        self.group = False  # signal the process group (its DataLoader workers too)

    def on_train_step_end(self, trainer: Any, logs: Any) -> None:
        started = self.out / f"started-{trainer.rank}"
        if not started.exists():
            started.write_text(str(os.getpid()))
        if self.sleep:
            time.sleep(self.sleep)
        step = self.points.get(trainer.rank)
        marker = self.out / f"signalled-{trainer.rank}"
        if step is not None and logs["step"] == step and not marker.exists():
            marker.write_text(str(step))
            self.sent = True
            if self.group:
                os.killpg(os.getpgid(0), self.signum)
            else:
                os.kill(os.getpid(), self.signum)
            # a peer learns of it from the side channel: posted within one poll (0.2 s), read
            # within the next; give it that before the steps left could run out
            time.sleep(0.5)

    def state_dict(self) -> dict[str, Any]:
        if self.second and self.sent:  # the preemption's save is running: signal again
            self.sent = False
            os.kill(os.getpid(), self.signum)
            time.sleep(0.05)  # let it arrive while the checkpoint is being written
        return {}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("strategy")
    parser.add_argument("out", type=Path)
    parser.add_argument("--signal-at", action="append", default=[])
    parser.add_argument("--send", default="TERM")
    parser.add_argument("--second-signal", action="store_true")
    parser.add_argument("--user-handler", action="store_true")
    parser.add_argument("--sharded", action="store_true")
    parser.add_argument("--requeue", action="store_true")
    parser.add_argument("--max-epochs", type=int, default=2)
    parser.add_argument("--step-sleep", type=float, default=0.0)
    parser.add_argument("--num-workers", type=int, default=0)
    parser.add_argument("--group", action="store_true")
    parser.add_argument("--async-every", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    signum = getattr(signal, f"SIG{args.send}")
    points = {int(r): int(s) for r, s in (p.split(":") for p in args.signal_at)}
    strategy: Any = args.strategy
    checkpoint = "sharded" if args.sharded else "full"
    if args.strategy == "tp2":  # the two Linear layers split over the 2 ranks (one group)
        plan = {"0": "colwise", "3": "rowwise"}
        strategy = distkit.FSDPStrategy(tensor_parallel=2, tensor_plan=plan, checkpoint=checkpoint)
    elif args.strategy == "pp2":  # two pipeline stages: the dropout's and the last layer's
        strategy = distkit.FSDPStrategy(
            pipeline_parallel=2, pipeline_split=["3"], microbatches=2, checkpoint=checkpoint
        )
    elif args.sharded:
        strategy = distkit.FSDPStrategy(checkpoint="sharded")
    callback = SignalAt(args.out, signum, points, args.second_signal, args.step_sleep)
    callback.group = args.group
    trainer = distkit.Trainer(
        strategy, batch_size=4, max_epochs=args.max_epochs, seed=7, progress=False,
        checkpoint_dir=args.out / "ckpt", resume="auto", callbacks=[callback],
        requeue=args.requeue, log_every_n_steps=5, num_workers=args.num_workers,
        checkpoint_async=args.async_every is not None,
        checkpoint_every=args.async_every or "epoch",
    )  # fmt: skip
    rank = trainer.rank
    (args.out / f"pid-{rank}").write_text(str(os.getpid()))
    if args.user_handler:

        def handler(number: int, frame: object) -> None:
            (args.out / f"user-handler-{rank}").write_text(str(number))

        signal.signal(signum, handler)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 3))
    model = model.to(DTYPE)  # float64: the runs are compared at 1e-9
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    try:
        trainer.fit(model, optimizer, make_dataset(96, dtype=DTYPE), nn.functional.cross_entropy)
    except TrainingPreempted as exc:
        said = {"code": exc.code, "step": exc.step, "signal": exc.signal, "ckpt": exc.checkpoint}
        (args.out / f"preempted-{rank}.json").write_text(json.dumps(said))
        raise
    state = trainer.full_state_dict()
    if trainer.is_main:
        torch.save(state, args.out / "final.pt")
    trainer.close()


if __name__ == "__main__":
    main()
