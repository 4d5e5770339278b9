"""Which apex is installed: none, the wrong one, legacy NVIDIA apex, or modern NVIDIA apex.

Probing uses ``importlib.util.find_spec`` on subpackages. That imports apex's top-level package
(legacy apex's ``__init__`` imports ``amp`` and ``parallel`` itself, and PyPI's impostor fails
there), which is why the strategy probes only after its CUDA check, and only when
``strategy="apex"`` was chosen: importing distkit never probes.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass
from typing import Literal

from distkit.errors import ApexImpostorError, ApexNotInstalledError

INSTALL_ROUTES = (
    "NVIDIA apex is not on PyPI (`pip install apex` installs an unrelated web toolkit). Get it "
    "by building https://github.com/NVIDIA/apex from source with its CUDA extensions "
    "(`APEX_CPP_EXT=1 APEX_CUDA_EXT=1 pip install -v --no-build-isolation .`, nvcc matching "
    "torch.version.cuda), from conda-forge (`conda install -c conda-forge nvidia-apex`), or in "
    "an NGC PyTorch container. The legacy API (apex.amp, apex.parallel) needs tag 25.04 or "
    "older; 25.07+ keeps only fused optimizers and norms."
)
NVIDIA_MARKERS = ("apex.optimizers", "apex.normalization", "apex.amp", "apex.parallel")


@dataclass(frozen=True)
class ApexInstall:
    """What :func:`detect_apex` found."""

    generation: Literal["legacy", "modern"]
    version: str
    location: str

    @property
    def has_legacy_api(self) -> bool:
        return self.generation == "legacy"


def _spec_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):  # the parent imported with an error
        return False


def detect_apex() -> ApexInstall:
    """Classify the importable ``apex`` package.

    Raises:
        ApexNotInstalledError: no ``apex`` at all.
        ApexImpostorError: an ``apex`` without any of NVIDIA apex's subpackages.
    """
    spec = importlib.util.find_spec("apex")
    if spec is None:
        raise ApexNotInstalledError(
            f"strategy='apex' needs NVIDIA apex, which is not installed. {INSTALL_ROUTES}"
        )
    location = str(spec.origin or (spec.submodule_search_locations or ["?"])[0])
    version = _version()
    if not any(_spec_exists(name) for name in NVIDIA_MARKERS):
        raise ApexImpostorError(
            f"the installed 'apex' ({version} at {location}) is not NVIDIA apex: it has none of "
            f"{', '.join(NVIDIA_MARKERS)}. It is probably PyPI's unrelated 'apex' package; "
            f"remove it (`pip uninstall apex`). {INSTALL_ROUTES}"
        )
    legacy = _spec_exists("apex.amp") and _spec_exists("apex.parallel")
    return ApexInstall("legacy" if legacy else "modern", version, location)


def _version() -> str:
    try:
        return importlib.metadata.version("apex")
    except importlib.metadata.PackageNotFoundError:
        return "unknown version"
