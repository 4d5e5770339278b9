"""``compile="blocks"`` against a whole-model compile and eager, on the GPT-2 example.

Each mode trains examples/lm.py's model (transformers' GPT-2 at width 64, ``--layers`` blocks)
on its corpus (standard library modules) with its token-exact loss and AdamW, through
``distkit.Trainer("dp", compile=...)``, for ``--steps`` optimizer steps, and reports:

- **first step**: from ``fit`` to the end of its first optimizer step: the set-up, and for the
  compiled modes the compilation (dynamo's tracing and the backend's code generation);
- **step**: the median step after ``--warmup`` steps (a forward to the next);
- **vs eager**: the largest difference of any weight from the eager run's after the last step,
  and the loss history's; in float64 (``--dtype float64``) the noise floor of reordered float
  arithmetic is ~1e-12, in float32 ~1e-5 after a few dozen steps of Adam.

Every mode runs in a fresh process with an empty inductor cache of its own (a cold compile,
as a user's first run): nothing compiled by one mode is reused by the next.

    python benchmarks/compile_blocks.py                          # inductor, 2 and 6 blocks
    python benchmarks/compile_blocks.py --layers 12 --steps 40
    python benchmarks/compile_blocks.py --dtype float64          # exactness, 1e-12 floor
    python benchmarks/compile_blocks.py --device cuda --precision bf16 --layers 12

Writes benchmarks/results/compile_blocks.json.
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

RESULTS = Path(__file__).resolve().parent / "results"
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
MODES = {"eager": False, "model": True, "blocks": "blocks"}


def worker(args: argparse.Namespace) -> None:
    """One mode's run in this process; its figures and final weights under ``args.out``."""
    import torch

    import distkit

    sys.path.insert(0, str(EXAMPLES))
    import lm

    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # dp then trains on the CPU
        torch.set_num_threads(args.threads)
    dtype = {"float32": torch.float32, "float64": torch.float64}[args.dtype]
    train_files, _ = lm.corpus_files(8)
    data = lm.ByteSequences(train_files, args.max_len, args.steps * args.batch_size)
    torch.manual_seed(0)
    model = lm.build_model("hf", args.max_len, layers=args.layers[0]).to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3, weight_decay=0.01)
    option = MODES[args.worker]
    if option and args.backend != "inductor":
        option = {"backend": args.backend, **({"blocks": True} if option == "blocks" else {})}
    marks: list[float] = []

    class Clock(distkit.Callback):
        def on_train_step_end(self, trainer: Any, logs: Any) -> None:
            if args.device == "cuda":
                torch.cuda.synchronize()
            marks.append(time.perf_counter())

    trainer = distkit.Trainer(
        "dp", batch_size=args.batch_size, max_epochs=1, progress=False, seed=0,
        precision=args.precision, compile=option, callbacks=[Clock()],
    )  # fmt: skip
    start = time.perf_counter()
    result = trainer.fit(model, optimizer, data, step_fn=lm.token_loss)
    steps_s = [b - a for a, b in zip(marks[args.warmup :], marks[args.warmup + 1 :], strict=False)]
    record = {
        "first_step_s": marks[0] - start,
        "step_ms": 1e3 * statistics.median(steps_s),
        "steps": len(marks),
        "train_loss": [epoch["train_loss"] for epoch in result.history],
        "graphs": int(torch._dynamo.utils.counters["stats"]["unique_graphs"]),
    }
    weights = {k: v.detach().cpu() for k, v in trainer.full_state_dict().items()}
    trainer.close()
    torch.save(weights, args.out / f"{args.worker}.pt")
    (args.out / f"{args.worker}.json").write_text(json.dumps(record))


def launch(mode: str, layers: int, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    command = [
        sys.executable, __file__, "--worker", mode, "--out", str(folder),
        "--layers", str(layers), "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--batch-size", str(args.batch_size), "--max-len", str(args.max_len),
        "--dtype", args.dtype, "--precision", args.precision, "--device", args.device,
        "--backend", args.backend, "--threads", str(args.threads),
    ]  # fmt: skip
    with tempfile.TemporaryDirectory() as cache:  # a cold compile: no graph from another run
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "OMP_NUM_THREADS": str(args.threads)}
        done = subprocess.run(command, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        tail = "\n".join((done.stderr or done.stdout).splitlines()[-20:])
        return {"status": "failed", "detail": f"exit {done.returncode}:\n{tail}"}
    return {"status": "ok", **json.loads((folder / f"{mode}.json").read_text())}


def compare(folder: Path, results: dict[str, dict[str, Any]]) -> None:
    """Each compiled mode's distance from the eager run: its weights and its losses."""
    import torch

    if results["eager"]["status"] != "ok":
        return
    eager = torch.load(folder / "eager.pt")
    for mode, entry in results.items():
        if entry["status"] != "ok":
            continue
        weights = torch.load(folder / f"{mode}.pt")
        entry["max_weight_diff"] = max(
            (weights[k].double() - eager[k].double()).abs().max().item() for k in eager
        )
        entry["max_loss_diff"] = max(
            abs(a - b)
            for a, b in zip(entry["train_loss"], results["eager"]["train_loss"], strict=True)
        )


def print_table(layers: int, results: dict[str, dict[str, Any]]) -> None:
    print(f"\nGPT-2, {layers} blocks:")
    print(f"{'mode':<8}{'first step s':>13}{'step ms':>9}{'graphs':>8}{'max |w - eager|':>17}")
    for mode, r in results.items():
        if r["status"] != "ok":
            print(f"{mode:<8}{r['detail']}")
            continue
        print(f"{mode:<8}{r['first_step_s']:>13.2f}{r['step_ms']:>9.2f}{r['graphs']:>8}"
              f"{r['max_weight_diff']:>17.2e}")  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 6])
    parser.add_argument("--steps", type=int, default=30, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the median")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=64)
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--precision", default="32", choices=["32", "bf16", "fp16"])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--backend", default="inductor", help="torch.compile's backend")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    parser.add_argument("--out", type=Path, default=RESULTS / "compile_blocks.json")
    parser.add_argument("--worker", choices=sorted(MODES), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.steps <= args.warmup + 1:
        parser.error(f"--steps {args.steps}: more than --warmup + 1 ({args.warmup + 1})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    report: dict[str, Any] = {"meta": {k: v for k, v in vars(args).items() if k != "out"}}
    report["meta"]["out"] = str(args.out)
    report["meta"]["cores"] = os.cpu_count()
    for layers in args.layers:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp)
            results = {mode: launch(mode, layers, args, folder) for mode in MODES}
            compare(folder, results)
        report[f"layers_{layers}"] = results
        print_table(layers, results)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out}")
    failed = any(
        r["status"] != "ok" for key, v in report.items() if key != "meta" for r in v.values()
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
