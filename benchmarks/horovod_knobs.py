"""Where a hand-written Horovod step goes on CPU, and which of Horovod's knobs change it.

Trains the small CNN of overhead.py (`make_model`, `make_data`; SGD momentum, 32 samples per
process per step) with the hand-written Horovod step of seed 002 (`hvd.broadcast_parameters` +
`hvd.DistributedOptimizer`) under one Horovod setting per launch. Most knobs are environment
variables read once by `hvd.init()`, so every setting is its own `horovodrun -np 2 --gloo`
launch. In each launch a hand-written DDP loop (seed 001, over a gloo process group) trains in
the same processes, taking turns with the Horovod loop by epoch (order reversed every epoch,
epoch 0 discarded): the reference saw the same machine at the same moments. Launches are
interleaved too: every round runs each setting once, in reversed order every other round.
`ddp (torchrun)` is DDP alone, without Horovod in the process. A step is timed from one
forward pass to the next (overhead.py's definition); numbers are rank 0's.

    python benchmarks/horovod_knobs.py                     # every setting, 3 rounds
    python benchmarks/horovod_knobs.py --only defaults "cycle 5 ms" --rounds 5
    python benchmarks/horovod_knobs.py --timeline /tmp/tl  # one setting with HOROVOD_TIMELINE

The table gives, per setting, each loop's median ms/step over all its launches, Horovod over
DDP (with the range of the per-epoch ratios), and that ratio over the defaults' (with the range
of the per-round ratios). Writes benchmarks/results/horovod_knobs.json. `--timeline DIR` runs
one setting (`--setting`, default Horovod's defaults) with HOROVOD_TIMELINE=DIR/timeline.json
and prints, per step, the mean time in each of Horovod's activities, the fused all-reduces and
background cycles, how much of the step comes after backward, and the process CPU time per
step of both loops.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import make_data, make_model  # the shared model and data

RESULTS = Path(__file__).resolve().parent / "results"
BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Setting:
    """One configuration: its launcher, the loops it times, and the environment it adds."""

    name: str
    env: dict[str, str] = field(default_factory=dict)
    groups: int | None = None  # DistributedOptimizer(groups=...): one grouped allreduce
    launcher: str = "horovodrun"  # or "torchrun"
    # under horovodrun the DDP loop trains in the same processes, interleaved by epoch: the
    # reference that saw the same machine at the same moments
    loops: tuple[str, ...] = ("horovod", "ddp")


DDP = Setting("ddp (torchrun)", launcher="torchrun", loops=("ddp",))
DEFAULTS = Setting("defaults")
SETTINGS = (
    DDP,
    DEFAULTS,
    Setting("cycle 0.1 ms", env={"HOROVOD_CYCLE_TIME": "0.1"}),
    Setting("cycle 0.5 ms", env={"HOROVOD_CYCLE_TIME": "0.5"}),
    Setting("cycle 2 ms", env={"HOROVOD_CYCLE_TIME": "2"}),
    Setting("cycle 5 ms", env={"HOROVOD_CYCLE_TIME": "5"}),
    Setting("no fusion", env={"HOROVOD_FUSION_THRESHOLD": "0"}),
    Setting("no response cache", env={"HOROVOD_CACHE_CAPACITY": "0"}),
    Setting("thread affinity 0,1", env={"HOROVOD_THREAD_AFFINITY": "0,1"}),
    Setting("groups=1", groups=1),
)
BY_NAME = {s.name: s for s in SETTINGS}

Launch = dict[str, list[list[dict[str, float]]]]  # loop -> timed epochs -> step stamps


# ------------------------------------------------------------------------------ the worker
@dataclass(frozen=True)
class Stamps:
    """Wall-clock times (time.time()) of one step: start, backward done, optimizer step done;
    and the CPU time of the whole process (every thread) at the start."""

    start: float
    backward_end: float
    end: float
    cpu: float


@dataclass
class Loop:
    """One hand-written training loop with its own model, optimizer and sampler."""

    model: nn.Module
    optimizer: Any
    sampler: DistributedSampler[Any]
    loader: DataLoader[Any]


def make_loop(
    kind: str, setting: Setting, data: Dataset[Any], batch_size: int, rank: int, world: int
) -> Loop:
    """The wrapping of seed 002 (Horovod) or seed 001 (DDP) around a fresh model."""
    net = make_model()
    optimizer: Any = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    model: nn.Module = net
    if kind == "horovod":
        import horovod.torch as hvd

        hvd.broadcast_parameters(net.state_dict(), root_rank=0)
        extra = {} if setting.groups is None else {"groups": setting.groups}
        optimizer = hvd.DistributedOptimizer(
            optimizer, named_parameters=net.named_parameters(), **extra
        )
    else:
        model = nn.parallel.DistributedDataParallel(net)
    sampler: DistributedSampler[Any] = DistributedSampler(data, num_replicas=world, rank=rank)
    return Loop(model, optimizer, sampler, DataLoader(data, batch_size=batch_size, sampler=sampler))


def init_processes(setting: Setting) -> tuple[int, int]:
    """Horovod (under horovodrun) and a gloo process group for DDP; rank and world size."""
    import torch.distributed as dist

    if setting.launcher == "horovodrun":
        import horovod.torch as hvd

        hvd.init()
        rank, world = hvd.rank(), hvd.size()
        # horovodrun sets no MASTER_ADDR/PORT: the driver does
        dist.init_process_group("gloo", rank=rank, world_size=world)
        return rank, world
    dist.init_process_group("gloo")
    return dist.get_rank(), dist.get_world_size()


def train_epoch(loop: Loop, epoch: int) -> list[Stamps]:
    """The seeds' loop: zero_grad, forward, loss, backward, step, .item(); stamped."""
    loop.sampler.set_epoch(epoch)
    stamps = []
    for x, y in loop.loader:
        start, cpu = time.time(), time.process_time()
        loop.optimizer.zero_grad()
        loss = nn.functional.cross_entropy(loop.model(x), y)
        loss.backward()
        backward_end = time.time()
        loop.optimizer.step()
        loss.item()
        stamps.append(Stamps(start, backward_end, time.time(), cpu))
    return stamps


def worker(setting: Setting, steps: int, epochs: int, batch_size: int, out: Path) -> None:
    """Under the launcher: the loops take turns by epoch (order reversed every epoch); epoch 0
    warms up and is discarded; rank 0 writes its stamps."""
    torch.set_num_threads(1)
    rank, world = init_processes(setting)
    data = make_data(steps * batch_size * world)
    loops = {
        kind: make_loop(kind, setting, data, batch_size, rank, world) for kind in setting.loops
    }
    timed: Launch = {kind: [] for kind in loops}
    for epoch in range(epochs + 1):
        for kind in loops if epoch % 2 == 0 else reversed(loops):
            stamps = train_epoch(loops[kind], epoch)
            if epoch:
                timed[kind].append([vars(s) for s in stamps])
    if rank == 0:
        out.write_text(json.dumps(timed))


# ------------------------------------------------------------------------------ the driver
def step_times_ms(epochs: list[list[dict[str, float]]]) -> list[float]:
    """Forward to next forward, within each epoch."""
    return [
        (b["start"] - a["start"]) * 1e3 for epoch in epochs for a, b in itertools.pairwise(epoch)
    ]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def launch(setting: Setting, args: argparse.Namespace, out: Path, env: dict[str, str]) -> Launch:
    """One launch of `setting` with 2 processes; rank 0's stamps per loop and timed epoch."""
    if setting.launcher == "horovodrun":
        launcher = [str(BIN / "horovodrun"), "-np", "2", "-H", "localhost:2", "--gloo"]
        launcher.append(sys.executable)
    else:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        launcher += ["--nproc_per_node", "2"]
    cmd = [
        *launcher, __file__, "--worker", setting.name, "--steps", str(args.steps),
        "--epochs", str(args.epochs), "--batch-size", str(args.batch_size), "--out", str(out),
    ]  # fmt: skip
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **setting.env, **env}
    if setting.launcher == "horovodrun":
        full_env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    subprocess.run(cmd, check=True, env=full_env, stdout=subprocess.DEVNULL)
    result: Launch = json.loads(out.read_text())
    return result


def run_rounds(settings: Sequence[Setting], args: argparse.Namespace) -> dict[str, list[Launch]]:
    """Every setting launched once per round, the order reversed every other round."""
    launches: dict[str, list[Launch]] = defaultdict(list)
    for r in range(args.rounds):
        for setting in settings if r % 2 == 0 else reversed(settings):
            result = launch(setting, args, RESULTS / "horovod_knobs_rank0.json", {})
            launches[setting.name].append(result)
            medians = {k: statistics.median(step_times_ms(v)) for k, v in result.items()}
            line = "  ".join(f"{k} {ms:6.2f} ms" for k, ms in medians.items())
            print(f"round {r}  {setting.name:<20} {line}", flush=True)
    return launches


def pooled_ms(launches: list[Launch], kind: str) -> float:
    """Median step over every timed step of every launch."""
    return statistics.median([t for run in launches for t in step_times_ms(run[kind])])


def epoch_ratios(run: Launch) -> list[float]:
    """Horovod over DDP per epoch pair of one launch (the two ran in turns)."""
    return [
        statistics.median(step_times_ms([h])) / statistics.median(step_times_ms([d]))
        for h, d in zip(run["horovod"], run["ddp"], strict=True)
    ]


def summarise(launches: dict[str, list[Launch]]) -> dict[str, dict[str, Any]]:
    """Per setting: ms/step of each loop, Horovod over DDP in the same processes (with the
    per-epoch range), and that ratio over the defaults' (with the per-round range)."""
    table: dict[str, dict[str, Any]] = {}
    for name, runs in launches.items():
        row: dict[str, Any] = {"env": BY_NAME[name].env, "launches": len(runs)}
        row.update({f"{kind}_ms": pooled_ms(runs, kind) for kind in runs[0]})
        if "horovod" in runs[0]:
            ratios = [r for run in runs for r in epoch_ratios(run)]
            row["vs_ddp"] = row["horovod_ms"] / row["ddp_ms"]
            row["vs_ddp_epochs"] = (min(ratios), max(ratios))
        table[name] = row
    base = table.get(DEFAULTS.name)
    for name, row in table.items():
        if base and "vs_ddp" in row:
            per_round = [
                statistics.median(epoch_ratios(a)) / statistics.median(epoch_ratios(b))
                for a, b in zip(launches[name], launches[DEFAULTS.name], strict=True)
            ]
            row["vs_defaults"] = row["vs_ddp"] / base["vs_ddp"]
            row["vs_defaults_rounds"] = (min(per_round), max(per_round))
    return table


def print_table(table: dict[str, dict[str, Any]]) -> None:
    def cell(row: dict[str, Any], key: str) -> str:
        if key not in row:
            return "-"
        low, high = row[f"{key}_epochs" if key == "vs_ddp" else f"{key}_rounds"]
        return f"{row[key]:.3f} ({low:.2f}-{high:.2f})"

    print(
        f"\n{'setting':<22}{'horovod ms':>11}{'ddp ms':>8}  "
        f"{'hvd/ddp (per epoch)':<21}{'vs defaults (per round)':<23}"
    )
    for name, row in table.items():
        hvd_ms = f"{row['horovod_ms']:.2f}" if "horovod_ms" in row else "-"
        print(
            f"{name:<22}{hvd_ms:>11}{row['ddp_ms']:>8.2f}  "
            f"{cell(row, 'vs_ddp'):<21}{cell(row, 'vs_defaults'):<23}"
        )


# ---------------------------------------------------------------------------- the timeline
@dataclass(frozen=True)
class Interval:
    """One activity of one tensor in Horovod's timeline, in epoch microseconds."""

    tensor: str
    activity: str
    start: float
    end: float


def timeline_events(path: Path) -> list[dict[str, Any]]:
    """The Chrome-trace events; a timeline cut off mid-write may lack its closing bracket."""
    text = path.read_text().strip().rstrip(",")
    if not text.endswith("]"):
        text += "]"
    events: list[dict[str, Any]] = json.loads(text)
    return events


def timeline_intervals(events: Iterable[dict[str, Any]]) -> tuple[list[Interval], list[float]]:
    """Pairs each tensor's B/E events into intervals; also the CYCLE_START markers' times."""
    origin = 0.0
    names: dict[int, str] = {}
    open_: dict[int, list[tuple[str, float]]] = defaultdict(list)
    intervals, cycles = [], []
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            args = e.get("args", {})
            origin = args.get("start_time_since_epoch_in_micros", origin)
            if "name" in args:
                names[e["pid"]] = args["name"]
        elif e.get("ph") == "i":
            cycles.append(origin + e["ts"])
        elif e.get("ph") == "B":
            open_[e["pid"]].append((e["name"], origin + e["ts"]))
        elif e.get("ph") == "E" and open_[e["pid"]]:
            activity, start = open_[e["pid"]].pop()
            tensor = names.get(e["pid"], str(e["pid"]))
            intervals.append(Interval(tensor, activity, start, origin + e["ts"]))
    return intervals, cycles


def merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping spans joined: the tensors of one fused operation share one span."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def timeline_breakdown(
    intervals: list[Interval], cycles: list[float], steps: list[Stamps]
) -> dict[str, float]:
    """Mean ms per step in each activity (clipped to the step), cycles and fused ops per step,
    and the step split at the end of backward."""
    per_activity: dict[str, float] = defaultdict(float)
    after_backward = comm_after_backward = n_cycles = n_ops = 0.0
    for step, nxt in itertools.pairwise(steps):
        lo, hi = step.start * 1e6, nxt.start * 1e6
        bwd = step.backward_end * 1e6
        spans: dict[str, list[tuple[float, float]]] = defaultdict(list)
        for i in intervals:
            if i.end > lo and i.start < hi:
                spans[i.activity].append((max(i.start, lo), min(i.end, hi)))
        for activity, s in spans.items():
            per_activity[activity] += sum(b - a for a, b in merged(s)) / 1e3
        reduces = [i for i in intervals if i.activity == "ALLREDUCE" and lo <= i.end < hi]
        last_reduce_end = max((i.end for i in reduces), default=bwd)
        comm_after_backward += max(0.0, last_reduce_end - bwd) / 1e3
        after_backward += (hi - bwd) / 1e3
        n_ops += len(
            merged(
                [
                    (i.start, i.end)
                    for i in intervals
                    if i.activity == "GLOO_ALLREDUCE" and lo <= i.start < hi
                ]
            )
        )
        n_cycles += sum(1 for c in cycles if lo <= c < hi)
    n = max(1, len(steps) - 1)
    step_ms = statistics.mean((b.start - a.start) * 1e3 for a, b in itertools.pairwise(steps))
    summary = {f"{k} ms": v / n for k, v in sorted(per_activity.items())}
    summary.update({
        "step ms (mean)": step_ms,
        "forward+backward ms": statistics.mean((s.backward_end - s.start) * 1e3 for s in steps),
        "after backward ms": after_backward / n,
        "backward end -> last ALLREDUCE end ms": comm_after_backward / n,
        "fused gloo ops per step": n_ops / n,
        "cycles per step": n_cycles / n,
    })  # fmt: skip
    return summary


def run_timeline(setting: Setting, folder: Path, args: argparse.Namespace) -> dict[str, float]:
    """One launch with HOROVOD_TIMELINE (and cycle marks); the breakdown of its timed steps."""
    folder.mkdir(parents=True, exist_ok=True)
    timeline = folder / "timeline.json"
    env = {"HOROVOD_TIMELINE": str(timeline), "HOROVOD_TIMELINE_MARK_CYCLES": "1"}
    result = launch(setting, args, folder / "steps.json", env)
    steps = [Stamps(**s) for s in result["horovod"][-1]]  # its last timed epoch
    intervals, cycles = timeline_intervals(timeline_events(timeline))
    summary = timeline_breakdown(intervals, cycles, steps)
    for kind, epochs in result.items():  # the same processes, the same moments
        summary[f"{kind}: wall ms per step (median)"] = statistics.median(step_times_ms(epochs))
        summary[f"{kind}: process CPU ms per step (median)"] = statistics.median(
            (b["cpu"] - a["cpu"]) * 1e3 for e in epochs for a, b in itertools.pairwise(e)
        )
    (folder / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"\n{setting.name}: mean per step over {len(steps) - 1} steps ({timeline})")
    for key, value in summary.items():
        print(f"  {key:<40}{value:>9.3f}")
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=150, help="steps per epoch (default 150)")
    parser.add_argument("--epochs", type=int, default=2, help="timed epochs per launch")
    parser.add_argument("--rounds", type=int, default=3, help="launches of every setting")
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--only", nargs="+", choices=list(BY_NAME), help="settings to run")
    parser.add_argument("--timeline", type=Path, metavar="DIR", help="timeline mode")
    horovod_settings = [s.name for s in SETTINGS if "horovod" in s.loops]
    parser.add_argument("--setting", choices=horovod_settings, default=DEFAULTS.name)
    parser.add_argument("--worker", choices=list(BY_NAME), help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(BY_NAME[args.worker], args.steps, args.epochs, args.batch_size, args.out)
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.timeline:
        run_timeline(BY_NAME[args.setting], args.timeline, args)
        return 0
    settings = [BY_NAME[n] for n in args.only] if args.only else list(SETTINGS)
    table = summarise(run_rounds(settings, args))
    if DDP.name in table and DEFAULTS.name in table:
        ddp_alone = table[DDP.name]["ddp_ms"] / table[DEFAULTS.name]["ddp_ms"]
        print(f"DDP under torchrun / DDP beside Horovod's defaults: {ddp_alone:.3f}")
    print_table(table)
    (RESULTS / "horovod_knobs.json").write_text(json.dumps(table, indent=2))
    print(f"\nwrote {RESULTS / 'horovod_knobs.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
