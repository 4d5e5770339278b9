"""``distkit doctor``: which strategies work here, why not, and the command that fixes it.

:func:`collect_facts` looks at the machine (torch, CUDA, ``horovodrun --check-build``, the
installed apex) without importing Horovod or apex; :func:`assess` turns the facts into one
:class:`StrategyReport` per strategy and is a pure function, as are the two renderers.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from distkit._env import LaunchEnv
from distkit.registry import auto_strategy_name

STRATEGIES = ("ddp", "dp", "horovod", "apex")
CHECK_BUILD_TIMEOUT = 60.0
APEX_INSTALL = (
    "conda install -c conda-forge nvidia-apex  (or build https://github.com/NVIDIA/apex: "
    "APEX_CPP_EXT=1 APEX_CUDA_EXT=1 pip install -v --no-build-isolation .)"
)


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


@dataclass(frozen=True)
class ApexFacts:
    """``kind``: ``"none"``, ``"impostor"``, ``"legacy"``, ``"modern"`` or ``"error"``."""

    kind: str
    version: str | None = None
    location: str | None = None
    message: str | None = None


@dataclass(frozen=True)
class Facts:
    """Everything :func:`assess` looks at."""

    python: str
    torch_version: str
    cuda_devices: int  # 0 when CUDA is not available
    distributed: bool
    nccl: bool
    gloo: bool
    launcher: LaunchEnv
    horovod: HorovodFacts | None = None  # None: not examined
    apex: ApexFacts | None = None


@dataclass(frozen=True)
class StrategyReport:
    """One strategy's verdict: ``fix`` is one command (or the alternative where none exists)."""

    name: str
    usable: bool
    summary: str
    why_not: list[str] = field(default_factory=list)
    fix: str | None = None


def collect_facts(strategies: Sequence[str] = STRATEGIES) -> Facts:
    """Examine this machine; Horovod and apex only when ``strategies`` includes them."""
    import torch
    import torch.distributed as dist

    distributed = dist.is_available()
    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    gpu_build = bool(cuda and torch.version.cuda)
    return Facts(
        python=sys.executable,
        torch_version=str(torch.__version__),
        cuda_devices=cuda,
        distributed=distributed,
        nccl=distributed and dist.is_nccl_available(),
        gloo=distributed and dist.is_gloo_available(),
        launcher=LaunchEnv.detect(),
        horovod=_horovod_facts(gpu_build) if "horovod" in strategies else None,
        apex=_apex_facts() if "apex" in strategies else None,
    )


def _horovod_facts(cuda: bool) -> HorovodFacts:
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
    torch_version = hb.torch_info()[0]
    expected = hb.cache_key(version, torch_version, hb.python_tag(), hb.detect_flavour(cuda))
    return HorovodFacts(
        version=version,
        horovodrun=horovodrun,
        check_build=sections,
        check_build_error=error,
        mpirun=shutil.which("mpirun") is not None,
        build_key=hb.installed_key(version),
        expected_key=expected,
    )


def _apex_facts() -> ApexFacts:
    from distkit.errors import ApexImpostorError, ApexNotInstalledError
    from distkit.strategies.apex._detect import detect_apex

    try:
        found = detect_apex()
    except ApexNotInstalledError:
        return ApexFacts("none")
    except ApexImpostorError as exc:
        spec = importlib.util.find_spec("apex")
        try:
            version: str | None = importlib.metadata.version("apex")
        except importlib.metadata.PackageNotFoundError:
            version = None
        return ApexFacts("impostor", version, spec.origin if spec else None, str(exc))
    except Exception as exc:  # a broken apex must not break the doctor
        return ApexFacts("error", message=f"{type(exc).__name__}: {exc}")
    return ApexFacts(found.generation, found.version, found.location)


def assess(facts: Facts) -> dict[str, StrategyReport]:
    """One report per examined strategy, in :data:`STRATEGIES` order."""
    reports = [_ddp(facts), _dp(facts)]
    if facts.horovod is not None:
        reports.append(_horovod(facts, facts.horovod))
    if facts.apex is not None:
        reports.append(_apex(facts, facts.apex))
    return {report.name: report for report in reports}


def _ddp(facts: Facts) -> StrategyReport:
    gpus = facts.cuda_devices
    if gpus and facts.nccl:
        return StrategyReport("ddp", True, f"backend nccl, {gpus} GPU(s)")
    if facts.gloo:
        return StrategyReport("ddp", True, f"backend gloo {'(no NCCL)' if gpus else 'on CPU'}")
    why = "torch.distributed is not available" if not facts.distributed else "no gloo backend"
    fix = (
        "install a torch with torch.distributed and gloo (PyPI's Linux wheels have both): "
        f"{facts.python} -m pip install torch=={facts.torch_version.split('+')[0]}"
    )
    return StrategyReport("ddp", False, f"torch {facts.torch_version}", [why], fix)


def _dp(facts: Facts) -> StrategyReport:
    n = facts.cuda_devices
    if n > 1:
        return StrategyReport("dp", True, f"{n} replicas (nn.DataParallel over GPUs 0..{n - 1})")
    where = "one GPU" if n == 1 else "no GPU"
    return StrategyReport("dp", True, f"1 replica ({where}: DataParallel just runs the module)")


def _horovod(facts: Facts, hvd: HorovodFacts) -> StrategyReport:
    build = f"{facts.python} -m distkit.horovod_build"
    if hvd.version is None:
        return StrategyReport("horovod", False, "not installed", ["not installed"], build)
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
            torch = facts.torch_version
            why.append(f"its PyTorch extension is missing or does not load with torch {torch}")
        if not controllers:
            why.append("no usable controller (no Gloo; MPI needs mpirun on PATH)")
    if hvd.build_key == hvd.expected_key:
        summary += "; built by distkit.horovod_build for this torch"
    elif hvd.build_key is None:
        summary += "; not built by distkit.horovod_build (cannot tell which torch it was built for)"
    else:
        summary += f"; built by distkit.horovod_build as {hvd.build_key}, not {hvd.expected_key}"
    stale = hvd.build_key is not None and hvd.build_key != hvd.expected_key
    fix = f"{build} --force" if why or stale else None
    return StrategyReport("horovod", not why, summary, why, fix)


def _apex(facts: Facts, apex: ApexFacts) -> StrategyReport:
    why = [] if facts.cuda_devices else ["no CUDA device (NVIDIA apex is CUDA-only)"]
    summary = {
        "none": "not installed",
        "impostor": f"impostor: PyPI's unrelated 'apex' {apex.version} at {apex.location}",
        "legacy": f"legacy NVIDIA apex {apex.version} (amp + apex DDP)",
        "modern": f"modern NVIDIA apex {apex.version} (>= 25.07: no amp/parallel; distkit uses "
        "native autocast + torch DDP + apex fused optimizers)",
        "error": f"probing apex failed: {apex.message}",
    }.get(apex.kind, apex.kind)
    fix = None
    if apex.kind == "impostor":
        why.append("the importable 'apex' is not NVIDIA apex")
        fix = f"{facts.python} -m pip uninstall -y apex"
    elif apex.kind in ("none", "error"):
        why.append("NVIDIA apex is not installed" if apex.kind == "none" else summary)
    if fix is None and not facts.cuda_devices:
        fix = "none here (apex needs a GPU); on CPU: distkit run --strategy ddp, precision='bf16'"
    elif fix is None and why:
        fix = APEX_INSTALL
    return StrategyReport("apex", not why, summary, why, fix)


def to_json(facts: Facts, reports: dict[str, StrategyReport]) -> dict[str, Any]:
    """A JSON-ready dict: the facts, ``"auto"`` and ``"strategies": {name: report}``."""
    data = asdict(facts)
    data["auto"] = auto_strategy_name(facts.launcher)
    data["strategies"] = {name: asdict(report) for name, report in reports.items()}
    return data


def render_text(facts: Facts, reports: dict[str, StrategyReport]) -> str:
    """The report as aligned lines."""
    env = facts.launcher
    cuda = f"CUDA: {facts.cuda_devices} device(s)" if facts.cuda_devices else "CUDA: no"
    yes = {True: "yes", False: "no"}
    lines = [
        f"python    {facts.python}",
        f"torch     {facts.torch_version}  {cuda}  NCCL: {yes[facts.nccl]}  "
        f"Gloo: {yes[facts.gloo]}",
        f"launcher  {env.launcher} (rank {env.rank} of {env.world_size})  ->  "
        f"strategy='auto' picks {auto_strategy_name(env)}",
        "",
    ]
    for report in reports.values():
        verdict = "usable" if report.usable else "NOT usable"
        lines.append(f"{report.name:<8} {verdict:<10}  {report.summary}")
        if report.why_not:
            lines.append(f"{'':<21}why not: {'; '.join(report.why_not)}")
        if report.fix:
            lines.append(f"{'':<21}fix: {report.fix}")
    lines.append("\nlaunch: distkit run --strategy NAME -n N script.py  (dp: one process, no -n)")
    return "\n".join(lines)
