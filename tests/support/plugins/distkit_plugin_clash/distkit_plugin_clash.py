"""A plugin that claims a built-in strategy's name, another plugin's name (``twin``, which
distkit_plugin_twin claims too), and an entry point that is no Strategy."""

from distkit.strategies.ddp import DDPStrategy


class ClashStrategy(DDPStrategy):
    """Would shadow the built-in ``ddp``: distkit must leave it out."""


class TwinStrategy(DDPStrategy):
    """The second ``twin``: distkit must use neither and name both."""

    name = "twin"


def not_a_strategy() -> None:
    """A function, not a distkit.Strategy subclass."""
