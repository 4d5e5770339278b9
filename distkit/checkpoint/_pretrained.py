"""The config files of a ``transformers`` model, beside its weights in a folder.

``AutoModelForCausalLM.from_pretrained(folder)`` reads ``config.json`` (and
``generation_config.json`` where the model has one) beside the safetensors weights. A model is
recognised by what it has (a ``config`` with ``save_pretrained``), so transformers is never
imported here.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
from torch import nn


def is_pretrained(module: nn.Module) -> bool:
    """Whether ``module`` carries a transformers-style config that can write itself."""
    return callable(getattr(getattr(module, "config", None), "save_pretrained", None))


def write_configs(module: nn.Module, folder: Path) -> list[Path]:
    """``config.json`` (and ``generation_config.json``) of ``module`` into ``folder``, as
    ``PreTrainedModel.save_pretrained`` writes them: the architecture and dtype recorded on a
    copy of the config, so the user's model is left as it was."""
    config: Any = copy.deepcopy(getattr(module, "config"))  # noqa: B009 (a dynamic attribute)
    # FSDP2's fully_shard swaps the class for an ``FSDP<name>`` subclass
    config.architectures = [type(module).__name__.removeprefix("FSDP")]
    dtype = _float_dtype(module)
    if dtype is not None:
        config.dtype = str(dtype).split(".")[1]  # "float32", as transformers records it
    config.save_pretrained(folder)
    if _generates(module):
        generation: Any = getattr(module, "generation_config")  # noqa: B009
        generation.save_pretrained(folder)
    return config_files(module, folder)


def config_files(module: nn.Module, folder: Path) -> list[Path]:
    """The files :func:`write_configs` writes for ``module`` (none for a plain module)."""
    if not is_pretrained(module):
        return []
    names = ["config.json", *(["generation_config.json"] if _generates(module) else [])]
    return [folder / name for name in names]


def _generates(module: nn.Module) -> bool:
    generation = getattr(module, "generation_config", None)
    can_generate = getattr(module, "can_generate", lambda: True)
    return callable(getattr(generation, "save_pretrained", None)) and bool(can_generate())


def _float_dtype(module: nn.Module) -> torch.dtype | None:
    for parameter in module.parameters():
        if parameter.is_floating_point():
            return parameter.dtype
    return None
