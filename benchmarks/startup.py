"""Start-up: from ``torchrun`` to the first optimizer step, distkit against a hand-written script.

Both scripts train the same one-layer model on the same 28x28 data on 2 processes, DDP over
gloo, each started by ``torchrun --standalone --nproc_per_node 2`` (one thread per process).
The launcher's start time travels to the workers in an environment variable; rank 0 notes, as
seconds since then, when its interpreter ran the script's first line, when each set-up stage
ended (imports, process group, ``Trainer(...)``, the first training step) and when the first
optimizer step returned (a ``register_step_post_hook`` on the optimizer, in both scripts). The
two scripts are launched in turn, the order swapped every round, after one warm-up round each
(cold file caches) that is thrown away. distkit's extra start-up is the median of the per-round
differences.

    python benchmarks/startup.py                    # 8 rounds, then the breakdown
    python benchmarks/startup.py --rounds 4 --no-breakdown

The breakdown says where distkit's own share goes: the stages' medians, ``python -X importtime``
for ``import distkit`` after ``import torch``, and a cProfile of rank 0 from ``import distkit``
to the first optimizer step (the distkit functions with the most cumulative time).

Writes benchmarks/results/startup.json.
"""

from __future__ import annotations

import os
import sys
import time

T_SCRIPT = time.time()  # first: how long the launcher and the interpreter took to get here
T0_ENV = "DISTKIT_STARTUP_T0"  # the launch's start, seconds since the epoch
PROFILE_ENV = "DISTKIT_STARTUP_PROFILE"  # rank 0 writes its cProfile stats there
MARK = "STARTUP "  # rank 0's line on stdout: MARK + JSON
BATCH, STEPS = 32, 4
#: torch's first optimizer imports torch._dynamo (about 1.5 s here): both scripts pay it
OPTIMIZER = "optimizer (torch._dynamo)"
CPU = "cpu to first step"


class Marks:
    """Seconds since the launch at each named stage, on this rank."""

    def __init__(self) -> None:
        self.t0 = float(os.environ.get(T0_ENV, T_SCRIPT))
        self.stages: dict[str, float] = {"interpreter up": T_SCRIPT - self.t0}
        # this process's CPU seconds: what other tenants of the machine cannot inflate
        self.cpu: dict[str, float] = {"interpreter up": time.process_time()}

    def __call__(self, stage: str) -> None:
        if stage not in self.stages:
            self.stages[stage] = time.time() - self.t0
            self.cpu[stage] = time.process_time()

    def report(self) -> None:
        if os.environ.get("RANK", "0") == "0":
            import json

            print(MARK + json.dumps({"wall": self.stages, "cpu": self.cpu}), flush=True)


def tiny_model_and_data(torch):  # type: ignore[no-untyped-def]
    from torch import nn
    from torch.utils.data import TensorDataset

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))
    generator = torch.Generator().manual_seed(0)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    x = torch.randn(BATCH * STEPS * world, 1, 28, 28, generator=generator)
    y = torch.randint(0, 10, (len(x),), generator=generator)
    return model, TensorDataset(x, y)


def hand_worker(marks: Marks) -> None:
    """The seeds' script: init_process_group, DDP, DistributedSampler, the loop."""
    import torch

    marks("import torch")
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    marks("process group")
    net, data = tiny_model_and_data(torch)
    model = DistributedDataParallel(net)
    marks("model, data, DDP(model)")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    optimizer.register_step_post_hook(lambda *_: marks("first optimizer step"))
    marks(OPTIMIZER)
    sampler = DistributedSampler(data, num_replicas=dist.get_world_size(), rank=dist.get_rank())
    loader = DataLoader(data, batch_size=BATCH, sampler=sampler)
    marks("sampler, loader")
    sampler.set_epoch(0)
    for x, y in loader:
        marks("first step starts")
        optimizer.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        loss.item()
    marks("epoch done")
    dist.destroy_process_group()
    marks("teardown done")


def distkit_worker(marks: Marks) -> None:
    """The same training written with distkit: Trainer("ddp").fit(...)."""
    import torch

    marks("import torch")
    torch.set_num_threads(1)
    profile = os.environ.get(PROFILE_ENV) if os.environ.get("RANK", "0") == "0" else None
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile()
        profiler.enable()
    import distkit

    marks("import distkit")
    trainer = distkit.Trainer("ddp", batch_size=BATCH, max_epochs=1, progress=False)
    marks("Trainer(...)")
    net, data = tiny_model_and_data(torch)
    marks("model, data")
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)

    def first_step(*_: object) -> None:
        marks("first optimizer step")
        if profiler is not None:
            profiler.disable()

    optimizer.register_step_post_hook(first_step)
    marks(OPTIMIZER)

    def step_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        marks("first step starts")  # fit's set-up is done: it wrapped, sharded, and began
        x, y = batch
        return torch.nn.functional.cross_entropy(model(x), y)

    trainer.fit(net, optimizer, data, step_fn=step_fn)
    marks("epoch done")
    trainer.close()
    marks("teardown done")
    if profiler is not None:
        profiler.dump_stats(profile)


WORKERS = {"hand": hand_worker, "distkit": distkit_worker}


# ---------------------------------------------------------------------------- the launcher
def launch(kind: str, env: dict[str, str] | None = None) -> dict[str, float]:
    """One ``torchrun`` of one script: rank 0's stages, the launch's wall time, and rank 0's
    CPU seconds at the first optimizer step (``cpu to first step``)."""
    import json
    import subprocess

    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
        os.path.abspath(__file__), "--worker", kind,
    ]  # fmt: skip
    t0 = time.time()
    env = {**os.environ, "OMP_NUM_THREADS": "1", T0_ENV: repr(t0), **(env or {})}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    wall = time.time() - t0
    lines = [line for line in proc.stdout.splitlines() if line.startswith(MARK)]
    if proc.returncode != 0 or not lines:
        # the ranks' own errors, before torchrun's summary of them
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        errors = [line for line in lines if "Error" in line and "elastic" not in line]
        tail = "\n".join(errors[-5:] + lines[-6:])
        raise RuntimeError(f"torchrun {kind} exited {proc.returncode}:\n{tail}")
    found = json.loads(lines[-1][len(MARK) :])
    stages: dict[str, float] = found["wall"]
    stages["torchrun exited"] = wall
    stages[CPU] = found["cpu"].get("first optimizer step", float("nan"))
    return stages


def import_breakdown(cached: bool = True) -> list[tuple[str, float, float]]:
    """``python -X importtime``: what ``import distkit`` imports after ``import torch``.

    Returns (module, self ms, cumulative ms) for the modules of that import whose own
    cumulative time is at least 5 ms, largest first, ``distkit`` itself included. ``cached``:
    with bytecode cached in a scratch folder (``PYTHONPYCACHEPREFIX``; a first import fills it),
    as a user's second run imports, even where ``PYTHONDONTWRITEBYTECODE`` is set.
    """
    import subprocess
    import tempfile

    cmd = [sys.executable, "-X", "importtime", "-c", "import torch; import distkit"]
    with tempfile.TemporaryDirectory() as prefix:
        env = dict(os.environ)
        if cached:
            env.pop("PYTHONDONTWRITEBYTECODE", None)
            env["PYTHONPYCACHEPREFIX"] = prefix
            subprocess.run(cmd, env=env, capture_output=True, check=True)  # fills the cache
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    rows = []
    for line in proc.stderr.splitlines():
        if not line.startswith("import time:") or "|" not in line:
            continue
        self_us, cumulative_us, name = line[len("import time:") :].split("|")
        if not self_us.strip().isdigit():
            continue  # the header
        rows.append((name.rstrip(), int(self_us) / 1e3, int(cumulative_us) / 1e3))
    # importtime prints a package after its imports; the top-level "torch" ends torch's tree
    end_torch = max(i for i, (name, _, _) in enumerate(rows) if name.strip() == "torch")
    after = rows[end_torch + 1 :]
    return sorted(
        ((name.strip(), own, cum) for name, own, cum in after if cum >= 5),
        key=lambda row: -row[2],
    )


def profile_breakdown(top: int) -> list[tuple[str, float, float, int]]:
    """One distkit launch with rank 0 under cProfile: (function, cumulative s, own s, calls)
    for distkit's functions with the most cumulative time, from ``import distkit`` to the
    first optimizer step."""
    import pstats
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "rank0.prof")
        launch("distkit", {PROFILE_ENV: path})
        stats = pstats.Stats(path)
    rows = []
    for (filename, line, function), (_, calls, own, cumulative, _) in stats.stats.items():  # type: ignore[attr-defined]
        if f"{os.sep}distkit{os.sep}" not in filename:
            continue
        where = filename.split(f"{os.sep}distkit{os.sep}")[-1]
        rows.append((f"distkit/{where}:{line} {function}", cumulative, own, calls))
    rows.sort(key=lambda row: -row[1])
    return rows[:top]


def median_stages(runs: list[dict[str, float]]) -> dict[str, float]:
    import statistics

    names = [name for name in runs[0] if all(name in run for run in runs)]
    return {name: statistics.median(run[name] for run in runs) for name in names}


def print_stages(kind: str, stages: dict[str, float]) -> None:
    print(f"\n{kind}: median seconds since the launch (rank 0), and each stage's share")
    before = 0.0
    for name, at in sorted(stages.items(), key=lambda item: item[1]):
        if name == CPU:
            continue
        print(f"  {name:<26}{at:>8.3f}  (+{at - before:.3f})")
        before = at


def main(argv: list[str] | None = None) -> int:
    import argparse
    import json
    import statistics
    from pathlib import Path

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=8, help="timed launches of each (8)")
    parser.add_argument(
        "--no-breakdown", action="store_true", help="skip -X importtime and the cProfile run"
    )
    parser.add_argument("--top", type=int, default=15, help="profile rows to print (15)")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).resolve().parent / "results" / "startup.json"
    )
    parser.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        marks = Marks()
        WORKERS[args.worker](marks)
        marks.report()
        return 0
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    runs: dict[str, list[dict[str, float]]] = {"hand": [], "distkit": []}
    print(f"launching hand and distkit {args.rounds + 1} times each (round 0: warm-up)...")
    for round_ in range(args.rounds + 1):
        order = ["hand", "distkit"] if round_ % 2 == 0 else ["distkit", "hand"]
        for kind in order:
            stages = launch(kind)
            if round_:
                runs[kind].append(stages)
    first = "first optimizer step"
    medians = {kind: median_stages(found) for kind, found in runs.items()}
    extra = [k[first] - h[first] for h, k in zip(runs["hand"], runs["distkit"], strict=True)]
    for kind in runs:
        print_stages(kind, medians[kind])
    hand_s, kit_s = medians["hand"][first], medians["distkit"][first]
    print(
        f"\ntorchrun to the first optimizer step, 2 processes, gloo, median of {args.rounds}:\n"
        f"  hand-written {hand_s:.3f} s, distkit {kit_s:.3f} s; distkit's extra: "
        f"{statistics.median(extra):+.3f} s (median of the per-round differences; "
        f"range {min(extra):+.3f} to {max(extra):+.3f})"
    )
    report = {
        "method": "torchrun --standalone --nproc_per_node 2, gloo, OMP_NUM_THREADS=1; seconds "
        "from the launch to rank 0's stages; medians over interleaved rounds after a warm-up",
        "rounds": args.rounds,
        "machine": f"{os.cpu_count()}-core CPU machine",
        "first_step_s": {"hand": hand_s, "distkit": kit_s},
        "distkit_extra_s": statistics.median(extra),
        "distkit_extra_range_s": [min(extra), max(extra)],
        "median_stages_s": medians,
        "runs": runs,
    }
    cpu = {kind: median_stages(found)[CPU] for kind, found in runs.items()}
    cpu_extra = [k[CPU] - h[CPU] for h, k in zip(runs["hand"], runs["distkit"], strict=True)]
    print(
        f"  rank 0's CPU time to the first optimizer step: hand-written {cpu['hand']:.3f} s, "
        f"distkit {cpu['distkit']:.3f} s; distkit's extra {statistics.median(cpu_extra):+.3f} s"
    )
    report["cpu_to_first_step_s"] = cpu
    report["distkit_extra_cpu_s"] = statistics.median(cpu_extra)
    if not args.no_breakdown:
        as_is = import_breakdown(cached=False)
        imports = import_breakdown()
        print(
            f"\nimport distkit after import torch: {imports[0][2]:.0f} ms with cached bytecode, "
            f"{as_is[0][2]:.0f} ms in this environment"
            + (
                " (PYTHONDONTWRITEBYTECODE is set)"
                if os.environ.get("PYTHONDONTWRITEBYTECODE")
                else ""
            )
        )
        report["import_distkit_ms"] = {"cached": imports[0][2], "this_environment": as_is[0][2]}
        print(
            "python -X importtime -c 'import torch; import distkit', cached: after torch, >= 5 ms"
        )
        print(f"  {'module':<48}{'self ms':>9}{'cumul. ms':>11}")
        for name, own, cum in imports[: args.top]:
            print(f"  {name:<48}{own:>9.1f}{cum:>11.1f}")
        profile = profile_breakdown(args.top)
        print("\ncProfile, rank 0, import distkit to the first optimizer step: distkit's")
        print(f"functions by cumulative time\n  {'cumul. s':>9}{'own s':>8}{'calls':>7}  function")
        for name, cum, own, calls in profile:
            print(f"  {cum:>9.3f}{own:>8.3f}{calls:>7}  {name}")
        report["imports_ms"] = [{"module": n, "self": o, "cumulative": c} for n, o, c in imports]
        report["profile"] = [
            {"function": n, "cumulative_s": c, "own_s": o, "calls": k} for n, c, o, k in profile
        ]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
