"""Throughput against process count, per strategy, and the scaling efficiency.

Each configuration trains the overhead benchmark's CNN for a few epochs with the same per-process
batch (weak scaling: the global batch grows with the process count) and reports the median of
distkit's own per-epoch throughput (``samples_per_s`` in the history) after the first epoch.
Efficiency = throughput(N) / (N x throughput(1)). One thread per process.

    python benchmarks/scaling.py                  # dp x1, ddp x1/x2, horovod x1/x2
    python benchmarks/scaling.py --procs 1 2 4    # where the cores allow

Writes benchmarks/results/scaling.json: {strategy: {"N": {"samples_per_s", "efficiency"}}}.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import torch

import distkit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from overhead import make_data, make_model

RESULTS = Path(__file__).resolve().parent / "results"


def worker(strategy: str, steps: int, epochs: int, batch_size: int, out: Path) -> None:
    torch.set_num_threads(1)
    trainer = distkit.Trainer(strategy, batch_size=batch_size, max_epochs=epochs, progress=False)
    data = make_data(steps * batch_size * trainer.world_size)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    result = trainer.fit(model, optimizer, data, loss_fn=torch.nn.functional.cross_entropy)
    if trainer.is_main:
        rates = [record["samples_per_s"] for record in result.history[1:]]
        steps_ms = [record["time_step_ms"] for record in result.history[1:]]
        out.write_text(
            json.dumps(
                {
                    "samples_per_s": statistics.median(rates),
                    "step_ms": statistics.median(steps_ms),
                    "world_size": trainer.world_size,
                }
            )
        )
    trainer.close()


def launch(strategy: str, procs: int, args: argparse.Namespace) -> dict[str, float]:
    out = RESULTS / f"scaling_{strategy}_{procs}.json"
    script = [
        __file__, "--worker", strategy, "--steps", str(args.steps), "--epochs", str(args.epochs),
        "--batch-size", str(args.batch_size), "--out", str(out),
    ]  # fmt: skip
    if strategy == "horovod":
        horovodrun = str(Path(sys.executable).parent / "horovodrun")
        cmd = [horovodrun, "-np", str(procs), "-H", f"localhost:{procs}", "--gloo",
               sys.executable, *script]  # fmt: skip
    elif strategy == "dp":
        cmd = [sys.executable, *script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(procs), *script]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    result: dict[str, float] = json.loads(out.read_text())
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per epoch")
    parser.add_argument("--epochs", type=int, default=4, help="the first is warm-up")
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.steps, args.epochs, args.batch_size, args.out)
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    plan = {"dp": [1], "ddp": args.procs}
    if importlib.util.find_spec("horovod") is not None:
        plan["horovod"] = args.procs
    else:
        print("horovod: skipped, not installed (python -m distkit.horovod_build)")
    results: dict[str, dict[str, dict[str, float]]] = {}
    for strategy, counts in plan.items():
        for procs in counts:
            results.setdefault(strategy, {})[str(procs)] = launch(strategy, procs, args)
    print(f"\n{'strategy':<10}{'procs':>6}{'samples/s':>12}{'step ms':>10}{'efficiency':>12}")
    for strategy, by_procs in results.items():
        base = by_procs.get("1", {}).get("samples_per_s")
        for procs, r in by_procs.items():
            r["efficiency"] = r["samples_per_s"] / (int(procs) * base) if base else float("nan")
            print(f"{strategy:<10}{procs:>6}{r['samples_per_s']:>12,.0f}{r['step_ms']:>10.2f}"
                  f"{r['efficiency']:>12.2f}")  # fmt: skip
    (RESULTS / "scaling.json").write_text(json.dumps(results, indent=2))
    print(f"\nwrote {RESULTS / 'scaling.json'} (machine: {os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
