"""FAKE NVIDIA apex, legacy generation (<= 25.04: ``amp`` and ``parallel`` present), for tests.

This is a test double written for distkit; it contains no NVIDIA code and needs no CUDA. It
mirrors the public API and the behaviour that matters to a training loop (see each submodule's
docstring for what differs). Activate it with ``tests.support.fakes.use_fake_apex("legacy")``.

Test-only additions (not in real apex): ``CALLS`` (every fake API call as ``(name, details)``),
``reset_calls()``, ``calls_named(name)`` and ``__fake_apex__ == "legacy"``. The shared
implementation lives in ``tests/support/fakes/_apex_common`` and is loaded below as
``apex._common``.
"""

import importlib.util as _importlib_util
import pathlib as _pathlib
import sys as _sys

import torch as _torch


def _load_common():
    name = __name__ + "._common"
    module = _sys.modules.get(name)
    if module is None:
        directory = _pathlib.Path(__file__).resolve().parents[2] / "_apex_common"
        spec = _importlib_util.spec_from_file_location(
            name, directory / "__init__.py", submodule_search_locations=[str(directory)]
        )
        module = _importlib_util.module_from_spec(spec)
        _sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


_common = _load_common()

__fake_apex__ = "legacy"
CALLS = _common.recorder.CALLS
reset_calls = _common.recorder.reset_calls
calls_named = _common.recorder.calls_named
DeprecatedFeatureWarning = _common.deprecation.DeprecatedFeatureWarning
deprecated_warning = _common.deprecation.deprecated_warning

# Real apex <= 25.04 imports these eagerly, parallel only when torch.distributed is available.
from . import amp, fp16_utils, normalization, optimizers  # noqa: E402

__all__ = ["amp", "fp16_utils", "normalization", "optimizers"]
if _torch.distributed.is_available():
    from . import parallel  # noqa: F401

    __all__.append("parallel")
