"""FAKE ``apex.amp.initialize`` / ``state_dict`` / ``load_state_dict`` (test double, CPU).

Mirrors real apex (NVIDIA/apex ``apex/amp/frontend.py`` and ``_initialize.py``):

* opt levels O0-O3 with the real defaults (O0: fp32, static scale 1.0; O1: patch functions,
  dynamic scale; O2: fp16 model + fp32 master weights, dynamic; O3: pure fp16, static 1.0),
  then user overrides checked like real ``Properties`` (e.g. ``master_weights`` with O1, or a
  ``keep_batchnorm_fp32`` that is not a bool / "True" / "False", is refused);
* ``RuntimeError`` for an unknown opt level, for a model already wrapped in torch DDP, apex DDP
  or DataParallel ("Parallel wrappers should only be applied to the model(s) AFTER the model(s)
  have been returned from amp.initialize."), for fp16 parameters, and for an optimizer passed
  through ``amp.initialize`` twice; ``TypeError`` for models / optimizers of the wrong type;
* return values: the *same* model and optimizer objects, single or lists as passed;
* ``enabled=False`` returns the inputs untouched and creates no loss scaler, so a later
  ``amp.state_dict()`` raises ``AttributeError`` exactly like real apex;
* ``state_dict()`` -> ``OrderedDict(loss_scaler0={"loss_scale": float, "unskipped": int}, ...)``
  and ``load_state_dict()`` restore the real format; before ``initialize`` both raise
  ``AttributeError`` ('AmpState' object has no attribute 'loss_scalers').

Differences, because this is a CPU fake: real apex requires CUDA parameters ("Found param ...
expected torch.cuda.FloatTensor") and casts the model (O2/O3) and patches torch functions (O1);
the fake accepts CPU fp32 parameters and casts nothing, so results equal fp32 training with loss
scaling. Every call is recorded (``"amp.initialize"``, ``"amp.state_dict"``,
``"amp.load_state_dict"``).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from apex._common.recorder import record

from ._amp_state import _amp_state, maybe_print, warn_or_err
from ._process_optimizer import _process_optimizer
from .scaler import LossScaler


class Properties:
    """The amp options, with the consistency checks real apex runs when one is set."""

    def __init__(self) -> None:
        self.options: dict[str, Any] = {
            "enabled": False,
            "opt_level": None,
            "cast_model_type": None,
            "patch_torch_functions": False,
            "keep_batchnorm_fp32": None,
            "master_weights": None,
            "loss_scale": 1.0,
        }

    def __getattr__(self, name: str) -> Any:
        options = self.__dict__.get("options")
        if options is not None and name in options:
            return options[name]
        raise AttributeError(f"'{type(self).__name__}' object has no attribute '{name}'")

    def __setattr__(self, name: str, value: Any) -> None:
        if "options" not in self.__dict__ or name not in self.options:
            super().__setattr__(name, value)
            return
        if name == "cast_model_type":
            if (
                self.opt_level == "O1"
                and value is not None
                and value is not False
                and value is not torch.float32
            ):
                warn_or_err(
                    "O1 inserts casts around Torch functions rather than model weights, so with "
                    "O1, the model weights themselves should remain FP32. If you wish to cast "
                    f"the model to a different type, use opt_level='O2' or 'O3'. "
                    f"cast_model_type was {value}"
                )
        elif name == "patch_torch_functions":
            if self.opt_level != "O1" and value:
                warn_or_err(
                    "Currently, patch_torch_functions=True should only be set by selecting "
                    "opt_level='O1'."
                )
        elif name == "keep_batchnorm_fp32":
            if self.opt_level == "O1" and value is not None:
                warn_or_err(
                    "With opt_level O1, batchnorm functions are automatically patched to run in "
                    "FP32, so keep_batchnorm_fp32 should be None. "
                    f"keep_batchnorm_fp32 was {value}"
                )
            if value == "False":
                value = False
            elif value == "True":
                value = True
            elif not (value is True or value is False or value is None):
                raise AssertionError(
                    "keep_batchnorm_fp32 must be a boolean, the string 'True' or 'False', or "
                    f"None, found keep_batchnorm_fp32={value}"
                )
        elif name == "master_weights":
            if self.opt_level == "O1" and value is not None:
                warn_or_err(
                    "It doesn't make sense to use master_weights with O1. With O1, your model "
                    "weights themselves should be FP32."
                )
        elif name == "loss_scale":
            value = value if value == "dynamic" else float(value)
        self.options[name] = value


# (cast_model_type, patch_torch_functions, keep_batchnorm_fp32, master_weights, loss_scale)
_OPT_LEVEL_DEFAULTS: dict[str, tuple[Any, ...]] = {
    "O0": (torch.float32, False, None, False, 1.0),
    "O1": (None, True, None, None, "dynamic"),
    "O2": (torch.float16, False, True, True, "dynamic"),
    "O3": (torch.float16, False, False, False, 1.0),
}
_BRIEFS = {
    "O0": "O0:  Pure FP32 training.",
    "O1": "O1:  Insert automatic casts around Pytorch functions and Tensor methods.",
    "O2": "O2:  FP16 training with FP32 batchnorm and FP32 master weights.",
    "O3": "O3:  Pure FP16 training.",
}
opt_levels = tuple(_OPT_LEVEL_DEFAULTS)


def _apply_opt_level(properties: Properties, opt_level: str) -> None:
    cast, patch, keep_bn, master, scale = _OPT_LEVEL_DEFAULTS[opt_level]
    properties.enabled = True
    properties.opt_level = opt_level
    properties.cast_model_type = cast
    properties.patch_torch_functions = patch
    properties.keep_batchnorm_fp32 = keep_bn
    properties.master_weights = master
    properties.loss_scale = scale


def _check_models(models: list[Any]) -> None:
    from apex.parallel import DistributedDataParallel as ApexDDP

    for model in models:
        parallel_type = None
        if isinstance(model, torch.nn.parallel.DistributedDataParallel):
            parallel_type = "torch.nn.parallel.DistributedDataParallel"
        if isinstance(model, ApexDDP):
            parallel_type = "apex.parallel.DistributedDataParallel"
        if isinstance(model, torch.nn.parallel.DataParallel):
            parallel_type = "torch.nn.parallel.DataParallel"
        if parallel_type is not None:
            raise RuntimeError(
                f"Incoming model is an instance of {parallel_type}. Parallel wrappers should "
                "only be applied to the model(s) AFTER \nthe model(s) have been returned from "
                "amp.initialize."
            )


def _check_params_fp32(models: list[Any]) -> None:
    for model in models:
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if tensor.is_floating_point() and tensor.dtype == torch.float16:
                warn_or_err(
                    f"Found param {name} with type {tensor.type()}, expected "
                    "torch.cuda.FloatTensor.\nWhen using amp.initialize, you do not need to "
                    "call .half() on your model\nbefore passing it, no matter what optimization "
                    "level you choose."
                )


def initialize(
    models: Any,
    optimizers: Any = None,
    enabled: bool = True,
    opt_level: str = "O1",
    cast_model_type: Any = None,
    patch_torch_functions: Any = None,
    keep_batchnorm_fp32: Any = None,
    master_weights: Any = None,
    loss_scale: Any = None,
    cast_model_outputs: Any = None,
    num_losses: int = 1,
    verbosity: int = 1,
    min_loss_scale: float | None = None,
    max_loss_scale: float = 2.0**24,
) -> Any:
    """Fake ``amp.initialize``: validates like real apex, returns the inputs, casts nothing."""
    _amp_state.opt_properties = Properties()
    _amp_state.verbosity = verbosity

    if not enabled:
        record("amp.initialize", enabled=False, opt_level=opt_level, num_losses=num_losses)
        if optimizers is None:
            return models
        return models, optimizers

    if not torch.backends.cudnn.enabled:
        raise RuntimeError("Amp requires torch.backends.cudnn.enabled = True")
    if opt_level not in _OPT_LEVEL_DEFAULTS:
        raise RuntimeError(
            f"Unexpected optimization level {opt_level}. Options are 'O0', 'O1', 'O2', 'O3'.  "
            "Note that in `O0`, `O1`, etc., the prefix O is the letter O, not the number zero."
        )
    properties = _amp_state.opt_properties
    _apply_opt_level(properties, opt_level)
    maybe_print(f"Selected optimization level {_BRIEFS[opt_level]}", True)

    _amp_state.min_loss_scale = min_loss_scale
    _amp_state.max_loss_scale = max_loss_scale

    overrides = {
        "enabled": enabled,
        "opt_level": opt_level,
        "cast_model_type": cast_model_type,
        "patch_torch_functions": patch_torch_functions,
        "keep_batchnorm_fp32": keep_batchnorm_fp32,
        "master_weights": master_weights,
        "loss_scale": loss_scale,
    }
    for key, value in overrides.items():
        if value is not None:
            setattr(properties, key, value)
    maybe_print("After processing overrides, optimization options are:", True)
    for key, value in properties.options.items():
        maybe_print(f"{key:22} : {value}", True)

    record(
        "amp.initialize",
        enabled=True,
        opt_level=opt_level,
        loss_scale=properties.loss_scale,
        cast_model_type=properties.cast_model_type,
        patch_torch_functions=properties.patch_torch_functions,
        keep_batchnorm_fp32=properties.keep_batchnorm_fp32,
        master_weights=properties.master_weights,
        cast_model_outputs=cast_model_outputs,
        num_losses=num_losses,
        verbosity=verbosity,
        min_loss_scale=min_loss_scale,
        max_loss_scale=max_loss_scale,
    )
    return _initialize(models, optimizers, properties, num_losses)


def _initialize(models: Any, optimizers: Any, properties: Properties, num_losses: int) -> Any:
    optimizers_was_list = False
    if isinstance(optimizers, torch.optim.Optimizer):
        optimizers = [optimizers]
    elif optimizers is None:
        optimizers = []
    elif isinstance(optimizers, list):
        optimizers_was_list = True
    else:
        raise TypeError("optimizers must be either a single optimizer or a list of optimizers.")

    if isinstance(models, torch.nn.Module):
        models_was_list = False
        models = [models]
    elif isinstance(models, list):
        models_was_list = True
    else:
        raise TypeError("models must be either a single model or a list of models.")

    _check_models(models)
    if not _amp_state.allow_incoming_model_not_fp32:
        _check_params_fp32(models)

    for i, optimizer in enumerate(optimizers):
        optimizers[i] = _process_optimizer(optimizer, properties)

    if properties.patch_torch_functions:  # O1 (real apex: amp.init patches torch here)
        from .handle import patch_torch_functions

        patch_torch_functions()

    _amp_state.loss_scalers = [
        LossScaler(
            properties.loss_scale,
            min_loss_scale=_amp_state.min_loss_scale,
            max_loss_scale=_amp_state.max_loss_scale,
        )
        for _ in range(num_losses)
    ]

    if optimizers_was_list:
        return (models if models_was_list else models[0]), optimizers
    if not optimizers:
        return models if models_was_list else models[0]
    return (models if models_was_list else models[0]), optimizers[0]


def state_dict(destination: Any = None) -> Any:
    """``{"loss_scaler<i>": {"loss_scale": float, "unskipped": int}}`` in an OrderedDict."""
    record("amp.state_dict")
    if destination is None:
        destination = OrderedDict()
    for idx, loss_scaler in enumerate(_amp_state.loss_scalers):
        destination[f"loss_scaler{idx}"] = {
            "loss_scale": loss_scaler.loss_scale(),
            "unskipped": loss_scaler._unskipped,
        }
    return destination


def load_state_dict(state_dict: Any) -> None:
    """Restore loss scales saved by ``state_dict``; unexpected keys raise ``RuntimeError``."""
    record("amp.load_state_dict", keys=sorted(state_dict))
    if len(state_dict) != len(_amp_state.loss_scalers):
        print(
            f"Warning: state_dict contains {len(state_dict)} entries, while "
            f"{len(_amp_state.loss_scalers)} loss_scalers are used"
        )
    nb_loss_scalers = len(_amp_state.loss_scalers)
    unexpected_keys = []
    idx = 0
    for key in dict(state_dict):
        if "loss_scaler" not in key:
            unexpected_keys.append(key)
            continue
        if idx > nb_loss_scalers - 1:
            print(f"Skipping loss_scaler[{idx}], since num_losses was set to {nb_loss_scalers}")
            break
        _amp_state.loss_scalers[idx]._loss_scale = state_dict[key]["loss_scale"]
        _amp_state.loss_scalers[idx]._unskipped = state_dict[key]["unskipped"]
        idx += 1
    if unexpected_keys:
        raise RuntimeError(
            "Error(s) in loading state_dict. Unexpected key(s) in state_dict: {}. ".format(
                ", ".join(f'"{k}"' for k in unexpected_keys)
            )
        )
