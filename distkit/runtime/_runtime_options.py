"""Every setting of a Runtime as one frozen, validated value.

``Runtime(...)`` keeps its keyword arguments and builds a :class:`RuntimeOptions` from them;
a Trainer builds one from the same keywords of its own, starts its Runtime from it, and
checks a Runtime it is given against it field by field. A setting is defined once, here: its
name, default and check (the two signatures, ``Runtime``'s and ``Trainer``'s, are the API
that spells it).
"""

from __future__ import annotations

import dataclasses
import functools
import signal
from dataclasses import dataclass, field
from typing import Any, ClassVar

from distkit._validate import check_flags, check_ints, check_seconds
from distkit.errors import ConfigurationError
from distkit.faults import _preempt
from distkit.runtime._checkpointing import ActivationCheckpointing, Policy, checkpoint_policy
from distkit.runtime._determinism import check_deterministic
from distkit.strategies.base import TrainOptions
from distkit.strategies.precision import normalize_precision


@dataclass(frozen=True)
class RuntimeOptions:
    """Every setting of ``Runtime(...)`` but the strategy; the fields, their defaults and
    their meaning are :class:`~distkit.Runtime`'s keywords. ``rt.options`` is the Runtime's
    (``precision`` in its canonical spelling: ``"32"``, ``"bf16"`` or ``"fp16"``).

    ``Runtime(strategy, **options.keywords())`` starts a Runtime with them: a sweep keeps
    one value and changes a field with :meth:`replace`, validated again.
    """

    #: the settings the strategy is started with (a started Runtime cannot change them): a
    #: Trainer given a Runtime may leave them out, or must say what the Runtime holds
    STARTED_WITH: ClassVar[tuple[str, ...]] = (
        "precision",
        "grad_accum_steps",
        "sync_batchnorm",
        "find_unused_parameters",
        "collective_timeout",
        "activation_checkpointing",
        "deterministic",
    )

    precision: str = "32"
    grad_accum_steps: int = 1
    seed: int = 0
    sync_batchnorm: bool = False
    find_unused_parameters: bool = False
    fault_timeout: float | None = 10.0
    hang_warning: float | None = 300.0
    collective_timeout: float | None = None
    activation_checkpointing: ActivationCheckpointing = None
    preempt_signals: Any = None
    requeue: bool = False
    deterministic: bool | str = False
    same_data_on_every_rank: bool = False
    storage_options: dict[str, Any] | None = None

    # derived from the fields above, once, in __post_init__ (validated there)
    #: the policy ``activation_checkpointing`` asks for (None: off)
    checkpointing: Policy | None = field(init=False, repr=False, compare=False)
    #: ``preempt_signals`` resolved (() when off)
    signals: tuple[signal.Signals, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        derive = functools.partial(object.__setattr__, self)  # frozen: set once, here
        derive("precision", normalize_precision(self.precision))
        for name in ("fault_timeout", "hang_warning", "collective_timeout"):
            check_seconds(name, getattr(self, name))
        check_ints(grad_accum_steps=(self.grad_accum_steps, 1), seed=(self.seed, 0))
        check_flags(
            sync_batchnorm=self.sync_batchnorm,
            find_unused_parameters=self.find_unused_parameters,
            requeue=self.requeue,
            same_data_on_every_rank=self.same_data_on_every_rank,
        )
        check_storage_options(self.storage_options)
        derive("checkpointing", checkpoint_policy(self.activation_checkpointing))
        check_deterministic(self.deterministic)
        derive("signals", _preempt.preempt_signals(self.preempt_signals or (), "runtime"))
        if self.requeue and not self.signals:
            raise ConfigurationError(
                "Runtime(requeue=True) requeues the job after a preemption, but no "
                "preempt_signals were given: pass preempt_signals=(signal.SIGTERM, "
                "signal.SIGUSR1) too, and call rt.preempted() after each optimizer step"
            )

    def keywords(self) -> dict[str, Any]:
        """The settings as ``Runtime(...)``'s keyword arguments."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}

    def replace(self, **changes: Any) -> RuntimeOptions:
        """A copy with ``changes``, validated as ``Runtime(...)`` validates its arguments
        (an unknown name is dataclasses' TypeError)."""
        return dataclasses.replace(self, **changes)

    def train_options(self) -> TrainOptions:
        """What the strategy is started with (``strategy.options``)."""
        return TrainOptions(
            precision=self.precision,
            grad_accum_steps=self.grad_accum_steps,
            sync_batchnorm=self.sync_batchnorm,
            find_unused_parameters=self.find_unused_parameters,
            collective_timeout=self.collective_timeout,
        )

    def differences(self, given: RuntimeOptions) -> list[tuple[str, Any, Any]]:
        """The settings in :attr:`STARTED_WITH` that ``given`` sets (away from its default)
        to something else than these options hold, as (name, given, held)."""
        defaults = RuntimeOptions()
        return [
            (name, getattr(given, name), getattr(self, name))
            for name in self.STARTED_WITH
            if getattr(given, name) != getattr(defaults, name)
            and getattr(given, name) != getattr(self, name)
        ]


def check_storage_options(value: object) -> None:
    """``storage_options`` is None or a dict of fsspec options by name."""
    if value is not None and not (
        isinstance(value, dict) and all(isinstance(key, str) for key in value)
    ):
        raise ConfigurationError(
            "storage_options must be a dict of the fsspec filesystem's options by name (for "
            "S3: {'key': ..., 'secret': ..., 'endpoint_url': ...}) or None, got "
            f"{type(value).__name__} {value!r}"
        )
