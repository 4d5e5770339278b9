"""Import the example scripts in tests (examples/ is not a package)."""

from __future__ import annotations

import importlib.util
import sys
from types import ModuleType

from tests.support.paths import ROOT

EXAMPLES = ROOT / "examples"
# what a test must clear so a subprocess example does not think a launcher started it
LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                 "TORCHELASTIC_RUN_ID", "HOROVOD_RANK", "HOROVOD_SIZE", "OMPI_COMM_WORLD_SIZE",
                 "PMI_SIZE")  # fmt: skip


def load_example(name: str, filename: str) -> ModuleType:
    """``examples/<filename>`` imported as ``name`` (the name the other examples import it by)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / filename)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
