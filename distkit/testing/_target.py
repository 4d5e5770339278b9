"""The strategy under test, as every rank rebuilds it: a registered name or a class, and kwargs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

import distkit
from distkit.registry import resolve_strategy_class
from distkit.strategies.base import Strategy


@dataclass(frozen=True)
class StrategyUnderTest:
    """A picklable recipe for a fresh strategy instance on each rank, for each Trainer or Runtime.

    Attributes:
        strategy: a registered name (built-in or a plugin's entry point, which every process
            sees) or a :class:`~distkit.Strategy` subclass defined at module level (pickled by
            reference, so the ranks import its module).
        kwargs: keyword arguments for the class.
        dtype: what the training promises train the workload in (its model and data).
    """

    strategy: str | type[Strategy]
    kwargs: Mapping[str, Any] = field(default_factory=dict)
    dtype: torch.dtype = torch.float64

    @property
    def label(self) -> str:
        """The name messages use: the registered name, or the class's ``name``."""
        if isinstance(self.strategy, str):
            return self.strategy
        return self.strategy.name or self.strategy.__qualname__

    def resolve(self) -> type[Strategy]:
        """The class behind :attr:`strategy`."""
        if isinstance(self.strategy, str):
            return resolve_strategy_class(self.strategy)
        return self.strategy

    def build(self) -> Strategy:
        """A new, not yet set up instance."""
        return self.resolve()(**self.kwargs)

    def trainer(self, **options: Any) -> distkit.Trainer:
        """A Trainer on a new instance, without a progress bar."""
        return distkit.Trainer(self.build(), progress=False, **options)

    def runtime(self, **options: Any) -> distkit.Runtime:
        """A Runtime on a new instance, for a user's own loop."""
        return distkit.Runtime(self.build(), **options)
