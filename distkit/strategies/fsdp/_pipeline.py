"""Pipeline parallelism: this rank's stages, torch's schedule, and the forwards around it.

Training runs torch.distributed.pipelining's schedule (GPipe, 1F1B or interleaved 1F1B) over
the batch of this data-parallel rank: the first stage takes the inputs, the last computes the
loss of each micro-batch, gradients flow back. distkit weights each micro-batch's loss itself
(torch's ``scale_grads`` off), so that the gradients are those of one process on the whole
batch: a mean loss by the micro-batch's share of the batch's rows, a token-exact total by the
step's one scale. torch's stages fix the shapes they send at the first step, so every step's
micro-batches have the first's rows: a shorter batch (an epoch's uneven end) is padded with
copies of its first row, which no loss sees (their gradients are exactly zero). The batch's
loss (and its items) then goes from the last stage to every rank of the pipeline, so that
every rank reports what one process would.

Evaluation and prediction run no schedule: the batch goes through the stages in turn
(forward only, any shape) and the last stage's output reaches every rank of the pipeline.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree

from distkit.errors import ConfigurationError, UnsupportedFeatureError
from distkit.strategies.fsdp._layout import Layout
from distkit.strategies.fsdp._pipeline_split import ChainCheck

#: what to use instead of a training forward of the set-up model (see PipelineModule)
TRAIN_HINT = (
    "under pipeline parallelism a training forward is one step of the schedule with its "
    "backward (the stages run micro-batches interleaved), so the model cannot be called on "
    "its own. Train with distkit.Trainer(...).fit, or in your own loop call "
    "loss = rt.forward_backward(model, inputs, target, loss_fn) in place of "
    "loss_fn(model(inputs), target) and rt.backward(loss)"
)

#: the loss of a micro-batch as the training step computes it: (value, items or None)
LossOf = Callable[[Any, Any], tuple[torch.Tensor, "int | torch.Tensor | None"]]


class Pipeline:
    """This rank's stages of the model and the schedule that trains them.

    Args:
        modules: every stage module (set up: split, sharded, on the device) in pipeline
            order; this rank runs those at ``layout.pipeline_rank + k * pipeline``.
        layout: the mesh (its pipeline group carries the activations).
        schedule: "gpipe", "1F1B" or "interleaved1F1B".
        microbatches: micro-batches per step (each batch's rows split into that many).
        check: the proof, on a first batch, that the model is its stages in order.
    """

    def __init__(
        self,
        modules: list[nn.Module],
        layout: Layout,
        device: torch.device,
        schedule: str,
        microbatches: int,
        check: ChainCheck | None,
    ) -> None:
        self.layout = layout
        self.device = device
        self.modules = modules
        self.stages = len(modules)
        self.mine = list(range(layout.pipeline_rank, self.stages, layout.pipeline))
        self.schedule_name = schedule
        self.microbatches = microbatches
        self._check = check
        self._group = layout.pp_group()
        self._peers = layout.pipeline_peers()
        self._schedule: Any = None
        self._rows: int | None = None  # each micro-batch's rows, fixed by the first step
        self._shape: tuple[int, ...] | None = None  # the inputs' shape past dim 0, the same
        self._items: bool | None = None  # whether the losses are token-exact (first step)
        # the step being run: its micro-batches' targets and rows, and the weights
        self._targets: list[Any] = []
        self._real: list[int] = []
        self._step_rows = 0
        self._loss_of: LossOf | None = None
        self._mean_weight = 1.0
        self._item_weight = 1.0
        #: each micro-batch's loss (and items), by its index: torch's first step also runs
        #: the loss once to infer the shapes of the gradients it sends, which is not counted
        self._values: dict[int, torch.Tensor] = {}
        self._counts: dict[int, int | torch.Tensor] = {}

    @property
    def is_last(self) -> bool:
        return self.stages - 1 in self.mine

    def owner(self, stage: int) -> int:
        """The global rank that runs ``stage`` among this rank's pipeline peers."""
        return self._peers[stage % self.layout.pipeline]

    def describe(self) -> str:
        stages = ", ".join(str(s) for s in self.mine)
        return f"pipeline stage {stages} of {self.stages}"

    # ---------------------------------------------------------------- training
    def train_step(
        self,
        inputs: Any,
        target: Any,
        loss_of: LossOf,
        *,
        mean_weight: float,
        item_weight: float,
    ) -> tuple[torch.Tensor, int | torch.Tensor | None]:
        """One batch's forward and backward through the schedule; its loss (the batch's mean,
        or a token-exact total) and items (None for a mean), the same on every rank of the
        pipeline. ``mean_weight``: a mean loss's weight (its share of the step); an items
        total's: ``item_weight``."""
        if not isinstance(inputs, torch.Tensor):
            raise ConfigurationError(
                f"under pipeline parallelism a batch's inputs must be one tensor (the first "
                f"stage's input, split into micro-batches), got {type(inputs).__name__}. Pass "
                "(inputs, target) batches whose inputs are a tensor"
            )
        self._run_check(inputs)
        rows = inputs.shape[0]
        size = self._micro_rows(inputs)
        padded = size * self.microbatches
        self._step_rows = rows
        self._real = [max(0, min(size, rows - i * size)) for i in range(self.microbatches)]
        self._targets = [_rows_of(target, i * size, n) for i, n in enumerate(self._real)]
        self._loss_of = loss_of
        self._mean_weight, self._item_weight = mean_weight, item_weight
        self._values, self._counts = {}, {}
        schedule = self._schedule_now()
        index = torch.arange(self.microbatches)  # on the CPU: which micro-batch a loss is
        args = (_pad(inputs, padded),) if 0 in self.mine else ()
        try:
            schedule.step(*args, target=index if self.is_last else None, return_outputs=False)
        finally:
            self._targets, self._loss_of = [], None
        return self._shared_loss(inputs.device)

    def _micro_rows(self, inputs: torch.Tensor) -> int:
        rows, shape = inputs.shape[0], tuple(inputs.shape[1:])
        if self._rows is None:
            if rows % self.microbatches:
                raise ConfigurationError(
                    f"FSDPStrategy(microbatches={self.microbatches}) must divide the batch of "
                    f"each data-parallel group, and the first batch has {rows} rows: choose "
                    f"microbatches that divide the batch size, or a batch size that is a "
                    f"multiple of {self.microbatches}"
                )
            self._rows, self._shape = rows // self.microbatches, shape
        if shape != self._shape or rows > self._rows * self.microbatches:
            raise ConfigurationError(
                f"a batch's inputs have shape {tuple(inputs.shape)}, the first batch's "
                f"{(self._rows * self.microbatches, *(self._shape or ()))}: torch's pipeline "
                "stages send activations of the shapes of the first step, so every batch "
                "needs the first's shape past its rows and no more rows (a shorter last batch "
                "is padded). Pad sequences to one length (a collate_fn), or batch them so"
            )
        return self._rows

    def _schedule_now(self) -> Any:
        if self._schedule is None:
            self._schedule = self._build_schedule()
        return self._schedule

    def _build_schedule(self) -> Any:
        from torch.distributed import pipelining as pp

        stages = [
            pp.PipelineStage(self.modules[s], s, self.stages, self.device, group=self._group)
            for s in self.mine
        ]
        kinds = {
            "gpipe": pp.ScheduleGPipe,
            "1F1B": pp.Schedule1F1B,
            "interleaved1F1B": pp.ScheduleInterleaved1F1B,
        }
        kind = kinds[self.schedule_name]
        first = stages if self.schedule_name == "interleaved1F1B" else stages[0]
        return kind(first, n_microbatches=self.microbatches, loss_fn=self._loss, scale_grads=False)

    def _loss(self, output: Any, index: torch.Tensor) -> torch.Tensor:
        """The schedule's loss of one micro-batch (on the last stage): the user's, on its
        real rows, weighted so that the step's gradients are one process's."""
        assert self._loss_of is not None
        i = int(index[0])  # a CPU tensor: no device read
        real = self._real[i]
        if real == 0:  # all padding: nothing to learn, a zero that keeps the graph
            return _zero_of(output)
        value, items = self._loss_of(_rows_of(output, 0, real), self._targets[i])
        if self._items is None:
            self._items = items is not None
        elif self._items != (items is not None):
            raise ConfigurationError(
                "the loss function returned a distkit.Loss for some batches and a mean for "
                "others: under pipeline parallelism (and for exact sums) it must return the "
                "same kind every time"
            )
        if items is None:
            share = real / self._step_rows
            self._values[i] = value.detach() * share
            return value * (share * self._mean_weight)
        self._values[i], self._counts[i] = value.detach(), items
        return value * self._item_weight

    def _shared_loss(self, device: torch.device) -> tuple[torch.Tensor, int | torch.Tensor | None]:
        """The step's loss and items from the last stage to every rank of the pipeline (one
        small broadcast; the kind of loss read once, at the first step)."""
        sent = torch.zeros(3, dtype=torch.float64, device=device)
        if self.is_last:
            values, counts = self._values.values(), self._counts.values()
            if values:
                sent[0] = torch.stack([v.to(device, torch.float64) for v in values]).sum()
            if counts:
                sent[1] = sum(torch.as_tensor(c, device=device).double() for c in counts)
            sent[2] = 1.0 if self._items else 0.0
        dist.broadcast(sent, src=self.owner(self.stages - 1), group=self._group)
        if self._items is None or not self.is_last:
            first = self._items is None
            self._items = bool(sent[2].item()) if first else self._items
        value = sent[0]  # in float64: a float32 loss's sum of shares loses nothing
        if not self._items:
            return value, None
        return value, sent[1].round().long()

    def _run_check(self, inputs: Any) -> None:
        if self._check is not None:
            check, self._check = self._check, None
            check.run(inputs)

    # ------------------------------------------------------------ forward only
    def relay(self, inputs: Any) -> Any:
        """``model(inputs)`` forward only: each stage in turn on the previous one's output
        (sent between ranks), the last stage's output then sent to every rank of the
        pipeline. Every rank of the pipeline calls it with the same inputs."""
        self._run_check(inputs)
        held: Any = inputs
        out: Any = None
        me = self.layout.rank
        for stage in range(self.stages):
            owner = self.owner(stage)
            if owner == me:
                args = held if stage and isinstance(held, tuple) else (held,)
                out = self.modules[stage](*args)
            if stage + 1 == self.stages:
                break
            successor = self.owner(stage + 1)
            if owner == successor:
                held = out
            elif owner == me:
                _send(out, successor, self._group, self.device)
            elif successor == me:
                held = _receive(owner, self._group, self.device)
        return _broadcast(out, self.owner(self.stages - 1), self._group, self.device, me)


class PipelineModule(nn.Module):
    """What the set-up model runs under a pipeline: the user's model (its modules: this
    rank's stages with values, the others' on the meta device) whose forward relays a batch
    through the stages. A training forward is refused (see :data:`TRAIN_HINT`)."""

    def __init__(self, module: nn.Module, pipeline: Pipeline) -> None:
        super().__init__()
        self.module = module
        self.__dict__["pipeline"] = pipeline

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        if self.training and torch.is_grad_enabled():
            raise UnsupportedFeatureError(TRAIN_HINT)
        if kwargs or len(args) != 1:
            raise ConfigurationError(
                "under pipeline parallelism the model is called on one input, the first "
                f"stage's: got {len(args)} positional and {sorted(kwargs)} keyword arguments"
            )
        with torch.no_grad():
            return self.__dict__["pipeline"].relay(args[0])


# -------------------------------------------------------------------- helpers
def _rows_of(value: Any, start: int, count: int) -> Any:
    """Rows ``start:start + count`` of every tensor in ``value`` (a pytree)."""
    return _pytree.tree_map(
        lambda t: t[start : start + count] if isinstance(t, torch.Tensor) and t.ndim else t,
        value,
    )


def _pad(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with copies of its first row appended up to ``rows`` rows (finite values
    where the batch's are: no NaN reaches a gradient through rows no loss sees)."""
    short = rows - tensor.shape[0]
    if short <= 0:
        return tensor
    return torch.cat([tensor, tensor[:1].expand(short, *tensor.shape[1:])])


def _zero_of(output: Any) -> torch.Tensor:
    leaves = [t for t in _pytree.tree_leaves(output) if isinstance(t, torch.Tensor)]
    floating = [t for t in leaves if t.is_floating_point() and t.requires_grad]
    if not floating:
        return torch.zeros((), device=leaves[0].device) if leaves else torch.zeros(())
    return sum((t * 0).sum() for t in floating)  # type: ignore[return-value]


def _send(value: Any, dst: int, group: Any, device: torch.device) -> None:
    leaves, spec = _pytree.tree_flatten(value)
    tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
    meta = [_meta_of(t) for t in leaves]
    dist.send_object_list([spec, meta], dst=dst, group=group, device=_object_device(device))
    for tensor in tensors:
        dist.send(tensor.detach().contiguous(), dst=dst, group=group)


def _receive(src: int, group: Any, device: torch.device) -> Any:
    box: list[Any] = [None, None]
    dist.recv_object_list(box, src=src, group=group, device=_object_device(device))
    spec, meta = box
    leaves: list[Any] = []
    for entry in meta:
        if entry[0] == "value":
            leaves.append(entry[1])
            continue
        tensor = torch.empty(entry[0], dtype=entry[1], device=device)
        dist.recv(tensor, src=src, group=group)
        leaves.append(tensor)
    return _pytree.tree_unflatten(leaves, spec)


def _broadcast(value: Any, src: int, group: Any, device: torch.device, me: int) -> Any:
    """``value`` (a pytree) from ``src`` to every rank of ``group``."""
    box: list[Any] = [None]
    leaves: list[Any] = []
    if me == src:
        leaves, spec = _pytree.tree_flatten(value)
        box = [(spec, [_meta_of(t) for t in leaves])]
    dist.broadcast_object_list(box, src=src, group=group, device=_object_device(device))
    spec, meta = box[0]
    out: list[Any] = []
    for index, entry in enumerate(meta):
        if entry[0] == "value":
            out.append(entry[1])
            continue
        if me == src:
            tensor = leaves[index].detach().contiguous()
        else:
            tensor = torch.empty(entry[0], dtype=entry[1], device=device)
        dist.broadcast(tensor, src=src, group=group)
        out.append(tensor)
    return _pytree.tree_unflatten(out, spec)


def _meta_of(leaf: Any) -> tuple[Any, Any]:
    return (tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor) else ("value", leaf)


def _object_device(device: torch.device) -> torch.device | None:
    """Where torch stages a pickled object for a collective: the CUDA device under nccl."""
    return device if device.type == "cuda" else None
