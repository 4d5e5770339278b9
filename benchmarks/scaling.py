"""Throughput against process count, per strategy, and the scaling efficiency.

Each configuration trains the overhead benchmark's CNN for a few epochs with the same per-process
batch (weak scaling: the global batch grows with the process count) and reports the median of
distkit's own per-epoch throughput (``samples_per_s`` in the history) after the first epoch,
and its MFU beside it (``mfu``: FLOPs per sample over the devices' peak; see docs/performance.md).
Efficiency = throughput(N) / (N x throughput(1)). One thread per process.

    python benchmarks/scaling.py                  # dp x1, ddp x1/x2, horovod x1/x2
    python benchmarks/scaling.py --procs 1 2 4    # where the cores allow
    python benchmarks/scaling.py --device cuda --procs 1 2 4 8 --model resnet --precision bf16

On CUDA only ddp runs (one GPU per process, cuda:LOCAL_RANK, NCCL), and the throughput is
distkit's own per-epoch figure, timed with CUDA events read once per epoch.

Writes benchmarks/results/scaling.json: {strategy: {"N": {"samples_per_s", "mfu", "efficiency"}}}.
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
from overhead import add_arguments, make_data, make_model, use_device


def worker(strategy: str, steps: int, epochs: int, batch_size: int, out: Path, **how) -> None:
    """One rank; ``how``: precision and model."""
    torch.set_num_threads(1)
    precision, name = how.get("precision", "32"), how.get("model", "cnn")
    trainer = distkit.Trainer(
        strategy, batch_size=batch_size, max_epochs=epochs, progress=False, precision=precision
    )
    data = make_data(steps * batch_size * trainer.world_size, name)
    model = make_model(name)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    result = trainer.fit(model, optimizer, data, loss_fn=torch.nn.functional.cross_entropy)
    if trainer.is_main:
        rates = [record["samples_per_s"] for record in result.history[1:]]
        steps_ms = [record["time_step_ms"] for record in result.history[1:]]
        # distkit's own MFU (absent where the device's peak is not known)
        mfus = [record["mfu"] for record in result.history[1:] if "mfu" in record]
        out.write_text(
            json.dumps(
                {
                    "samples_per_s": statistics.median(rates),
                    "step_ms": statistics.median(steps_ms),
                    "mfu": statistics.median(mfus) if mfus else None,
                    "world_size": trainer.world_size,
                }
            )
        )
    trainer.close()


def launch(strategy: str, procs: int, args: argparse.Namespace) -> dict[str, float]:
    out = args.results / f"scaling_{strategy}_{procs}.json"
    script = [
        __file__, "--worker", strategy, "--steps", str(args.steps), "--epochs", str(args.epochs),
        "--batch-size", str(args.batch_size), "--out", str(out), "--device", args.device,
        "--precision", args.precision, "--model", args.model,
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
    parser.add_argument(
        "--procs", type=int, nargs="+", help="process counts (default 1 2; on CUDA 1..GPUs)"
    )
    parser.add_argument("--steps", type=int, default=100, help="optimizer steps per epoch")
    parser.add_argument("--epochs", type=int, default=4, help="the first is warm-up")
    parser.add_argument("--batch-size", type=int, default=32, help="per process")
    add_arguments(parser)  # --device, --precision, --model, --results
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    use_device(args.device)
    if args.worker:
        how = {"precision": args.precision, "model": args.model}
        worker(args.worker, args.steps, args.epochs, args.batch_size, args.out, **how)
        return 0
    args.results.mkdir(parents=True, exist_ok=True)
    if args.device == "cuda":
        # ddp alone: one GPU per process (dp x1 would spread over every GPU)
        plan = {"ddp": args.procs or list(range(1, torch.cuda.device_count() + 1))}
    else:
        plan = {"dp": [1], "ddp": args.procs or [1, 2]}
        if importlib.util.find_spec("horovod") is not None:
            plan["horovod"] = plan["ddp"]
        else:
            print("horovod: skipped, not installed (python -m distkit.horovod_build)")
    results: dict[str, dict[str, dict[str, float]]] = {}
    for strategy, counts in plan.items():
        for procs in counts:
            results.setdefault(strategy, {})[str(procs)] = launch(strategy, procs, args)
    print(f"\n{'strategy':<10}{'procs':>6}{'samples/s':>12}{'MFU':>9}{'step ms':>10}"
          f"{'efficiency':>12}")  # fmt: skip
    for strategy, by_procs in results.items():
        base = by_procs.get("1", {}).get("samples_per_s")
        for procs, r in by_procs.items():
            r["efficiency"] = r["samples_per_s"] / (int(procs) * base) if base else float("nan")
            mfu = "-" if r.get("mfu") is None else f"{100 * r['mfu']:.3g}%"
            print(f"{strategy:<10}{procs:>6}{r['samples_per_s']:>12,.0f}{mfu:>9}"
                  f"{r['step_ms']:>10.2f}{r['efficiency']:>12.2f}")  # fmt: skip
    (args.results / "scaling.json").write_text(json.dumps(results, indent=2))
    cuda = args.device == "cuda"
    machine = f"{torch.cuda.device_count()} GPUs" if cuda else f"{os.cpu_count()} cores"
    print(f"\nwrote {args.results / 'scaling.json'} (machine: {machine})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
