"""What distkit's trainer costs per step against the hand-written loop of the seeds.

Both loops train the same small CNN on the same data with the same sampler, alternating
(hand, distkit, hand, distkit, ...) so that machine noise hits both alike. A step is timed from
one forward pass to the next, so data loading, forward, backward, all-reduce and optimizer step
are all inside it. The ratio is median(distkit step) / median(hand step).

    python benchmarks/overhead.py                 # single, DP, DDP x2 (torchrun), Horovod x2
    python benchmarks/overhead.py --only horovod  # one of: single, dp, ddp, horovod
    python benchmarks/overhead.py --device cuda --only ddp --nprocs 4 --model resnet \
        --precision bf16

On CUDA (one GPU per process, cuda:LOCAL_RANK, NCCL) a step's start is a CUDA event recorded
in the stream, not a host timestamp, and the events are read after each epoch with one
``torch.cuda.synchronize()``: nothing waits for the GPU inside the timed steps except what
the loops do themselves (the hand loop's ``loss.item()``).

Writes benchmarks/results/overhead.json (``--results DIR`` elsewhere).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from models import MODELS, make_data, make_model  # make_*: peers.py, scaling.py too

import distkit

RESULTS = Path(__file__).resolve().parent / "results"
PRECISIONS = ("32", "bf16", "fp16")


class StepClock:
    """Start-of-step marks for one epoch: host time on the CPU; on CUDA, events in the stream.

    A CUDA event is recorded without waiting for the GPU; the epoch's marks are read after the
    epoch with one ``torch.cuda.synchronize()``, so the interval between two marks is the GPU's
    time from one step's start to the next (host-bound gaps included), and the timing adds no
    host synchronisation to the steps it times.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def stamp(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def steps_ms(self) -> list[float]:
        """The epoch's step times in ms, and a fresh start for the next epoch."""
        if self.cuda:
            torch.cuda.synchronize()  # the measurement boundary: the end of the epoch
            steps = [a.elapsed_time(b) for a, b in itertools.pairwise(self.marks)]
        else:
            steps = [(b - a) * 1e3 for a, b in itertools.pairwise(self.marks)]
        self.marks = []
        return steps


def autocast(device: torch.device, precision: str):
    """The hand loop's mixed precision, as distkit's Trainer(precision=...) does it."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=dtype)


def hand_epoch(model, loader, sampler, optimizer, epoch, clock, device, precision="32") -> None:
    """Seed 002 / 001 style: set_epoch, zero_grad, forward, loss, backward, step, .item().

    ``optimizer`` is ``(optimizer, GradScaler or None)``; the scaler for fp16 only.
    """
    optimizer, scaler = optimizer
    cuda, mixed = device.type == "cuda", precision != "32"
    sampler.set_epoch(epoch)
    model.train()
    total = 0.0
    for x, y in loader:
        clock.stamp()
        if cuda:
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        optimizer.zero_grad()
        if mixed:
            with autocast(device, precision):
                loss = nn.functional.cross_entropy(model(x), y)
        else:
            loss = nn.functional.cross_entropy(model(x), y)
        if scaler is None:
            loss.backward()
            optimizer.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        total += loss.item()


def hand_setup(backend: str, world: int, device: torch.device, precision: str, model: str):
    """The seeds' wrapping: DDP (seed 001), Horovod (seed 002), DataParallel (seed 004)."""
    net = make_model(model).to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    scaler = torch.amp.GradScaler(device.type) if precision == "fp16" else None
    if backend == "horovod":
        import horovod.torch as hvd

        hvd.broadcast_parameters(net.state_dict(), root_rank=0)
        optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=net.named_parameters())
        return net, (optimizer, scaler)
    if backend == "dp":
        # on a machine without GPUs it calls the module; with GPUs it spreads over all of them
        return nn.DataParallel(net), (optimizer, scaler)
    device_ids = [device] if device.type == "cuda" else None
    model_ = nn.parallel.DistributedDataParallel(net, device_ids=device_ids) if world > 1 else net
    return model_, (optimizer, scaler)


def run(
    backend: str,
    steps: int,
    rounds: int,
    batch_size: int,
    precision: str = "32",
    model: str = "cnn",
) -> dict[str, float]:
    strategy = {"horovod": "horovod", "dp": "dp"}.get(backend, "ddp")
    trainer = distkit.Trainer(
        strategy, batch_size=batch_size, max_epochs=1, progress=False, precision=precision
    )
    world, rank = trainer.world_size, trainer.rank
    device = trainer.device  # the hand loop trains where distkit does: cuda:LOCAL_RANK or cpu
    data = make_data(steps * batch_size * world, model)

    hand_model, hand_opt = hand_setup(backend, world, device, precision, model)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True)
    cuda = device.type == "cuda"
    loader = DataLoader(data, batch_size=batch_size, sampler=sampler, pin_memory=cuda)

    kit_net = make_model(model)
    kit_opt = torch.optim.SGD(kit_net.parameters(), lr=0.01, momentum=0.9)
    hand_clock, kit_clock = StepClock(device), StepClock(device)

    def step_fn(model: nn.Module, batch) -> torch.Tensor:
        kit_clock.stamp()
        x, y = batch
        return nn.functional.cross_entropy(model(x), y)

    # the control: a second, identical hand-written loop, timed like the others. Its ratio to
    # the first is what "no difference" measures in this run (the machine's noise floor).
    # Not for Horovod: two DistributedOptimizers would all-reduce under the same names.
    control = backend != "horovod"
    if control:
        again_model, again_opt = hand_setup(backend, world, device, precision, model)
        again_sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True)
        again_loader = DataLoader(
            data, batch_size=batch_size, sampler=again_sampler, pin_memory=cuda
        )
    again_clock = StepClock(device)

    def epoch_of(name: str, epoch: int) -> None:
        if name == "distkit":
            trainer.fit(kit_net, kit_opt, data, step_fn=step_fn)
        elif name == "hand":
            hand_epoch(hand_model, loader, sampler, hand_opt, epoch, hand_clock, device, precision)
        else:
            hand_epoch(again_model, again_loader, again_sampler, again_opt, epoch, again_clock,
                       device, precision)  # fmt: skip

    names = ["hand", "distkit", *(["again"] if control else [])]
    clocks = {"hand": hand_clock, "distkit": kit_clock, "again": again_clock}
    steps_of: dict[str, list[float]] = {name: [] for name in names}
    ratios: dict[str, list[float]] = {name: [] for name in names}
    for epoch in range(rounds + 1):  # round 0 warms every loop up and is discarded
        # a different loop goes first each round, so none always runs on a warmer machine
        shift = epoch % len(names)
        for name in names[shift:] + names[:shift]:
            epoch_of(name, epoch)
        epoch_ms = {name: clocks[name].steps_ms() for name in names}
        if epoch:
            hand_median = statistics.median(epoch_ms["hand"])
            for name in names:
                steps_of[name] += epoch_ms[name]
                # the round's ratio: medians in the same round (the same machine state)
                ratios[name].append(statistics.median(epoch_ms[name]) / hand_median)
    trainer.close()
    hand_ms = statistics.median(steps_of["hand"])
    kit_ms = statistics.median(steps_of["distkit"])
    result: dict[str, Any] = {
        "world_size": world,
        "batch_size_per_process": batch_size,
        "steps_timed": len(steps_of["distkit"]),
        "hand_ms": hand_ms,
        "distkit_ms": kit_ms,
        "ratio": kit_ms / hand_ms,
        "round_ratios": ratios["distkit"],
        "round_ratio_median": statistics.median(ratios["distkit"]),
    }
    if control:
        result["control_ratio"] = statistics.median(steps_of["again"]) / hand_ms
        result["control_round_ratio_median"] = statistics.median(ratios["again"])
        result["control_round_ratios"] = ratios["again"]
    return result


def launch(backend: str, args: argparse.Namespace) -> dict[str, float]:
    nprocs = args.nprocs
    out = args.results / f"overhead_{backend}.json"
    if backend == "horovod":
        launcher = [str(Path(sys.executable).parent / "horovodrun"), "-np", str(nprocs)]
        launcher += ["-H", f"localhost:{nprocs}", "--gloo", sys.executable]
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        launcher += ["--nproc_per_node", str(nprocs)]
    cmd = [
        *launcher, __file__, "--worker", backend, "--steps", str(args.steps),
        "--rounds", str(args.rounds), "--batch-size", str(args.batch_size), "--out", str(out),
        "--device", args.device, "--precision", args.precision, "--model", args.model,
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env)
    return json.loads(out.read_text())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--device, --precision, --model: shared with scaling.py (and read by gpu.py)."""
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu",
        help="cpu (default; hides the GPUs) or cuda (one GPU per process, cuda:LOCAL_RANK, NCCL)",
    )  # fmt: skip
    parser.add_argument(
        "--precision", choices=PRECISIONS, default="32",
        help="32 (default), or bf16 / fp16 autocast (fp16 with a GradScaler), in both loops",
    )  # fmt: skip
    parser.add_argument(
        "--model", choices=MODELS, default="cnn",
        help="cnn (default: the small CNN) or resnet (a ResNet-18 on 3x32x32 inputs)",
    )  # fmt: skip
    parser.add_argument(
        "--results", type=Path, default=RESULTS, help="folder for the JSON (default results/)"
    )


def use_device(device: str) -> None:
    """Before any CUDA call: --device cpu hides the GPUs, from distkit and the launched ranks;
    --device cuda stops here when torch sees none."""
    if device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    elif not torch.cuda.is_available():
        sys.exit(f"--device cuda: torch {torch.__version__} sees no CUDA device here")


#: --steady-malloc's thresholds (bytes)
STEADY_MALLOC = str(2**30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150, help="steps per epoch (default 150)")
    parser.add_argument("--rounds", type=int, default=4, help="timed epochs per loop")
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--only", choices=["single", "dp", "ddp", "horovod"])
    parser.add_argument(
        "--nprocs", type=int, default=2, help="processes for ddp and horovod (default 2)"
    )
    add_arguments(parser)
    parser.add_argument(
        "--steady-malloc", action="store_true",
        help="run with glibc's heap trimming and mmap threshold raised (MALLOC_TRIM_THRESHOLD_ "
        "and MALLOC_MMAP_THRESHOLD_ = 1 GB), so that no loop pays for memory given back to the "
        "OS and page-faulted in again: a quieter comparison of the loops' own work",
    )  # fmt: skip
    parser.add_argument("--worker", choices=["ddp", "horovod"], help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steady_malloc and os.environ.get("MALLOC_TRIM_THRESHOLD_") != STEADY_MALLOC:
        # glibc reads these at start-up: run again with them (torchrun/horovodrun pass them on)
        env = {**os.environ, "MALLOC_TRIM_THRESHOLD_": STEADY_MALLOC,
               "MALLOC_MMAP_THRESHOLD_": STEADY_MALLOC}  # fmt: skip
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    use_device(args.device)
    measure = dict(precision=args.precision, model=args.model)
    if args.worker:
        torch.set_num_threads(1)
        result = run(args.worker, args.steps, args.rounds, args.batch_size, **measure)
        if int(os.environ.get("RANK", os.environ.get("HOROVOD_RANK", "0"))) == 0:
            args.out.write_text(json.dumps(result))
        return 0
    args.results.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    results = {}
    n = args.nprocs
    if args.only in (None, "single"):
        results["single"] = run("single", args.steps, args.rounds, args.batch_size, **measure)
    if args.only in (None, "dp"):
        results["dp"] = run("dp", args.steps, args.rounds, args.batch_size, **measure)
    if args.only in (None, "ddp"):
        results[f"ddp x{n}"] = launch("ddp", args)
    if args.only in (None, "horovod"):
        if importlib.util.find_spec("horovod") is None:
            print(
                f"horovod x{n}: skipped, Horovod is not installed (python -m distkit.horovod_build)"
            )
        elif args.device == "cuda":
            print(f"horovod x{n}: skipped on CUDA (the GPU runs compare DDP over NCCL)")
        else:
            results[f"horovod x{n}"] = launch("horovod", args)
    print(
        f"\n{'config':<11}{'hand ms/step':>13}{'distkit ms/step':>16}{'ratio':>7}"
        f"{'by round':>25}{'control (hand again)':>25}{'steps':>7}"
    )
    for name, r in results.items():
        rounds = r.get("round_ratios") or [r["ratio"]]
        by_round = (
            f"{r.get('round_ratio_median', r['ratio']):.3f} [{min(rounds):.2f}-{max(rounds):.2f}]"
        )
        control = r.get("control_round_ratios")
        noise = (
            f"{r['control_round_ratio_median']:.3f} [{min(control):.2f}-{max(control):.2f}]"
            if control
            else "-"
        )
        print(
            f"{name:<11}{r['hand_ms']:>13.2f}{r['distkit_ms']:>16.2f}"
            f"{r['ratio']:>7.3f}{by_round:>25}{noise:>25}{r['steps_timed']:>7}"
        )
    print(
        "ratio: median distkit step / median hand step over every timed step; by round: the "
        "median [lowest-highest] of each round's ratio (both loops' medians in that round); "
        "control: the same for a second, identical hand loop (no difference, measured: the "
        "noise floor of this run)"
    )
    if f"ddp x{n}" in results and f"horovod x{n}" in results:
        ratio = results[f"horovod x{n}"]["hand_ms"] / results[f"ddp x{n}"]["hand_ms"]
        print(f"\nHorovod vs DDP, hand-written loops, same model: {ratio:.3f} x DDP's step time")
    (args.results / "overhead.json").write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.results / 'overhead.json'} (target: ratio <= 1.02)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
