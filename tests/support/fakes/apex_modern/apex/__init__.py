"""FAKE NVIDIA apex, modern generation (>= 25.07: no ``amp``, ``parallel``, ``fp16_utils``).

This is a test double written for distkit; it contains no NVIDIA code and needs no CUDA.
apex 25.07 (PR #1896 "remove old features: amp, ddp, and rnn") deleted ``apex.amp``,
``apex.parallel`` and ``apex.fp16_utils``; ``from apex import amp`` then fails with
``ImportError: cannot import name 'amp' from 'apex'`` and ``import apex.amp`` with
``ModuleNotFoundError: No module named 'apex.amp'``, exactly as with this fake. What remains:
``apex.optimizers`` and ``apex.normalization``. Activate with
``tests.support.fakes.use_fake_apex("modern")``.

Test-only additions: ``CALLS``, ``reset_calls()``, ``calls_named(name)``,
``__fake_apex__ == "modern"``; shared code is loaded from ``tests/support/fakes/_apex_common`` as
``apex._common``.
"""

import importlib.util as _importlib_util
import pathlib as _pathlib
import sys as _sys


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

__fake_apex__ = "modern"
CALLS = _common.recorder.CALLS
reset_calls = _common.recorder.reset_calls
calls_named = _common.recorder.calls_named
DeprecatedFeatureWarning = _common.deprecation.DeprecatedFeatureWarning
deprecated_warning = _common.deprecation.deprecated_warning

from . import normalization, optimizers  # noqa: E402

__all__ = ["normalization", "optimizers"]
