"""A plugin that claims a built-in strategy's name, and an entry point that is no Strategy."""

from distkit.strategies.ddp import DDPStrategy


class ClashStrategy(DDPStrategy):
    """Would shadow the built-in ``ddp``: distkit must leave it out."""


def not_a_strategy() -> None:
    """A function, not a distkit.Strategy subclass."""
