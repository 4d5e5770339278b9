"""What ``distkit doctor`` says about DeepSpeed, without importing it (an import probes every
op's build and prints a page of warnings).

Installed? Its version, from the package metadata. A C++ compiler? DeepSpeed JIT-builds its
native ops with ninja and a compiler at first use (fused Adam when a config names it, and on a
CPU machine a shared-memory op distkit skips); without one, such a build fails.
"""

from __future__ import annotations

import importlib.metadata
import shutil
from dataclasses import replace

from distkit.launch.diagnosis import MachineFacts, StrategyReport


def verdict(name: str, machine: MachineFacts, launcher: StrategyReport) -> StrategyReport:
    """``launcher``'s verdict (the torch launchers' check), with DeepSpeed's own facts."""
    try:
        version = importlib.metadata.version("deepspeed")
    except importlib.metadata.PackageNotFoundError:
        return StrategyReport(
            name,
            False,
            "DeepSpeed is not installed",
            ["the Python package 'deepspeed' is not installed"],
            f"{machine.python} -m pip install 'distkit[deepspeed]'  (after the pinned torch)",
        )
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    details = {**launcher.details, "deepspeed": version, "c++ compiler": compiler}
    summary = f"deepspeed {version}; {launcher.summary}"
    if compiler is None:
        summary += "; no C++ compiler: ops DeepSpeed JIT-builds (FusedAdam) cannot build"
    return replace(launcher, summary=summary, details=details)
