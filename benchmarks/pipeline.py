"""Pipeline schedules on CPU: each schedule's step time at 2 stages against one process, and
the bubble that leaves.

One process trains the whole model on the batch (``rt.forward_backward``, plain ``"dp"``);
``FSDPStrategy(pipeline_parallel=2)`` trains it cut in two at the middle block (interleaved:
in four, two stages per rank), each rank on a core of its own (torchrun, gloo, one thread per
process), for each schedule and number of micro-batches. With the work split perfectly and
nothing else to do, a step would take ``one / 2``; the measured bubble is the share of the step
beyond that, ``1 - (one / 2) / step`` (idle ranks waiting for a micro-batch, and what the
pipeline adds: the activations sent between the stages, the loss sent back, the per-micro-batch
overhead). The theory for the idle time alone is ``(P - 1) / (v M + P - 1)`` (P stages per
pipeline, M micro-batches, v stages per rank: 1, or 2 interleaved).

Beside each one-stage-per-rank schedule, the same step written by hand on
torch.distributed.pipelining (its stages, its schedule, torch's own loss scaling; no distkit):
what distkit's weighting, padding and loss sharing cost on top.

    python benchmarks/pipeline.py                 # the table in docs/large-models.md (~4 min)
    python benchmarks/pipeline.py --microbatches 4 --steps 5 --batch 64

Writes benchmarks/results/pipeline.json: ``{"meta": {...}, "one_ms": float, "rows": [{"schedule",
"stages_per_rank", "microbatches", "step_ms", "hand_ms", "bubble", "theory"}]}``, each step
time the median over the timed steps of the slowest rank.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

RESULTS = Path(__file__).resolve().parent / "results"
SCHEDULES = (("gpipe", 1), ("1F1B", 1), ("interleaved1F1B", 2))
PIPELINE = 2
HAND = ("hand-gpipe", "hand-1F1B")  # the schedules also written by hand (one stage per rank)


class Block(nn.Module):
    """``x + W2 gelu(W1 x)``: the unit the stages are cut between."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


def make_model(args: argparse.Namespace) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(args.width, args.hidden) for _ in range(args.layers)))


def batch_of(args: argparse.Namespace) -> tuple[torch.Tensor, torch.Tensor]:
    """The one batch every step trains on (inputs, regression targets)."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(args.batch, args.width, generator=generator)
    return x, torch.randn(args.batch, args.width, generator=generator)


def timed_steps(rt: Any, model: Any, opt: Any, args: argparse.Namespace) -> list[float]:
    """Seconds per step (forward, backward, optimizer) after ``args.warmup`` untimed ones."""
    x, y = batch_of(args)
    times = []
    for step in range(args.warmup + args.steps):
        rt.barrier()
        start = time.perf_counter()
        rt.forward_backward(model, x, y, nn.functional.mse_loss)
        opt.step()
        opt.zero_grad()
        seconds = time.perf_counter() - start
        if step >= args.warmup:
            times.append(seconds)
    return times


def hand_worker(args: argparse.Namespace) -> None:
    """The same step written by hand on torch.distributed.pipelining: the baseline distkit's
    pipeline is measured against (its cut, its schedule, no distkit)."""
    import torch.distributed as dist
    from torch.distributed import pipelining

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model = make_model(args)
    half = args.layers // PIPELINE
    stage_module = model[:half] if rank == 0 else model[half:]
    stage = pipelining.PipelineStage(stage_module, rank, PIPELINE, torch.device("cpu"))
    kind = {"hand-gpipe": pipelining.ScheduleGPipe, "hand-1F1B": pipelining.Schedule1F1B}
    schedule = kind[args.schedule](stage, args.microbatches, loss_fn=nn.functional.mse_loss)
    opt = torch.optim.SGD(stage_module.parameters(), lr=1e-3)
    x, y = batch_of(args)
    times = []
    for step in range(args.warmup + args.steps):
        dist.barrier()
        start = time.perf_counter()
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)
        opt.step()
        opt.zero_grad()
        if step >= args.warmup:
            times.append(time.perf_counter() - start)
    mine = torch.tensor(times, dtype=torch.float64)
    everyone = [torch.empty_like(mine) for _ in range(PIPELINE)]
    dist.all_gather(everyone, mine)
    if rank == 0:
        slowest = torch.stack(everyone).amax(dim=0)
        args.out.write_text(json.dumps({"step_ms": 1e3 * statistics.median(slowest.tolist())}))
    dist.destroy_process_group()


def worker(args: argparse.Namespace) -> None:
    import distkit

    torch.set_num_threads(1)
    if args.schedule.startswith("hand-"):
        hand_worker(args)
        return
    strategy: Any = "dp"
    if args.schedule != "one":
        stages = PIPELINE * args.stages_per_rank
        per = args.layers // stages
        strategy = distkit.FSDPStrategy(
            pipeline_parallel=PIPELINE,
            pipeline_split=[str(i * per) for i in range(1, stages)],
            microbatches=args.microbatches,
            schedule=args.schedule,
            stages_per_rank=args.stages_per_rank,
        )
    with distkit.Runtime(strategy=strategy) as rt:
        model = make_model(args)
        model, opt = rt.setup(model, torch.optim.SGD(model.parameters(), lr=1e-3))
        times = torch.tensor(timed_steps(rt, model, opt, args), dtype=torch.float64)
        slowest = rt.all_gather(times.reshape(1, -1)).reshape(-1, len(times)).amax(dim=0)
        if rt.is_main:
            args.out.write_text(json.dumps({"step_ms": 1e3 * statistics.median(slowest.tolist())}))


def launch(args: argparse.Namespace, schedule: str, stages_per_rank: int, micro: int) -> float:
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        script = [__file__, "--worker", "--schedule", schedule, "--stages-per-rank",
                  str(stages_per_rank), "--microbatches", str(micro), "--out", str(out),
                  *shape_arguments(args)]  # fmt: skip
        torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={PIPELINE}"]
        cmd = [sys.executable, *(torchrun if schedule != "one" else []), *script]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{schedule} failed:\n{proc.stderr[-3000:]}")
        return float(json.loads(out.read_text())["step_ms"])


def shape_arguments(args: argparse.Namespace) -> list[str]:
    names = ("width", "hidden", "layers", "batch", "steps", "warmup")
    return [text for name in names for text in (f"--{name}", str(vars(args)[name]))]


def theory(micro: int, stages_per_rank: int) -> float:
    return (PIPELINE - 1) / (stages_per_rank * micro + PIPELINE - 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--schedule", default="one", help=argparse.SUPPRESS)
    parser.add_argument("--stages-per-rank", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--microbatches", type=int, nargs="+", default=[4, 8])
    parser.add_argument(
        "--schedules", nargs="+", default=[name for name, _ in SCHEDULES],
        choices=[name for name, _ in SCHEDULES], help="(default: all three)",
    )  # fmt: skip
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batch", type=int, default=512, help="rows per step (default: 512)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--results", type=Path, default=RESULTS, help="where pipeline.json goes")
    args = parser.parse_args()
    if args.worker:
        args.microbatches = args.microbatches[0]
        worker(args)
        return 0
    one = launch(args, "one", 1, 1)
    ideal = one / PIPELINE
    rows = []
    print(f"one process: {one:.1f} ms per step (ideal at {PIPELINE} stages: {ideal:.1f} ms)")
    print("| schedule | stages per rank | micro-batches | step ms | by hand ms (distkit's x) | "
          "bubble | theory (idle) |")  # fmt: skip
    print("|---|--:|--:|--:|--:|--:|--:|")
    for schedule, per_rank in SCHEDULES:
        if schedule not in args.schedules:
            continue
        for micro in args.microbatches:
            step = launch(args, schedule, per_rank, micro)
            hand = None
            if f"hand-{schedule}" in HAND:
                hand = launch(args, f"hand-{schedule}", per_rank, micro)
            row = {"schedule": schedule, "stages_per_rank": per_rank, "microbatches": micro,
                   "step_ms": step, "bubble": 1 - ideal / step,
                   "theory": theory(micro, per_rank), "hand_ms": hand}  # fmt: skip
            rows.append(row)
            by_hand = "-" if hand is None else f"{hand:.1f} ({step / hand:.2f}x)"
            print(f"| {schedule} | {per_rank} | {micro} | {step:.1f} | {by_hand} | "
                  f"{row['bubble']:.1%} | {row['theory']:.1%} |", flush=True)  # fmt: skip
    args.results.mkdir(parents=True, exist_ok=True)
    meta = {"torch": torch.__version__, **{k: vars(args)[k] for k in ("width", "hidden",
            "layers", "batch", "steps", "warmup")}}  # fmt: skip
    (args.results / "pipeline.json").write_text(
        json.dumps({"meta": meta, "one_ms": one, "rows": rows})
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
