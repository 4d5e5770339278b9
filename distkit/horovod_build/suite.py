"""Run Horovod's own PyTorch tests against the installed build, on 2 Gloo ranks.

    python -m distkit.horovod_build.suite [--source DIR] [--np 2] [--timeout S] [--keep DIR]

The tests are ``test/parallel/test_torch.py`` of the Horovod release the build uses (the sdist
on PyPI has no tests; they need pytest, pytest-timeout and mock, which ``nox -s horovod_suite``
installs): read from ``--source`` (a horovod checkout, or a git clone with the
release's tag) or downloaded from GitHub at the tag, and checked against the digests below
either way. Every rank runs pytest under ``horovodrun -np N -H localhost:N --gloo``; the tests
in :data:`NOT_APPLICABLE` are deselected, each with its reason. The run fails on a failed test,
on a test that skips itself (deselect it, with the reason, instead), and on a list that names a
test the file does not have (a stale list hides nothing).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import xml.etree.ElementTree as ET
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from distkit.errors import DistkitError
from distkit.horovod_build._install import horovodrun_path
from distkit.horovod_build._recipe import _PREFIX, DEFAULT_VERSION

TAG = f"v{DEFAULT_VERSION}"
TEST_FILE = "test/parallel/test_torch.py"
#: the files the run needs, with their sha256 at the tag
FILES = {
    TEST_FILE: "8af114f63fb7a87271322ad2da2c7050c3a9028570e45e8c44e9b1b4cac8db3a",
    "test/utils/common.py": "9844d1041c1e26b34657273608a51a19a94c18e0c22f9aa7971ae78189119290",
}
URL = "https://raw.githubusercontent.com/horovod/horovod/{tag}/{path}"

_GPU = "needs a CUDA device (this build is CPU + Gloo)"
#: test name -> why it does not apply to a CPU, Gloo-only build with torch 2.13 (deselected)
NOT_APPLICABLE: dict[str, str] = {
    "test_gpu_required": _GPU,
    "test_horovod_allreduce_multi_gpu": _GPU,
    "test_horovod_allreduce_cpu_gpu_error": _GPU,
    "test_horovod_grouped_allreduce_cpu_gpu_error": _GPU,
    "test_horovod_alltoall_splits_on_gpu": _GPU,
    "test_broadcast_state_gpu": _GPU,
    "test_horovod_sync_batch_norm": f"hvd.SyncBatchNorm {_GPU}",
    "test_model_parallelism": "needs two CUDA devices per rank (this build is CPU + Gloo)",
    "test_delta_optimizer": f"Adasum's delta optimizer needs MPI, and {_GPU}",
    "test_timeline_api": "marked skip by Horovod itself (horovod issue 2496)",
}
#: torch optimizers left out of the tests that sweep every ``torch.optim`` optimizer
#: (test_broadcast_state, test_broadcast_state_options, test_force_allreduce), and why; the
#: sweep keeps every other optimizer
SWEEP_EXCLUDED: dict[str, str] = {
    "Muon": "newer than Horovod 0.28.1's tests; it takes only 2-D parameters and raises "
    "ValueError on the sweep's model, whose biases are 1-D",
}


@dataclass
class Outcome:
    """One rank's results: test name -> "passed" / "failed" / "skipped: reason"."""

    results: dict[str, str] = field(default_factory=dict)

    def counts(self) -> Counter[str]:
        return Counter(result.split(":")[0] for result in self.results.values())


def fetch(dest: Path, source: Path | None = None, tag: str = TAG) -> Path:
    """Put :data:`FILES` under ``dest`` (same relative paths), checked against their digests.

    Args:
        dest: the folder to fill.
        source: a horovod checkout at ``tag``, or a git clone holding ``tag``; None downloads.
        tag: the release tag.

    Returns:
        The test file's path.

    Raises:
        DistkitError: a file cannot be read or has another digest than the release's.
    """
    for rel, digest in FILES.items():
        data = _read(rel, source, tag)
        got = hashlib.sha256(data).hexdigest()
        if got != digest:
            raise DistkitError(
                f"{rel} from {source or 'GitHub'} has sha256 {got}, not {digest} (horovod "
                f"{tag}'s): point --source at a horovod checkout of {tag}."
            )
        path = dest / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
    (dest / "pytest.ini").write_text("[pytest]\n")  # not the settings of a project around it
    return dest / TEST_FILE


def _read(rel: str, source: Path | None, tag: str) -> bytes:
    if source is not None and (source / rel).is_file():
        return (source / rel).read_bytes()
    if source is not None:
        done = subprocess.run(
            ["git", "--git-dir", str(_git_dir(source)), "show", f"{tag}:{rel}"],
            capture_output=True,
        )
        if done.returncode != 0:
            raise DistkitError(
                f"{source} has no {rel} and is not a git clone with tag {tag} "
                f"({done.stderr.decode(errors='replace').strip()})"
            )
        return done.stdout
    url = URL.format(tag=tag, path=rel)
    try:
        with urllib.request.urlopen(url, timeout=60) as response:
            return bytes(response.read())
    except OSError as exc:
        raise DistkitError(
            f"downloading {url} failed ({exc}); offline, pass --source DIR: a horovod checkout "
            f"of {tag} or a git clone that has the tag"
        ) from exc


def _git_dir(source: Path) -> Path:
    return source / ".git" if (source / ".git").exists() else source


def pytest_args(junit: Path, timeout: float) -> list[str]:
    """What each rank passes to pytest (run in the folder :func:`fetch` filled): the file, the
    deselections, a per-test timeout."""
    args = [TEST_FILE, "-q", "-p", "no:cacheprovider", f"--junitxml={junit}", "-rs"]
    args += ["-o", "junit_family=xunit2", "-o", f"timeout={timeout:g}"]
    for name in NOT_APPLICABLE:
        args += ["--deselect", f"{TEST_FILE}::TorchTests::{name}"]
    return args


def exclude_from_sweep(optim: object) -> list[str]:
    """Hide :data:`SWEEP_EXCLUDED` from the optimizer sweeps; the names hidden.

    The sweeps take ``torch.optim.Optimizer.__subclasses__()`` whose ``__module__`` starts with
    ``torch.optim``; renaming the module of an excluded class (in this test process only) is
    the one change that leaves the test file as released.
    """
    hidden = []
    for name, why in SWEEP_EXCLUDED.items():
        cls = getattr(optim, name, None)
        if isinstance(cls, type):
            cls.__module__ = f"distkit.horovod_build.suite (left out of the sweep: {why})"
            hidden.append(name)
    return hidden


def read_junit(path: Path) -> Outcome:
    """The results a rank's JUnit XML file holds."""
    outcome = Outcome()
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "?")
        if (node := case.find("failure")) is not None or (node := case.find("error")) is not None:
            outcome.results[name] = f"failed: {node.get('message', '')[:300]}"
        elif (node := case.find("skipped")) is not None:
            outcome.results[name] = f"skipped: {node.get('message', '')}"
        else:
            outcome.results[name] = "passed"
    return outcome


def problems(outcomes: list[Outcome], collected: set[str]) -> list[str]:
    """What makes the run fail: failures, skips, deselections of tests the file does not have."""
    found = []
    for rank, outcome in enumerate(outcomes):
        for name, result in sorted(outcome.results.items()):
            if result.startswith("failed"):
                found.append(f"rank {rank}: {name} {result}")
            elif result.startswith("skipped"):
                found.append(f"rank {rank}: {name} {result} (not applicable? deselect it)")
    stale = sorted(set(NOT_APPLICABLE) - collected)
    found += [f"{name} is deselected but {TEST_FILE} has no such test" for name in stale]
    return found


def defined_tests(test_file: Path) -> set[str]:
    """The ``test_*`` methods the file defines (read as text: collecting imports horovod)."""
    lines = test_file.read_text().splitlines()
    return {
        line.split("def ", 1)[1].split("(", 1)[0]
        for line in lines
        if line.startswith("    def test_")
    }


def run(workdir: Path, np: int, timeout: float, test_timeout: float) -> list[Outcome]:
    """Run the suite on ``np`` Gloo ranks; each rank's outcome (missing ranks raise)."""
    launcher = horovodrun_path()
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(workdir), env.get("PYTHONPATH")]))
    cmd = [
        launcher,
        "-np",
        str(np),
        "-H",
        f"localhost:{np}",
        "--gloo",
        sys.executable,
        "-m",
        "distkit.horovod_build.suite",
        "--rank-run",
        str(workdir),
        "--test-timeout",
        f"{test_timeout:g}",
    ]
    log = workdir / "horovodrun.log"
    with log.open("w") as fh:
        try:
            done = subprocess.run(
                cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=workdir, env=env, timeout=timeout
            )
        except subprocess.TimeoutExpired as exc:
            raise DistkitError(f"the suite ran past {timeout:g}s; its output: {log}") from exc
    outcomes = []
    for rank in range(np):
        junit = workdir / f"rank{rank}.xml"
        if not junit.is_file():
            tail = "\n".join(log.read_text(errors="replace").splitlines()[-40:])
            raise DistkitError(
                f"rank {rank} wrote no results (horovodrun exit code {done.returncode}); the "
                f"log ends:\n{tail}\nfull log: {log}"
            )
        outcomes.append(read_junit(junit))
    return outcomes


def _rank_run(workdir: Path, test_timeout: float) -> int:
    """One rank's pytest run (``horovodrun`` starts this on every rank)."""
    import pytest
    import torch

    exclude_from_sweep(torch.optim)
    rank = os.environ.get("HOROVOD_RANK", "0")
    os.chdir(workdir)
    return int(pytest.main(pytest_args(workdir / f"rank{rank}.xml", test_timeout)))


def report(outcomes: list[Outcome], seconds: float) -> str:
    """A summary: counts per rank, and every non-pass with its reason."""
    lines = [f"{_PREFIX} horovod {TAG} {TEST_FILE}: {seconds:.0f}s"]
    for rank, outcome in enumerate(outcomes):
        counts = outcome.counts()
        lines.append(
            f"  rank {rank}: {counts['passed']} passed, {counts['skipped']} skipped, "
            f"{counts['failed']} failed, {len(NOT_APPLICABLE)} deselected"
        )
    lines.append("  deselected (not applicable):")
    lines += [f"    {name}: {why}" for name, why in NOT_APPLICABLE.items()]
    lines.append("  left out of the optimizer sweeps:")
    lines += [f"    torch.optim.{name}: {why}" for name, why in SWEEP_EXCLUDED.items()]
    for rank, outcome in enumerate(outcomes):
        for name, result in sorted(outcome.results.items()):
            if result != "passed":
                lines.append(f"  rank {rank} {name}: {result}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Command line entry point; 0 when every applicable test passed on every rank."""
    parser = argparse.ArgumentParser(prog="python -m distkit.horovod_build.suite")
    parser.add_argument(
        "--source",
        type=Path,
        metavar="DIR",
        help=f"a horovod checkout of {TAG}, or a git clone with the tag "
        "(default: download the files from GitHub)",
    )
    parser.add_argument("--np", type=int, default=2, help="ranks (default: %(default)s)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds for the whole run")
    parser.add_argument("--test-timeout", type=float, default=300, help="seconds per test")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="run in DIR and keep it")
    parser.add_argument("--rank-run", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_run is not None:
        return _rank_run(args.rank_run, args.test_timeout)
    workdir = args.keep or Path(tempfile.mkdtemp(prefix="distkit-horovod-suite-"))
    try:
        test_file = fetch(workdir, args.source)
        start = time.monotonic()
        outcomes = run(workdir, args.np, args.timeout, args.test_timeout)
        print(report(outcomes, time.monotonic() - start), flush=True)
        found = problems(outcomes, defined_tests(test_file))
    except DistkitError as exc:
        found = [str(exc)]
    for line in found:
        print(f"{_PREFIX} FAIL: {line}", file=sys.stderr, flush=True)
    if found and (workdir / "horovodrun.log").exists():
        print(f"{_PREFIX} the run's files (logs, JUnit XML per rank): {workdir}", file=sys.stderr)
    elif args.keep is None:
        shutil.rmtree(workdir, ignore_errors=True)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
