"""A rank blocked in a collective, for a test to signal (plain processes with torchrun's variables).

    python -m tests.support.job_scripts.blocked_job OUT_DIR --grace G --sleep S [--runtime]

Every rank writes OUT_DIR/started_<rank> at step 3. Then rank 1 sleeps S seconds in its
``step_fn`` (in Python), while rank 0 goes on into the backward pass and blocks in DDP's gradient
all-reduce (in C++) until rank 1 comes. ``fault_timeout`` is G seconds: the grace after a signal.
Every rank records what its own ``except`` / ``finally`` blocks saw in OUT_DIR/<what>_<rank>.
With ``--runtime`` the same steps run as a user's own loop inside ``with distkit.Runtime(...)``.
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
    parser.add_argument("out", type=Path)
    parser.add_argument("--grace", type=float, required=True)
    parser.add_argument("--sleep", type=float, required=True)
    parser.add_argument("--runtime", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.runtime:
        user_loop(args.out, args.grace, args.sleep)
        return
    calls = {"n": 0}
    trainer = distkit.Trainer(
        "ddp", batch_size=4, max_epochs=2, progress=False, fault_timeout=args.grace,
        hang_warning=60.0,
    )  # fmt: skip
    rank = trainer.rank

    def step_fn(model: nn.Module, batch) -> torch.Tensor:
        calls["n"] += 1
        if calls["n"] == 3:
            (args.out / f"started_{rank}").write_text("1")
            if rank == 1:
                time.sleep(args.sleep)
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
    try:
        trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), make_dataset(64),
                    step_fn=step_fn)  # fmt: skip
        (args.out / f"done_{rank}").write_text("1")
    except BaseException as exc:
        (args.out / f"except_{rank}").write_text(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        (args.out / f"finally_{rank}").write_text("1")


def user_loop(out: Path, grace: float, sleep: float) -> None:
    """The same job as a user's own loop on the Runtime (the block is the fail-fast guard)."""
    torch.manual_seed(0)
    rank = -1
    try:
        with distkit.Runtime("ddp", fault_timeout=grace, hang_warning=60.0) as rt:
            rank = rt.rank
            model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))
            model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
            for _ in range(2):
                for i, (x, y) in enumerate(rt.loader(make_dataset(64), batch_size=4)):
                    if i == 2:
                        (out / f"started_{rank}").write_text("1")
                        if rank == 1:
                            time.sleep(sleep)
                    rt.backward(nn.functional.cross_entropy(model(x), y))
                    optimizer.step()
                    optimizer.zero_grad()
        (out / f"done_{rank}").write_text("1")
    except BaseException as exc:
        (out / f"except_{rank}").write_text(f"{type(exc).__name__}: {exc}")
        raise
    finally:
        (out / f"finally_{rank}").write_text("1")


if __name__ == "__main__":
    main()
