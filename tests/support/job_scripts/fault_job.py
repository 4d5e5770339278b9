"""A training job for launcher-level fault tests (run with torchrun / horovodrun).

    python -m tests.support.job_scripts.fault_job STRATEGY OUT_DIR \
        [--kill-at N] [--raise-at N] [--max-steps N]

--kill-at N: rank 1 SIGKILLs itself when it reaches optimizer step N, once per OUT_DIR (a marker
file remembers), so a torchrun restart runs to the end. --raise-at N: rank 1 raises ValueError
at step N. Rank 0 writes the final parameters to OUT_DIR/final.pt.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path
from typing import Any

import torch
from torch import nn

import distkit
from tests.support.exactness import DTYPE
from tests.support.workloads import make_dataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("strategy")
    parser.add_argument("out", type=Path)
    parser.add_argument("--kill-at", type=int)
    parser.add_argument("--raise-at", type=int)
    parser.add_argument("--fault-timeout", type=float, default=10.0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    # "tp2": the model's two Linear layers split over the 2 ranks (one tensor-parallel group);
    # "pp2": the model in two pipeline stages (rank 1, the last, computes the loss)
    strategy: Any = args.strategy
    if args.strategy == "tp2":
        strategy = distkit.FSDPStrategy(
            tensor_parallel=2, tensor_plan={"0": "colwise", "3": "rowwise"}
        )
    elif args.strategy == "pp2":
        strategy = distkit.FSDPStrategy(pipeline_parallel=2, pipeline_split=["3"], microbatches=2)
    trainer = distkit.Trainer(
        strategy, batch_size=4, max_epochs=2, seed=7, checkpoint_dir=args.out / "ckpt",
        checkpoint_every=2, resume="auto", fault_timeout=args.fault_timeout,
    )  # fmt: skip
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 3))
    model = model.to(DTYPE)  # float64: the runs are compared at 1e-9
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    calls = {"n": 0}

    def step_fn(m: nn.Module, batch) -> torch.Tensor:
        calls["n"] += 1
        step = calls["n"]  # one micro-batch per step here; counts from this process's start
        if trainer.rank == 1 and args.kill_at is not None and step == args.kill_at:
            marker = args.out / "killed"
            if not marker.exists():
                marker.write_text("1")
                os.kill(os.getpid(), signal.SIGKILL)
        if trainer.rank == 1 and args.raise_at is not None and step == args.raise_at:
            raise ValueError(f"boom at step {step}")
        x, y = batch
        return nn.functional.cross_entropy(m(x), y)

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """pp2's: called on the last stage per micro-batch (2 per step, and once more by
        torch's first step)."""
        calls["n"] += 1
        if trainer.rank == 1 and args.raise_at is not None and calls["n"] > 2 * args.raise_at:
            raise ValueError(f"boom at step {args.raise_at}")
        return nn.functional.cross_entropy(out, y)

    data = make_dataset(64, dtype=DTYPE)
    if args.strategy == "pp2":
        trainer.fit(model, optimizer, data, loss_fn=loss_fn)
    else:
        trainer.fit(model, optimizer, data, step_fn=step_fn)
    if trainer.is_main:
        torch.save(model.state_dict(), args.out / "final.pt")
    print(f"rank {trainer.rank} done", flush=True)
    trainer.close()


if __name__ == "__main__":
    main()
