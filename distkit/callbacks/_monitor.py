"""A monitored metric and whether a new value improves on the best one."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from distkit.errors import ConfigurationError

MODES = ("min", "max")


@dataclass(frozen=True)
class Monitor:
    """A metric to watch (``monitor``) and which way is better (``mode``)."""

    monitor: str
    mode: str

    @classmethod
    def checked(cls, owner: str, monitor: object, mode: object) -> Monitor:
        if not isinstance(monitor, str) or not monitor:
            raise ConfigurationError(
                f"{owner}(monitor={monitor!r}): monitor is the name of a metric, e.g. "
                "'val_loss' or 'val_acc' (a key of the validation results or epoch records)"
            )
        if mode not in MODES:
            raise ConfigurationError(
                f"{owner}(mode={mode!r}): allowed 'min' (lower is better, e.g. a loss) or "
                "'max' (higher is better, e.g. accuracy)"
            )
        return cls(monitor, str(mode))

    def value_in(self, owner: str, values: Mapping[str, float]) -> float | None:
        """The monitored value, or None when ``values`` do not hold it."""
        value = values.get(self.monitor)
        return None if value is None else float(value)

    def missing(self, owner: str, seen: list[str]) -> ConfigurationError:
        return ConfigurationError(
            f"{owner} monitors {self.monitor!r}, which no validation or epoch reported; "
            f"they reported: {', '.join(sorted(set(seen))) or 'nothing'}. Pass val_data (and "
            "metrics) to fit, or monitor one of these names"
        )

    def better(self, value: float, best: float | None, min_delta: float = 0.0) -> bool:
        """Whether ``value`` improves on ``best`` by more than ``min_delta`` (NaN never does)."""
        if math.isnan(value):
            return False
        if best is None:
            return True
        return value < best - min_delta if self.mode == "min" else value > best + min_delta
