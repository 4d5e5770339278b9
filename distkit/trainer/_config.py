"""A Trainer's settings as one frozen, validated value.

``Trainer(...)`` keeps its keyword arguments and builds a :class:`TrainerConfig` from them;
the loop's settings, the strategy's options, the hyperparameters sent to the loggers and the
settings every rank must agree on are all read from it. Changing a setting later
(``trainer.max_epochs = 5``, as ``examples/mnist.py`` does once it knows its data) replaces
the whole value through :meth:`TrainerConfig.replace`, validated again, so a setting can never
hold what ``Trainer(...)`` would have refused.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import signal
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar, overload

import torch

from distkit._validate import check_flags
from distkit.errors import ConfigurationError
from distkit.faults import _preempt
from distkit.runtime import (
    ActivationCheckpointing,
    Profiler,
    check_compile,
    check_deterministic,
    checkpoint_policy,
    profiler_settings,
)
from distkit.strategies._placement import input_device_override
from distkit.strategies._steps import GradientClip
from distkit.trainer._arguments import check_trainer_arguments


@dataclass(frozen=True)
class TrainerConfig:
    """Every setting of ``Trainer(...)`` but the strategy, the callbacks and the loggers
    (objects with state of their own). The fields and their defaults are ``Trainer``'s."""

    max_epochs: int = 1
    batch_size: int = 32
    precision: str = "32"
    grad_accum_steps: int = 1
    seed: int = 0
    shuffle: bool = True
    sync_batchnorm: bool = False
    find_unused_parameters: bool = False
    num_workers: int = 0
    progress: bool = True
    drop_last: bool = False
    scheduler_interval: str = "epoch"
    max_steps: int | None = None
    checkpoint_dir: str | os.PathLike[str] | None = None
    checkpoint_every: int | str = "epoch"
    keep_last: int = 3
    resume: str | os.PathLike[str] | None = None
    nonfinite: str = "raise"
    fault_timeout: float | None = 10.0
    hang_warning: float | None = 300.0
    collective_timeout: float | None = None
    gradient_clip_norm: float | None = None
    gradient_clip_value: float | None = None
    log_every_n_steps: int = 50
    val_every_n_steps: int | None = None
    compile: bool | dict[str, Any] = False
    input_device: str | int | torch.device | None = None
    cudnn_benchmark: bool = False
    deterministic: bool | str = False
    activation_checkpointing: ActivationCheckpointing = None
    preempt_signals: Any = None
    requeue: bool = False
    profiler: bool | str | Profiler | None = None

    # derived from the fields above, once, in __post_init__ (validated there)
    #: ``compile``'s ``torch.compile`` arguments (None: off)
    compile_options: dict[str, Any] | None = field(init=False, repr=False, compare=False)
    #: ``input_device`` as a device (None: the model's own)
    input_device_override: torch.device | None = field(init=False, repr=False, compare=False)
    #: the clipping ``gradient_clip_norm`` / ``gradient_clip_value`` ask for (None: none)
    clip: GradientClip | None = field(init=False, repr=False, compare=False)
    #: the signals that preempt a fit (``preempt_signals`` resolved: () when off)
    preempt: tuple[signal.Signals, ...] = field(init=False, repr=False, compare=False)
    #: ``profiler`` as settings (None: off)
    profiling: Profiler | None = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fields = dataclasses.fields(self)
        check_trainer_arguments({f.name: getattr(self, f.name) for f in fields if f.init})
        derive = functools.partial(object.__setattr__, self)  # frozen: set once, here
        derive("compile_options", check_compile(self.compile))
        derive("input_device_override", input_device_override(self.input_device))
        clip = GradientClip.from_settings(self.gradient_clip_norm, self.gradient_clip_value)
        derive("clip", clip)
        checkpoint_policy(self.activation_checkpointing)  # refuses what it cannot take
        derive("preempt", _preempt.preempt_signals(self.preempt_signals, self.checkpoint_dir))
        check_flags(requeue=self.requeue)
        derive("profiling", profiler_settings(self.profiler))
        check_deterministic(self.deterministic)
        if self.cudnn_benchmark and self.deterministic is not False:
            raise ConfigurationError(
                f"cudnn_benchmark=True with deterministic={self.deterministic!r} (given here, "
                "or by the Runtime passed as runtime=): cuDNN's benchmark picks convolution "
                "algorithms by timing them, which is not reproducible; drop one of the two"
            )
        if self.requeue and not self.preempt:
            raise ConfigurationError(
                "requeue=True asks SLURM to requeue the job after a preemption checkpoint, but "
                "this trainer saves none: pass checkpoint_dir=... (preemption on SIGTERM and "
                "SIGUSR1 is then on by default), and do not pass preempt_signals=()"
            )

    def replace(self, **changes: Any) -> TrainerConfig:
        """A copy with ``changes``, validated as ``Trainer(...)`` validates its arguments
        (``__post_init__``; an unknown name is dataclasses' TypeError)."""
        return dataclasses.replace(self, **changes)


T = TypeVar("T")


class Setting(Generic[T]):
    """A ``Trainer`` attribute that reads and writes one field of its ``config``."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, trainer: None, owner: type | None = None) -> Setting[T]: ...

    @overload
    def __get__(self, trainer: object, owner: type | None = None) -> T: ...

    def __get__(self, trainer: object, owner: type | None = None) -> Any:
        if trainer is None:
            return self
        return getattr(trainer.config, self.name)  # type: ignore[attr-defined]

    def __set__(self, trainer: object, value: T) -> None:
        config = trainer.config  # type: ignore[attr-defined]
        trainer.config = config.replace(**{self.name: value})  # type: ignore[attr-defined]
