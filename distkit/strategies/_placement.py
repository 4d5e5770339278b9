"""Where a model's parameters live: distkit's device, or a placement the user chose.

A model built on the CPU (the usual case) is moved to this rank's device. A model whose
parameters and buffers the user already spread over several devices (seed 003's ``net1`` on
one GPU and ``net2`` on another), or put on one device that is neither the CPU nor this rank's,
is *user-placed*: it is not moved, its batches' inputs go to the device of its first
parameter (or ``Trainer(input_device=...)``), and targets follow the output to the loss.
Only strategies that can train such a model keep it (their ``placement_refusal`` is None);
the others refuse it, naming the devices found and the strategies that keep it.
"""

from __future__ import annotations

import functools
import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from distkit.batch import to_device
from distkit.checkpoint import _pending_weights
from distkit.errors import ConfigurationError
from distkit.launch import BUILTIN_CHOICES, StrategyChoices
from distkit.strategies import _meta_init

CPU = torch.device("cpu")
#: why a strategy cannot train a model built on meta (its ``meta_refusal`` default)
NO_META = "every rank needs the whole model's values before it starts"


@dataclass(frozen=True)
class Placement:
    """The devices a model's parameters and buffers are on, against this rank's device.

    Attributes:
        devices: each device holding a parameter or buffer, in the order first met
            (parameters before buffers, so ``devices[0]`` is the first parameter's).
        target: the strategy's device for this rank.
    """

    devices: tuple[torch.device, ...]
    target: torch.device
    #: ``Trainer(input_device=...)``: where inputs go instead of the first parameter's device
    override: torch.device | None = None
    #: whether ``load_weights`` recorded weights for the model on meta, read at its set-up
    weights_pending: bool = False

    @classmethod
    def of(cls, model: nn.Module, target: torch.device) -> Placement:
        found: dict[torch.device, None] = {}
        for tensor in (*model.parameters(), *model.buffers()):
            found.setdefault(_plain(tensor.device), None)
        pending = bool(_pending_weights.recorded(model))
        return cls(tuple(found), _plain(target), weights_pending=pending)

    @functools.cached_property
    def user_placed(self) -> bool:
        """True when the user chose the devices: several, or one that is neither the CPU
        nor this rank's (a model all on the CPU or all on ``target`` is distkit's to move).
        Computed once: the training loop reads it every micro-batch."""
        if len(self.devices) > 1:
            return True
        if self.on_meta:
            return False  # no values yet: the strategy materialises it (or refuses it)
        return bool(self.devices) and self.devices[0] not in (CPU, self.target)

    @property
    def on_meta(self) -> bool:
        """Whether the whole model is on the meta device (built under ``torch.device("meta")``
        or ``distkit.init_empty()``)."""
        return bool(self.devices) and all(d.type == "meta" for d in self.devices)

    @property
    def input_device(self) -> torch.device:
        """Where a batch's inputs go: ``override``, else the first parameter's device when
        user-placed, else this rank's."""
        if self.override is not None:
            return self.override
        return self.devices[0] if self.user_placed else self.target

    def describe(self) -> str:
        return ", ".join(str(device) for device in self.devices) or "no parameters"

    def check(
        self,
        strategy_name: str,
        refusal: str | None,
        meta_refusal: str | None = NO_META,
        *,
        choices: StrategyChoices = BUILTIN_CHOICES,
    ) -> None:
        """Raise when the model cannot train here: meta tensors (no values) where
        ``meta_refusal`` says why the strategy cannot materialise them (None: it can, for a
        model wholly on meta), or a user-placed model under a strategy that refuses one
        (``refusal`` says why). A model wholly on meta with weights ``load_weights``
        recorded is materialised whole by :func:`place` where the strategy does not.
        ``choices`` names the strategies that keep a placed model (the strategy's own)."""
        if self.weights_pending and not self.on_meta:
            raise ConfigurationError(
                "load_weights recorded weights for this model while it was on the meta device, "
                f"and it has values now (on {self.describe()}: materialised since, by "
                "to_empty() or .to()?), so they were never read into it. Call load_weights "
                "again on the model as it is now, or leave it on meta and let the set-up read "
                "them"
            )
        materialised_here = self.on_meta and self.weights_pending
        meta = torch.device("meta") in self.devices and not materialised_here
        if meta and (meta_refusal or not self.on_meta):
            why = meta_refusal if self.on_meta else "only a model wholly on meta can be"
            raise ConfigurationError(
                f"the model has parameters or buffers on the meta device (found on: "
                f"{self.describe()}); meta tensors hold no values to train, and strategy "
                f"{strategy_name!r} does not materialise them here ({why}). Use "
                "strategy='fsdp' or DeepSpeedStrategy(stage=3), which materialise each rank's "
                "shard of a model built wholly on meta; load its weights with "
                "distkit.load_weights(model, path), which this strategy reads at the set-up; "
                "or materialise it first: model.to_empty(device='cpu'), then initialise the "
                "weights (e.g. reset_parameters()) or load a state dict"
            )
        if self.user_placed and refusal is not None:
            keepers = " or ".join(  # those that keep such a model, plugins included
                f"strategy={name!r}" for name in choices.keeping_placed_models()
            )
            raise ConfigurationError(
                f"strategy {strategy_name!r} cannot train a model you placed on "
                f"{self.describe()} (this rank's device is {self.target}): {refusal}. Use "
                f"{keepers}, which keep a model where you placed it, or build the model on "
                "the CPU (or move it there with model.cpu()) and let distkit put it on this "
                "rank's device"
            )

    def claim(self) -> Claim | None:
        """What this rank tells the others (see :func:`check_claims`): the one accelerator
        its whole model trains on, whoever placed it there; None on the CPU and for a model
        spread over several devices."""
        devices = self.devices if self.user_placed else (self.target,)
        if len(devices) != 1 or devices[0].type in ("cpu", "meta"):
            return None
        device = devices[0]
        return Claim(socket.gethostname(), str(device), physical_id(device), self.user_placed)


@dataclass(frozen=True)
class Claim:
    """One rank's single accelerator: where it is, its name here, and which chip it is
    (the same ``cuda:0`` may be different GPUs under per-rank ``CUDA_VISIBLE_DEVICES``)."""

    host: str
    device: str
    physical: str
    user_placed: bool


def physical_id(device: torch.device) -> str:
    """Which chip ``device`` is: a CUDA GPU's UUID where torch reports it, else its name
    with the visible-device list it was counted in (or just its name, where no CUDA runs)."""
    if device.type == "cuda" and torch.cuda.is_available():
        uuid = getattr(torch.cuda.get_device_properties(device), "uuid", None)
        if uuid is not None:
            return str(uuid)
        return f"{device} of CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}"
    return str(device)


def check_claims(claims: Sequence[Claim | None]) -> None:
    """Raise (on every rank alike) when ranks on one host train on the same single GPU and
    one of them placed its model there itself: the ``model.cuda()`` before
    ``distkit.Trainer(...)`` mistake, which puts every rank's whole model on GPU 0.

    Ranks that share devices of a model spread over several devices are left alone (seed
    003's tutorial does that over gloo); NCCL refuses it with its own error.
    """
    owners: dict[tuple[str, str], list[tuple[int, Claim]]] = {}
    for rank, claim in enumerate(claims):
        if claim is not None:
            owners.setdefault((claim.host, claim.physical), []).append((rank, claim))
    for (host, _), sharing in owners.items():
        if len(sharing) > 1 and any(claim.user_placed for _, claim in sharing):
            ranks = ", ".join(str(rank) for rank, _ in sharing)
            where = sharing[0][1].device
            raise ConfigurationError(
                f"ranks {ranks} on host {host!r} each hold their whole model on one GPU "
                f"({where}), so they would all train on it: a model moved with model.cuda() "
                "or model.to('cuda') before distkit.Trainer(...) chose each rank's GPU lands "
                "on GPU 0. Build the model on the CPU and let distkit move it, or move it "
                "after creating the Trainer: model.to(trainer.device)"
            )


def place(
    model: nn.Module,
    target: torch.device,
    strategy_name: str,
    refusal: str | None,
    meta_refusal: str | None = NO_META,
    *,
    choices: StrategyChoices = BUILTIN_CHOICES,
) -> None:
    """Move ``model`` to ``target`` unless the user placed it (and the strategy keeps that),
    or it is wholly on meta and the strategy materialises it (``meta_refusal`` None). One
    wholly on meta with weights ``load_weights`` recorded, under a strategy that does not
    materialise it, is given them here, whole on ``target`` (a tensor they lack by its
    module's ``reset_parameters()``: see ``_meta_init``)."""
    placement = Placement.of(model, target)
    placement.check(strategy_name, refusal, meta_refusal, choices=choices)
    if placement.on_meta and placement.weights_pending and meta_refusal is not None:
        _meta_init.materialise(model, target, _pending_weights.take(model))
        return
    if not placement.user_placed and not placement.on_meta:
        model.to(target)


def state_follows_parameters(optimizer: torch.optim.Optimizer) -> None:
    """Move ``optimizer``'s state tensors to the device of their parameter.

    torch's ``Optimizer.load_state_dict`` puts each state tensor where its parameter is at
    load time, and ``model.to(device)`` moves parameters but not optimizer state. A
    checkpoint loaded before the set-up (as a fit resumes) left the state on the CPU while
    the set-up moved the model to the GPU: the first step failed on a GPU with "Expected all
    tensors to be on the same device" (found on an H200, docs/gpu.md). ``step`` stays where
    it is unless the group is fused or capturable, as torch keeps it.
    """
    for group in optimizer.param_groups:
        host_step = not (group.get("fused") or group.get("capturable"))
        for param in group["params"]:
            state = optimizer.state.get(param)
            if not state:
                continue
            for key, value in state.items():
                if not isinstance(value, torch.Tensor) or value.device == param.device:
                    continue
                if key == "step" and host_step:
                    continue
                state[key] = value.to(param.device)


def output_device(output: Any) -> torch.device | None:
    """The device of the first tensor in a model's output (a tensor, or tuples, lists and
    mappings of them); None when it holds none."""
    if isinstance(output, torch.Tensor):
        return output.device
    if isinstance(output, (tuple, list)):
        values: Any = output
    elif isinstance(output, dict):
        values = output.values()
    else:
        return None
    for value in values:
        device = output_device(value)
        if device is not None:
            return device
    return None


def follow_output(target: Any, output: Any) -> Any:
    """``target`` (a tensor or a structure of them) on the device of the model's output, for
    the loss; as it is when the output holds no tensor."""
    device = output_device(output)
    return target if device is None else to_device(target, device)


def input_device_override(value: Any) -> torch.device | None:
    """``Trainer(input_device=...)`` as a device: None, a ``torch.device``, a string such as
    ``"cuda:1"`` or a CUDA index."""
    if value is None or isinstance(value, torch.device):
        return value
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise ConfigurationError(
            f"input_device={value!r} ({type(value).__name__}); allowed: None, a torch.device, "
            "a string such as 'cuda:1', or a CUDA device index"
        )
    try:
        return torch.device(value)
    except (RuntimeError, ValueError) as exc:
        raise ConfigurationError(
            f"input_device={value!r} is not a device ({exc}); allowed: None, a torch.device, "
            "a string such as 'cuda:1', or a CUDA device index"
        ) from None


def _plain(device: torch.device) -> torch.device:
    """``cuda`` as ``cuda:<current>``, so one GPU is not counted twice."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
