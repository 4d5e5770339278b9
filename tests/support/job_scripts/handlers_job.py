"""A user script whose own handlers must run when a multi-process fit fails (torchrun / horovodrun).

    python -m tests.support.job_scripts.handlers_job STRATEGY OUT_DIR MODE [--at N] [--seconds S]

MODE ``raise``: rank 1 raises ValueError at step N. ``sleep``: rank 1 sleeps S seconds in its
step_fn at step N (a stuck rank; ``hang_warning`` is 2 s). ``wait``: every rank writes
OUT_DIR/started_<rank> at step N and then keeps training slowly, for a test to interrupt.
Every rank records what its own ``except`` / ``finally`` / ``with`` blocks saw in
OUT_DIR/<what>_<rank>.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from torch import nn

import distkit
from tests.support.workloads import make_dataset


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("strategy")
    parser.add_argument("out", type=Path)
    parser.add_argument("mode", choices=("raise", "sleep", "wait"))
    parser.add_argument("--at", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=8.0)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    calls = {"n": 0}
    with distkit.Trainer(
        args.strategy, batch_size=4, max_epochs=50 if args.mode == "wait" else 2, seed=7,
        progress=False, hang_warning=2.0, fault_timeout=10.0,
    ) as trainer:  # fmt: skip
        rank = trainer.rank

        def step_fn(model: nn.Module, batch) -> torch.Tensor:
            calls["n"] += 1
            if calls["n"] == args.at:
                if args.mode == "raise" and rank == 1:
                    raise ValueError(f"boom at step {args.at}")
                if args.mode == "sleep" and rank == 1:
                    time.sleep(args.seconds)
                if args.mode == "wait":
                    (args.out / f"started_{rank}").write_text("1")
            if args.mode == "wait" and calls["n"] > args.at:
                time.sleep(0.05)
            x, y = batch
            return nn.functional.cross_entropy(model(x), y)

        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            trainer.fit(model, optimizer, make_dataset(64), step_fn=step_fn)
            (args.out / f"done_{rank}").write_text("1")
        except KeyboardInterrupt as exc:
            (args.out / f"except_{rank}").write_text(f"{type(exc).__name__}: {exc}")
            raise
        except Exception as exc:
            (args.out / f"except_{rank}").write_text(f"{type(exc).__name__}: {exc}")
            raise
        finally:
            (args.out / f"finally_{rank}").write_text("1")
    (args.out / f"with_exit_{rank}").write_text("1")


if __name__ == "__main__":
    main()
