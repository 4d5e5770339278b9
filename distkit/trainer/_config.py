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
from typing import TYPE_CHECKING, Any, Generic, TypeVar, overload

import torch

from distkit._validate import check_flags
from distkit.errors import ConfigurationError
from distkit.faults import _preempt
from distkit.runtime import Profiler, RuntimeOptions, check_compile, profiler_settings
from distkit.strategies._placement import input_device_override
from distkit.strategies._steps import GradientClip
from distkit.trainer._trainer_arguments import check_trainer_arguments

#: the Trainer's arguments that are the Runtime's settings: every field of RuntimeOptions but
#: ``preempt_signals`` and ``requeue`` (the Trainer's own: a fit's preemption saves in its
#: ``checkpoint_dir``) and ``same_data_on_every_rank`` (the Trainer shards its data itself)
RUNTIME_SETTINGS = frozenset(f.name for f in dataclasses.fields(RuntimeOptions) if f.init) - {
    "preempt_signals",
    "requeue",
    "same_data_on_every_rank",
}


@dataclass(frozen=True)
class TrainerConfig:
    """Every setting of ``Trainer(...)`` but the strategy, the callbacks and the loggers
    (objects with state of their own). The fields and their defaults are ``Trainer``'s; the
    Runtime's settings are one :class:`~distkit.RuntimeOptions` (``runtime_options``), and
    read here by their names too (``config.seed``)."""

    max_epochs: int = 1
    batch_size: int = 32
    shuffle: bool = True
    num_workers: int = 0
    progress: bool = True
    drop_last: bool = False
    scheduler_interval: str = "epoch"
    max_steps: int | None = None
    checkpoint_dir: str | os.PathLike[str] | None = None
    checkpoint_every: int | str = "epoch"
    checkpoint_async: bool = False
    keep_last: int = 3
    resume: str | os.PathLike[str] | None = None
    nonfinite: str = "raise"
    gradient_clip_norm: float | None = None
    gradient_clip_value: float | None = None
    log_every_n_steps: int = 50
    val_every_n_steps: int | None = None
    compile: bool | str | dict[str, Any] = False
    input_device: str | int | torch.device | None = None
    cudnn_benchmark: bool = False
    preempt_signals: Any = None
    requeue: bool = False
    profiler: bool | str | Profiler | None = None
    #: the Runtime's settings (``precision``, ``grad_accum_steps``, ``seed``, the timeouts,
    #: ...): the Trainer's Runtime starts from them; ``seed``, ``fault_timeout`` and
    #: ``hang_warning`` are read by each fit, the others fixed when the Runtime starts
    runtime_options: RuntimeOptions = field(default_factory=RuntimeOptions)

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

    @classmethod
    def of(cls, settings: dict[str, Any]) -> TrainerConfig:
        """The config of ``Trainer(**settings)``: the Runtime's settings among them go into
        :attr:`runtime_options`, validated there."""
        ours = {name: value for name, value in settings.items() if name not in RUNTIME_SETTINGS}
        runtime = {name: value for name, value in settings.items() if name in RUNTIME_SETTINGS}
        return cls(**ours, runtime_options=RuntimeOptions(**runtime))

    if not TYPE_CHECKING:  # distkit's own code reads config.runtime_options.<name>, typed

        def __getattr__(self, name: str) -> Any:
            # config.seed, config.precision, ...: the Runtime's settings, by the Trainer's names
            options = self.__dict__.get("runtime_options")
            if options is not None and name in RUNTIME_SETTINGS:
                return getattr(options, name)
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __post_init__(self) -> None:
        if not isinstance(self.runtime_options, RuntimeOptions):
            raise ConfigurationError(
                f"runtime_options must be a distkit.RuntimeOptions, got "
                f"{type(self.runtime_options).__name__}"
            )
        fields = dataclasses.fields(self)
        check_trainer_arguments({f.name: getattr(self, f.name) for f in fields if f.init})
        derive = functools.partial(object.__setattr__, self)  # frozen: set once, here
        derive("compile_options", check_compile(self.compile))
        derive("input_device_override", input_device_override(self.input_device))
        clip = GradientClip.from_settings(self.gradient_clip_norm, self.gradient_clip_value)
        derive("clip", clip)
        derive("preempt", _preempt.preempt_signals(self.preempt_signals, self.checkpoint_dir))
        check_flags(requeue=self.requeue)
        derive("profiling", profiler_settings(self.profiler))
        deterministic = self.runtime_options.deterministic
        if self.cudnn_benchmark and deterministic is not False:
            raise ConfigurationError(
                f"cudnn_benchmark=True with deterministic={deterministic!r} (given here, "
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
        """A copy with ``changes`` (the Runtime's settings among them too), validated as
        ``Trainer(...)`` validates its arguments (an unknown name is dataclasses' TypeError)."""
        runtime = {name: changes.pop(name) for name in list(changes) if name in RUNTIME_SETTINGS}
        if runtime:
            changes["runtime_options"] = self.runtime_options.replace(**runtime)
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
        config: TrainerConfig = trainer.config  # type: ignore[attr-defined]
        if self.name in RuntimeOptions.STARTED_WITH:
            held = getattr(config.runtime_options, self.name)
            raise ConfigurationError(
                f"trainer.{self.name} = {value!r}: the Trainer's Runtime started its strategy "
                f"with {self.name}={held!r}, which it cannot change; create the Trainer with "
                f"distkit.Trainer({self.name}={value!r}, ...) (or its Runtime with "
                f"distkit.Runtime({self.name}={value!r}, ...))"
            )
        trainer.config = config.replace(**{self.name: value})  # type: ignore[attr-defined]
