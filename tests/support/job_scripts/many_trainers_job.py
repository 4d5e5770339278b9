"""A user script that creates many Trainers one after another in one worker (a sweep loop).

    torchrun --standalone --nproc_per_node 2 \
        -m tests.support.job_scripts.many_trainers_job STRATEGY OUT [--runs N]
    horovodrun -np 2 -H localhost:2 --gloo \
        python -m tests.support.job_scripts.many_trainers_job horovod OUT

Each run builds a fresh Trainer and fits the same tiny model for a few steps. Runs take turns
ending in three ways a user would write: ``close()``, a ``with`` block, and simply dropping the
trainer. Every run must end with the same parameters (same seed, same data), bit for bit on
2 ranks (with 3 or more, Horovod's tensor fusion may sum in another order). Each rank writes
``OUT/rank<r>.json``: the runs it finished and whether they all agreed; rank 0 also prints one
line per run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from torch import nn

import distkit
from tests.support.workloads import make_dataset, make_mlp

ENDINGS = ("close", "with", "drop")


def _fit(trainer: distkit.Trainer) -> torch.Tensor:
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer.fit(model, optimizer, make_dataset(24), loss_fn=nn.functional.cross_entropy)
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _make(strategy: str) -> distkit.Trainer:
    return distkit.Trainer(strategy, batch_size=4, max_epochs=1, seed=5, progress=False)


def _run(strategy: str, ending: str) -> tuple[torch.Tensor, int]:
    if ending == "with":
        with _make(strategy) as trainer:
            return _fit(trainer), trainer.rank
    trainer = _make(strategy)
    params, rank = _fit(trainer), trainer.rank
    if ending == "close":
        trainer.close()
    return params, rank  # "drop": the trainer goes when this frame does, without close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("strategy")
    parser.add_argument("out", type=Path)
    parser.add_argument("--runs", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    first: torch.Tensor | None = None
    finished, identical, rank = 0, True, -1
    for run in range(args.runs):
        ending = ENDINGS[run % len(ENDINGS)]
        params, rank = _run(args.strategy, ending)
        first = params if first is None else first
        identical = identical and torch.equal(params, first)
        finished += 1
        if rank == 0:
            print(f"run {run} ({ending}) done", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {"runs": finished, "identical": identical}
    (args.out / f"rank{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
