"""Run test bodies on real Horovod processes: ``horovodrun -np N -H localhost:N --gloo``.

One horovodrun launch runs a list of calls in sequence on every rank (importing horovod costs
seconds, so the Horovod tests share launches). Each rank pickles its results, or the traceback
of a call that raised, to a folder the parent reads back.
"""

from __future__ import annotations

import importlib
import os
import pickle
import shutil
import subprocess
import sys
import traceback
from pathlib import Path
from typing import Any

from tests.support.paths import ROOT

Call = tuple[str, str, tuple[Any, ...], dict[str, Any]]  # module, function, args, kwargs


class RankError(Exception):
    """A call raised on a Horovod rank; the message holds that rank's traceback."""


def horovodrun_path() -> str | None:
    beside = Path(sys.executable).parent / "horovodrun"
    return str(beside) if beside.exists() else shutil.which("horovodrun")


def run_with_horovodrun(
    calls: list[Call], workdir: Path, *, np: int = 2, timeout: float = 600
) -> list[list[Any]]:
    """Results per rank, one per call; a call that raised gives a :class:`RankError`."""
    launcher = horovodrun_path()
    assert launcher, "horovodrun not found next to python or on PATH"
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / "calls.pkl").write_bytes(pickle.dumps(calls))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [
        launcher, "-np", str(np), "-H", f"localhost:{np}", "--gloo",
        sys.executable, "-m", "tests.support.horovod_runner", str(workdir),
    ]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    (workdir / "output.txt").write_text(proc.stdout + proc.stderr)
    results = []
    for rank in range(np):
        path = workdir / f"rank{rank}.pkl"
        assert path.exists(), f"rank {rank} wrote no results (exit {proc.returncode}):\n" + (
            proc.stdout[-4000:] + proc.stderr[-4000:]
        )
        results.append(pickle.loads(path.read_bytes()))
    return results


def _main(workdir: Path) -> None:
    import torch

    # run as __main__ (python -m), this module's RankError would pickle as __main__'s,
    # which the parent cannot load: raise the importable one
    from tests.support.horovod_runner import RankError

    torch.set_num_threads(1)
    rank = int(os.environ["HOROVOD_RANK"])
    calls: list[Call] = pickle.loads((workdir / "calls.pkl").read_bytes())
    results: list[Any] = []
    for module, function, args, kwargs in calls:
        try:
            fn = getattr(importlib.import_module(module), function)
            results.append(fn(*args, **kwargs))
        except Exception:
            results.append(
                RankError(f"{module}.{function} on rank {rank}:\n{traceback.format_exc()}")
            )
    (workdir / f"rank{rank}.pkl").write_bytes(pickle.dumps(results))


if __name__ == "__main__":
    _main(Path(sys.argv[1]))
