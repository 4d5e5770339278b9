"""Callbacks: hook order, step logs, errors, stopping, and callback state in checkpoints.

Single-process cases run on dp; the multi-rank ones on real gloo processes (ddp). The
promises every backend keeps (clipping, stop_together) are in
tests/contract/test_strategy_contract.py.
"""

from __future__ import annotations

import collections
import enum
import math
import os
import re
import time
import warnings
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import distkit
from distkit.callbacks import BestCheckpoint, Callback, EarlyStopping
from distkit.errors import PeerFailureError, RankDisagreementError
from tests.support.stream_workloads import SampleStream
from tests.support.workloads import make_dataset, make_mlp

pytestmark = pytest.mark.timeout(300)


class Recorder(Callback):
    """Every hook call, in order; step logs are read (device values become floats)."""

    stops_training = False

    def __init__(self) -> None:
        self.calls: list[tuple[str, object]] = []

    def on_fit_start(self, trainer):
        self.calls.append(("fit_start", trainer.global_step))

    def on_train_step_end(self, trainer, logs):
        self.calls.append(("step", dict(logs)))

    def on_validation_end(self, trainer, metrics):
        self.calls.append(("validation", dict(metrics)))

    def on_epoch_end(self, trainer, record):
        self.calls.append(("epoch", dict(record)))

    def on_fit_end(self, trainer, result):
        self.calls.append(("fit_end", result))

    def on_exception(self, trainer, exc):
        self.calls.append(("exception", exc))


def _fit(trainer: distkit.Trainer, n: int = 24, lr: float = 0.1, train_data=None, **fit_kwargs):
    model = make_mlp()
    data = make_dataset(n) if train_data is None else train_data
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return trainer.fit(model, optimizer, data, loss_fn=nn.functional.cross_entropy, **fit_kwargs)


def test_callbacks_hooks_run_in_order_with_step_logs():
    recorder = Recorder()
    trainer = distkit.Trainer("dp", batch_size=4, max_epochs=2, progress=False,
                              val_every_n_steps=4, callbacks=[recorder])  # fmt: skip
    result = _fit(trainer, n=24, val_data=make_dataset(10))  # 6 steps per epoch
    kinds = [kind for kind, _ in recorder.calls]
    assert kinds == (
        ["fit_start"] + ["step"] * 4 + ["validation"] + ["step"] * 2 + ["validation", "epoch"]
        + ["step"] * 2 + ["validation"] + ["step"] * 4 + ["validation", "epoch", "fit_end"]
    )  # fmt: skip
    steps = [value for kind, value in recorder.calls if kind == "step"]
    assert [s["step"] for s in steps] == list(range(1, 13))  # 1-based global steps
    assert all(s["lr"] == 0.1 and math.isfinite(s["loss"]) and s["skipped"] is False
               for s in steps)  # fmt: skip
    assert "grad_norm" not in steps[0]  # only with clipping
    # validations at steps 4, 8, 12 and the ends of epochs (6, 12): step 12 validated once
    assert [v["step"] for v in result.validations] == [4, 6, 8, 12]
    assert result.history[1]["val_loss"] == result.validations[-1]["val_loss"]
    assert recorder.calls[-1][1] is result and not result.stopped_early


def test_callbacks_step_loss_is_the_mean_of_the_step_micro_batches():
    recorder = Recorder()
    trainer = distkit.Trainer("dp", batch_size=4, max_epochs=1, progress=False,
                              grad_accum_steps=2, callbacks=[recorder])  # fmt: skip
    result = _fit(trainer, n=24)
    losses = [v["loss"] for k, v in recorder.calls if k == "step"]
    assert len(losses) == 3  # 6 micro-batches, 2 per step
    # equal-sized steps: the epoch's loss is the mean of the steps' losses
    assert sum(losses) / 3 == pytest.approx(result.history[0]["train_loss"], rel=1e-9)


class Exploding(Callback):
    def on_train_step_end(self, trainer, logs):
        if logs["step"] == 2:
            raise ValueError("my callback's own error")


def test_callbacks_error_keeps_its_type_and_reaches_on_exception():
    recorder = Recorder()
    trainer = distkit.Trainer("dp", batch_size=4, progress=False,
                              callbacks=[recorder, Exploding()])  # fmt: skip
    with pytest.raises(ValueError, match="my callback's own error") as info:
        _fit(trainer)
    assert any("Exploding.on_train_step_end" in note for note in info.value.__notes__)
    assert recorder.calls[-1] == ("exception", info.value)


class FailingOnException(Callback):
    def on_exception(self, trainer, exc):
        raise RuntimeError("cleanup failed")


def test_callbacks_error_in_on_exception_does_not_replace_the_fit_error(capsys):
    trainer = distkit.Trainer("dp", batch_size=4, progress=False,
                              callbacks=[Exploding(), FailingOnException()])  # fmt: skip
    with pytest.raises(ValueError, match="my callback's own error"):
        _fit(trainer)
    assert "FailingOnException.on_exception raised RuntimeError: cleanup failed" in (
        capsys.readouterr().err
    )


def _explode_on_rank_one() -> str:
    class ExplodeOnRankOne(Callback):
        def on_train_step_end(self, trainer, logs):
            if trainer.rank == 1 and logs["step"] == 2:
                raise ValueError("rank one's callback failed")

    trainer = distkit.Trainer("ddp", batch_size=4, progress=False, callbacks=[ExplodeOnRankOne()])
    try:
        _fit(trainer)
    except (ValueError, PeerFailureError) as exc:
        return type(exc).__name__
    return "no error"


def test_callbacks_error_on_one_rank_surfaces_there_as_itself(run_on_ranks):
    assert run_on_ranks(_explode_on_rank_one, world_size=2) == ["PeerFailureError", "ValueError"]


def _different_callbacks() -> str:
    rank = int(__import__("os").environ["RANK"])
    callbacks = [EarlyStopping()] if rank == 0 else []
    trainer = distkit.Trainer("ddp", batch_size=4, progress=False, callbacks=callbacks)
    try:
        _fit(trainer, val_data=make_dataset(8))
    except RankDisagreementError as exc:
        return str(exc)
    return "no error"


def test_callbacks_that_differ_between_ranks_are_refused_before_training(run_on_ranks):
    messages = run_on_ranks(_different_callbacks, world_size=2)
    assert messages[0] == messages[1]
    assert "callbacks" in messages[0] and "EarlyStopping[val_loss,min]" in messages[0]


def test_callbacks_early_stopping_stops_when_the_metric_stops_improving():
    # train_loss falls every epoch, so mode="max" sees no improvement after the first
    stopper = EarlyStopping(monitor="train_loss", mode="max", patience=2)
    trainer = distkit.Trainer("dp", batch_size=4, max_epochs=10, progress=False,
                              callbacks=[stopper])  # fmt: skip
    result = _fit(trainer)
    assert len(result.history) == 3 and result.stopped_early
    assert stopper.wait == 2 and stopper.stopped_step == trainer.global_step == 18


def test_callbacks_early_stopping_resumes_its_patience_from_the_checkpoint(tmp_path):
    def run(max_epochs: int) -> tuple[distkit.FitResult, EarlyStopping]:
        stopper = EarlyStopping(monitor="train_loss", mode="max", patience=3)
        trainer = distkit.Trainer("dp", batch_size=4, max_epochs=max_epochs, progress=False,
                                  checkpoint_dir=tmp_path, resume="auto",
                                  callbacks=[stopper])  # fmt: skip
        return _fit(trainer), stopper

    first, stopper = run(2)
    assert not first.stopped_early and stopper.wait == 1
    resumed, stopper = run(10)
    # a fresh counter would stop after epoch 6; the saved one (1) stops after epoch 4
    assert resumed.stopped_early and len(resumed.history) == 4 and stopper.wait == 3


def test_callbacks_early_stopping_names_the_metrics_it_saw_when_its_own_is_missing():
    trainer = distkit.Trainer("dp", batch_size=4, progress=False,
                              callbacks=[EarlyStopping(monitor="val_acc")])  # fmt: skip
    with pytest.raises(distkit.ConfigurationError, match=r"'val_acc'.*train_loss"):
        _fit(trainer)


def _early_stop_on_ranks() -> dict:
    stopper = EarlyStopping(monitor="val_loss", mode="max", patience=1)  # loss falls: stops
    trainer = distkit.Trainer("ddp", batch_size=4, max_epochs=5, progress=False,
                              val_every_n_steps=2, callbacks=[stopper])  # fmt: skip
    result = _fit(trainer, val_data=make_dataset(11))
    return {"step": trainer.global_step, "stopped": result.stopped_early,
            "validations": result.validations}  # fmt: skip


def test_callbacks_early_stopping_stops_every_rank_after_the_same_step(run_on_ranks):
    ranks = run_on_ranks(_early_stop_on_ranks, world_size=2)
    assert ranks[0] == ranks[1]
    # 3 steps per epoch: checks at step 2 (the best) and at the epoch's end, step 3 (worse)
    assert ranks[0]["stopped"] and ranks[0]["step"] == 3
    assert [v["step"] for v in ranks[0]["validations"]] == [2, 3]


class Counter(Callback):
    def __init__(self, state: object = None) -> None:
        self.count = 0
        self.bad = state

    def on_train_step_end(self, trainer, logs):
        self.count += 1

    def state_dict(self):
        return {"count": self.count} if self.bad is None else {"thing": self.bad}

    def load_state_dict(self, state):
        self.count = state["count"]


def test_callbacks_state_goes_into_checkpoints_and_back(tmp_path):
    counter = Counter()
    trainer = distkit.Trainer("dp", batch_size=4, progress=False, callbacks=[counter])
    _fit(trainer)
    trainer.save_checkpoint(tmp_path / "c.pt")
    assert distkit.checkpoint.load(tmp_path / "c.pt")["callbacks"] == {"Counter": {"count": 6}}
    again = Counter()
    other = distkit.Trainer("dp", batch_size=4, max_epochs=2, progress=False,
                            resume=tmp_path / "c.pt", callbacks=[again])  # fmt: skip
    _fit(other)
    assert again.count == 12  # 6 restored + 6 trained


def test_callbacks_state_that_would_not_load_weights_only_is_refused_by_name(tmp_path):
    trainer = distkit.Trainer("dp", batch_size=4, progress=False,
                              callbacks=[Counter(state=object())])  # fmt: skip
    _fit(trainer)
    with pytest.raises(distkit.ConfigurationError, match=r"Counter.state_dict\(\)\['thing'\]"):
        trainer.save_checkpoint(tmp_path / "c.pt")
    assert not (tmp_path / "c.pt").exists()


def test_callbacks_two_of_a_kind_keep_their_own_state(tmp_path):
    first, second = Counter(), Counter()
    trainer = distkit.Trainer("dp", batch_size=4, progress=False, callbacks=[first, second])
    _fit(trainer)
    second.count = 99
    trainer.save_checkpoint(tmp_path / "c.pt")
    assert distkit.checkpoint.load(tmp_path / "c.pt")["callbacks"] == {
        "Counter": {"count": 6}, "Counter#1": {"count": 99},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"callbacks": EarlyStopping()}, "wrap one in a list"),
        ({"callbacks": [EarlyStopping]}, "pass an instance: EarlyStopping(...)"),
        ({"callbacks": [print]}, "not a distkit.Callback"),
        ({"loggers": [object()]}, "not a distkit.loggers.Logger"),
        ({"loggers": distkit.loggers.CSVLogger}, "wrap one in a list"),
        ({"log_every_n_steps": 0}, "log_every_n_steps must be an integer >= 1"),
        ({"val_every_n_steps": 1.5}, "val_every_n_steps must be an integer >= 1"),
    ],
)
def test_callbacks_and_loggers_bad_arguments_say_the_fix(kwargs, words):
    with pytest.raises(distkit.ConfigurationError, match=__import__("re").escape(words)):
        distkit.Trainer("dp", progress=False, **kwargs)


@pytest.mark.parametrize(
    ("factory", "words"),
    [
        (partial(EarlyStopping, mode="mn"), "allowed 'min'"),
        (partial(EarlyStopping, patience=0), "patience must be an integer >= 1"),
        (partial(EarlyStopping, min_delta=-1), "min_delta"),
        (partial(EarlyStopping, monitor=""), "monitor is the name of a metric"),
        (partial(distkit.callbacks.BestCheckpoint, keep=0), "keep must be an integer >= 1"),
    ],
)
def test_callbacks_builtin_bad_arguments_say_the_fix(factory, words):
    with pytest.raises(distkit.ConfigurationError, match=__import__("re").escape(words)):
        factory()


# ---------------------------------------------------------------- state that loads weights-only
class _Colour(enum.IntEnum):
    RED = 1


_Span = collections.namedtuple("_Span", "low high")


@pytest.mark.parametrize(
    ("value", "fix"),
    [
        # np.float64 subclasses float: it once passed the check and failed the save, blaming
        # extra=; np.int64 (no int subclass) got the callback error. Now every one does.
        pytest.param(np.float64(0.5), "store float(value) instead", id="np.float64"),
        pytest.param(np.float32(0.5), "store float(value) instead", id="np.float32"),
        pytest.param(np.int64(3), "store int(value) instead", id="np.int64"),
        pytest.param(np.bool_(True), "store bool(value) instead", id="np.bool_"),
        pytest.param(
            np.arange(3),
            "store value.tolist() (or torch.from_numpy(value)) instead",
            id="np.ndarray",
        ),
        pytest.param(_Colour.RED, "store value.value instead", id="IntEnum"),
        pytest.param(
            _Span(0, 1), "store value._asdict() (or tuple(value)) instead", id="namedtuple"
        ),
        pytest.param(collections.defaultdict(list), "store dict(value) instead", id="defaultdict"),
        pytest.param({1, 2}, "store list(value) instead", id="set"),
        pytest.param(object(), "store its plain values", id="object"),
    ],
)
def test_callbacks_state_that_would_not_load_weights_only_names_the_entry_and_the_fix(
    value, fix, tmp_path
):
    trainer = distkit.Trainer(
        "dp", batch_size=4, progress=False, callbacks=[Counter(state={"scores": [1.0, value]})]
    )
    _fit(trainer)
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    with pytest.raises(distkit.ConfigurationError) as info:
        trainer.save_checkpoint(tmp_path / "c.pt")
    message = str(info.value)
    assert message.startswith("callback Counter.state_dict()['thing']['scores'][1] holds ")
    assert f", a {kind}, which a checkpoint cannot load weights-only" in message
    assert fix in message
    assert not (tmp_path / "c.pt").exists()


def test_callbacks_state_refuses_a_numpy_key_by_name(tmp_path):
    trainer = distkit.Trainer(
        "dp", batch_size=4, progress=False, callbacks=[Counter(state={np.int64(7): 1.0})]
    )
    _fit(trainer)
    with pytest.raises(
        distkit.ConfigurationError,
        match=re.escape("a key of callback Counter.state_dict()['thing'] holds np.int64(7)"),
    ):
        trainer.save_checkpoint(tmp_path / "c.pt")


def test_callbacks_state_of_plain_values_saves_and_loads_back(tmp_path):
    state = {
        "ordered": collections.OrderedDict(a=1),
        "row": (1, 2.5, "x", None, True),
        "shape": torch.Size([2, 3]),
        "weight": nn.Parameter(torch.ones(2)),
        "n": [-1],
    }
    trainer = distkit.Trainer("dp", batch_size=4, progress=False, callbacks=[Counter(state)])
    _fit(trainer)
    trainer.save_checkpoint(tmp_path / "c.pt")
    loaded = distkit.checkpoint.load(tmp_path / "c.pt")["callbacks"]["Counter"]["thing"]
    assert torch.equal(loaded.pop("weight"), torch.ones(2))
    assert loaded == {
        "ordered": {"a": 1},
        "row": (1, 2.5, "x", None, True),
        "shape": torch.Size([2, 3]),
        "n": [-1],
    }


# ---------------------------------------------------------------- BestCheckpoint's folder
class Scripted(distkit.Metric):
    """A metric whose value at each validation is the next of ``values``."""

    def __init__(self, *values: float) -> None:
        self.values = list(values)

    def batch_state(self, output, target):
        return torch.zeros(1)

    def state_shape(self):
        return (1,)

    def compute(self, state):
        return self.values.pop(0)


def _best_run(folder: Path, *scores: float, keep: int = 1) -> tuple[BestCheckpoint, Path | None]:
    """A fresh run into ``folder`` (no resume): one validation per epoch, 2 steps each,
    reporting ``scores`` in turn as val_score (lower is better)."""
    best = BestCheckpoint("val_score", keep=keep)
    trainer = distkit.Trainer(
        "dp",
        batch_size=4,
        max_epochs=len(scores),
        progress=False,
        checkpoint_dir=folder,
        callbacks=[best],
    )
    _fit(trainer, n=8, val_data=make_dataset(8), metrics={"score": Scripted(*scores)})
    return best, best.best_path(trainer)


def _best_files(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.glob("best-*.pt"))


def test_best_checkpoint_keep_holds_across_runs_sharing_the_folder(tmp_path):
    _best_run(tmp_path, 0.5, 0.3)
    assert _best_files(tmp_path) == ["best-val_score=0.3-step-000000004.pt"]
    # a second run that never beats the folder's best saves nothing, and names that file
    best, path = _best_run(tmp_path, 0.4)
    assert _best_files(tmp_path) == ["best-val_score=0.3-step-000000004.pt"]
    assert best.best_score == 0.3 and path == tmp_path / "best-val_score=0.3-step-000000004.pt"
    # one that beats it replaces it: keep=1 leaves one file, whichever run wrote it
    best, path = _best_run(tmp_path, 0.4, 0.2)
    assert _best_files(tmp_path) == ["best-val_score=0.2-step-000000004.pt"]
    assert best.best_score == 0.2 and path is not None and path.exists()
    assert distkit.checkpoint.load(path)["extra"]["val_score"] == 0.2


def test_best_checkpoint_ranks_the_folder_by_the_values_in_the_names(tmp_path):
    _best_run(tmp_path, 0.5, 0.3, keep=2)
    assert _best_files(tmp_path) == [
        "best-val_score=0.3-step-000000004.pt",
        "best-val_score=0.5-step-000000002.pt",
    ]
    best, _ = _best_run(tmp_path, 0.4, keep=2)  # beats 0.5, the folder's second best
    assert _best_files(tmp_path) == [
        "best-val_score=0.3-step-000000004.pt",
        "best-val_score=0.4-step-000000002.pt",
    ]
    assert [name for _, name in best.kept] == _best_files(tmp_path)


def test_best_checkpoint_never_touches_files_whose_score_it_cannot_read(tmp_path):
    untouchable = [
        "best-val_score=final-step-000000001.pt",  # renamed by hand: no value
        "best-val_score_ema=0.01-step-000000001.pt",  # another monitor
        "best-val_score=nan-step-000000001.pt",  # never ranked (a NaN is never the best)
        "best-val_score=0.3.pt",  # not the pattern
    ]
    for name in [*untouchable, "best-val_score=0.9-step-000000001.pt"]:
        (tmp_path / name).write_bytes(b"never loaded")
    _best_run(tmp_path, 0.5)  # beats the 0.9 file of an earlier run: that one goes
    assert _best_files(tmp_path) == sorted([*untouchable, "best-val_score=0.5-step-000000002.pt"])


def test_best_checkpoint_an_equal_value_in_the_name_is_no_improvement(tmp_path):
    (tmp_path / "best-val_score=0.3-step-000000009.pt").write_bytes(b"never loaded")
    best, path = _best_run(tmp_path, 0.3000001)  # 0.3 to the name's 6 digits
    assert _best_files(tmp_path) == ["best-val_score=0.3-step-000000009.pt"]
    assert best.best_score == 0.3 and path == tmp_path / "best-val_score=0.3-step-000000009.pt"


def _best_with_folders_of_their_own(root: str) -> dict:
    rank = int(os.environ["RANK"])
    folder = Path(root) / f"rank{rank}"
    folder.mkdir()
    if rank == 0:  # only rank 0's folder holds an earlier run's better file
        (folder / "best-val_score=0.1-step-000000009.pt").write_bytes(b"never loaded")
    best = BestCheckpoint("val_score")
    trainer = distkit.Trainer(
        "ddp", batch_size=2, max_epochs=2, progress=False, checkpoint_dir=folder, callbacks=[best]
    )
    _fit(trainer, n=8, val_data=make_dataset(8), metrics={"score": Scripted(0.5, 0.3)})
    return {"best": best.best_score, "files": _best_files(folder)}


def test_best_checkpoint_ranks_decide_on_rank_zeros_folder(run_on_ranks, tmp_path):
    # were each rank to read its own folder, rank 1 alone would save (a collective): a hang
    ranks = run_on_ranks(_best_with_folders_of_their_own, str(tmp_path), world_size=2)
    assert ranks == [
        {"best": 0.1, "files": ["best-val_score=0.1-step-000000009.pt"]},
        {"best": 0.1, "files": []},
    ]


# ---------------------------------------------------------------- a monitor nothing reports
@pytest.mark.parametrize(
    "make",
    [partial(BestCheckpoint, "val_los"), partial(EarlyStopping, "val_los")],
    ids=["BestCheckpoint", "EarlyStopping"],
)
def test_callbacks_misspelled_monitor_fails_at_the_first_validation_of_a_stream(make, tmp_path):
    # a stream with max_steps never ends an epoch: the epoch-end check never comes
    callback = make()
    trainer = distkit.Trainer(
        "dp",
        batch_size=4,
        max_steps=6,
        progress=False,
        val_every_n_steps=2,
        checkpoint_dir=tmp_path,
        callbacks=[callback],
    )
    with pytest.raises(distkit.ConfigurationError) as info:
        _fit(
            trainer,
            train_data=SampleStream(400, dtype=torch.float32),
            val_data=make_dataset(8),
            metrics={"acc": distkit.Accuracy()},
        )
    assert str(info.value).startswith(
        f"{type(callback).__name__} monitors 'val_los', which the validation at step 2 did not "
        "report; it reported: val_acc, val_loss. Monitor one of these"
    )
    assert trainer.global_step == 2 and not list(tmp_path.glob("best-*.pt"))


def _misspelled_on_ranks() -> tuple[str, str, int]:
    trainer = distkit.Trainer(
        "ddp",
        batch_size=4,
        max_epochs=1,
        progress=False,
        val_every_n_steps=2,
        callbacks=[EarlyStopping("val_accuracy")],
    )
    try:
        _fit(trainer, val_data=make_dataset(8), metrics={"acc": distkit.Accuracy()})
    except Exception as exc:
        return type(exc).__name__, str(exc), trainer.global_step
    return "no error", "", trainer.global_step


def test_callbacks_misspelled_monitor_fails_on_every_rank_alike(run_on_ranks):
    ranks = run_on_ranks(_misspelled_on_ranks, world_size=2)  # 3 steps an epoch: 2 < 3
    assert ranks[0] == ranks[1]
    assert ranks[0][0] == "ConfigurationError" and ranks[0][2] == 2
    assert "'val_accuracy'" in ranks[0][1] and "reported: val_acc, val_loss" in ranks[0][1]


def _fit_stream(callback: Callback, folder: Path, **fit_kwargs) -> distkit.FitResult:
    trainer = distkit.Trainer(
        "dp",
        batch_size=4,
        max_steps=4,
        progress=False,
        val_every_n_steps=2 if "val_data" in fit_kwargs else None,
        checkpoint_dir=folder,
        callbacks=[callback],
    )
    return _fit(trainer, train_data=SampleStream(400, dtype=torch.float32), **fit_kwargs)


def test_callbacks_monitor_never_reported_warns_at_fit_end(tmp_path):
    # without val_data nothing is ever reported: the name may be right, so no error
    with pytest.warns(
        UserWarning,
        match=re.escape(
            "BestCheckpoint monitors 'val_loss', which was never reported: fit ended at step 4 "
            "without BestCheckpoint acting once. Reported: nothing"
        ),
    ):
        result = _fit_stream(BestCheckpoint(), tmp_path)
    assert result.history == [] and not list(tmp_path.glob("best-*.pt"))
    # an epoch-record name under a stream: the validations' names are listed
    with pytest.warns(
        UserWarning,
        match=r"'train_loss', which was never reported.*"
        r"Reported: val_loss \(an epoch record's names",
    ):
        _fit_stream(EarlyStopping("train_loss"), tmp_path, val_data=make_dataset(8))


def test_callbacks_monitor_is_quiet_when_the_fit_trains_nothing(tmp_path):
    trainer = distkit.Trainer(
        "dp", batch_size=4, max_epochs=0, progress=False, callbacks=[EarlyStopping()]
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _fit(trainer)
    assert not [w for w in caught if "never reported" in str(w.message)]


def test_best_checkpoint_removes_the_temp_file_a_killed_save_left(tmp_path):
    """A save killed mid-write leaves ``.best-...pt.<hex>.tmp``, as big as the model; the
    next best save removes it once it is stale (no live writer touched it for 10 minutes),
    and leaves a fresh one (maybe another run's save in progress) alone."""
    tmp_path.mkdir(exist_ok=True)
    killed = tmp_path / ".best-val_loss=0.9-step-000000002.pt.0123456789ab.tmp"
    live = tmp_path / ".best-val_loss=0.8-step-000000004.pt.ba9876543210.tmp"
    other = tmp_path / ".notes.txt.0123456789ab.tmp"  # not a BestCheckpoint's
    for path in (killed, live, other):
        path.write_bytes(b"x" * 1000)
    old = time.time() - 3600
    for path in (killed, other):
        os.utime(path, (old, old))
    trainer = distkit.Trainer("dp", batch_size=4, max_epochs=1, progress=False,
                              checkpoint_dir=tmp_path, callbacks=[BestCheckpoint()])  # fmt: skip
    _fit(trainer, val_data=make_dataset(8))
    assert not killed.exists()
    assert live.exists() and other.exists()
    assert any(p.name.startswith("best-val_loss=") for p in tmp_path.iterdir())


class ZeroedForValidation(Callback):
    """Validates with the last layer zeroed (logits all 0), then puts the weights back: a
    stand-in for a callback that swaps averaged (EMA) weights in around validation."""

    stops_training = False

    def __init__(self) -> None:
        self.kept: list[torch.Tensor] = []
        self.order: list[str] = []

    def on_validation_start(self, trainer):
        self.order.append("start")
        layer = trainer.model[-1]
        self.kept = [layer.weight.detach().clone(), layer.bias.detach().clone()]
        with torch.no_grad():
            layer.weight.zero_()
            layer.bias.zero_()

    def on_validation_end(self, trainer, metrics):
        self.order.append("end")
        layer = trainer.model[-1]
        with torch.no_grad():
            layer.weight.copy_(self.kept[0])
            layer.bias.copy_(self.kept[1])


def test_callbacks_on_validation_start_runs_before_each_validation_on_its_weights():
    swapper = ZeroedForValidation()
    with_swap = distkit.Trainer("dp", batch_size=4, max_epochs=2, progress=False,
                                val_every_n_steps=4, callbacks=[swapper])  # fmt: skip
    torch.manual_seed(0)
    result = _fit(with_swap, n=24, val_data=make_dataset(10))
    plain = distkit.Trainer("dp", batch_size=4, max_epochs=2, progress=False,
                            val_every_n_steps=4)  # fmt: skip
    torch.manual_seed(0)
    reference = _fit(plain, n=24, val_data=make_dataset(10))
    assert swapper.order == ["start", "end"] * 4  # validations at steps 4, 6, 8 and 12
    classes = make_mlp()[-1].out_features
    # every validation saw the zeroed layer: uniform predictions, loss = log(classes)
    assert all(v["val_loss"] == pytest.approx(math.log(classes)) for v in result.validations)
    # and training went on with the weights it had: the same as without the callback
    assert [h["train_loss"] for h in result.history] == [h["train_loss"] for h in reference.history]
    for mine, theirs in zip(with_swap.model.parameters(), plain.model.parameters(), strict=True):
        assert torch.equal(mine, theirs)
