"""Hostile inputs: every wrong argument gets an error at the call that is wrong, of a typed
distkit error (or the builtin it subclasses), naming what was given and the fix; inputs that
look odd but are valid give the correct result.

Each case is one row: what to do, the error type, and a phrase of its message. Single process
(strategy "dp"); the multi-process disagreements are in tests/runtime/test_agreement.py.
"""

from __future__ import annotations

import re
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler, IterableDataset, TensorDataset

import distkit
from distkit import checkpoint as ckpt
from distkit.errors import ConfigurationError, RankDisagreementError, TrainerClosedError
from distkit.launch._env import LaunchEnv

pytestmark = [pytest.mark.timeout(120), pytest.mark.filterwarnings("ignore::UserWarning")]


# ---------------------------------------------------------------- a small run to be hostile to
def _data(n: int = 8) -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, generator=generator), torch.arange(n) % 2)


def _trainer(**kwargs: Any) -> distkit.Trainer:
    return distkit.Trainer("dp", **{"batch_size": 4, "progress": False, **kwargs})


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(3, 2)


def _untrained(model: nn.Module, batch: Any) -> torch.Tensor:
    raise AssertionError("a training step ran before the bad input was reported")


def _fit(trainer: distkit.Trainer | None = None, **kwargs: Any) -> Any:
    """fit a tiny classifier; keyword arguments replace fit's (model, optimizer included)."""
    trainer = trainer or _trainer()
    model = kwargs.pop("model", None) or _model()
    optimizer = kwargs.pop("optimizer", None) or torch.optim.SGD(model.parameters(), lr=0.1)
    data = kwargs.pop("train_data", _data())
    kwargs.setdefault("loss_fn", nn.functional.cross_entropy)
    return trainer.fit(model, optimizer, data, **kwargs)


def _fit_untrained(**kwargs: Any) -> Any:
    """fit whose training step must never run: the error must come first."""
    return _fit(loss_fn=None, step_fn=_untrained, **kwargs)


class _Stream(IterableDataset):
    def __init__(self, n: int = 64) -> None:
        self.n = n

    def __iter__(self):
        return iter(_data(self.n))


class _NumpyScore(distkit.Metric):
    """A metric whose compute returns a numpy scalar, as many hand-written ones do."""

    def batch_state(self, output, target):
        hits = (output.argmax(1) == target).sum()
        return torch.stack([hits, torch.tensor(len(target), device=hits.device)])

    def state_shape(self):
        return (2,)

    def compute(self, state):
        return np.float64(state[0].item() / state[1].item())


class _TextScore(_NumpyScore):
    def compute(self, state):
        return "good"


class _TensorScores(_NumpyScore):
    def compute(self, state):
        return {"hits": state[0], "rate": np.float32(0.5), "count": int(state[1])}


def _fitted(tmp: Path, optimizer: str = "sgd", **trainer_kwargs: Any) -> distkit.Trainer:
    trainer = _trainer(**trainer_kwargs)
    model = _model()
    opt: torch.optim.Optimizer = (
        torch.optim.Adam(model.parameters(), lr=0.01)
        if optimizer == "adam"
        else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    )
    _fit(trainer, model=model, optimizer=opt)
    return trainer


def _saved(tmp: Path, optimizer: str = "sgd", **trainer_kwargs: Any) -> Path:
    path = tmp / "saved.pt"
    _fitted(tmp, optimizer, **trainer_kwargs).save_checkpoint(path)
    return path


def _mid_epoch_checkpoint(tmp: Path) -> Path:
    """A checkpoint at step 1 of 2 in epoch 0 of 8 samples (position 4)."""
    folder = tmp / "ckpt"
    _fit(_trainer(checkpoint_dir=folder, checkpoint_every=1, max_steps=1))
    found = ckpt.CheckpointFolder(folder).checkpoints()
    assert found and ckpt.load(found[-1])["progress"]["position"] == 4
    return found[-1]


def _dp() -> distkit.Strategy:
    strategy = distkit.DataParallelStrategy()
    strategy.start()
    return strategy


def _closed() -> distkit.Trainer:
    trainer = _trainer()
    trainer.close()
    return trainer


def _write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def _plateau_per_step(tmp: Path) -> Any:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer)
    trainer = _trainer(scheduler_interval="step")
    return _fit(trainer, model=model, optimizer=optimizer, scheduler=scheduler,
                loss_fn=None, step_fn=_untrained)  # fmt: skip


def _scheduler_of_other_optimizer(tmp: Path) -> Any:
    model = _model()
    other = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(other, step_size=1)
    return _fit_untrained(model=model, scheduler=scheduler)


def _sgd_into_adam(tmp: Path) -> Any:
    path = _saved(tmp, "sgd")
    model = _model()
    trainer = _trainer(resume=path)
    return _fit(trainer, model=model, optimizer=torch.optim.Adam(model.parameters()),
                loss_fn=None, step_fn=_untrained)  # fmt: skip


def _sgd_into_adam_by_load_checkpoint(tmp: Path) -> Any:
    path = _saved(tmp, "sgd")
    trainer = _fitted(tmp, "adam")
    return trainer.load_checkpoint(path)


def _other_shapes(tmp: Path) -> Any:
    path = _saved(tmp)
    model = nn.Linear(3, 5)
    return _fit_untrained(trainer=_trainer(resume=path), model=model)


def _smaller_dataset_mid_epoch(tmp: Path) -> Any:
    path = _mid_epoch_checkpoint(tmp)
    return _fit_untrained(trainer=_trainer(resume=path), train_data=_data(4))


def _unwritable_dir_is_a_file(tmp: Path) -> Any:
    target = _write(tmp / "occupied", b"x")
    return _fit_untrained(trainer=_trainer(checkpoint_dir=target))


def _unwritable_dir_below_a_file(tmp: Path) -> Any:
    _write(tmp / "occupied", b"x")
    return _fit_untrained(trainer=_trainer(checkpoint_dir=tmp / "occupied" / "ckpt"))


class _Ragged(torch.utils.data.Dataset):
    """Token sequences of different lengths, as a tokenizer gives them (no padding)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": torch.arange(3 + i), "labels": torch.tensor(i % 2)}


class _DictModel(nn.Module):
    """Returns {"logits": ...}, as transformers models do; no training step may run before
    the metric that cannot read it is named."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = _model()
        self.trained = 0

    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        self.trained += self.training
        assert self.trained <= 1, "a training step ran before the bad metric was reported"
        return {"logits": self.linear(x)}


def _negative_count_step(model: nn.Module, batch: Any) -> distkit.Loss:
    """A sign slip: -(labels != -100).sum(), a count kept on the device."""
    x, y = batch
    total = nn.functional.cross_entropy(model(x), y, reduction="sum")
    return distkit.Loss(total, -torch.tensor(len(y)))


def _resume_from(data: bytes) -> Callable[[Path], Any]:
    def act(tmp: Path) -> Any:
        return _fit_untrained(trainer=_trainer(resume=_write(tmp / "c.pt", data)))

    return act


# ---------------------------------------------------------------- the table
# Trainer(argument=value) -> ConfigurationError with this phrase
TRAINER_ARGUMENTS: list[tuple[str, object, str]] = [
    ("max_epochs", "3", "max_epochs must be an integer >= 0, got '3'"),
    ("max_epochs", True, "max_epochs must be an integer >= 0, got True"),
    ("batch_size", 0, "batch_size must be an integer >= 1, got 0"),
    ("batch_size", 2.5, "batch_size must be an integer >= 1, got 2.5"),
    ("grad_accum_steps", 0, "grad_accum_steps must be an integer >= 1"),
    ("num_workers", -1, "num_workers must be an integer >= 0"),
    ("keep_last", 0, "keep_last must be an integer >= 1"),
    ("max_steps", 0, "max_steps must be an integer >= 1"),
    ("checkpoint_every", 0, "checkpoint_every must be an integer >= 1"),
    ("checkpoint_every", "step", "checkpoint_every must be"),
    ("precision", "fp8", "unknown precision 'fp8'"),
    ("scheduler_interval", "batch", "scheduler_interval='batch'; allowed: epoch, step"),
    ("nonfinite", "ignore", "nonfinite='ignore'; allowed: raise, skip"),
    ("seed", "0", "seed must be an integer >= 0, got '0'"),
    ("shuffle", "no", "shuffle must be True or False, got 'no'"),
    ("sync_batchnorm", 1, "sync_batchnorm must be True or False, got 1"),
    ("cudnn_benchmark", "yes", "cudnn_benchmark must be True or False, got 'yes'"),
    ("deterministic", "on", "deterministic must be False, True or 'warn', got 'on'"),
    ("resume", True, "resume must be 'auto', a checkpoint path, or None, got True"),
    ("resume", 123, "resume must be 'auto', a checkpoint path, or None, got 123"),
    ("resume", "auto", "resume='auto' needs checkpoint_dir"),
    ("fault_timeout", 0, "fault_timeout must be a positive number of seconds or None (off)"),
    ("fault_timeout", -5.0, "fault_timeout must be a positive number of seconds"),
    ("fault_timeout", "10", "fault_timeout must be a positive number of seconds"),
    ("checkpoint_dir", 5, "checkpoint_dir must be a folder path (str or os.PathLike) or None"),
]


@pytest.mark.parametrize(
    ("argument", "value", "phrase"),
    [pytest.param(*row, id=f"{row[0]}={row[1]!r}") for row in TRAINER_ARGUMENTS],
)
def test_hostile_trainer_argument_is_refused_by_name(argument, value, phrase):
    with pytest.raises(ConfigurationError, match=re.escape(phrase)):
        _trainer(**{argument: value})


# ---------------------------------------------------------------- weights, Runtimes, trackers
def _int_weights(tmp: Path) -> Any:
    from safetensors import torch as safetensors_torch

    ids = {"weight": torch.arange(6).reshape(2, 3), "bias": torch.zeros(2)}
    safetensors_torch.save_file(ids, str(tmp / "ids.safetensors"))
    return distkit.load_weights(_model(), tmp / "ids.safetensors")


def _flipped_weights(tmp: Path) -> Any:
    with distkit.Runtime("dp") as rt:
        rt.save_weights(_model(), tmp / "w")
    file = tmp / "w" / "model.safetensors"
    data = bytearray(file.read_bytes())
    data[-3] ^= 0x10  # a bit of the tensors (after the header)
    file.write_bytes(bytes(data))
    return distkit.load_weights(_model(), tmp / "w")


def _rt_load_other_shapes(tmp: Path) -> Any:
    with distkit.Runtime("dp") as rt:
        model = _model()
        model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        rt.save(tmp / "c.pt", {"model": model, "optimizer": optimizer})
    with distkit.Runtime("dp") as rt:
        other = nn.Linear(3, 5)
        model, optimizer = rt.setup(other, torch.optim.SGD(other.parameters(), lr=0.1))
        before = other.weight.detach().clone()
        try:
            return rt.load(tmp / "c.pt", {"model": model, "optimizer": optimizer})
        finally:
            assert torch.equal(other.weight, before), "a refused rt.load changed the model"


def _closed_runtimes_model(tmp: Path) -> Any:
    with distkit.Runtime("dp") as rt:
        model = _model()
        model, _ = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return model(torch.randn(2, 3))


def _one_module_two_runtimes(tmp: Path) -> Any:
    model = _model()
    with distkit.Runtime("dp") as first, distkit.Runtime("dp") as second:
        first.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return second.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _mlflow(uri: str) -> Any:
    pytest.importorskip("mlflow")
    from distkit.loggers import MLflowLogger

    return MLflowLogger("e", tracking_uri=uri)


def _pending_weights_removed(tmp: Path) -> Any:
    with distkit.Runtime("dp") as rt:
        rt.save_weights(_model(), tmp / "w")
    with distkit.init_empty():
        model = nn.Linear(3, 2)
    distkit.load_weights(model, tmp / "w")  # recorded, to be read at the set-up
    (tmp / "w" / "model.safetensors").unlink()
    with distkit.Runtime("fsdp") as rt:
        return rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))


# (case id, what to do with a tmp folder, the error type, a phrase of its message)
CASES: list[tuple[str, Callable[[Path], Any], type[BaseException], str]] = [
    # Trainer(strategy) (the other Trainer arguments: TRAINER_ARGUMENTS)
    (
        "strategy-typo",
        lambda t: distkit.Trainer("horvod"),
        distkit.UnknownStrategyError,
        "Did you mean 'horovod'?",
    ),
    (
        "strategy-int",
        lambda t: distkit.Trainer(3),
        distkit.UnknownStrategyError,
        "strategy must be a name or a distkit.Strategy instance, got int 3",
    ),
    # fit(...) arguments
    (
        "model-not-module",
        lambda t: _fit(model="net", optimizer=torch.optim.SGD(_model().parameters(), lr=0.1)),
        ConfigurationError,
        "model must be a torch.nn.Module, got str",
    ),
    (
        "optimizer-not-optimizer",
        lambda t: _fit(optimizer=object()),
        ConfigurationError,
        "optimizer must be a torch.optim.Optimizer, got object",
    ),
    (
        "optimizer-of-another-model",
        lambda t: _fit(optimizer=torch.optim.SGD(_model().parameters(), lr=0.1)),
        ConfigurationError,
        "not parameters of the model",
    ),
    ("no-loss", lambda t: _fit(loss_fn=None), ConfigurationError, "fit needs loss_fn"),
    (
        "loss_fn-not-callable",
        lambda t: _fit(loss_fn="cross_entropy"),
        ConfigurationError,
        "loss_fn must be callable, got str",
    ),
    (
        "step_fn-not-callable",
        lambda t: _fit(loss_fn=None, step_fn=3),
        ConfigurationError,
        "step_fn must be callable, got int",
    ),
    (
        "step_fn-returns-float",
        lambda t: _fit(loss_fn=None, step_fn=lambda m, b: 1.5),
        ConfigurationError,
        "step_fn returned a float, not a tensor",
    ),
    (
        "step_fn-returns-constant",
        lambda t: _fit(loss_fn=None, step_fn=lambda m, b: torch.tensor(1.0)),
        ConfigurationError,
        "step_fn returned a tensor that does not require grad",
    ),
    (
        "step_fn-returns-none",
        lambda t: _fit(loss_fn=None, step_fn=lambda m, b: None),
        ConfigurationError,
        "step_fn returned a NoneType, not a tensor",
    ),
    (
        "loss_fn-returns-per-sample",
        lambda t: _fit(loss_fn=lambda o, y: nn.functional.cross_entropy(o, y, reduction="none")),
        ConfigurationError,
        "Return the batch-mean loss from loss_fn / step_fn",
    ),
    (
        "scheduler-of-another-optimizer",
        _scheduler_of_other_optimizer,
        ConfigurationError,
        "the scheduler steps another optimizer",
    ),
    (
        "scheduler-not-a-scheduler",
        lambda t: _fit_untrained(scheduler="cosine"),
        ConfigurationError,
        "scheduler must be a torch LR scheduler",
    ),
    (
        "plateau-per-step",
        _plateau_per_step,
        ConfigurationError,
        "ReduceLROnPlateau steps on a validation metric",
    ),
    (
        "train_data-str",
        lambda t: _fit(train_data="data.csv"),
        ConfigurationError,
        "train_data must be a torch Dataset",
    ),
    (
        "train_data-int",
        lambda t: _fit(train_data=64),
        ConfigurationError,
        "train_data must be a torch Dataset",
    ),
    (
        "train_data-stream",
        lambda t: _fit(train_data=_Stream(0)),
        ConfigurationError,
        "train_data has no data in epoch 0: it yielded nothing on every process",
    ),
    (
        "train_data-empty",
        lambda t: _fit(train_data=_data(0)),
        ConfigurationError,
        "train_data is empty (0 samples)",
    ),
    (
        "train_data-loader-batch_sampler",
        lambda t: _fit(train_data=DataLoader(_data(), batch_size=None)),
        ConfigurationError,
        "distkit must own batching",
    ),
    (
        "train_data-loader-distributed-sampler",
        lambda t: _fit(
            train_data=DataLoader(
                _data(), sampler=DistributedSampler(_data(), num_replicas=1, rank=0), batch_size=2
            )
        ),
        ConfigurationError,
        "uses a DistributedSampler",
    ),
    (
        "drop_last-leaves-nothing",
        lambda t: _fit(trainer=_trainer(batch_size=16, drop_last=True)),
        ConfigurationError,
        "drop_last=True leaves no batch",
    ),
    (
        "val_data-empty",
        lambda t: _fit_untrained(val_data=_data(0), metrics=[distkit.Accuracy()]),
        ConfigurationError,
        "val_data is empty (0 samples)",
    ),
    (
        "val_data-stream",
        lambda t: _fit_untrained(
            val_data=iter([]), metrics=[distkit.Accuracy()], trainer=_trainer(max_epochs=2)
        ),
        ConfigurationError,
        "val_data is an iterator (list_iterator), which can be read once, and max_epochs=2",
    ),
    (
        # (val_data with only a step_fn is validated with that step_fn: issue 27)
        "eval_step_fn-not-callable",
        lambda t: _fit_untrained(val_data=_data(), eval_step_fn="loss"),
        ConfigurationError,
        "eval_step_fn must be callable, got str",
    ),
    (
        "metrics-without-val_data",
        lambda t: _fit_untrained(metrics=[distkit.Accuracy()]),
        ConfigurationError,
        "metrics are computed on val_data",
    ),
    (
        "metric-not-a-metric",
        lambda t: _fit_untrained(val_data=_data(), metrics={"acc": len}),
        ConfigurationError,
        "metric 'acc' is a builtin_function_or_method",
    ),
    (
        "metric-class-not-instance",
        lambda t: _fit_untrained(val_data=_data(), metrics={"acc": distkit.Accuracy}),
        ConfigurationError,
        "pass an instance: Accuracy()",
    ),
    (
        "metric-returns-text",
        lambda t: _trainer().evaluate(_model(), _data(), metrics={"txt": _TextScore()}),
        ConfigurationError,
        "metric 'txt' returned a str",
    ),
    # evaluate(...)
    (
        "evaluate-nothing-to-compute",
        lambda t: _trainer().evaluate(_model(), _data()),
        ConfigurationError,
        "evaluate needs a loss_fn, a step_fn, metrics",
    ),
    (
        "evaluate-model-not-module",
        lambda t: _trainer().evaluate("net", _data(), loss_fn=nn.functional.cross_entropy),
        ConfigurationError,
        "model must be a torch.nn.Module, got str",
    ),
    (
        "evaluate-empty",
        lambda t: _trainer().evaluate(_model(), _data(0), loss_fn=nn.functional.cross_entropy),
        ConfigurationError,
        "val_data is empty",
    ),
    # checkpoints
    (
        "checkpoint_dir-is-a-file",
        _unwritable_dir_is_a_file,
        ckpt.CheckpointError,
        "cannot write checkpoints to",
    ),
    (
        "checkpoint_dir-below-a-file",
        _unwritable_dir_below_a_file,
        ckpt.CheckpointError,
        "cannot write checkpoints to",
    ),
    (
        "resume-missing-file",
        lambda t: _fit_untrained(trainer=_trainer(resume=t / "no.pt")),
        ckpt.CheckpointError,
        "no checkpoint at",
    ),
    (
        "resume-random-bytes",
        _resume_from(bytes((i * 37 + 11) % 256 for i in range(64))),
        ckpt.CheckpointError,
        "is not a torch file",
    ),
    (
        "resume-text-file",
        _resume_from(b"step-000000004.pt\n"),
        ckpt.CheckpointError,
        "is not a torch file",
    ),
    ("resume-empty-file", _resume_from(b""), ckpt.CheckpointError, "is empty"),
    (
        "resume-garbage-after-a-pickle-header",
        _resume_from(b"\x80\x02" + b"garbage" * 9),
        ckpt.CheckpointError,
        "is corrupt: its pickle cannot be read (Unsupported operand",
    ),
    (
        "resume-zip-that-is-not-torch",
        lambda t: _fit_untrained(trainer=_trainer(resume=_zip(t))),
        ckpt.CheckpointError,
        "is not a readable checkpoint (truncated or corrupt?)",
    ),
    (
        "resume-checkpoint-that-needs-code",
        lambda t: _fit_untrained(trainer=_trainer(resume=_needs_code(t))),
        ckpt.CheckpointError,
        "needs pickled Python objects to load",
    ),
    (
        "resume-plain-state-dict",
        lambda t: _fit_untrained(trainer=_trainer(resume=_plain_state_dict(t))),
        ckpt.CheckpointError,
        "not a distkit checkpoint",
    ),
    (
        "resume-distkit-file-without-model",
        lambda t: _fit_untrained(trainer=_trainer(resume=_no_model(t))),
        ckpt.CheckpointError,
        "has no model state: it is not a checkpoint distkit can resume from",
    ),
    (
        "resume-a-folder",
        lambda t: _fit_untrained(trainer=_trainer(resume=t)),
        ckpt.CheckpointError,
        "is a folder, not a checkpoint file",
    ),
    (
        "resume-sgd-into-adam",
        _sgd_into_adam,
        ckpt.CheckpointError,
        "optimizer state of SGD; this optimizer is Adam",
    ),
    (
        "load_checkpoint-sgd-into-adam",
        _sgd_into_adam_by_load_checkpoint,
        ckpt.CheckpointError,
        "optimizer state of SGD; this optimizer is Adam",
    ),
    (
        "resume-other-model-shapes",
        _other_shapes,
        ckpt.CheckpointError,
        "does not fit this model: weight: checkpoint (2, 3), model (5, 3)",
    ),
    (
        "resume-mid-epoch-smaller-dataset",
        _smaller_dataset_mid_epoch,
        ConfigurationError,
        "stopped mid-epoch after 4 of 8 samples; train_data has 4",
    ),
    (
        "save-before-fit",
        lambda t: _trainer().save_checkpoint(t / "c.pt"),
        ConfigurationError,
        "save_checkpoint needs a model: call fit(...) first",
    ),
    (
        "save-extra-not-a-dict",
        lambda t: _fitted(t).save_checkpoint(t / "c.pt", extra=[1, 2]),
        ConfigurationError,
        "extra must be a dict",
    ),
    (
        "save-extra-object",
        lambda t: _fitted(t).save_checkpoint(t / "c.pt", extra={"f": _model()}),
        ckpt.CheckpointError,
        "cannot be loaded weights-only",
    ),
    (
        "save-to-a-folder",
        lambda t: _fitted(t).save_checkpoint(t),
        ckpt.CheckpointError,
        "is a folder",
    ),
    # a closed trainer
    (
        "fit-after-close",
        lambda t: _fit(_closed()),
        TrainerClosedError,
        "the trainer is closed; create a new Trainer",
    ),
    (
        "evaluate-after-close",
        lambda t: _closed().evaluate(_model(), _data(), loss_fn=nn.functional.cross_entropy),
        TrainerClosedError,
        "the trainer is closed",
    ),
    (
        "save-after-close",
        lambda t: _closed().save_checkpoint(t / "c.pt"),
        TrainerClosedError,
        "the trainer is closed",
    ),
    # collectives
    (
        "all_reduce-op-max",
        lambda t: _dp().all_reduce(torch.ones(2), op="max"),
        ConfigurationError,
        "unknown reduce op 'max'. Allowed: mean, sum",
    ),
    (
        "all_reduce-list",
        lambda t: _dp().all_reduce([1.0]),
        ConfigurationError,
        "all_reduce takes a torch.Tensor, got list",
    ),
    (
        "all_gather-number",
        lambda t: _dp().all_gather(3),
        ConfigurationError,
        "all_gather takes a torch.Tensor, got int",
    ),
    (
        "broadcast-src-out-of-range",
        lambda t: _dp().broadcast(1, src=1),
        ConfigurationError,
        "src=1 is not a rank; allowed 0..0",
    ),
    # launch environments (issue 24)
    (
        "slurm-procid-out-of-range",
        lambda t: LaunchEnv.detect(environ=_SRUN_TWO_TASKS | {"SLURM_PROCID": "2"}, argv=["x"]),
        ConfigurationError,
        "SLURM_PROCID=2 with SLURM_NTASKS=2: a rank must lie in 0..1",
    ),
    (
        "rank-out-of-range",
        lambda t: LaunchEnv.detect(environ={"RANK": "4", "WORLD_SIZE": "4"}, argv=["x"]),
        ConfigurationError,
        "RANK=4 with WORLD_SIZE=4: a rank must lie in 0..3",
    ),
    # checkpoints: digests and hand-damaged fields (issue 23)
    (
        "val_every_n_steps-without-val_data",
        lambda t: _fit_untrained(trainer=_trainer(val_every_n_steps=2)),
        ConfigurationError,
        "Trainer(val_every_n_steps=2) validates val_data every 2 steps, and this fit has no "
        "val_data: pass val_data=... to fit",
    ),
    (
        "checkpoint-validations-not-a-list",
        lambda t: ckpt.load(_damaged(t, validations=3)),
        ckpt.CheckpointError,
        "field 'validations' is int 3; it should be a list of dicts of numbers",
    ),
    (
        "fit-inside-a-callback",
        lambda t: _fit(_trainer(callbacks=[_Refit()])),
        ConfigurationError,
        "fit() called while this trainer's fit is running (from a callback?): a fit cannot "
        "start inside another. Train a second model",
    ),
    (
        "resume-auto-no-checkpoint-loads",
        lambda t: _fit_untrained(trainer=_trainer(checkpoint_dir=_all_flipped(t), resume="auto")),
        ckpt.CheckpointError,
        "resume='auto' found 1 checkpoint(s) in",
    ),
    (
        "resume-auto-no-checkpoint-loads-fix",
        lambda t: _fit_untrained(trainer=_trainer(checkpoint_dir=_all_flipped(t), resume="auto")),
        ckpt.CheckpointError,
        "Move the folder aside to start afresh, or pass resume=<a file that loads>",
    ),
    (
        "load_checkpoint-flipped-bit",
        lambda t: _fitted(t).load_checkpoint(_flipped(t)),
        ckpt.CheckpointError,
        "flipped.pt is corrupt: its bytes differ",
    ),
    (
        "checkpoint-claims-a-digest-it-lacks",
        lambda t: ckpt.load(_claims_digest(t)),
        ckpt.CheckpointError,
        "claims.pt is damaged: it was written with a sha256 digest at its end",
    ),
    (
        "checkpoint-optimizer-state-a-list",
        lambda t: ckpt.load(_damaged(t, optimizer={"state": [], "param_groups": []})),
        ckpt.CheckpointError,
        "field 'optimizer.state' is a list; it should be a dict",
    ),
    (
        "checkpoint-scheduler-a-list",
        lambda t: ckpt.load(_damaged(t, scheduler=[0.1])),
        ckpt.CheckpointError,
        "field 'scheduler' is a list; it should be a dict",
    ),
    (
        "checkpoint-rng-numpy-keys-float",
        lambda t: ckpt.load(_damaged(t, rng_numpy_keys=torch.zeros(624))),
        ckpt.CheckpointError,
        "'ranks[0].rng.numpy.keys' is a torch.float32 tensor of 624 elements",
    ),
    (
        "checkpoint-flipped-bit",
        lambda t: ckpt.load(_flipped(t)),
        ckpt.CheckpointError,
        "flipped.pt is corrupt: its bytes differ from those distkit wrote",
    ),
    (
        "resume-flipped-bit-file",
        lambda t: _fit_untrained(trainer=_trainer(resume=_flipped(t))),
        ckpt.CheckpointError,
        "resume='auto' falls back to the newest one that verifies",
    ),
    (
        "checkpoint-digest-cut-off",
        lambda t: ckpt.load(_digest_cut_off(t)),
        ckpt.CheckpointError,
        "digest at its end, and that digest is missing or unreadable",
    ),
    (
        "checkpoint-version-a-string",
        lambda t: ckpt.load(_damaged(t, version="1")),
        ckpt.CheckpointError,
        "its field 'version' is str '1', not an int",
    ),
    (
        "checkpoint-version-a-float",
        lambda t: ckpt.load(_damaged(t, version=1.0)),
        ckpt.CheckpointError,
        "its field 'version' is float 1.0, not an int",
    ),
    (
        "checkpoint-progress-without-epoch",
        lambda t: ckpt.load(_damaged(t, progress=_without("epoch"))),
        ckpt.CheckpointError,
        "field 'progress.epoch' is missing; it should be an int >= 0. Resume from another",
    ),
    (
        "checkpoint-progress-step-negative",
        lambda t: ckpt.load(_damaged(t, progress=_progress(global_step=-2))),
        ckpt.CheckpointError,
        "field 'progress.global_step' is int -2; it should be an int >= 0",
    ),
    (
        "checkpoint-progress-a-list",
        lambda t: ckpt.load(_damaged(t, progress=[0, 0, 2])),
        ckpt.CheckpointError,
        "field 'progress' is a list; it should be a dict",
    ),
    (
        "checkpoint-history-not-a-list",
        lambda t: ckpt.load(_damaged(t, history={"loss": 1.0})),
        ckpt.CheckpointError,
        "field 'history' is a dict; it should be a list of dicts of numbers",
    ),
    (
        "checkpoint-history-text-value",
        lambda t: ckpt.load(_damaged(t, history=[{"train_loss": "low"}])),
        ckpt.CheckpointError,
        "field 'history[0].train_loss' is str 'low'; it should be a number",
    ),
    (
        "checkpoint-rng-wrong-size",
        lambda t: ckpt.load(_damaged(t, rng_torch=torch.zeros(10, dtype=torch.uint8))),
        ckpt.CheckpointError,
        "'ranks[0].rng.torch' is a torch.uint8 tensor of 10 elements; it should be a torch.uint8",
    ),
    (
        "checkpoint-rng-python-short",
        lambda t: ckpt.load(_damaged(t, rng_python=[1, 2, 3])),
        ckpt.CheckpointError,
        "field 'ranks[0].rng.python.internal' is a list; it should be a list of 625 ints",
    ),
    (
        "checkpoint-ranks-not-a-list",
        lambda t: ckpt.load(_damaged(t, ranks={"0": {}})),
        ckpt.CheckpointError,
        "field 'ranks' is a dict; it should be a list with one dict per rank",
    ),
    (
        "checkpoint-rank-samples-text",
        lambda t: ckpt.load(_damaged(t, rank_samples="8")),
        ckpt.CheckpointError,
        "field 'ranks[0].samples' is str '8'; it should be an int >= 0",
    ),
    (
        "checkpoint-scaler-without-keys",
        lambda t: ckpt.load(_damaged(t, scaler={"scale": 1024.0})),
        ckpt.CheckpointError,
        "field 'scaler.growth_factor' is missing; it should be a number",
    ),
    (
        "checkpoint-model-a-list",
        lambda t: ckpt.load(_damaged(t, model=[torch.ones(2)])),
        ckpt.CheckpointError,
        "field 'model' is a list; it should be a dict",
    ),
    (
        "checkpoint-model-value-text",
        lambda t: ckpt.load(_damaged(t, model={"weight": "w"})),
        ckpt.CheckpointError,
        "field 'model.weight' is str 'w'; it should be a tensor",
    ),
    (
        "checkpoint-optimizer-groups-dict",
        lambda t: ckpt.load(_damaged(t, optimizer={"state": {}, "param_groups": {}})),
        ckpt.CheckpointError,
        "field 'optimizer.param_groups' is a dict; it should be a list of dicts",
    ),
    (
        "checkpoint-extra-a-list",
        lambda t: ckpt.load(_damaged(t, extra=[1, 2])),
        ckpt.CheckpointError,
        "field 'extra' is a list; it should be a dict",
    ),
    (
        "checkpoint-callbacks-text",
        lambda t: ckpt.load(_damaged(t, callbacks="none")),
        ckpt.CheckpointError,
        "field 'callbacks' is str 'none'; it should be a dict",
    ),
    (
        "resume-damaged-field",
        lambda t: _fit_untrained(trainer=_trainer(resume=_damaged(t, history=5))),
        ckpt.CheckpointError,
        "damaged.pt is damaged: its field 'history' is int 5",
    ),
    (
        "sharded-checkpoint-without-its-folder",
        lambda t: ckpt.load(_shards_gone(t)),
        ckpt.CheckpointError,
        "shards folder gone.pt.0123456789ab.shards is not beside it: copy the checkpoint file",
    ),
    # loggers (issue 23)
    (
        "csv-logger-save-dir-under-a-file",
        lambda t: distkit.loggers.CSVLogger(_write(t / "notes.txt", b"mine") / "logs"),
        ConfigurationError,
        "notes.txt' is a file, not a folder; pass a save_dir whose existing parts are folders",
    ),
    (
        "csv-logger-save-dir-is-a-file",
        lambda t: distkit.loggers.CSVLogger(_write(t / "notes.txt", b"mine")),
        ConfigurationError,
        "notes.txt' is a file, not a folder; pass a save_dir whose existing parts are folders",
    ),
    (
        "csv-logger-filename-is-a-folder",
        lambda t: distkit.loggers.CSVLogger(t, filename=(t / "sub").mkdir() or "sub"),
        ConfigurationError,
        "sub' is a folder, not a file; pass another filename or save_dir",
    ),
    (
        "tensorboard-logger-name-is-a-file",
        lambda t: distkit.loggers.TensorBoardLogger(t, name=_write(t / "exp1", b"mine").name),
        ConfigurationError,
        "exp1' is a file, not a folder; pass a save_dir and name whose existing parts are",
    ),
    (
        "logger-strict-not-bool",
        lambda t: distkit.loggers.CSVLogger(t, strict="yes"),
        ConfigurationError,
        "CSVLogger(strict=...) must be True or False, got str: 'yes'; pass strict=True",
    ),
    (
        "logger-strict-attribute-not-bool",
        lambda t: _trainer(
            loggers=[
                type(
                    "Tracker",
                    (distkit.loggers.Logger,),
                    {"strict": 1, "log_metrics": lambda self, metrics, step: None},
                )()
            ]
        ),
        ConfigurationError,
        "(Tracker) has strict=1 (int); it must be True (its errors end the fit) or False (they "
        "are reported and training goes on): set logger.strict = True or False",
    ),
    (
        "logger-strict-made-not-bool-before-fit",
        lambda t: (
            logger := distkit.loggers.CSVLogger(t),
            trainer := _trainer(loggers=[logger]),
            setattr(logger, "strict", "no"),
            _fit(trainer),
        ),
        ConfigurationError,
        "(CSVLogger) has strict='no' (str); it must be True (its errors end the fit) or False "
        "(they are reported and training goes on): set logger.strict = True or False",
    ),
    # the profiler (issue 43): /proc takes no new folder, for root too
    (
        "profiler-dir-it-cannot-create",
        lambda t: distkit.Profiler(dir="/proc/prof"),
        ConfigurationError,
        "Profiler(dir='/proc/prof'): '/proc' (the nearest existing folder of '/proc/prof') "
        "cannot be written",
    ),
    # callbacks (issue 23)
    (
        "callback-state-numpy-float64",
        lambda t: _fitted(
            t,
            callbacks=[
                type("S", (distkit.Callback,), {"state_dict": lambda s: {"x": np.float64(0.5)}})()
            ],
        ).save_checkpoint(t / "c.pt"),
        ConfigurationError,
        "callback S.state_dict()['x'] holds np.float64(0.5), a numpy.float64, which a "
        "checkpoint cannot load weights-only: store float(value) instead",
    ),
    (
        "callback-state-numpy-float32",
        lambda t: _fitted(
            t,
            callbacks=[
                type("S", (distkit.Callback,), {"state_dict": lambda s: {"x": np.float32(2)}})()
            ],
        ).save_checkpoint(t / "c.pt"),
        ConfigurationError,
        "callback S.state_dict()['x'] holds np.float32(2.0), a numpy.float32, which a "
        "checkpoint cannot load weights-only: store float(value) instead",
    ),
    (
        "callback-state-numpy-bool",
        lambda t: _fitted(
            t,
            callbacks=[
                type("S", (distkit.Callback,), {"state_dict": lambda s: {"x": np.bool_(1)}})()
            ],
        ).save_checkpoint(t / "c.pt"),
        ConfigurationError,
        "callback S.state_dict()['x'] holds np.True_, a numpy.bool, which a checkpoint cannot "
        "load weights-only: store bool(value) instead",
    ),
    (
        "callback-state-numpy-array-in-a-list",
        lambda t: _fitted(
            t,
            callbacks=[
                type("S", (distkit.Callback,), {"state_dict": lambda s: {"x": [np.zeros(2)]}})()
            ],
        ).save_checkpoint(t / "c.pt"),
        ConfigurationError,
        "callback S.state_dict()['x'][0] holds array([0., 0.]), a numpy.ndarray, which a "
        "checkpoint cannot load weights-only: store value.tolist() (or torch.from_numpy(value))",
    ),
    (
        "callback-state-set",
        lambda t: _fitted(
            t,
            callbacks=[type("S", (distkit.Callback,), {"state_dict": lambda s: {"x": {1, 2}}})()],
        ).save_checkpoint(t / "c.pt"),
        ConfigurationError,
        "callback S.state_dict()['x'] holds {1, 2}, a builtins.set, which a checkpoint cannot "
        "load weights-only: store list(value) instead",
    ),
    (
        "best-checkpoint-misspelled-monitor-on-a-stream",
        lambda t: _fit(
            _trainer(
                checkpoint_dir=t,
                max_steps=4,
                val_every_n_steps=2,
                callbacks=[distkit.callbacks.BestCheckpoint("val_los")],
            ),
            train_data=_Stream(),
            val_data=_data(),
        ),
        ConfigurationError,
        "BestCheckpoint monitors 'val_los', which the validation at step 2 did not report; it "
        "reported: val_loss. Monitor one of these",
    ),
    (
        "early-stopping-misspelled-monitor-on-a-stream",
        lambda t: _fit(
            _trainer(
                max_steps=4,
                val_every_n_steps=2,
                callbacks=[distkit.callbacks.EarlyStopping("val_acc")],
            ),
            train_data=_Stream(),
            val_data=_data(),
        ),
        ConfigurationError,
        "EarlyStopping monitors 'val_acc', which the validation at step 2 did not report; it "
        "reported: val_loss. Monitor one of these",
    ),
    (
        "accuracy-on-a-model-that-returns-a-dict",
        lambda t: _fit(
            model=_DictModel(),
            loss_fn=lambda out, y: nn.functional.cross_entropy(out["logits"], y),
            val_data=_data(),
            metrics={"acc": distkit.Accuracy()},
        ),
        ConfigurationError,
        "Accuracy reads the output as a tensor ((N, C, ...) class scores for the output, (N, "
        "...) class indices for the target), got a dict with keys ['logits']: the model "
        "returns more than one value. Give Accuracy the tensor: a subclass whose batch_state "
        "reads it, `class MyAccuracy(distkit.Accuracy): def batch_state(self, output, "
        "target): return super().batch_state(output['logits'], target)`",
    ),
    (
        "step_fn-returns-a-dict-without-loss",
        lambda t: _fit(loss_fn=None, step_fn=lambda m, b: {"logits": m(b[0])}),
        ConfigurationError,
        "step_fn returned a dict with keys ['logits'] and no loss: the model computes no loss "
        "of its own here (a transformers model needs labels= for that). Return the loss",
    ),
    (
        "fsdp-keyword-fully-shard-does-not-take",
        lambda t: distkit.FSDPStrategy(offload_polcy=None),
        ConfigurationError,
        "FSDPStrategy(offload_polcy=...): neither FSDPStrategy nor torch's fully_shard takes "
        "'offload_polcy'. Did you mean 'offload_policy'?",
    ),
    (
        "ragged-dict-samples-without-a-collate_fn",
        lambda t: _fit_untrained(train_data=_Ragged()),
        ConfigurationError,
        "the samples of a batch cannot be stacked into one tensor (field 'input_ids'): stack "
        "expects each tensor to be equal size",
    ),
    (
        "loss-count-negative-tensor",
        lambda t: _fit(loss_fn=None, step_fn=_negative_count_step),
        ConfigurationError,
        "Loss.count (rt.backward count=) must be >= 0 (a number of items), but 2 optimizer "
        "steps had a negative tensor count on some rank (this rank's lowest was -4)",
    ),
    (
        "load_weights-integer-tensors-into-float-weights",
        _int_weights,
        ckpt.CheckpointError,
        "holds integer tensors where the model has floating-point ones: weight: file I64, "
        "model torch.float32. Those are not weights of this model (a file of token ids or "
        "counts?): save the weights as floats, or load them yourself with the cast you mean",
    ),
    (
        "load_weights-one-flipped-bit",
        _flipped_weights,
        ckpt.CheckpointError,
        "model.safetensors is damaged: its tensors do not match the digest save_weights "
        "recorded (a changed bit, or a partial copy). Nothing was loaded. Copy the file again",
    ),
    (
        "rt.load-into-a-model-of-other-shapes",
        _rt_load_other_shapes,
        ckpt.CheckpointError,
        "'model' does not fit this model: weight: checkpoint (2, 3), model (5, 3); bias: "
        "checkpoint (2,), model (5,). Nothing was loaded. Load it into the model it was saved "
        "from",
    ),
    (
        "closed-runtimes-model-called",
        _closed_runtimes_model,
        TrainerClosedError,
        "a set-up model or optimizer was used on a closed Runtime: the Runtime was closed "
        "(close(), the end of its with-block, or a failed multi-process run) and its backend "
        "state with it. Use the model you passed to rt.setup",
    ),
    (
        "one-module-set-up-by-two-open-runtimes",
        _one_module_two_runtimes,
        ConfigurationError,
        "this Linear is set up by another Runtime (or Trainer) that is still open: its "
        "backend's hooks are on the model's parameters, and a second set-up would add its own "
        "(gradients averaged twice, or not at all). Close the first",
    ),
    (
        "mlflow-tracking-uri-of-no-scheme-mlflow-has",
        lambda t: _mlflow("bogus://x"),
        ConfigurationError,
        "MLflowLogger(tracking_uri='bogus://x'): MLflow has no tracking store for the scheme "
        "'bogus'; allowed: a folder path, or a URI of scheme file, http, https, databricks, "
        "sqlite, postgresql, mysql or mssql",
    ),
    (
        "mlflow-sqlite-store-in-a-folder-it-cannot-write",
        lambda t: _mlflow("sqlite:////proc/m.db"),
        ConfigurationError,
        "MLflowLogger(tracking_uri='sqlite:////proc/m.db'): '/proc' cannot be written",
    ),
    (
        "meta-model-pending-weights-removed-before-the-set-up",
        _pending_weights_removed,
        ckpt.CheckpointError,
        "model.safetensors is gone (FileNotFoundError: No such file or directory): load_weights "
        "recorded it for a model on the meta device, to be read at the set-up. Keep the weights "
        "where they were until fit / rt.setup has run, or call load_weights again",
    ),
]


class _Refit(distkit.Callback):
    """Calls fit again from inside the fit (it recursed into a RecursionError before)."""

    def on_train_step_end(self, trainer, logs):
        _fit(trainer)


def _all_flipped(tmp: Path) -> Path:
    folder = tmp / "ckpt"
    _fit(_trainer(checkpoint_dir=folder))
    for path in ckpt.CheckpointFolder(folder).checkpoints():
        data = bytearray(path.read_bytes())
        data[len(data) // 3] ^= 0x01
        path.write_bytes(bytes(data))
    return folder


def _claims_digest(tmp: Path) -> Path:
    """A checkpoint saved by plain torch.save from a payload that says it has a digest."""
    path = tmp / "claims.pt"
    torch.save(ckpt.load(_saved(tmp)), path)
    return path


_SRUN_TWO_TASKS = {
    "SLURM_PROCID": "0",
    "SLURM_NTASKS": "2",
    "SLURM_JOB_ID": "1",
    "SLURM_STEP_ID": "0",
}


# ---------------------------------------------------------------- damaged checkpoints (issue 23)
def _flipped(tmp: Path) -> Path:
    """A checkpoint with one bit flipped inside its first tensor record."""
    path = tmp / "flipped.pt"
    _fitted(tmp).save_checkpoint(path)
    with zipfile.ZipFile(path) as archive:
        record = next(i for i in archive.infolist() if "/data/" in i.filename)
    data = bytearray(path.read_bytes())
    data[record.header_offset + 30 + len(record.filename) + len(record.extra) + 2] ^= 0x08
    path.write_bytes(bytes(data))
    return path


def _digest_cut_off(tmp: Path) -> Path:
    path = tmp / "cut.pt"
    _fitted(tmp).save_checkpoint(path)
    data = path.read_bytes()
    comment = int.from_bytes(data[-2 - 79 : -79], "little")  # the comment's length field
    path.write_bytes(data[: -comment - 2] + b"\x00\x00")
    return path


def _progress(**changes: Any) -> dict[str, Any]:
    return {"epoch": 1, "position": 0, "global_step": 2, "skipped_steps": 0,
            "train_samples": 8, **changes}  # fmt: skip


def _without(key: str) -> dict[str, Any]:
    progress = _progress()
    del progress[key]
    return progress


def _damaged(tmp: Path, **changes: Any) -> Path:
    """A real checkpoint with fields changed by hand, saved again (with a fresh digest, so
    only the field checks can catch it)."""
    path = tmp / "damaged.pt"
    _fitted(tmp).save_checkpoint(path)
    payload = ckpt.load(path)
    rank = payload["ranks"][0]
    for key, value in changes.items():
        if key == "rng_torch":
            rank["rng"]["torch"] = value
        elif key == "rng_python":
            rank["rng"]["python"]["internal"] = value
        elif key == "rng_numpy_keys":
            rank["rng"]["numpy"]["keys"] = value
        elif key == "rank_samples":
            rank["samples"] = value
        else:
            payload[key] = value
    ckpt.atomic_save(payload, path)
    return path


def _shards_gone(tmp: Path) -> Path:
    """A sharded checkpoint's file copied without its shards folder."""
    path = tmp / "gone.pt"
    payload = ckpt.load(_saved(tmp))
    ckpt.atomic_save({**payload, "shards": "gone.pt.0123456789ab.shards"}, path)
    return path


def _zip(tmp: Path) -> Path:
    path = tmp / "archive.pt"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("notes.txt", "not a checkpoint")
    return path


class _Code:
    """Loading an instance of a class would need to run code."""


def _needs_code(tmp: Path) -> Path:
    path = tmp / "code.pt"
    torch.save({"format": ckpt.FORMAT, "version": 1, "obj": _Code()}, path)
    return path


def _no_model(tmp: Path) -> Path:
    path = tmp / "no_model.pt"
    progress = {"epoch": 0, "position": 0, "global_step": 1}
    torch.save({"format": ckpt.FORMAT, "version": 1, "progress": progress}, path)
    return path


def _plain_state_dict(tmp: Path) -> Path:
    path = tmp / "plain.pt"
    torch.save(_model().state_dict(), path)
    return path


@pytest.mark.parametrize(
    ("act", "error", "phrase"), [pytest.param(*row[1:], id=row[0]) for row in CASES]
)
def test_hostile_input_gets_a_typed_error_naming_it(act, error, phrase, tmp_path):
    with pytest.raises(error, match=re.escape(phrase)):
        act(tmp_path)


# ---------------------------------------------------------------- odd but valid: the right result
def _numpy_metric_in_history(tmp: Path) -> None:
    trainer = _trainer(checkpoint_dir=tmp / "ckpt")
    result = _fit(trainer, val_data=_data(), metrics={"score": _NumpyScore()})
    value = result.history[0]["val_score"]
    assert type(value) is float and 0.0 <= value <= 1.0
    saved = ckpt.load(ckpt.CheckpointFolder(tmp / "ckpt").checkpoints()[-1])  # saved and loads
    assert type(saved["history"][0]["val_score"]) is float


def _any_number_type_becomes_float(tmp: Path) -> None:
    scores = _trainer().evaluate(_model(), _data(), metrics={"s": _TensorScores()})
    assert {k: type(v) for k, v in scores.items()} == {
        "s_hits": float, "s_rate": float, "s_count": float
    }  # fmt: skip
    assert scores["s_rate"] == 0.5 and scores["s_count"] == 8.0


def _max_epochs_zero_trains_nothing(tmp: Path) -> None:
    model = _model()
    before = model.weight.detach().clone()
    assert _fit(_trainer(max_epochs=0), model=model, loss_fn=None, step_fn=_untrained).history == []
    assert torch.equal(model.weight.cpu(), before.cpu())  # set-up moved it onto a GPU, if any


def _resume_auto_in_empty_folder_starts_fresh(tmp: Path) -> None:
    result = _fit(_trainer(checkpoint_dir=tmp / "new", resume="auto"))
    assert len(result.history) == 1


def _resume_mid_epoch_same_dataset(tmp: Path) -> None:
    path = _mid_epoch_checkpoint(tmp)
    result = _fit(_trainer(resume=path))
    assert len(result.history) == 1


def _resume_from_the_last_step_of_an_epoch(tmp: Path) -> None:
    folder = tmp / "ckpt"
    _fit(_trainer(checkpoint_dir=folder, checkpoint_every=1, max_steps=2))  # 2 steps = 1 epoch
    last = ckpt.load(ckpt.CheckpointFolder(folder).checkpoints()[-1])["progress"]
    assert last["position"] == last["train_samples"] == 8  # saved before the epoch closed
    result = _fit(_trainer(resume=ckpt.CheckpointFolder(folder).checkpoints()[-1]))
    assert len(result.history) == 1


def _fit_after_failed_fit(tmp: Path) -> None:
    trainer = _trainer()
    with pytest.raises(ConfigurationError):
        _fit(trainer, loss_fn="nope")
    assert len(_fit(trainer).history) == 1  # a refused call leaves the trainer usable


def _close_twice(tmp: Path) -> None:
    trainer = _trainer()
    assert not trainer.closed
    trainer.close()
    trainer.close()
    assert trainer.closed


RESULTS: list[tuple[str, Callable[[Path], None]]] = [
    ("metric-numpy-float-becomes-float-and-saves", _numpy_metric_in_history),
    ("metric-number-types-become-float", _any_number_type_becomes_float),
    ("max_epochs-zero-trains-nothing", _max_epochs_zero_trains_nothing),
    ("resume-auto-empty-folder-starts-fresh", _resume_auto_in_empty_folder_starts_fresh),
    ("resume-mid-epoch-same-dataset", _resume_mid_epoch_same_dataset),
    ("resume-from-the-last-step-of-an-epoch", _resume_from_the_last_step_of_an_epoch),
    ("fit-after-refused-fit", _fit_after_failed_fit),
    ("close-twice", _close_twice),
]


@pytest.mark.parametrize("check", [pytest.param(fn, id=name) for name, fn in RESULTS])
def test_hostile_looking_input_gives_the_correct_result(check, tmp_path):
    check(tmp_path)


def test_hostile_single_rank_errors_keep_their_own_type(tmp_path):
    # one process: a local error is raised as itself, never as a disagreement between ranks
    with pytest.raises(ckpt.CheckpointError) as caught:
        _fit_untrained(trainer=_trainer(resume=tmp_path / "missing.pt"))
    assert not isinstance(caught.value, RankDisagreementError)
