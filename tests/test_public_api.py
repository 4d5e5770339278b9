"""The public surface: a pinned ``__all__``, and an import that loads and changes nothing."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import distkit
from distkit.registry import BUILTIN_STRATEGIES
from tests.support.paths import ROOT

pytestmark = pytest.mark.timeout(60)


PUBLIC_NAMES = [
    "Accuracy",
    "Callback",
    "ConfigurationError",
    "ConfusionMatrix",
    "DistkitError",
    "FitResult",
    "GlobalBatchNorm",
    "LauncherMismatchError",
    "Loss",
    "MeanIoU",
    "Metric",
    "MissingDependencyError",
    "PeerFailureError",
    "PeerStuckError",
    "Profiler",
    "Runtime",
    "RuntimeOptions",
    "ShardedStream",
    "Strategy",
    "StrategyPluginError",
    "Topology",
    "TrainOptions",
    "Trainer",
    "UnknownStrategyError",
    "UnsupportedFeatureError",
    "WorkerError",
    "__version__",
    "available_strategies",
    "callbacks",
    "init_empty",
    "load_weights",
    "loggers",
    "read_predictions",
    "register_strategy",
    "spawn",
]

# Modules that importing distkit must not load: backend libraries, torch's launchers and the
# built-in strategies' modules (as the registry names them).
FORBIDDEN_MODULES = [
    "horovod",
    "apex",
    "safetensors",
    "deepspeed",
    "transformers",
    "wandb",  # the loggers import their trackers on first use
    "mlflow",
    "torch.distributed.launch",
    "torch.distributed.run",
    "torch.distributed.elastic",
    *sorted({target.split(":")[0] for target in BUILTIN_STRATEGIES.values()}),
]

_IMPORT_PROBE = textwrap.dedent(
    """
    import json, os, sys
    before = dict(os.environ)
    import distkit
    after = dict(os.environ)
    forbidden = json.loads(sys.argv[1])
    loaded = sorted(
        name for name in sys.modules
        if any(name == f or name.startswith(f + ".") for f in forbidden)
    )
    changed = sorted(
        key for key in before.keys() | after.keys() if before.get(key) != after.get(key)
    )
    print(json.dumps({
        "loaded": loaded,
        "changed": changed,
        "file": distkit.__file__,
        "horovod": "horovod" in sys.modules,
        "apex": "apex" in sys.modules,
    }))
    """
)


# plus the built-in strategy classes, exported lazily under the names the registry gives them
STRATEGY_CLASSES = [target.rpartition(":")[2] for target in BUILTIN_STRATEGIES.values()]


def test_public_api_all_is_pinned():
    assert distkit.__all__ == sorted([*PUBLIC_NAMES, *STRATEGY_CLASSES])
    assert {"DDPStrategy", "DataParallelStrategy", "HorovodStrategy"} <= set(STRATEGY_CLASSES)


def test_public_api_every_name_exists():
    missing = [name for name in distkit.__all__ if not hasattr(distkit, name)]

    assert missing == []


def test_public_api_version_is_a_string():
    assert isinstance(distkit.__version__, str) and distkit.__version__.count(".") >= 1


def test_public_api_errors_derive_from_distkit_error_and_builtins():
    assert issubclass(distkit.UnknownStrategyError, (distkit.DistkitError, ValueError))
    assert issubclass(distkit.ConfigurationError, ValueError)
    assert issubclass(distkit.MissingDependencyError, ImportError)
    assert issubclass(distkit.LauncherMismatchError, RuntimeError)
    assert issubclass(distkit.UnsupportedFeatureError, RuntimeError)
    for name in distkit.__all__:
        obj = getattr(distkit, name)
        if isinstance(obj, type) and issubclass(obj, Exception):
            assert issubclass(obj, distkit.DistkitError), name


def test_public_api_strategy_classes_resolve_lazily_to_the_registry_classes():
    from distkit.registry import resolve_strategy_class

    for name in BUILTIN_STRATEGIES:
        cls = resolve_strategy_class(name)
        assert getattr(distkit, cls.__name__) is cls
    with pytest.raises(AttributeError, match="no attribute 'Nope'"):
        distkit.Nope  # noqa: B018


def test_public_api_import_loads_no_backend_and_changes_no_environment():
    completed = subprocess.run(
        [sys.executable, "-c", _IMPORT_PROBE, json.dumps(FORBIDDEN_MODULES)],
        capture_output=True,
        text=True,
        timeout=50,
        cwd=ROOT,
        check=False,
    )

    assert completed.returncode == 0, completed.stderr
    report = json.loads(completed.stdout.strip().splitlines()[-1])
    assert Path(report["file"]).resolve() == (ROOT / "distkit" / "__init__.py").resolve()
    assert report["loaded"] == []
    assert report["changed"] == [], "import distkit changed os.environ"
    assert report["horovod"] is False and report["apex"] is False
