"""A sweep as users write it: each Trainer (or Runtime) is made while the last one is still
alive, then the last one is dropped without close().

    torchrun --standalone --nproc_per_node 2 \
        tests/support/job_scripts/sweep_pairs_job.py MODE ddp,fsdp,deepspeed2 OUT

``MODE``:

- ``trainers``: ``trainer = distkit.Trainer(name, ...)`` then ``trainer.fit(...)``, in a loop
  (the reassignment drops the previous Trainer only once the new one has joined the group);
- ``runtimes``: the same with ``rt = distkit.Runtime(name)`` and a hand-written loop;
- ``cycles``: Trainers kept in a reference cycle, so only the garbage collector takes them,
  and it runs at another point on each rank: rank 0 collects after every new Trainer, rank 1
  not until the end (its collector is off).

Before, the dropped one's teardown destroyed the process group the next one used: "Default
process group has not been initialized" at the second fit. At the end the last one is closed
explicitly, which must leave no process group. Each rank writes ``OUT/rank<r>.json``: per
fit, the strategy, its optimizer steps and a digest of its final weights; and whether a group
was left.
"""

from __future__ import annotations

import gc
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

import distkit
from tests.support.workloads import make_dataset, make_mlp

#: small enough for DeepSpeed to partition the MLP's parameters at stage 3
STAGE3 = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


def strategy(name: str) -> Any:
    if name == "deepspeed2":
        return distkit.DeepSpeedStrategy(stage=2)
    if name == "deepspeed3":
        return distkit.DeepSpeedStrategy(stage=3, config=STAGE3)
    return name


def digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(state):
        h.update(key.encode())
        h.update(state[key].detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def fit_with_trainer(trainer: distkit.Trainer) -> dict[str, Any]:
    torch.manual_seed(0)
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer.fit(model, optimizer, make_dataset(24), loss_fn=nn.functional.cross_entropy)
    return {"steps": trainer.global_step, "digest": digest(trainer.full_state_dict())}


def fit_with_runtime(rt: distkit.Runtime) -> dict[str, Any]:
    torch.manual_seed(0)
    model = make_mlp()
    model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    steps = 0
    for x, y in rt.loader(make_dataset(24), batch_size=4):
        rt.backward(nn.functional.cross_entropy(model(x), y))
        optimizer.step()
        optimizer.zero_grad()
        steps += 1
    return {"steps": steps, "digest": digest(rt.full_state_dict(model))}


def main(mode: str, names: list[str], out: Path) -> None:
    torch.set_num_threads(1)
    fits: list[dict[str, Any]] = []
    held: Any = None
    rank = -1
    for name in names:
        if mode == "runtimes":
            held = distkit.Runtime(strategy(name), seed=5)
            result = fit_with_runtime(held)
        else:
            trainer = distkit.Trainer(strategy(name), batch_size=4, max_epochs=1, seed=5,
                                      progress=False)  # fmt: skip
            if mode == "cycles":
                box: list[Any] = [trainer]
                box.append(box)  # only the collector frees it
                if trainer.rank == 1:
                    gc.disable()
                trainer = None  # type: ignore[assignment]
                held = box
                if box[0].rank == 0:
                    gc.collect()  # the previous Trainer goes now on rank 0 only
                result = fit_with_trainer(box[0])
            else:
                held = trainer
                result = fit_with_trainer(trainer)
        rank = (held[0] if mode == "cycles" else held).rank
        fits.append({"strategy": name, **result})
        if rank == 0:
            print(f"{name} done", flush=True)
    last = held[0] if mode == "cycles" else held
    last.close()
    left = torch.distributed.is_initialized()
    gc.enable()
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank{rank}.json").write_text(json.dumps({"fits": fits, "group_left": left}))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2].split(","), Path(sys.argv[3]))
