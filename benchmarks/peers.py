"""distkit against its peers: the same small training in distkit, a hand-written loop,
Lightning Fabric, the Lightning Trainer and Hugging Face Accelerate.

Method (that of benchmarks/overhead.py): the same CNN, the same synthetic data, the same
optimizer and per-process batch size in every framework; all frameworks live in the same
process(es) and run one epoch each per round, in an order that is reversed every round so
that none always runs on a warmer (or noisier) machine; round 0 warms everything up and is
discarded. A step is timed from one forward pass to the next (a timestamp at the start of the
step: in distkit's ``step_fn``, in Lightning's ``training_step``, at the top of the other
loops), so data loading, forward, backward, all-reduce and optimizer step are all inside it.
Each framework's number is the median step over every timed round; its ratio is that median
over the hand-written loop's median. One thread per process.

    python benchmarks/peers.py                          # 1 process, then 2 (torchrun)
    python benchmarks/peers.py --only distkit,fabric    # the hand loop always runs too
    python benchmarks/peers.py --nprocs 1 --steps 300 --rounds 6
    python benchmarks/peers.py --model tiny --steps 200   # each framework's fixed cost per step
    python benchmarks/peers.py --device cuda --model resnet --precision bf16 --nprocs 1,8

Frameworks that are not installed are reported, not fatal:
``pip install lightning accelerate torch==2.13.0`` (keep torch pinned).
Writes benchmarks/results/peers.json.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as _dt
import importlib.util
import io
import itertools
import json
import logging
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from overhead import (  # same models, same data, same allocator settings
    PRECISIONS,
    STEADY_MALLOC,
    autocast,
    make_data,
    make_model,
)
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

RESULTS = Path(__file__).resolve().parent / "results"
FRAMEWORKS = ("hand", "distkit", "runtime", "fabric", "lightning", "accelerate")
# the module each framework needs, and what installs it
NEEDS = {
    "hand": ("torch", "pip install torch==2.13.0"),
    "distkit": ("distkit", "pip install -e ."),
    "runtime": ("distkit", "pip install -e ."),
    "fabric": ("lightning", "pip install lightning torch==2.13.0"),
    "lightning": ("lightning", "pip install lightning torch==2.13.0"),
    "accelerate": ("accelerate", "pip install accelerate torch==2.13.0"),
}
LR, MOMENTUM = 0.01, 0.9
Stamp = tuple[float, float]  # (wall, process CPU) seconds at the start of a step


@dataclass
class Context:
    """What every framework trains with, in this process."""

    world: int
    rank: int
    local_world: int
    batch_size: int
    device: str  # "cpu" or "cuda"
    data: TensorDataset
    model: str = "cnn"  # or "tiny", "resnet"
    precision: str = "32"  # or "bf16", "fp16": autocast, each framework its own way
    counter: CallCounter | None = None  # counts Python calls between stamps (one epoch)

    def make_model(self) -> nn.Module:
        if self.model == "tiny":  # a step is then mostly the framework's own per-step work
            torch.manual_seed(0)
            return nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))
        return make_model(self.model)

    @property
    def lightning_precision(self) -> str:
        return {"32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}[self.precision]

    @property
    def cuda(self) -> bool:
        return self.device == "cuda"

    def stamp(self, stamps: list[Stamp]) -> None:
        """Wall-clock time, and this process's CPU time (which other tenants cannot inflate)."""
        if self.cuda:  # host time only sees kernel launches: wait for the previous step
            torch.cuda.synchronize()
        stamps.append((time.perf_counter(), time.process_time()))
        if self.counter is not None:
            self.counter.mark()

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=LR, momentum=MOMENTUM)


class CallCounter:
    """The Python calls (functions and builtins) on the training thread between a
    framework's step stamps: how much per-step Python it runs, a count a noisy machine
    cannot blur as it blurs times. Counted in one extra epoch after the timed rounds (the
    count slows the steps down); the epoch's set-up is outside it, as in the times."""

    def __init__(self) -> None:
        self.calls = 0
        self.marks: list[int] = []

    def _count(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" or event == "c_call":
            self.calls += 1

    def mark(self) -> None:
        if not self.marks:
            sys.setprofile(self._count)
        self.marks.append(self.calls)

    def stop(self) -> float | None:
        """Calls per step (None: fewer than two stamps)."""
        sys.setprofile(None)
        if len(self.marks) < 2:
            return None
        return (self.marks[-1] - self.marks[0]) / (len(self.marks) - 1)


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(x), y)


# ---------------------------------------------------------------------------- frameworks
# Each runner sets itself up once (outside the timing) and trains one epoch per epoch() call,
# returning a stamp per step.


class Hand:
    """The seeds' loop (as in overhead.py): DDP + DistributedSampler, or the bare model."""

    def __init__(self, ctx: Context) -> None:
        self.ctx = ctx
        device = torch.device(ctx.device, torch.cuda.current_device() if ctx.cuda else None)
        net = ctx.make_model().to(device)
        self.device = device
        self.optim = ctx.optimizer(net)
        self.model: nn.Module = (
            nn.parallel.DistributedDataParallel(net, device_ids=[device] if ctx.cuda else None)
            if ctx.world > 1
            else net
        )
        self.sampler = DistributedSampler(
            ctx.data, num_replicas=ctx.world, rank=ctx.rank, shuffle=True
        )
        self.loader = DataLoader(
            ctx.data, batch_size=ctx.batch_size, sampler=self.sampler, pin_memory=ctx.cuda
        )
        self.how = "DDP(model) + DistributedSampler" if ctx.world > 1 else "plain loop"
        self.scaler = torch.amp.GradScaler(device.type) if ctx.precision == "fp16" else None
        if ctx.precision != "32":
            self.how += f" + autocast({ctx.precision})"

    def epoch(self, epoch: int) -> list[float]:
        stamps: list[Stamp] = []
        self.sampler.set_epoch(epoch)
        self.model.train()
        total = 0.0
        mixed, scaler = self.ctx.precision != "32", self.scaler
        for x, y in self.loader:
            self.ctx.stamp(stamps)
            x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
            self.optim.zero_grad()
            if mixed:
                with autocast(self.device, self.ctx.precision):
                    loss = loss_of(self.model, x, y)
            else:
                loss = loss_of(self.model, x, y)
            if scaler is None:
                loss.backward()
                self.optim.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(self.optim)
                scaler.update()
            total += loss.item()
        return stamps


class Distkit:
    def __init__(self, ctx: Context) -> None:
        import distkit

        strategy: Any = "ddp" if ctx.world > 1 else "dp"
        self.how = f'Trainer("{strategy}").fit(step_fn=...)'
        if ctx.cuda and ctx.world == 1:  # "dp" alone would spread over every visible GPU
            strategy = distkit.DataParallelStrategy(device_ids=[0])
            self.how = "Trainer(DataParallelStrategy(device_ids=[0])).fit(step_fn=...)"
        self.ctx = ctx
        self.trainer = distkit.Trainer(
            strategy,
            batch_size=ctx.batch_size,
            max_epochs=1,
            progress=False,
            precision=ctx.precision,
        )
        self.net = ctx.make_model()
        self.optim = ctx.optimizer(self.net)

    def epoch(self, epoch: int) -> list[float]:
        stamps: list[Stamp] = []
        ctx = self.ctx

        def step_fn(model: nn.Module, batch: Any) -> torch.Tensor:
            ctx.stamp(stamps)
            x, y = batch
            return loss_of(model, x, y)

        self.trainer.fit(self.net, self.optim, ctx.data, step_fn=step_fn)
        return stamps

    def close(self) -> None:
        self.trainer.close()


class Runtime:
    """distkit.Runtime in the same loop as Fabric's and Accelerate's (setup, loader,
    backward, step): the fixed cost of distkit under a user's own loop."""

    def __init__(self, ctx: Context) -> None:
        import distkit

        strategy: Any = "ddp" if ctx.world > 1 else "dp"
        if ctx.cuda and ctx.world == 1:  # "dp" alone would spread over every visible GPU
            strategy = distkit.DataParallelStrategy(device_ids=[0])
        self.ctx = ctx
        self.rt = distkit.Runtime(strategy, precision=ctx.precision)
        net = ctx.make_model()
        self.model, self.optim = self.rt.setup(net, ctx.optimizer(net))
        self.loader = self.rt.loader(ctx.data, batch_size=ctx.batch_size, shuffle=True)
        self.how = f'Runtime("{self.rt.strategy.name}"): setup, loader, backward, step'

    def epoch(self, epoch: int) -> list[float]:
        stamps: list[Stamp] = []
        self.model.train()
        total = 0.0
        for x, y in self.loader.epoch(epoch):
            self.ctx.stamp(stamps)
            self.optim.zero_grad()
            loss = loss_of(self.model, x, y)
            self.rt.backward(loss)
            self.optim.step()
            total += loss.item()
        return stamps

    def close(self) -> None:
        self.rt.close()


class Fabric:
    def __init__(self, ctx: Context) -> None:
        from lightning.fabric import Fabric as LightningFabric

        strategy = "ddp" if ctx.world > 1 else "auto"
        self.ctx = ctx
        self.fabric = LightningFabric(
            accelerator=ctx.device, devices=ctx.local_world,
            num_nodes=ctx.world // ctx.local_world, strategy=strategy,
            precision=ctx.lightning_precision,
        )  # fmt: skip
        self.fabric.launch()  # under torchrun: joins the existing processes
        net = ctx.make_model()
        self.model, self.optim = self.fabric.setup(net, ctx.optimizer(net))
        loader = DataLoader(ctx.data, batch_size=ctx.batch_size, shuffle=True)
        self.loader = self.fabric.setup_dataloaders(loader)  # DistributedSampler if world > 1
        self.how = f'Fabric(strategy="{strategy}"): setup, backward, step'

    def epoch(self, epoch: int) -> list[float]:
        stamps: list[Stamp] = []
        self.model.train()
        total = 0.0
        for x, y in self.loader:  # Fabric's loader sets the sampler's epoch itself
            self.ctx.stamp(stamps)
            self.optim.zero_grad()
            loss = loss_of(self.model, x, y)
            self.fabric.backward(loss)
            self.optim.step()
            total += loss.item()
        return stamps


class Lightning:
    """A LightningModule and a new ``lightning.pytorch.Trainer(max_epochs=1)`` per round."""

    def __init__(self, ctx: Context) -> None:
        import lightning.pytorch as pl

        class Module(pl.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = ctx.make_model()
                self.stamps: list[Stamp] = []
                self._optim: torch.optim.Optimizer | None = None

            def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
                ctx.stamp(self.stamps)
                x, y = batch
                return loss_of(self.net, x, y)

            def configure_optimizers(self) -> torch.optim.Optimizer:
                if self._optim is None:  # one optimizer (and momentum) across rounds
                    self._optim = ctx.optimizer(self)
                return self._optim

        self.pl = pl
        self.ctx = ctx
        self.module = Module()
        self.loader = DataLoader(ctx.data, batch_size=ctx.batch_size, shuffle=True)
        self.strategy = "ddp" if ctx.world > 1 else "auto"
        self.how = f'Trainer(strategy="{self.strategy}").fit(LightningModule)'

    def epoch(self, epoch: int) -> list[float]:
        ctx = self.ctx
        trainer = self.pl.Trainer(
            accelerator="gpu" if ctx.cuda else "cpu", devices=ctx.local_world,
            num_nodes=ctx.world // ctx.local_world, strategy=self.strategy, max_epochs=1,
            logger=False, enable_checkpointing=False, enable_progress_bar=False,
            enable_model_summary=False, num_sanity_val_steps=0,
            precision=ctx.lightning_precision,
        )  # fmt: skip
        self.module.stamps = []
        trainer.fit(self.module, train_dataloaders=self.loader)
        return self.module.stamps


class Accelerate:
    def __init__(self, ctx: Context) -> None:
        from accelerate import Accelerator

        self.ctx = ctx
        mixed = {"32": "no", "bf16": "bf16", "fp16": "fp16"}[ctx.precision]
        self.accelerator = Accelerator(cpu=not ctx.cuda, mixed_precision=mixed)
        net = ctx.make_model()
        loader = DataLoader(ctx.data, batch_size=ctx.batch_size, shuffle=True)
        self.model, self.optim, self.loader = self.accelerator.prepare(
            net, ctx.optimizer(net), loader
        )
        self.how = (
            "Accelerator(cpu=True): prepare, backward"
            if not ctx.cuda
            else ("Accelerator(): prepare, backward")
        )

    def epoch(self, epoch: int) -> list[float]:
        stamps: list[Stamp] = []
        self.model.train()
        total = 0.0
        for x, y in self.loader:
            self.ctx.stamp(stamps)
            self.optim.zero_grad()
            loss = loss_of(self.model, x, y)
            self.accelerator.backward(loss)
            self.optim.step()
            total += loss.item()
        return stamps


RUNNERS: dict[str, Callable[[Context], Any]] = {
    "hand": Hand,
    "distkit": Distkit,
    "runtime": Runtime,
    "fabric": Fabric,
    "lightning": Lightning,
    "accelerate": Accelerate,
}


# ---------------------------------------------------------------------------- measuring
def installed(name: str) -> bool:
    return importlib.util.find_spec(NEEDS[name][0]) is not None


def not_installed(name: str) -> dict[str, Any]:
    return {"status": "not installed", "detail": f"not installed ({NEEDS[name][1]})"}


def quiet_frameworks() -> None:
    """Keep the peers' banners and advice out of the table (they do not change timing)."""
    for logger in ("lightning", "lightning.pytorch", "lightning.fabric", "accelerate"):
        logging.getLogger(logger).setLevel(logging.ERROR)
    for message in (
        ".*does not have many workers.*",
        ".*number of training batches.*",
        ".*torch.distributed is already initialized.*",
        ".*GPU available but not used.*",
        ".*barrier.*",
        ".*isinstance.treespec, LeafSpec.*",
    ):
        warnings.filterwarnings("ignore", message=message)


def failure(exc: BaseException) -> dict[str, Any]:
    last = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return {"status": "failed", "detail": last[:500]}


def measure(ctx: Context, names: list[str], rounds: int) -> dict[str, dict[str, Any]]:
    """Interleaved rounds; each framework's median step after round 0, wall and CPU time."""
    results: dict[str, dict[str, Any]] = {}
    runners: dict[str, Any] = {}
    for name in names:
        if not installed(name):
            results[name] = not_installed(name)
            continue
        try:
            with contextlib.redirect_stdout(io.StringIO()):  # banners of the peers
                runners[name] = RUNNERS[name](ctx)
            torch.set_num_threads(1)  # in case a framework changed it
            quiet_frameworks()  # again: importing Lightning sets its loggers to INFO
        except Exception as exc:  # reported in the table and the JSON, not fatal
            results[name] = failure(exc)
    wall: dict[str, list[float]] = {name: [] for name in runners}  # ms per step
    cpu: dict[str, list[float]] = {name: [] for name in runners}
    round_medians: dict[str, list[float]] = {name: [] for name in runners}
    for epoch in range(rounds + 1):  # round 0 warms every framework up and is discarded
        order = list(runners) if epoch % 2 == 0 else list(reversed(runners))
        for name in order:
            if name in results:  # failed in an earlier round
                continue
            try:
                with contextlib.redirect_stdout(io.StringIO()):
                    stamps = runners[name].epoch(epoch)
            except Exception as exc:
                results[name] = failure(exc)
                continue
            if torch.get_num_threads() != 1:
                torch.set_num_threads(1)
            pairs = list(itertools.pairwise(stamps))
            if epoch and pairs:
                steps = [(b[0] - a[0]) * 1e3 for a, b in pairs]
                wall[name] += steps
                cpu[name] += [(b[1] - a[1]) * 1e3 for a, b in pairs]
                round_medians[name].append(statistics.median(steps))
    calls: dict[str, float | None] = {}
    for name, runner in runners.items():  # then one epoch each with its calls counted
        if name in results:
            continue
        ctx.counter = CallCounter()
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                runner.epoch(rounds + 1)
        except Exception as exc:
            results[name] = failure(exc)
        finally:
            calls[name] = ctx.counter.stop()
            ctx.counter = None
    for name, runner in runners.items():
        with contextlib.suppress(Exception):
            if hasattr(runner, "close"):
                runner.close()
        if name in results:
            continue
        if not wall[name]:
            results[name] = {"status": "failed", "detail": "no steps were timed"}
            continue
        q1, _, q3 = quartiles(wall[name])
        results[name] = {
            "status": "ok",
            "how": runner.how,
            "ms_per_step": statistics.median(wall[name]),
            "q1_ms": q1,
            "q3_ms": q3,
            "cpu_ms_per_step": statistics.median(cpu[name]),
            "calls_per_step": calls.get(name),
            "steps_timed": len(wall[name]),
            "round_medians_ms": round_medians[name],
        }
    return {name: results[name] for name in names}


def quartiles(values: list[float]) -> list[float]:
    return statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3


def model_flops(ctx: Context) -> dict[str, Any]:
    """The model's FLOPs per sample (one forward and backward, counted by torch's
    FlopCounterMode as distkit's Trainer counts them) and this device's matmul peak in the
    precision (distkit's measured CPU figure or its table of GPU figures): the same for every
    framework, so MFU ranks them exactly as samples/s does."""
    from distkit.trainer._throughput import count_flops, device_peak, matmul_kind

    device = torch.device("cuda", 0) if ctx.cuda else torch.device("cpu")
    model = ctx.make_model().to(device)
    x, y = ctx.data.tensors
    x, y = x[: ctx.batch_size].to(device), y[: ctx.batch_size].to(device)

    def step() -> None:
        with autocast(device, ctx.precision):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()

    _, flops = count_flops(step)
    parameters = next(p.dtype for p in model.parameters())
    peak = device_peak(device, matmul_kind(ctx.precision, parameters))
    return {
        "flops_per_sample": flops / len(y),
        "peak_flops": None if peak is None else peak.flops,
        "peak_source": None if peak is None else peak.source,
    }


def add_ratios(
    results: dict[str, dict[str, Any]], world: int, batch_size: int, flops: dict[str, Any]
) -> None:
    hand = results.get("hand", {})
    for entry in results.values():
        if entry.get("status") != "ok":
            continue
        entry["samples_per_s"] = world * batch_size / entry["ms_per_step"] * 1e3
        if flops["peak_flops"]:  # every process's device: the same kind, the same peak
            per_s = flops["flops_per_sample"] * entry["samples_per_s"]
            entry["mfu"] = per_s / (world * flops["peak_flops"])
            entry["peak_source"] = flops["peak_source"]
        if hand.get("status") == "ok":
            entry["ratio"] = entry["ms_per_step"] / hand["ms_per_step"]
            entry["cpu_ratio"] = entry["cpu_ms_per_step"] / hand["cpu_ms_per_step"]
            # the same ratio round by round: how much the machine's noise moves it
            mine, base = entry["round_medians_ms"], hand["round_medians_ms"]
            if len(mine) == len(base):
                entry["round_ratios"] = [a / b for a, b in zip(mine, base, strict=True)]
                entry["round_ratio_median"] = statistics.median(entry["round_ratios"])


# ---------------------------------------------------------------------------- processes
def context(world: int, rank: int, local_world: int, args: argparse.Namespace) -> Context:
    shape = "resnet" if args.model == "resnet" else "cnn"  # tiny reads the CNN's 28x28 inputs
    data = make_data(args.steps * args.batch_size * world, shape)
    return Context(
        world, rank, local_world, args.batch_size, args.device, data, args.model, args.precision
    )


def worker(args: argparse.Namespace) -> int:
    """One rank under torchrun: join the group every framework then reuses, and measure."""
    import torch.distributed as dist

    quiet_frameworks()
    local_rank = int(os.environ["LOCAL_RANK"])
    if args.device == "cuda":
        torch.cuda.set_device(local_rank)
    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    results = measure(context(world, rank, local_world, args), args.only, args.rounds)
    if rank == 0:
        args.out.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()
    return 0


def launch(nprocs: int, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """Every framework in the same ``nprocs`` processes, started by torchrun."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        cmd = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc_per_node", str(nprocs), __file__, "--worker",
            "--only", ",".join(args.only), "--steps", str(args.steps),
            "--rounds", str(args.rounds), "--batch-size", str(args.batch_size),
            "--device", args.device, "--model", args.model, "--precision", args.precision,
            "--out", str(out),
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        try:
            proc = subprocess.run(
                cmd, env=env, capture_output=True, text=True, timeout=args.timeout
            )
        except subprocess.TimeoutExpired:
            detail = f"torchrun with {nprocs} processes did not finish in {args.timeout}s"
            return {name: {"status": "failed", "detail": detail} for name in args.only}
        if proc.returncode != 0 or not out.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-15:]
            sys.stderr.write("\n".join(tail) + "\n")
            detail = f"torchrun with {nprocs} processes exited {proc.returncode}: " + (
                tail[-1] if tail else ""
            )
            return {name: {"status": "failed", "detail": detail[:500]} for name in args.only}
        return json.loads(out.read_text())


def versions() -> dict[str, str]:
    from importlib import metadata

    found = {"python": platform.python_version()}
    for package in ("torch", "distkit", "lightning", "accelerate"):
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[package] = metadata.version(package)
    return found


def machine(device: str) -> str:
    if device == "cuda" and torch.cuda.is_available():
        return f"{torch.cuda.device_count()}x {torch.cuda.get_device_name(0)}"
    return f"{os.cpu_count()}-core CPU machine"


def print_table(key: str, block: dict[str, Any]) -> None:
    results = block["frameworks"]
    mixed = block.get("precision", "32")
    mixed = "" if mixed == "32" else f", {mixed} autocast"
    print(f"\n{key}: {block['processes']} process(es), {block['model']} model{mixed}, batch "
          f"{block['batch_size_per_process']} per process, one thread each")  # fmt: skip
    print(f"{'framework':<12}{'ms/step':>8}{'vs hand':>9}{'by round':>20}{'cpu vs hand':>12}"
          f"{'calls/step':>11}{'samples/s':>11}{'MFU':>9}{'steps':>7}  how")  # fmt: skip
    for name, r in results.items():
        if r["status"] != "ok":
            print(f"{name:<12}{r['detail']}")
            continue
        ratio, cpu_ratio = (f"{r[k]:.3f}" if k in r else "-" for k in ("ratio", "cpu_ratio"))
        by_round = ""
        if name != "hand" and r.get("round_ratios"):
            rounds = r["round_ratios"]
            by_round = f"{r['round_ratio_median']:.3f} [{min(rounds):.2f}-{max(rounds):.2f}]"
        calls = r.get("calls_per_step")
        calls = "-" if calls is None else f"{calls:.0f}"
        mfu = f"{100 * r['mfu']:.3g}%" if "mfu" in r else "-"
        print(
            f"{name:<12}{r['ms_per_step']:>8.2f}{ratio:>9}{by_round:>20}{cpu_ratio:>12}"
            f"{calls:>11}{r['samples_per_s']:>11,.0f}{mfu:>9}{r['steps_timed']:>7}  {r['how']}"
        )
    print(
        "ms/step: median wall time from one forward to the next, over all timed rounds;\n"
        "vs hand: that median / the hand loop's; by round: the median [lowest-highest] of the\n"
        "per-round ratios (each against the hand loop's same round: a wide range = a noisy\n"
        "machine); cpu vs hand: the same with this process's CPU time instead of wall time;\n"
        "calls/step: Python calls on the training thread per step, in one more epoch (exact);\n"
        f"MFU: {block['flops_per_sample']:,.0f} FLOPs per sample (FlopCounterMode, forward and "
        f"backward) x samples/s over the processes' peak ({block['peak_source'] or 'unknown'})"
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=60, help="steps per round (default 60)")
    parser.add_argument(
        "--rounds", type=int, default=12, help="timed rounds (default 12), after one warm-up round"
    )
    parser.add_argument("--batch-size", type=int, default=32, help="per process (default 32)")
    parser.add_argument(
        "--only", default=",".join(FRAMEWORKS),
        help=f"comma-separated subset of {','.join(FRAMEWORKS)} (hand always runs: the baseline)",
    )  # fmt: skip
    parser.add_argument(
        "--nprocs", default="1,2",
        help="process counts to run, comma-separated (default 1,2; above 1: torchrun)",
    )  # fmt: skip
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu",
        help="cpu (default; hides GPUs from every framework) or cuda (one GPU per process)",
    )  # fmt: skip
    parser.add_argument(
        "--model", choices=["cnn", "tiny", "resnet"], default="cnn",
        help="cnn: overhead.py's CNN (default); tiny: one linear layer, so that a step is "
        "mostly each framework's fixed per-step cost; resnet: a ResNet-18 (3x32x32 inputs)",
    )  # fmt: skip
    parser.add_argument(
        "--precision", choices=PRECISIONS, default="32",
        help="32 (default), bf16 or fp16 autocast, in every framework (fp16 with loss scaling)",
    )  # fmt: skip
    parser.add_argument(
        "--timeout", type=int, default=900, help="seconds a multi-process run may take"
    )
    parser.add_argument(
        "--out", type=Path, help="JSON path (default benchmarks/results/peers.json)"
    )
    parser.add_argument(
        "--steady-malloc", action="store_true",
        help="run with glibc's heap trimming and mmap threshold raised (as overhead.py's "
        "option): no loop pays for memory handed back to the OS and page-faulted in again, "
        "which otherwise moves a CNN's step by +-10%% with the heap's layout",
    )  # fmt: skip
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(only) - set(FRAMEWORKS))
    if unknown:
        parser.error(f"unknown framework(s) {', '.join(unknown)}; choose from {FRAMEWORKS}")
    args.only = [name for name in FRAMEWORKS if name == "hand" or name in only]
    try:
        args.nprocs = sorted({int(n) for n in args.nprocs.split(",")})
    except ValueError:
        parser.error(f"--nprocs takes process counts like 1,2, got {args.nprocs!r}")
    if not args.nprocs or min(args.nprocs) < 1:
        parser.error("--nprocs: process counts must be at least 1")
    if min(args.steps, args.rounds, args.batch_size) < 1:
        parser.error("--steps, --rounds and --batch-size must be at least 1")
    if args.steps < 3:
        parser.error("--steps must be at least 3 (a step is timed between two forward passes)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.steady_malloc and os.environ.get("MALLOC_TRIM_THRESHOLD_") != STEADY_MALLOC:
        # glibc reads these at start-up: run again with them (torchrun passes them on)
        env = {**os.environ, "MALLOC_TRIM_THRESHOLD_": STEADY_MALLOC,
               "MALLOC_MMAP_THRESHOLD_": STEADY_MALLOC}  # fmt: skip
        os.execve(sys.executable, [sys.executable, *sys.argv], env)
    os.environ["OMP_NUM_THREADS"] = "1"  # also keeps Lightning/Accelerate from choosing
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # every framework on the CPU, distkit included
    elif not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device here", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    if args.worker:
        return worker(args)
    quiet_frameworks()
    started = time.perf_counter()
    report: dict[str, Any] = {
        "meta": {
            "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
            "machine": machine(args.device),
            "device": args.device,
            "threads_per_process": 1,
            "steps_per_round": args.steps,
            "timed_rounds": args.rounds,
            "batch_size_per_process": args.batch_size,
            "model": args.model,
            "precision": args.precision,
            "steady_malloc": args.steady_malloc,
            "versions": versions(),
            "method": "median step (forward to next forward) over interleaved rounds; "
            "ratio = median / hand loop's median",
        },
    }
    for nprocs in args.nprocs:
        print(f"running {', '.join(args.only)} on {nprocs} process(es)...", flush=True)
        if nprocs == 1:
            results = measure(context(1, 0, 1, args), args.only, args.rounds)
        else:
            results = launch(nprocs, args)
        flops = model_flops(context(1, 0, 1, args))
        add_ratios(results, nprocs, args.batch_size, flops)
        key = "single" if nprocs == 1 else f"x{nprocs}"
        report[key] = {
            "processes": nprocs,
            "launcher": "python" if nprocs == 1 else "torchrun --standalone",
            "batch_size_per_process": args.batch_size,
            "model": args.model,
            "precision": args.precision,
            **flops,
            "frameworks": results,
        }
        print_table(key, report[key])
    report["meta"]["wall_s"] = round(time.perf_counter() - started, 1)
    out = args.out or RESULTS / "peers.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {out} ({report['meta']['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
