"""Imported once by the fork server that ``run_on_ranks`` starts ranks from, on a CPU machine
(tests/conftest.py): DeepSpeed and transformers' GPT-2, so that no rank imports them again
(0.8 s and 2.3 s of every rank's start).

DeepSpeed imports mlflow whenever it can (its autotuner, which distkit never uses): that
would put mlflow in every rank, and a test checks that a rank that does not log never
imports it. So DeepSpeed is imported with mlflow held out, and mlflow stays importable.
"""

from __future__ import annotations

import importlib.util
import os
import sys

if importlib.util.find_spec("deepspeed") is not None:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as the strategy sets it without CUDA
    held = "mlflow" not in sys.modules
    if held:
        sys.modules["mlflow"] = None  # type: ignore[assignment]  # `import mlflow` fails
    try:
        import deepspeed  # noqa: F401
    finally:
        if held:
            del sys.modules["mlflow"]

if importlib.util.find_spec("transformers") is not None:
    import transformers.models.gpt2.modeling_gpt2  # noqa: F401
