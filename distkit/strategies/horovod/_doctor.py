"""What ``distkit doctor`` says about Horovod: :func:`probe` looks, :func:`verdict` judges.

The probe never imports Horovod: it reads the installed version, finds horovodrun and runs
``horovodrun --check-build`` (a few seconds). The verdict is a pure function of the facts.
"""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
from dataclasses import asdict, dataclass, replace

from distkit.launch.diagnosis import MachineFacts, StrategyReport

CHECK_BUILD_TIMEOUT = 60.0


@dataclass(frozen=True)
class HorovodFacts:
    """What is known about Horovod; ``check_build`` is ``{section: {name: enabled}}``."""

    version: str | None = None
    horovodrun: str | None = None
    check_build: dict[str, dict[str, bool]] | None = None
    check_build_error: str | None = None
    mpirun: bool = False
    build_key: str | None = None  # from distkit.horovod_build's marker in the installed package
    expected_key: str | None = None  # the key a build for this interpreter's torch would have
    #: the same build with the other MPI choice (``--without-mpi`` beside an mpicc): also current
    other_mpi_key: str | None = None
    #: False: horovodrun's rendezvous server keeps a finished init's keys (0.28.1 as released),
    #: so a second hvd.init() in one job can abort; None: not known (another version's file)
    rendezvous_fixed: bool | None = None


def probe(machine: MachineFacts) -> HorovodFacts:
    """Look at the installed Horovod (without importing it)."""
    from distkit import horovod_build as hb
    from distkit.errors import MissingDependencyError

    try:
        version = importlib.metadata.version("horovod")
    except importlib.metadata.PackageNotFoundError:
        return HorovodFacts()
    try:
        horovodrun = hb.horovodrun_path()
    except MissingDependencyError:
        horovodrun = None
    sections, error = None, None
    if horovodrun is not None:
        try:
            done = subprocess.run(
                [horovodrun, "--check-build"],
                capture_output=True,
                text=True,
                timeout=CHECK_BUILD_TIMEOUT,
                stdin=subprocess.DEVNULL,
            )
            output = (done.stdout + done.stderr).strip()
            sections = hb.parse_check_build(output) or None
            if done.returncode != 0 or sections is None:
                error = f"exit code {done.returncode}: {output[-300:]}"
        except (OSError, subprocess.TimeoutExpired) as exc:
            error = f"{type(exc).__name__}: {exc}"
    gpu_build = bool(machine.cuda_devices and _torch_cuda())
    torch_version = hb.torch_info()[0]
    flavour = hb.detect_flavour(gpu_build)
    expected = hb.cache_key(version, torch_version, hb.python_tag(), flavour)
    other = replace(flavour, mpi=not flavour.mpi)
    return HorovodFacts(
        version=version,
        horovodrun=horovodrun,
        check_build=sections,
        check_build_error=error,
        mpirun=shutil.which("mpirun") is not None,
        build_key=hb.installed_key(version),
        expected_key=expected,
        other_mpi_key=hb.cache_key(version, torch_version, hb.python_tag(), other),
        rendezvous_fixed=hb.installed_rendezvous_fixed(),
    )


def _torch_cuda() -> bool:
    import torch

    return bool(torch.version.cuda)


def verdict(name: str, machine: MachineFacts, hvd: HorovodFacts) -> StrategyReport:
    """The report for strategy ``name`` from what :func:`probe` found."""
    build = f"{machine.python} -m distkit.horovod_build"
    details = asdict(hvd)
    if hvd.version is None:
        return StrategyReport(name, False, "not installed", ["not installed"], build, details)
    why = []
    built = hvd.check_build or {}
    names = {k: [n for n, on in v.items() if on] for k, v in built.items()}
    controllers = [c for c in names.get("controllers", []) if c != "MPI" or hvd.mpirun]
    summary = f"Horovod {hvd.version}"
    if hvd.horovodrun is None:
        why.append("horovodrun is neither next to python nor on PATH")
    elif hvd.check_build_error is not None or not built:
        why.append(f"horovodrun --check-build failed ({hvd.check_build_error})")
    else:
        summary += (
            f": frameworks {'+'.join(names.get('frameworks', [])) or 'none'}, controllers "
            f"{'+'.join(names.get('controllers', [])) or 'none'}, tensor ops "
            f"{'+'.join(names.get('tensor operations', [])) or 'none'}"
        )
        if "PyTorch" not in names.get("frameworks", []):
            torch = machine.torch_version
            why.append(f"its PyTorch extension is missing or does not load with torch {torch}")
        if not controllers:
            why.append("no usable controller (no Gloo; MPI needs mpirun on PATH)")
    current = hvd.build_key is not None and hvd.build_key in (hvd.expected_key, hvd.other_mpi_key)
    if current:
        summary += "; built by distkit.horovod_build for this torch"
    elif hvd.build_key is None:
        summary += "; not built by distkit.horovod_build (cannot tell which torch it was built for)"
    else:
        summary += f"; built by distkit.horovod_build as {hvd.build_key}, not {hvd.expected_key}"
    stale = hvd.build_key is not None and not current
    fix = f"{build} --force" if why or stale else None
    if hvd.rendezvous_fixed is False:  # one init per job still works: a warning, not a why-not
        summary += (
            "; its horovodrun keeps a finished hvd.init()'s keys, so hvd.init() after "
            "hvd.shutdown() in the same job can abort in gloo (distkit's build fixes it)"
        )
        fix = fix or build
    return StrategyReport(name, not why, summary, why, fix, details)
