"""Parameters a DDP model's loss did not reach, caught at the loop's first backwards.

torch's DDP, unless told ``find_unused_parameters=True`` (or ``static_graph``), all-reduces a
bucket only once every parameter in it has its gradient. A parameter the loss does not reach
leaves its bucket waiting: that backward's ``optimizer.step()`` applies the rank's own,
un-averaged gradients (a wrong step, silently), and only the next forward raises torch's
"Expected to have finished reduction in the prior iteration", which names DDP's keyword, not
the distkit argument that sets it.

After each of a loop's first synchronising backwards, before any step, :class:`UnusedCheck`
looks at each DDP model that backward reached (some of its trainable parameters hold a
gradient): those without one took no part, and the error names them and the argument of the
Runtime or Trainer that runs the loop. A model no backward reached yet is looked at again at
the next one (a GAN's generator during the discriminator's step); once a model's backward is
found complete it is never looked at again, and after :data:`LOOKS` backwards the check ends,
so the steady loop pays nothing for it.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.nn.parallel import DistributedDataParallel

from distkit.errors import ConfigurationError

#: synchronising backwards after which a model not reached yet is no longer looked at
LOOKS = 8
_NAMED = 5  # parameter names an error lists


def strict_ddp(wrapped: nn.Module) -> bool:
    """Whether ``wrapped`` is torch's DDP waiting for every parameter's gradient."""
    return (
        isinstance(wrapped, DistributedDataParallel)
        and not wrapped.find_unused_parameters
        and not getattr(wrapped, "static_graph", False)
    )


class UnusedCheck:
    """Looks at DDP models after a loop's first synchronising backwards (module docstring)."""

    def __init__(self) -> None:
        self._done: set[int] = set()  # ids of the models found complete
        self._looks = 0

    @property
    def looking(self) -> bool:
        """Whether the next synchronising backward is still looked at (the first few)."""
        return self._looks < LOOKS

    def after_backward(self, models: Iterable[tuple[nn.Module, nn.Module, str]]) -> None:
        """``models``: each set-up model's ``(wrapped, module, owner)``, where ``owner`` is
        how the message spells the argument's home (``"distkit.Runtime"``)."""
        if self._looks >= LOOKS:
            return
        self._looks += 1
        for wrapped, module, owner in models:
            if id(module) in self._done or not strict_ddp(wrapped):
                continue
            trainable = [(name, p) for name, p in module.named_parameters() if p.requires_grad]
            missing = [name for name, p in trainable if p.grad is None]
            if len(missing) == len(trainable):
                continue  # not reached by a backward yet
            self._done.add(id(module))
            if missing:
                raise ConfigurationError(_message(module, missing, owner))


def _message(module: nn.Module, missing: list[str], owner: str) -> str:
    names = ", ".join(missing[:_NAMED]) + (f" and {len(missing) - _NAMED} more" if
                                           len(missing) > _NAMED else "")  # fmt: skip
    return (
        f"{len(missing)} trainable parameter(s) of {type(module).__name__} received no "
        f"gradient from this backward ({names}). DDP all-reduces a bucket only once every "
        "parameter in it has its gradient, so the next optimizer.step() would apply this "
        "rank's own gradients (not the average) and the next forward would fail. Where the "
        "model skips them on purpose (a head some batches do not use, a branch chosen per "
        f"batch), create it with {owner}(..., find_unused_parameters=True); where they are "
        "never trained, freeze them (requires_grad_(False)) before setting the model up; "
        "otherwise check that forward's output uses them"
    )
