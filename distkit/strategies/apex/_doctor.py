"""What ``distkit doctor`` says about apex: :func:`probe` looks, :func:`verdict` judges.

The probe classifies the installed apex by its subpackages (see :mod:`._detect`) and survives a
broken one; the verdict is a pure function of the facts.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import asdict, dataclass

from distkit.launch import native_alternative
from distkit.launch.diagnosis import MachineFacts, StrategyReport

APEX_INSTALL = (
    "conda install -c conda-forge nvidia-apex  (or build https://github.com/NVIDIA/apex: "
    "APEX_CPP_EXT=1 APEX_CUDA_EXT=1 pip install -v --no-build-isolation .)"
)


@dataclass(frozen=True)
class ApexFacts:
    """``kind``: ``"none"``, ``"impostor"``, ``"legacy"``, ``"modern"`` or ``"error"``."""

    kind: str
    version: str | None = None
    location: str | None = None
    message: str | None = None


def probe() -> ApexFacts:
    """Classify the installed apex."""
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


def verdict(name: str, machine: MachineFacts, apex: ApexFacts) -> StrategyReport:
    """The report for strategy ``name`` from what :func:`probe` found."""
    why = [] if machine.cuda_devices else ["no CUDA device (NVIDIA apex is CUDA-only)"]
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
        fix = f"{machine.python} -m pip uninstall -y apex"
    elif apex.kind in ("none", "error"):
        why.append("NVIDIA apex is not installed" if apex.kind == "none" else summary)
    if fix is None and not machine.cuda_devices:
        cpu = native_alternative(machine.choices)  # what runs in its place
        fix = (
            f"none here (apex needs a GPU); on CPU: distkit run --strategy {cpu}, precision='bf16'"
        )
    elif fix is None and why:
        fix = APEX_INSTALL
    return StrategyReport(name, not why, summary, why, fix, asdict(apex))
