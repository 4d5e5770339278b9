"""What distkit's trainer costs per step against the hand-written loop of the seeds.

Both loops train the same small CNN on the same data with the same sampler, alternating
(hand, distkit, hand, distkit, ...) so that machine noise hits both alike. A step is timed from
one forward pass to the next, so data loading, forward, backward, all-reduce and optimizer step
are all inside it. The ratio is median(distkit step) / median(hand step).

    python benchmarks/overhead.py                 # single, DP, DDP x2 (torchrun), Horovod x2
    python benchmarks/overhead.py --only horovod  # one of: single, dp, ddp, horovod

Writes benchmarks/results/overhead.json.
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import distkit

RESULTS = Path(__file__).resolve().parent / "results"


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(1, 16, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Flatten(),
        nn.Linear(32 * 7 * 7, 64),
        nn.ReLU(),
        nn.Linear(64, 10),
    )


def make_data(n: int) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(n, 1, 28, 28, generator=generator)
    return TensorDataset(x, torch.randint(0, 10, (n,), generator=generator))


def hand_epoch(model, loader, sampler, optimizer, epoch, stamps) -> None:
    """Seed 002 / 001 style: set_epoch, zero_grad, forward, loss, backward, step, .item()."""
    sampler.set_epoch(epoch)
    model.train()
    total = 0.0
    for x, y in loader:
        stamps.append(time.perf_counter())
        optimizer.zero_grad()
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        total += loss.item()


def hand_setup(backend: str, world: int):
    """The seeds' wrapping: DDP (seed 001), Horovod (seed 002), DataParallel (seed 004)."""
    net = make_model()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    if backend == "horovod":
        import horovod.torch as hvd

        hvd.broadcast_parameters(net.state_dict(), root_rank=0)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=net.named_parameters())
        return net, optimizer
    if backend == "dp":
        return nn.DataParallel(net), optimizer  # on a machine without GPUs it calls the module
    model = nn.parallel.DistributedDataParallel(net) if world > 1 else net
    return model, optimizer


def run(backend: str, steps: int, rounds: int, batch_size: int) -> dict[str, float]:
    strategy = {"horovod": "horovod", "dp": "dp"}.get(backend, "ddp")
    trainer = distkit.Trainer(strategy, batch_size=batch_size, max_epochs=1, progress=False)
    world, rank = trainer.world_size, trainer.rank
    data = make_data(steps * batch_size * world)

    hand_model, hand_opt = hand_setup(backend, world)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True)
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler)

    kit_net = make_model()
    kit_opt = torch.optim.SGD(kit_net.parameters(), lr=0.01, momentum=0.9)
    kit_stamps: list[float] = []

    def step_fn(model: nn.Module, batch) -> torch.Tensor:
        kit_stamps.append(time.perf_counter())
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    hand_steps: list[float] = []
    kit_steps: list[float] = []
    for epoch in range(rounds + 1):  # round 0 warms both up and is discarded
        stamps: list[float] = []
        kit_stamps.clear()
        # alternate which loop goes first, so neither always runs on a warmer machine
        if epoch % 2:
            trainer.fit(kit_net, kit_opt, data, step_fn=step_fn)
            hand_epoch(hand_model, loader, sampler, hand_opt, epoch, stamps)
        else:
            hand_epoch(hand_model, loader, sampler, hand_opt, epoch, stamps)
            trainer.fit(kit_net, kit_opt, data, step_fn=step_fn)
        if epoch:
            hand_steps += [b - a for a, b in itertools.pairwise(stamps)]
            kit_steps += [b - a for a, b in itertools.pairwise(kit_stamps)]
    trainer.close()
    hand_ms = statistics.median(hand_steps) * 1e3
    kit_ms = statistics.median(kit_steps) * 1e3
    return {
        "world_size": world,
        "batch_size_per_process": batch_size,
        "steps_timed": len(kit_steps),
        "hand_ms": hand_ms,
        "distkit_ms": kit_ms,
        "ratio": kit_ms / hand_ms,
    }


def launch(backend: str, args: argparse.Namespace) -> dict[str, float]:
    out = RESULTS / f"overhead_{backend}.json"
    if backend == "horovod":
        launcher = [str(Path(sys.executable).parent / "horovodrun"), "-np", "2"]
        launcher += ["-H", "localhost:2", "--gloo", sys.executable]
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        launcher += ["--nproc_per_node", "2"]
    cmd = [
        *launcher, __file__, "--worker", backend, "--steps", str(args.steps),
        "--rounds", str(args.rounds), "--batch-size", str(args.batch_size), "--out", str(out),
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env)
    return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150, help="steps per epoch (default 150)")
    parser.add_argument("--rounds", type=int, default=4, help="timed epochs per loop")
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--only", choices=["single", "dp", "ddp", "horovod"])
    parser.add_argument("--worker", choices=["ddp", "horovod"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        torch.set_num_threads(1)
        result = run(args.worker, args.steps, args.rounds, args.batch_size)
        if int(os.environ.get("RANK", os.environ.get("HOROVOD_RANK", "0"))) == 0:
            args.out.write_text(json.dumps(result))
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    results = {}
    if args.only in (None, "single"):
        results["single"] = run("single", args.steps, args.rounds, args.batch_size)
    if args.only in (None, "dp"):
        results["dp"] = run("dp", args.steps, args.rounds, args.batch_size)
    if args.only in (None, "ddp"):
        results["ddp x2"] = launch("ddp", args)
    if args.only in (None, "horovod"):
        if importlib.util.find_spec("horovod") is None:
            print("horovod x2: skipped, Horovod is not installed (python -m distkit.horovod_build)")
        else:
            results["horovod x2"] = launch("horovod", args)
    print(f"\n{'config':<10}{'hand ms/step':>14}{'distkit ms/step':>17}{'ratio':>8}{'steps':>7}")
    for name, r in results.items():
        print(
            f"{name:<10}{r['hand_ms']:>14.2f}{r['distkit_ms']:>17.2f}"
            f"{r['ratio']:>8.3f}{r['steps_timed']:>7}"
        )
    if "ddp x2" in results and "horovod x2" in results:
        ratio = results["horovod x2"]["hand_ms"] / results["ddp x2"]["hand_ms"]
        print(f"\nHorovod vs DDP, hand-written loops, same model: {ratio:.3f} x DDP's step time")
    (RESULTS / "overhead.json").write_text(json.dumps(results, indent=2))
    print(f"\nwrote {RESULTS / 'overhead.json'} (target: ratio <= 1.03)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
