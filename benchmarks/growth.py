"""Cost as the world grows: start-up and distkit's agreement checks at 2, 4, 8 and 16 ranks.

Each loop trains the same one-layer model (28x28 inputs, batch 8 per rank, a few steps) in
processes started by ``torchrun --standalone --nproc_per_node N`` over gloo, one thread each:
the hand-written DDP loop, ``distkit.Trainer("ddp").fit``, a ``distkit.Runtime("ddp")`` loop
and Lightning Fabric's. On a 2-core machine 16 ranks are oversubscribed 8 to a core: the
times then measure how much work each rank does and waits for, not a cluster's network.

What each rank notes:

- **first step**: seconds from the launch (the launcher's clock, passed in the environment)
  to the end of the rank's first optimizer step; the job's figure is the slowest rank's.
- **each distkit check** (distkit's loops only): every collective distkit itself calls
  through its strategy (the start-of-fit agreement, the set-up's, the loader's, the log
  points' tagged sums; not DDP's own gradient all-reduce), labelled by the check it belongs
  to, with the bytes this rank contributes (the tensor it sends, or its pickle) and the
  seconds from the call to the result on this rank. The slowest rank to arrive waits least,
  so the smallest time over the ranks is the check's own cost and the largest adds the
  ranks' skew at that point.

    python benchmarks/growth.py                       # 2, 4, 8, 16 ranks, every loop
    python benchmarks/growth.py --ranks 2 4 --only hand,trainer

Writes benchmarks/results/growth.json. docs/performance.md fits the growth and projects it
to 1,024 and 8,192 ranks.
"""

from __future__ import annotations

import time

T_SCRIPT = time.time()  # first: the interpreter's start counts in the rank's start-up

import argparse  # noqa: E402
import contextlib  # noqa: E402
import gc  # noqa: E402
import inspect  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import pickle  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
LOOPS = ("hand", "trainer", "runtime", "fabric")
T0_ENV = "DISTKIT_GROWTH_T0"
OUT_ENV = "DISTKIT_GROWTH_OUT"
BATCH, STEPS = 8, 4
#: the strategy's collectives distkit's checks go through (see distkit.strategies._collectives)
COLLECTIVES = ("all_reduce", "all_reduce_async", "all_gather", "all_gather_object", "broadcast")


class Notes:
    """This rank's figures, written as JSON at the end."""

    def __init__(self) -> None:
        self.t0 = float(os.environ.get(T0_ENV, T_SCRIPT))
        self.first_step: float | None = None
        self.steps = 0
        self.checks: list[dict[str, Any]] = []

    def stepped(self, *_: object) -> None:
        self.steps += 1
        if self.first_step is None:
            self.first_step = time.time() - self.t0

    def write(self, rank: int) -> None:
        out = Path(os.environ[OUT_ENV]) / f"rank{rank}.json"
        record = {"first_step_s": self.first_step, "script_start_s": T_SCRIPT - self.t0}
        out.write_text(json.dumps({**record, "checks": self.checks}))


def _nbytes(value: Any) -> int:
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    return len(pickle.dumps(value))


def _label() -> str:
    """The check a strategy collective belongs to: the outermost agreement (``exchange``)
    or tagged sum (``tagged_sum``) on the stack, by its call's name; else the nearest
    distkit function outside the strategies."""
    label = None
    for frame_info in inspect.stack()[2:]:
        path, name = frame_info.filename, frame_info.function
        if "/distkit/" not in path:
            continue
        if name in ("exchange", "tagged_sum") and "call" in frame_info.frame.f_locals:
            label = f"{name}[{frame_info.frame.f_locals['call']}]"
        elif label is None and "/strategies/" not in path:
            label = f"{Path(path).stem}.{name}"
    return label or "strategy"


class _TimedPending:
    """A pending sum whose ``wait`` notes when the result arrived."""

    def __init__(self, pending: Any, note: dict[str, Any], start: float) -> None:
        self._pending, self._note, self._start = pending, note, start

    def wait(self) -> Any:
        result = self._pending.wait()
        if "seconds" not in self._note:
            self._note["seconds"] = time.perf_counter() - self._start
        return result

    def __getattr__(self, name: str) -> Any:  # done(), abandon(): the backend's own
        return getattr(self._pending, name)


def record_checks(strategy: Any, notes: Notes) -> None:
    """Wrap the strategy's collectives (this instance's) so that each call is noted."""
    for name in COLLECTIVES:
        original = getattr(strategy, name)

        def timed(*args: Any, _original: Any = original, _name: str = name, **kwargs: Any) -> Any:
            note = {
                "check": _label(),
                "op": _name,
                "bytes": _nbytes(args[0]) if args else 0,
                "in_loop": notes.steps > 0,
            }
            notes.checks.append(note)
            start = time.perf_counter()
            result = _original(*args, **kwargs)
            if _name == "all_reduce_async":
                return _TimedPending(result, note, start)
            note["seconds"] = time.perf_counter() - start
            return result

        setattr(strategy, name, timed)


def model_and_data(world: int) -> tuple[Any, Any]:
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    torch.manual_seed(0)
    model = nn.Sequential(nn.Flatten(), nn.Linear(28 * 28, 10))
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(BATCH * STEPS * world, 1, 28, 28, generator=generator)
    y = torch.randint(0, 10, (len(x),), generator=generator)
    return model, TensorDataset(x, y)


def hand(notes: Notes) -> None:
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel
    from torch.utils.data import DataLoader, DistributedSampler

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, rank = dist.get_world_size(), dist.get_rank()
    net, data = model_and_data(world)
    model = DistributedDataParallel(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    optimizer.register_step_post_hook(notes.stepped)
    sampler = DistributedSampler(data, num_replicas=world, rank=rank)
    for x, y in DataLoader(data, batch_size=BATCH, sampler=sampler):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    notes.write(rank)
    # as a careful hand-written loop ends: a rank that tears its sockets down while its peer
    # still reads the last ring's messages aborts that peer (SIGABRT, seen 1 in ~50 jobs of 2
    # ranks on a loaded machine); and DDP's reducer holds the group: released first, or the
    # group outlives destroy_process_group and goes down with the interpreter's exit (the
    # abort was seen again with the barrier alone; the cause is not proven)
    del model, optimizer
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def trainer(notes: Notes) -> None:
    import torch

    import distkit

    torch.set_num_threads(1)
    # log points every step: the loop's checks are measured too (one tagged sum each)
    fit = distkit.Trainer(
        "ddp", batch_size=BATCH, max_epochs=1, progress=False, log_every_n_steps=1
    )
    record_checks(fit.strategy, notes)
    net, data = model_and_data(fit.world_size)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    optimizer.register_step_post_hook(notes.stepped)
    fit.fit(net, optimizer, data, loss_fn=torch.nn.functional.cross_entropy)
    notes.write(fit.rank)
    fit.close()


def runtime(notes: Notes) -> None:
    import torch

    import distkit

    torch.set_num_threads(1)
    rt = distkit.Runtime("ddp")
    record_checks(rt.strategy, notes)
    net, data = model_and_data(rt.world_size)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    optimizer.register_step_post_hook(notes.stepped)
    model, optimizer = rt.setup(net, optimizer)
    for x, y in rt.loader(data, batch_size=BATCH):
        optimizer.zero_grad()
        rt.backward(torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()
    notes.write(rt.rank)
    rt.close()


def fabric(notes: Notes) -> None:
    import torch
    from lightning.fabric import Fabric
    from torch.utils.data import DataLoader

    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])
    lightning = Fabric(accelerator="cpu", devices=world, strategy="ddp", precision="32-true")
    with contextlib.redirect_stdout(sys.stderr):
        lightning.launch()  # under torchrun: joins the processes it started
    net, data = model_and_data(world)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.01, momentum=0.9)
    optimizer.register_step_post_hook(notes.stepped)
    model, optimizer = lightning.setup(net, optimizer)
    loader = lightning.setup_dataloaders(DataLoader(data, batch_size=BATCH, shuffle=True))
    for x, y in loader:
        optimizer.zero_grad()
        lightning.backward(torch.nn.functional.cross_entropy(model(x), y))
        optimizer.step()
    notes.write(lightning.global_rank)
    # Fabric leaves its process group up: destroyed here, or gloo's threads may abort the
    # exit ("terminate called without an active exception", seen at 8 ranks)
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


WORKERS = {"hand": hand, "trainer": trainer, "runtime": runtime, "fabric": fabric}


def launch(loop: str, ranks: int, timeout: int) -> dict[str, Any]:
    """One job of ``ranks`` processes; what every rank noted, summarised."""
    with tempfile.TemporaryDirectory() as out:
        env = {**os.environ, T0_ENV: repr(time.time()), OUT_ENV: out, "OMP_NUM_THREADS": "1"}
        command = [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc_per_node={ranks}", __file__, "--worker", loop,
        ]  # fmt: skip
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        if done.returncode != 0:
            tail = failure_lines(done.stderr or done.stdout)
            return {"status": "failed", "detail": f"exit {done.returncode}:\n{tail}"}
        notes = [json.loads((Path(out) / f"rank{r}.json").read_text()) for r in range(ranks)]
    return summarise(notes)


def failure_lines(output: str) -> str:
    """A failed job's report in whole lines: the ranks' own last lines (their error, a
    native "terminate called ..."), then torchrun's summary (which rank, which signal)."""
    lines = output.splitlines()
    agent = next((i for i, line in enumerate(lines) if "failed (exitcode" in line), len(lines))
    own = lines[max(0, agent - 25) : agent]
    summary = [line for line in lines[agent:] if line.strip()][-14:]
    return "\n".join([*own, *summary])


def summarise(notes: list[dict[str, Any]]) -> dict[str, Any]:
    """The job's figures from every rank's notes (see the module's docstring)."""
    first = [n["first_step_s"] for n in notes]
    summary: dict[str, Any] = {
        "status": "ok",
        "first_step_s": max(first),  # the job trains once its slowest rank does
        "first_step_rank0_s": first[0],
        "script_start_s": max(n["script_start_s"] for n in notes),
    }
    checks: dict[str, dict[str, Any]] = {}
    for rank_notes in notes:
        for note in rank_notes["checks"]:
            key = f"{note['check']} {note['op']}" + (" (in loop)" if note["in_loop"] else "")
            entry = checks.setdefault(key, {"calls": 0, "bytes": [], "seconds": []})
            entry["bytes"].append(note["bytes"])
            entry["seconds"].append(note.get("seconds", float("nan")))
    ranks = len(notes)
    for entry in checks.values():
        entry["calls"] = len(entry["bytes"]) // ranks  # per rank
        entry["bytes_per_rank"] = max(entry.pop("bytes")) * entry["calls"]
        seconds = entry.pop("seconds")
        entry["min_s"], entry["max_s"] = min(seconds), max(seconds)
        entry["median_s"] = statistics.median(seconds)
    summary["checks"] = checks
    return summary


def print_table(results: dict[str, dict[str, Any]]) -> None:
    for loop, by_ranks in results.items():
        for ranks, summary in by_ranks.items():
            if summary["status"] != "ok":
                detail = summary["detail"].replace("\n", "\n    ")
                print(f"{loop:<8} x{ranks:<3} {detail}")
                continue
            print(f"{loop:<8} x{ranks:<3} first step {summary['first_step_s']:6.2f} s "
                  f"(rank 0 {summary['first_step_rank0_s']:.2f} s)")  # fmt: skip
            for key, entry in summary["checks"].items():
                sent, low, high = entry["bytes_per_rank"], entry["min_s"], entry["max_s"]
                print(f"    {key:<52} {entry['calls']:>2} x {sent:>9,} B/rank  "
                      f"{1e3 * low:8.2f} ms min {1e3 * high:8.2f} ms max")  # fmt: skip


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4, 8, 16])
    parser.add_argument("--only", default=",".join(LOOPS), help=f"a subset of {','.join(LOOPS)}")
    parser.add_argument("--timeout", type=int, default=600, help="seconds per job")
    parser.add_argument("--out", type=Path, default=RESULTS / "growth.json")
    parser.add_argument("--worker", choices=LOOPS, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.only = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(args.only) - set(LOOPS))
    if unknown:
        parser.error(f"unknown loop(s) {', '.join(unknown)}; choose from {', '.join(LOOPS)}")
    if min(args.ranks) < 2:
        parser.error("--ranks: at least 2 (a world of one has no agreement to measure)")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        WORKERS[args.worker](Notes())
        return 0
    results: dict[str, dict[str, Any]] = {loop: {} for loop in args.only}
    for ranks in args.ranks:
        for loop in args.only:
            results[loop][str(ranks)] = launch(loop, ranks, args.timeout)
    print_table(results)
    report = {"meta": {"cores": os.cpu_count(), "batch_per_rank": BATCH, "steps": STEPS,
                       "backend": "gloo over loopback"}, "results": results}  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")
    return 0 if all(s["status"] == "ok" for r in results.values() for s in r.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
