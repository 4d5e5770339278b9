"""The training loop every strategy shares. It talks to strategy hooks only."""

from __future__ import annotations

import contextlib
import logging
import random
import sys
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from distkit._env import LaunchEnv
from distkit.batch import batch_size_of, split_batch, to_device
from distkit.data import GlobalBatchPlan, LoaderSpec
from distkit.errors import ConfigurationError
from distkit.metrics import Metric
from distkit.precision import normalize_precision
from distkit.registry import auto_strategy_name, resolve_strategy_class
from distkit.strategies.base import Strategy, TrainOptions

log = logging.getLogger("distkit")

LossFn = Callable[[Any, torch.Tensor], torch.Tensor]
StepFn = Callable[[nn.Module, Any], torch.Tensor]
Metrics = Mapping[str, Metric] | Sequence[Metric]
SCHEDULER_INTERVALS = ("epoch", "step")


@dataclass
class FitResult:
    """What :meth:`Trainer.fit` returns.

    Attributes:
        history: one dict per epoch, ``{"epoch", "train_loss", "val_loss", "val_<metric>"...}``,
            identical on every rank.
    """

    history: list[dict[str, float]] = field(default_factory=list)


class Trainer:
    """Train and evaluate a model with any data-parallel strategy.

    Args:
        strategy: ``"auto"``, a registered name (``"ddp"``, ``"dp"``, ``"horovod"``, ``"apex"``)
            or a :class:`~distkit.Strategy` instance. ``"auto"`` follows the launcher.
        max_epochs: epochs :meth:`fit` runs.
        batch_size: samples per process per micro-batch (a DataLoader's own batch size wins).
            N processes with ``batch_size=b`` train like one process with ``N * b``.
        precision: ``"32"``, ``"bf16"`` or ``"fp16"`` (autocast; fp16 adds a GradScaler).
        grad_accum_steps: micro-batches per optimizer step; gradients are synchronised only
            on the last one.
        seed: the data order is seeded with ``seed + epoch`` (same on every rank); each rank's
            torch/numpy/random generators with ``seed + rank`` (augmentation, dropout).
        shuffle: shuffle the training data each epoch (for a Dataset; a DataLoader says itself).
        sync_batchnorm: BatchNorm statistics over the global batch (works on CPU too).
        find_unused_parameters: for models whose forward skips some parameters (DDP).
        num_workers: DataLoader worker processes per rank (for a Dataset).
        progress: a progress bar and an epoch summary line, on rank 0 only.
        drop_last: drop a last global batch smaller than ``world_size * batch_size``.
        scheduler_interval: step the LR scheduler every ``"epoch"`` or every optimizer ``"step"``.
    """

    def __init__(
        self,
        strategy: str | Strategy = "auto",
        *,
        max_epochs: int = 1,
        batch_size: int = 32,
        precision: str = "32",
        grad_accum_steps: int = 1,
        seed: int = 0,
        shuffle: bool = True,
        sync_batchnorm: bool = False,
        find_unused_parameters: bool = False,
        num_workers: int = 0,
        progress: bool = True,
        drop_last: bool = False,
        scheduler_interval: str = "epoch",
    ) -> None:
        for name, value, low in (
            ("max_epochs", max_epochs, 0),
            ("batch_size", batch_size, 1),
            ("grad_accum_steps", grad_accum_steps, 1),
            ("num_workers", num_workers, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < low:
                raise ConfigurationError(f"{name} must be an integer >= {low}, got {value!r}")
        if scheduler_interval not in SCHEDULER_INTERVALS:
            raise ConfigurationError(
                f"scheduler_interval={scheduler_interval!r}; allowed: "
                f"{', '.join(SCHEDULER_INTERVALS)}"
            )
        self.max_epochs = max_epochs
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.num_workers = num_workers
        self.progress = progress
        self.drop_last = drop_last
        self.scheduler_interval = scheduler_interval
        self.grad_accum_steps = grad_accum_steps
        self.strategy = _make_strategy(strategy)
        self.strategy.connect(
            TrainOptions(
                precision=normalize_precision(precision),
                grad_accum_steps=grad_accum_steps,
                sync_batchnorm=sync_batchnorm,
                find_unused_parameters=find_unused_parameters,
            )
        )
        self.strategy.setup_environment()
        self._finalizer = weakref.finalize(self, self.strategy.teardown)
        # set-up hooks into parameters (DDP's reducer, Horovod's allreduce hooks): it happens
        # once per model, and once per optimizer
        self._models: weakref.WeakKeyDictionary[nn.Module, nn.Module] = weakref.WeakKeyDictionary()
        self._optimizers: weakref.WeakKeyDictionary[
            torch.optim.Optimizer, torch.optim.Optimizer
        ] = weakref.WeakKeyDictionary()
        if self.strategy.device.type == "cuda":
            torch.backends.cudnn.benchmark = True

    # ------------------------------------------------------------------ topology
    @property
    def rank(self) -> int:
        return self.strategy.rank

    @property
    def world_size(self) -> int:
        return self.strategy.world_size

    @property
    def is_main(self) -> bool:
        return self.strategy.is_main

    @property
    def device(self) -> torch.device:
        return self.strategy.device

    def close(self) -> None:
        """Tear the strategy down (destroys a process group distkit created). Idempotent."""
        self._finalizer()

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ fit
    def fit(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        train_data: Any,
        loss_fn: LossFn | None = None,
        val_data: Any = None,
        metrics: Metrics | None = None,
        scheduler: Any = None,
        step_fn: StepFn | None = None,
    ) -> FitResult:
        """Train ``model`` in place for ``max_epochs``; returns the per-epoch history.

        Args:
            model: the user's module; it holds the trained weights afterwards.
            optimizer: an optimizer over ``model``'s parameters.
            train_data: a map-style Dataset or a DataLoader yielding ``(inputs, target)``.
            loss_fn: ``loss_fn(model(inputs), target)`` -> batch-mean loss.
            val_data: evaluated after every epoch (every sample exactly once).
            metrics: :class:`~distkit.metrics.Metric` objects, by name or in a list.
            scheduler: an LR scheduler, stepped per ``scheduler_interval``.
            step_fn: ``step_fn(model, batch)`` -> loss, for batches of any other layout.
        """
        _check_fit_args(model, optimizer, loss_fn, step_fn)
        strategy = self.strategy
        spec = self._loader_spec(train_data, "train_data", shuffle=self.shuffle)
        plan = GlobalBatchPlan(
            len(spec),
            batch_size=spec.batch_size,
            world_size=strategy.world_size,
            rank=strategy.rank,
            grad_accum_steps=self.grad_accum_steps,
            shuffle=spec.shuffle,
            seed=self.seed,
            drop_last=spec.drop_last or self.drop_last,
        )
        loader, sampler = spec.train_loader(plan, seed=self.seed + strategy.rank)
        wrapped, optimizer = self._setup(model, optimizer)
        _seed_generators(self.seed + strategy.rank)
        result = FitResult()
        for epoch in range(self.max_epochs):
            sampler.set_epoch(epoch)
            record: dict[str, float] = {"epoch": epoch}
            record["train_loss"] = self._train_epoch(
                wrapped, optimizer, loader, plan, epoch, loss_fn, step_fn, scheduler
            )
            if val_data is not None:
                scores = self.evaluate(model, val_data, loss_fn=loss_fn, metrics=metrics)
                record.update({f"val_{key}": value for key, value in scores.items()})
            if scheduler is not None and self.scheduler_interval == "epoch":
                _step_scheduler(scheduler, record)
            result.history.append(record)
            self._report(record)
        return result

    def _setup(
        self, model: nn.Module, optimizer: torch.optim.Optimizer
    ) -> tuple[nn.Module, torch.optim.Optimizer]:
        wrapped = self._models.get(model)
        if wrapped is None:
            wrapped, strategy_optimizer = self.strategy.setup(model, optimizer)
            self._models[model] = wrapped
            self._optimizers[optimizer] = strategy_optimizer
        elif optimizer not in self._optimizers:
            self._optimizers[optimizer] = self.strategy.setup_optimizer(wrapped, optimizer)
        return wrapped, self._optimizers[optimizer]

    def _train_epoch(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        loader: Any,
        plan: GlobalBatchPlan,
        epoch: int,
        loss_fn: LossFn | None,
        step_fn: StepFn | None,
        scheduler: Any,
    ) -> float:
        strategy = self.strategy
        model.train()
        loss_sum = torch.zeros((), dtype=torch.float64, device=strategy.device)
        samples = 0
        bar = tqdm(
            total=len(plan),
            desc=f"epoch {epoch + 1}/{self.max_epochs}",
            # a bar only where a person watches: piped output (CI, horovodrun) gets epoch lines
            disable=not (self.progress and strategy.is_main and sys.stderr.isatty()),
            leave=False,
            dynamic_ncols=True,
        )
        with bar:
            for batch, micro in zip(loader, plan.micro_batches(), strict=True):
                batch = to_device(batch, strategy.device)
                sync = contextlib.nullcontext() if micro.last_in_step else strategy.no_sync(model)
                with sync:
                    with strategy.autocast():
                        loss = _compute_loss(model, batch, loss_fn, step_fn)
                    loss = strategy.reduce_loss(loss, batch_size_of(batch))
                    strategy.backward(loss * micro.weight, optimizer)
                loss_sum += loss.detach().double() * micro.count
                samples += micro.count
                if micro.last_in_step:
                    strategy.optimizer_step(optimizer)
                    optimizer.zero_grad()  # set_to_none (Horovod's takes no argument)
                    if scheduler is not None and self.scheduler_interval == "step":
                        scheduler.step()
                bar.update()
        totals = strategy.all_reduce(
            torch.stack(
                [loss_sum, torch.tensor(samples, dtype=torch.float64, device=loss_sum.device)]
            ),
            op="sum",
        )
        return (totals[0] / totals[1]).item()

    # ------------------------------------------------------------------ evaluate
    def evaluate(
        self,
        model: nn.Module,
        data: Any,
        loss_fn: LossFn | None = None,
        metrics: Metrics | None = None,
    ) -> dict[str, float]:
        """Loss and metrics over ``data``, each sample counted exactly once over all ranks.

        Returns the same dict on every rank: ``{"loss": ..., <metric name>: ...}``.
        """
        named = _named_metrics(metrics)
        if loss_fn is None and not named:
            raise ConfigurationError("evaluate needs a loss_fn, metrics, or both")
        strategy = self.strategy
        spec = self._loader_spec(data, "val_data", shuffle=False)
        loader = spec.eval_loader(
            world_size=strategy.world_size, rank=strategy.rank, seed=self.seed + strategy.rank
        )
        wrapped = self._models.get(model)
        if wrapped is None:
            wrapped = model.to(strategy.device)
        module = strategy.eval_model(wrapped)
        for metric in named.values():
            metric.reset()
        loss_sum = torch.zeros(1, dtype=torch.float64, device=strategy.device)
        count = torch.zeros(1, dtype=torch.float64, device=strategy.device)
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad():
                for batch in loader:
                    inputs, target = split_batch(to_device(batch, strategy.device))
                    with strategy.autocast():
                        output = module(inputs)
                        if loss_fn is not None:
                            loss = loss_fn(output, target)
                    size = batch_size_of(target)
                    if loss_fn is not None:
                        loss_sum += strategy.reduce_loss(loss, size).double() * size
                    count += size
                    for metric in named.values():
                        metric.update(output, target)
        finally:
            module.train(was_training)
        states = [metric.state(strategy.device) for metric in named.values()]
        packed = torch.cat([loss_sum, count, *(s.reshape(-1) for s in states)])
        packed = strategy.all_reduce(packed, op="sum")
        scores: dict[str, float] = {}
        if loss_fn is not None:
            scores["loss"] = (packed[0] / packed[1]).item() if packed[1] else float("nan")
        offset = 2
        for (name, metric), state in zip(named.items(), states, strict=True):
            total = packed[offset : offset + state.numel()].reshape(state.shape)
            offset += state.numel()
            value = metric.compute(total)
            if isinstance(value, dict):
                scores.update({(k if k == name else f"{name}_{k}"): v for k, v in value.items()})
            else:
                scores[name] = value
        return scores

    # ------------------------------------------------------------------ helpers
    def _loader_spec(self, data: Any, what: str, *, shuffle: bool) -> LoaderSpec:
        return LoaderSpec.from_data(
            data,
            batch_size=self.batch_size,
            shuffle=shuffle,
            num_workers=self.num_workers,
            pin_memory=self.strategy.device.type == "cuda",
            what=what,
        )

    def _report(self, record: dict[str, float]) -> None:
        if not (self.progress and self.is_main):
            return
        parts = [f"epoch {int(record['epoch']) + 1}/{self.max_epochs}"]
        parts += [f"{k}={v:.4f}" for k, v in record.items() if k != "epoch"]
        tqdm.write(" ".join(parts))

    def __repr__(self) -> str:
        return f"Trainer(strategy={self.strategy!r}, max_epochs={self.max_epochs})"


def _make_strategy(strategy: str | Strategy) -> Strategy:
    if isinstance(strategy, Strategy):
        return strategy
    if isinstance(strategy, str) and strategy.strip().lower() == "auto":
        strategy = auto_strategy_name(LaunchEnv.detect())
    return resolve_strategy_class(strategy)()


def _check_fit_args(model: object, optimizer: object, loss_fn: object, step_fn: object) -> None:
    if not isinstance(model, nn.Module):
        raise ConfigurationError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigurationError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if loss_fn is None and step_fn is None:
        raise ConfigurationError(
            "fit needs loss_fn (called as loss_fn(model(inputs), target)) or step_fn "
            "(called as step_fn(model, batch) and returning the loss)"
        )
    owned = {id(p) for p in model.parameters()}
    foreign = sum(
        1 for group in optimizer.param_groups for p in group["params"] if id(p) not in owned
    )
    if foreign:
        raise ConfigurationError(
            f"the optimizer holds {foreign} tensor(s) that are not parameters of the model; "
            "build it from this model: optimizer = SGD(model.parameters(), ...)"
        )


def _compute_loss(
    model: nn.Module, batch: Any, loss_fn: LossFn | None, step_fn: StepFn | None
) -> torch.Tensor:
    if step_fn is not None:
        return step_fn(model, batch)
    assert loss_fn is not None
    inputs, target = split_batch(batch)
    return loss_fn(model(inputs), target)


def _named_metrics(metrics: Metrics | None) -> dict[str, Metric]:
    if metrics is None:
        return {}
    if isinstance(metrics, Mapping):
        items = list(metrics.items())
    else:
        items = [(type(m).__name__.lower(), m) for m in metrics]
    for name, metric in items:
        if not isinstance(metric, Metric):
            raise ConfigurationError(
                f"metric {name!r} is a {type(metric).__name__}, not a distkit.metrics.Metric; "
                "use distkit.metrics.Accuracy(), MeanIoU(num_classes), or subclass Metric"
            )
    return dict(items)


def _seed_generators(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % 2**32)
    random.seed(seed)


def _step_scheduler(scheduler: Any, record: Mapping[str, float]) -> None:
    if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
        scheduler.step(record.get("val_loss", record["train_loss"]))
    else:
        scheduler.step()
