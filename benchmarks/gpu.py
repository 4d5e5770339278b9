"""The GPU benchmarks in one command: overhead, scaling and peers on every GPU count here.

For each model (the small CNN, a ResNet-18) and precision (fp32, bf16 and fp16 autocast) this
runs, one GPU per process (cuda:LOCAL_RANK, NCCL, torchrun for 2 or more):

- ``overhead.py``: distkit's step against the hand-written loop, on 1 GPU and on each count
  from 2 to all of them (``--only ddp --nprocs N``);
- ``scaling.py``: distkit's throughput and scaling efficiency on 1..N GPUs;
- ``peers.py``: distkit, the hand loop, Lightning Fabric, the Lightning Trainer and Accelerate,
  on 1 GPU and on all of them.

It collects their JSON into benchmarks/results/gpu.json, draws benchmarks/results/gpu.png
(with matplotlib) and prints one markdown table, the one the performance page shows.

    nox -s bench -- --device cuda                 # the session runs this script
    python benchmarks/gpu.py                      # the same, in an environment of your own
    python benchmarks/gpu.py --gpus 1,8 --models resnet --precisions bf16
    python benchmarks/gpu.py --dry-run --gpus 1,2 # the commands, without running them
    python benchmarks/gpu.py --table results/gpu.json   # the table again, from the JSON

Without a CUDA device it prints one line saying so and exits 0. This module imports only the
standard library at the top (``noxfile.py`` reads :func:`split_device` from it); torch is
imported where it is used.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
MODELS = ("cnn", "resnet")
PRECISIONS = ("32", "bf16", "fp16")
BENCHMARKS = ("overhead", "scaling", "peers")
PEERS = ("fabric", "lightning", "accelerate")
#: per-GPU batch: enough that the GPU, not Python, sets the step time for the ResNet
BATCH = {"cnn": 256, "resnet": 128}


def split_device(argv: Sequence[str]) -> tuple[str, list[str]]:
    """``nox -s bench -- ARGS``: the device asked for, and the other arguments.

    ``--device cuda`` (or ``--device=cuda``) selects the GPU benchmarks (this script, given the
    other arguments); no ``--device``, or ``--device cpu``, the CPU ones (``overhead.py`` gets
    the other arguments, as before).

    Raises:
        ValueError: ``--device`` without a value, or with one other than cpu and cuda.
    """
    device, rest = "cpu", []
    args = iter(argv)
    for arg in args:
        if arg == "--device":
            value = next(args, None)
            if value is None:
                raise ValueError("--device needs a value: cpu (the default) or cuda")
            device = value
        elif arg.startswith("--device="):
            device = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    if device not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r}: allowed are cpu (the default) and cuda")
    return device, rest


def no_cuda_line(torch_version: str, available: bool) -> str:
    return (
        f"no CUDA device here (torch {torch_version}, cuda available: {available}): the GPU "
        "benchmarks skip; run this on a machine with NVIDIA GPUs and a CUDA build of torch"
    )


# ---------------------------------------------------------------------------- the plan
@dataclass
class Job:
    """One run of one benchmark script, and where its JSON lands."""

    benchmark: str
    model: str
    precision: str
    gpus: list[int]  # the GPU counts this run covers
    batch_size: int  # per GPU
    cmd: list[str]
    out: Path

    @property
    def key(self) -> str:
        return f"{self.model}/{self.precision}"


def plan(args: argparse.Namespace, gpus: list[int]) -> list[Job]:
    """Every run, in order: per model and precision, overhead, scaling, peers."""
    python = [sys.executable]
    jobs = []
    for model in args.models:
        for precision in args.precisions:
            batch = args.batch_size or BATCH[model]
            common = ["--device", "cuda", "--model", model, "--precision", precision]
            common += ["--batch-size", str(batch), "--steps", str(args.steps)]
            folder = args.results / f"{model}-{precision}"
            if "overhead" in args.benchmarks:
                for n in gpus:
                    where = folder / f"overhead-{n}"
                    only = ["--only", "single"] if n == 1 else ["--only", "ddp", "--nprocs", str(n)]
                    cmd = [*python, str(HERE / "overhead.py"), *only, *common]
                    cmd += ["--rounds", str(args.rounds), "--results", str(where)]
                    jobs.append(
                        Job("overhead", model, precision, [n], batch, cmd, where / "overhead.json")
                    )
            if "scaling" in args.benchmarks:
                where = folder / "scaling"
                cmd = [*python, str(HERE / "scaling.py"), "--procs", *map(str, gpus), *common]
                cmd += ["--epochs", str(args.rounds + 1), "--results", str(where)]
                jobs.append(
                    Job("scaling", model, precision, gpus, batch, cmd, where / "scaling.json")
                )
            if "peers" in args.benchmarks:
                ends = sorted({gpus[0], gpus[-1]})
                out = folder / "peers.json"
                cmd = [*python, str(HERE / "peers.py"), "--nprocs", ",".join(map(str, ends))]
                cmd += [*common, "--rounds", str(args.rounds), "--out", str(out)]
                jobs.append(Job("peers", model, precision, ends, batch, cmd, out))
    return jobs


def run_job(job: Job, timeout: float) -> dict[str, Any]:
    """Run one benchmark; its results by GPU count, or {"error": ...} (the run goes on)."""
    print(f"[{job.key}] {job.benchmark} on {','.join(map(str, job.gpus))} GPU(s)", flush=True)
    job.out.parent.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    try:
        proc = subprocess.run(job.cmd, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"did not finish in {timeout:.0f} s"}
    if proc.returncode != 0 or not job.out.exists():
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-10:]
        sys.stderr.write("\n".join(tail) + "\n")
        return {"error": f"exited {proc.returncode}: {tail[-1] if tail else ''}"[:500]}
    return by_gpus(job.benchmark, json.loads(job.out.read_text()))


def by_gpus(benchmark: str, data: dict[str, Any]) -> dict[str, Any]:
    """A script's own JSON, keyed by GPU count ("1", "2", ...)."""
    if benchmark == "overhead":  # {"single": {...}} or {"ddp xN": {...}}
        return {str(entry["world_size"]): entry for entry in data.values()}
    if benchmark == "scaling":  # {"ddp": {"N": {...}}}
        return dict(data.get("ddp", {}))
    # peers: {"meta", "single": {"processes", "frameworks"}, "xN": {...}}
    return {
        str(block["processes"]): block["frameworks"] for key, block in data.items() if key != "meta"
    }


# ---------------------------------------------------------------------------- the report
@dataclass
class Report:
    meta: dict[str, Any]
    runs: dict[str, dict[str, Any]] = field(default_factory=dict)

    def add(self, job: Job, result: dict[str, Any]) -> None:
        run = self.runs.setdefault(
            job.key,
            {"model": job.model, "precision": job.precision, "batch_size_per_process": None},
        )
        run["batch_size_per_process"] = job.batch_size
        run.setdefault(job.benchmark, {})
        if "error" in result:
            for n in job.gpus:
                run[job.benchmark][str(n)] = {"error": result["error"]}
        else:
            run[job.benchmark].update(result)

    def as_json(self) -> dict[str, Any]:
        return {"meta": self.meta, "runs": self.runs}


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}"


def _peer(entry: dict[str, Any] | None) -> str:
    if not entry:
        return "-"
    if entry.get("status") == "ok" and "ratio" in entry:
        return f"{entry['ratio']:.2f}"
    return str(entry.get("status", "failed"))


def _mfu(entry: dict[str, Any] | None) -> str:
    if not entry or "mfu" not in entry:
        return "-"
    return f"{100 * entry['mfu']:.3g}%"


def _peaks(report: dict[str, Any]) -> str:
    """The peaks the MFU column divides by, as peers.py named them ("published: NVIDIA
    H100 80GB HBM3, bf16"), each once."""
    sources = {
        entry["peak_source"]
        for run in report.get("runs", {}).values()
        for frameworks in run.get("peers", {}).values()
        for entry in frameworks.values()
        if isinstance(entry, dict) and entry.get("peak_source")
    }
    return "; ".join(sorted(sources)) or "none known"


def markdown_table(report: dict[str, Any]) -> str:
    """The performance page's table: one row per model, precision and GPU count."""
    meta = report.get("meta", {})
    lines = [
        f"{meta.get('machine', 'unknown machine')}, {meta.get('date', '')}; torch "
        f"{meta.get('torch', '?')}, CUDA {meta.get('cuda', '?')}; batch per GPU as shown; "
        "ms/step: median step (CUDA events; from peers.py where overhead.py did not run); "
        "vs hand: distkit / the hand-written loop; "
        "samples/s and efficiency: distkit's own per-epoch figures; Fabric, Lightning, "
        "Accelerate: their step / the hand loop's (peers.py); MFU: distkit's in peers.py "
        f"(FLOPs per sample x samples/s over the GPUs' peak: {_peaks(report)})",
        "",
        "| model | precision | batch/GPU | GPUs | hand ms/step | distkit ms/step | vs hand "
        "| samples/s | efficiency | MFU | Fabric | Lightning | Accelerate |",
        "| --- | --- " + "| ---: " * 11 + "|",
    ]
    for run in report.get("runs", {}).values():
        overhead = run.get("overhead", {})
        scaling = run.get("scaling", {})
        peers = run.get("peers", {})
        counts = sorted({*overhead, *scaling, *peers}, key=int)
        for n in counts:
            o, s, p = overhead.get(n, {}), scaling.get(n, {}), peers.get(n, {})
            if "error" in o:
                hand = kit = ratio = "failed"
            elif not o and _peer(p.get("distkit")) not in ("-", "failed") and "hand" in p:
                # overhead.py did not run: peers.py timed distkit and the hand loop too
                hand, kit = _ms(p["hand"].get("ms_per_step")), _ms(p["distkit"].get("ms_per_step"))
                ratio = f"{p['distkit']['ratio']:.3f}"
            else:
                hand, kit = _ms(o.get("hand_ms")), _ms(o.get("distkit_ms"))
                ratio = f"{o['ratio']:.3f}" if "ratio" in o else "-"
            if "error" in s:
                rate = efficiency = "failed"
            else:
                rate = f"{s['samples_per_s']:,.0f}" if "samples_per_s" in s else "-"
                efficiency = f"{s['efficiency']:.2f}" if "efficiency" in s else "-"
            if "error" in p:
                cells = ["failed"] * len(PEERS)
                mfu = "failed"
            else:
                cells = [_peer(p.get(name)) for name in PEERS]
                mfu = _mfu(p.get("distkit"))
            row = [
                run["model"], "fp32" if run["precision"] == "32" else run["precision"],
                str(run.get("batch_size_per_process") or "-"), n, hand, kit, ratio, rate,
                efficiency, mfu, *cells,
            ]  # fmt: skip
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> str:
    """samples/s against GPU count, and distkit / hand, per model and precision."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return f"{path.name}: not drawn, matplotlib is not installed (pip install matplotlib)"
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, run in report["runs"].items():
        scaling = {int(n): e for n, e in run.get("scaling", {}).items() if "samples_per_s" in e}
        if scaling:
            counts = sorted(scaling)
            left.plot(counts, [scaling[n]["samples_per_s"] for n in counts], "o-", label=key)
        overhead = {int(n): e for n, e in run.get("overhead", {}).items() if "ratio" in e}
        if overhead:
            counts = sorted(overhead)
            right.plot(counts, [overhead[n]["ratio"] for n in counts], "o-", label=key)
    left.set(xlabel="GPUs", ylabel="samples/s (distkit)", title="throughput (scaling.py)")
    right.axhline(1.0, color="grey", lw=0.8)
    right.set(xlabel="GPUs", ylabel="distkit / hand step", title="overhead (overhead.py)")
    for ax in (left, right):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{report['meta'].get('machine', '')}, {report['meta'].get('date', '')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return f"wrote {path}"


# ---------------------------------------------------------------------------- the command
def _names(value: str, allowed: Sequence[str], what: str) -> list[str]:
    names = [name.strip() for name in value.split(",") if name.strip()]
    names = ["32" if name == "fp32" else name for name in names]
    unknown = sorted(set(names) - set(allowed))
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"{what}: unknown {', '.join(unknown) or 'empty list'}; choose from {','.join(allowed)}"
        )
    return [name for name in allowed if name in names]


def _counts(value: str) -> list[int]:
    try:
        counts = sorted({int(n) for n in value.split(",")})
    except ValueError:
        raise argparse.ArgumentTypeError(f"--gpus takes counts like 1,2,4, got {value!r}") from None
    if not counts or counts[0] < 1:
        raise argparse.ArgumentTypeError("--gpus: counts must be at least 1")
    return counts


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--device", choices=["cuda"], default="cuda", help="cuda (the only device here)"
    )
    parser.add_argument("--gpus", type=_counts, help="GPU counts (default: 1 to every GPU here)")
    parser.add_argument(
        "--models", type=lambda v: _names(v, MODELS, "--models"), default=list(MODELS),
        help="comma-separated: cnn,resnet (default both)",
    )  # fmt: skip
    parser.add_argument(
        "--precisions", type=lambda v: _names(v, PRECISIONS, "--precisions"),
        default=list(PRECISIONS), help="comma-separated: 32 (or fp32),bf16,fp16 (default all)",
    )  # fmt: skip
    parser.add_argument(
        "--benchmarks", type=lambda v: _names(v, BENCHMARKS, "--benchmarks"),
        default=list(BENCHMARKS), help="comma-separated: overhead,scaling,peers (default all)",
    )  # fmt: skip
    parser.add_argument("--steps", type=int, default=100, help="steps per round (default 100)")
    parser.add_argument(
        "--rounds", type=int, default=4, help="timed rounds (default 4), after a warm-up round"
    )
    parser.add_argument("--batch-size", type=int, help="per GPU (default: cnn 256, resnet 128)")
    parser.add_argument(
        "--results", type=Path, default=RESULTS / "gpu", help="folder for each run's JSON"
    )
    parser.add_argument(
        "--out", type=Path, default=RESULTS / "gpu.json", help="the collected JSON (and .png)"
    )
    parser.add_argument(
        "--timeout", type=float, default=1800, help="seconds one run may take (default 1800)"
    )
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run none")
    parser.add_argument("--table", type=Path, help="print the table of this gpu.json and exit")
    args = parser.parse_args(argv)
    if args.steps < 3 or args.rounds < 1:
        parser.error("--steps must be at least 3 and --rounds at least 1")
    return args


def meta() -> dict[str, Any]:
    import torch

    count = torch.cuda.device_count()
    return {
        "date": _dt.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": f"{count}x {torch.cuda.get_device_name(0)}" if count else "no GPU",
        "gpus": count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if count else None,
        "python": platform.python_version(),
        "bf16_supported": bool(count and torch.cuda.is_bf16_supported()),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.table:
        print(markdown_table(json.loads(args.table.read_text())))
        return 0
    import torch

    available = torch.cuda.is_available()
    if not available and not args.dry_run:
        print(no_cuda_line(torch.__version__, available))
        return 0
    present = torch.cuda.device_count() if available else 0
    gpus = args.gpus or list(range(1, present + 1))
    if not gpus:
        print("--dry-run without a GPU here: say which counts, e.g. --gpus 1,2", file=sys.stderr)
        return 2
    if available and not args.dry_run and gpus[-1] > present:  # a dry run plans any count
        print(f"--gpus {gpus}: this machine has {present} GPU(s)", file=sys.stderr)
        return 2
    info = meta() if available else {"machine": "dry run"}
    if available and "bf16" in args.precisions and not info["bf16_supported"]:
        print(f"bf16: skipped, {info['machine']} does not support it")
        args.precisions = [p for p in args.precisions if p != "bf16"]
    jobs = plan(args, gpus)
    if args.dry_run:
        for job in jobs:
            print(" ".join(job.cmd))
        return 0
    started = time.perf_counter()
    report = Report(info)
    for job in jobs:
        report.add(job, run_job(job, args.timeout))
    report.meta["wall_s"] = round(time.perf_counter() - started, 1)
    data = report.as_json()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=2))
    print("\n" + markdown_table(data) + "\n")
    print(f"wrote {args.out} ({report.meta['wall_s']:.0f} s)")
    print(plot(data, args.out.with_suffix(".png")))
    return 0


if __name__ == "__main__":
    sys.exit(main())
