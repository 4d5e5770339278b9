"""Per-rank memory of parameters, gradients and optimizer state: fsdp against ddp, by process count.

Each configuration trains the same MLP of a few million parameters (default: four 1024 x 1024
layers and a head, 4.2 M parameters) with Adam for a few steps, and counts on every rank the
bytes of the tensors the strategy keeps between steps, at the optimizer step: parameters (a
sharded parameter's local slice), gradients and optimizer state. Not counted: activations,
fsdp's all-gathered unit while it runs forward or backward (one unit at a time), and ddp's
gradient buckets (a second copy of the gradients unless ``gradient_as_bucket_view=True``).

    python benchmarks/memory.py                      # ddp and fsdp, 1 and 2 processes
    python benchmarks/memory.py --procs 1 2 4 --width 2048

Writes benchmarks/results/memory.json: {strategy: {"N": {"params", "grads", "optimizer",
"total"} (bytes, the largest rank's), "vs_1": total(N) / total(1)}}.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

import distkit

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 2**20


def make_model(width: int, layers: int, classes: int = 10) -> nn.Module:
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(width, width), nn.ReLU()) for _ in range(layers)]
    return nn.Sequential(*blocks, nn.Linear(width, classes))


def _local_bytes(tensor: torch.Tensor | None) -> int:
    if tensor is None:
        return 0
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor  # a DTensor's slice
    return local.numel() * local.element_size()


def _state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return sum(
        _local_bytes(value)
        for state in optimizer.state.values()
        for value in state.values()
        if isinstance(value, torch.Tensor)
    )


def worker(strategy: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    trainer = distkit.Trainer(strategy, batch_size=args.batch_size, progress=False)
    model = make_model(args.width, args.layers)
    count = sum(p.numel() for p in model.parameters())
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    seen: dict[str, int] = {"params": 0, "grads": 0, "optimizer": 0}

    def before_step(opt: torch.optim.Optimizer, *_: Any) -> None:
        params = [p for group in opt.param_groups for p in group["params"]]
        seen["params"] = max(seen["params"], sum(_local_bytes(p) for p in params))
        seen["grads"] = max(seen["grads"], sum(_local_bytes(p.grad) for p in params))

    def after_step(opt: torch.optim.Optimizer, *_: Any) -> None:
        seen["optimizer"] = max(seen["optimizer"], _state_bytes(opt))

    # the user's optimizer object steps under every strategy (fsdp re-points it in place)
    optimizer.register_step_pre_hook(before_step)
    optimizer.register_step_post_hook(after_step)
    samples = args.steps * args.batch_size * trainer.world_size
    generator = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randn(samples, args.width, generator=generator),
        torch.randint(0, 10, (samples,), generator=generator),
    )
    trainer.fit(model, optimizer, data, loss_fn=nn.functional.cross_entropy)
    mine = {**seen, "total": sum(seen.values()), "parameters": count}
    per_rank = trainer.strategy.all_gather_object(mine)
    if trainer.is_main:
        args.out.write_text(json.dumps({"ranks": per_rank, "world_size": trainer.world_size}))
    trainer.close()


def launch(strategy: str, procs: int, args: argparse.Namespace) -> dict[str, Any]:
    out = RESULTS / f"memory_{strategy}_{procs}.json"
    script = [
        __file__, "--worker", strategy, "--steps", str(args.steps), "--width", str(args.width),
        "--layers", str(args.layers), "--batch-size", str(args.batch_size), "--out", str(out),
    ]  # fmt: skip
    if procs == 1:
        cmd = [sys.executable, *script]  # a world of one, as plain `python` runs it
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", str(procs), *script]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    report: dict[str, Any] = json.loads(out.read_text())
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--strategies", nargs="+", default=["ddp", "fsdp"])
    parser.add_argument("--width", type=int, default=1024, help="features of each layer")
    parser.add_argument("--layers", type=int, default=4, help="width x width layers")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=8, help="per process")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args)
        return 0
    RESULTS.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict[str, Any]] = {}
    parameters = 0
    for strategy in args.strategies:
        for procs in args.procs:
            report = launch(strategy, procs, args)
            largest = max(report["ranks"], key=lambda rank: rank["total"])
            parameters = largest["parameters"]
            entry = {key: largest[key] for key in ("params", "grads", "optimizer", "total")}
            results.setdefault(strategy, {})[str(procs)] = entry
    print(f"\nper-rank bytes kept between steps, {parameters / 1e6:.1f} M parameters, Adam (MiB)")
    header = ("strategy", "procs", "params", "grads", "optimizer", "total", "vs 1 proc")
    print(f"{header[0]:<10}{header[1]:>6}" + "".join(f"{h:>11}" for h in header[2:]))
    for strategy, by_procs in results.items():
        base = by_procs.get("1", {}).get("total")
        for procs, r in by_procs.items():
            r["vs_1"] = r["total"] / base if base else float("nan")
            sizes = "".join(f"{r[key] / MIB:>11.1f}" for key in ("params", "grads", "optimizer"))
            print(f"{strategy:<10}{procs:>6}{sizes}{r['total'] / MIB:>11.1f}{r['vs_1']:>11.2f}")
    results["meta"] = {"parameters": parameters, "width": args.width, "layers": args.layers}
    (RESULTS / "memory.json").write_text(json.dumps(results, indent=2))
    print(f"\nwrote {RESULTS / 'memory.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
