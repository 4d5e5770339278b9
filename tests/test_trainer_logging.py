"""Loggers and the built-in callbacks inside fit: rank 0 writes, no per-step host sync,
BestCheckpoint files, LearningRateMonitor rows."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from torch import nn

import distkit
from distkit.callbacks import BestCheckpoint, LearningRateMonitor
from distkit.loggers import CSVLogger, Logger
from tests.workloads import make_dataset, make_mlp

pytestmark = pytest.mark.timeout(300)


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path, newline="") as handle:
        return list(csv.DictReader(handle))


def _fit(trainer: distkit.Trainer, *, n: int = 24, groups: int = 1, **kwargs):
    model = make_mlp()
    params = list(model.parameters())
    if groups == 1:
        optimizer = torch.optim.SGD(params, lr=0.1)
    else:
        optimizer = torch.optim.SGD([{"params": params[:2]}, {"params": params[2:], "lr": 0.01}],
                                    lr=0.1)  # fmt: skip
    return trainer.fit(model, optimizer, make_dataset(n), loss_fn=nn.functional.cross_entropy,
                       **kwargs)  # fmt: skip


def test_logging_csv_has_a_row_per_log_point_and_per_epoch(tmp_path):
    trainer = distkit.Trainer("dp", batch_size=4, max_epochs=2, progress=False,
                              log_every_n_steps=4, gradient_clip_norm=1.0,
                              loggers=[CSVLogger(tmp_path)])  # fmt: skip
    result = _fit(trainer, val_data=make_dataset(8))  # 6 steps per epoch
    rows = _rows(tmp_path / "metrics.csv")
    # log points 4, 8, 12; the epochs' rows at steps 6 and 12 (after the step's own row)
    assert [int(r["step"]) for r in rows] == [4, 6, 8, 12, 12]
    assert rows[0]["train_loss"] and rows[0]["grad_norm"] and rows[0]["lr"] == "0.1"
    assert rows[0]["val_loss"] == "" and rows[0]["samples_per_s"] == ""
    for row, record in zip((rows[1], rows[4]), result.history, strict=True):
        assert float(row["val_loss"]) == pytest.approx(record["val_loss"])
        assert float(row["train_loss"]) == pytest.approx(record["train_loss"])
        assert float(row["samples_per_s"]) > 0
    assert "time_forward" not in rows[0]  # timings stay in the epoch report


class Memory(Logger):
    """A whole logger in a few lines: the base is enough for an MLflow or W&B adapter."""

    def __init__(self) -> None:
        self.rows: list[tuple[int, dict]] = []
        self.params: dict = {}
        self.status = ""

    def log_hyperparams(self, params):
        self.params = dict(params)

    def log_metrics(self, metrics, step):
        self.rows.append((step, dict(metrics)))

    def finalize(self, status):
        self.status = status


def test_logging_train_loss_at_a_log_point_is_the_mean_since_the_last_one():
    memory = Memory()
    steps = []

    class Losses(distkit.Callback):
        stops_training = False

        def on_train_step_end(self, trainer, logs):
            steps.append(logs["loss"])

    trainer = distkit.Trainer("dp", batch_size=4, progress=False, log_every_n_steps=3,
                              loggers=[memory], callbacks=[Losses()])  # fmt: skip
    _fit(trainer)
    logged = [m["train_loss"] for step, m in memory.rows if step in (3, 6) and "lr" in m]
    assert logged == pytest.approx([sum(steps[:3]) / 3, sum(steps[3:6]) / 3], rel=1e-9)
    assert memory.params["strategy"] == "dp" and memory.params["batch_size"] == 4
    assert memory.status == "success"


def test_logging_a_failed_fit_finalizes_its_loggers_as_failed():
    memory = Memory()
    trainer = distkit.Trainer("dp", batch_size=4, progress=False, loggers=[memory])

    def boom(model, batch):
        raise OSError("disk gone")

    model = make_mlp()
    with pytest.raises(OSError, match="disk gone"):
        trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), make_dataset(8),
                    step_fn=boom)  # fmt: skip
    assert memory.status == "failed"


def test_logging_adds_no_host_synchronisation_per_step(monkeypatch):
    """Loggers and a monitor between log points: no more .item()/.tolist() than without."""

    def count_syncs(**kwargs) -> int:
        calls = 0
        real_item, real_tolist = torch.Tensor.item, torch.Tensor.tolist

        def item(self):
            nonlocal calls
            calls += 1
            return real_item(self)

        def tolist(self):
            nonlocal calls
            calls += 1
            return real_tolist(self)

        with monkeypatch.context() as patch:
            patch.setattr(torch.Tensor, "item", item)
            patch.setattr(torch.Tensor, "tolist", tolist)
            trainer = distkit.Trainer("dp", batch_size=4, max_epochs=2, progress=False,
                                      log_every_n_steps=1000, **kwargs)  # fmt: skip
            _fit(trainer, n=64)
        return calls

    bare = count_syncs()
    logged = count_syncs(loggers=[Memory()], callbacks=[LearningRateMonitor()])
    assert logged == bare, (bare, logged)


def _two_ranks_log(root: str) -> list[str]:
    folder = Path(root) / f"rank{int(__import__('os').environ['RANK'])}"
    trainer = distkit.Trainer("ddp", batch_size=4, progress=False, log_every_n_steps=2,
                              loggers=[CSVLogger(folder)])  # fmt: skip
    _fit(trainer)
    return sorted(p.name for p in folder.glob("*")) if folder.exists() else []


def test_logging_only_rank_zero_writes(run_on_ranks, tmp_path):
    assert run_on_ranks(_two_ranks_log, str(tmp_path), world_size=2) == [["metrics.csv"], []]
    rows = _rows(tmp_path / "rank0" / "metrics.csv")
    assert [int(r["step"]) for r in rows] == [2, 3]  # a log point; the epoch (3 steps)


def test_logging_lr_monitor_logs_every_group(tmp_path):
    trainer = distkit.Trainer("dp", batch_size=4, progress=False, log_every_n_steps=2,
                              loggers=[CSVLogger(tmp_path)],
                              callbacks=[LearningRateMonitor()])  # fmt: skip
    _fit(trainer, groups=2)
    rows = _rows(tmp_path / "metrics.csv")
    assert rows[0]["step"] == "1" and rows[0]["lr-group0"] == "0.1"
    assert rows[0]["lr-group1"] == "0.01"


def test_best_checkpoint_keeps_the_best_files_with_their_metric(tmp_path):
    best = BestCheckpoint(monitor="val_acc", mode="max", keep=2)
    trainer = distkit.Trainer("dp", batch_size=4, max_epochs=4, progress=False,
                              checkpoint_dir=tmp_path, val_every_n_steps=2,
                              callbacks=[best])  # fmt: skip
    result = _fit(trainer, val_data=make_dataset(30, seed=2), metrics={"acc": distkit.Accuracy()})
    files = sorted(p.name for p in tmp_path.glob("best-*.pt"))
    assert len(files) == 2
    values = sorted((v["val_acc"] for v in result.validations), reverse=True)
    kept = [distkit.checkpoint.load(tmp_path / name)["extra"] for name in files]
    assert sorted((k["val_acc"] for k in kept), reverse=True) == values[:2]
    assert all(k["monitor"] == "val_acc" for k in kept)
    assert best.best_score == values[0] and best.best_path(trainer).name in files
    # the regular checkpoints are untouched: resume="auto" still takes the latest step
    assert [p.name for p in trainer.checkpoints.checkpoints()][-1] == "step-000000024.pt"


def test_best_checkpoint_needs_a_checkpoint_dir_before_training():
    trainer = distkit.Trainer("dp", batch_size=4, progress=False, callbacks=[BestCheckpoint()])
    with pytest.raises(distkit.ConfigurationError, match=r"pass Trainer\(checkpoint_dir=\.\.\.\)"):
        _fit(trainer, val_data=make_dataset(8))
    assert trainer.global_step == 0


class LogsAString(distkit.Callback):
    stops_training = False

    def on_train_step_end(self, trainer, logs):
        trainer.log_metrics({"note": "hello"})


def test_logging_a_value_that_is_not_a_number_is_refused_by_name(tmp_path):
    trainer = distkit.Trainer("dp", batch_size=4, progress=False,
                              loggers=[CSVLogger(tmp_path)], callbacks=[LogsAString()])  # fmt: skip
    with pytest.raises(distkit.ConfigurationError, match="metric 'note' is a str"):
        _fit(trainer)


class NanMetric(distkit.Metric):
    """A metric that is always NaN (a diverged model's score)."""

    def batch_state(self, output, target):
        return torch.zeros(1)

    def compute(self, state):
        return float("nan")

    def state_shape(self):
        return (1,)


def test_best_checkpoint_never_keeps_a_nan_metric(tmp_path):
    model = make_mlp()
    trainer = distkit.Trainer("dp", batch_size=4, max_epochs=2, progress=False,
                              checkpoint_dir=tmp_path,
                              callbacks=[BestCheckpoint("val_nan", mode="max")])  # fmt: skip
    result = trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), make_dataset(8),
                         loss_fn=nn.functional.cross_entropy, val_data=make_dataset(8),
                         metrics={"nan": NanMetric()})  # fmt: skip
    assert len(result.validations) == 2 and not list(tmp_path.glob("best-*.pt"))


class CtrlC(distkit.Callback):
    """Ctrl-C while training: the KeyboardInterrupt a terminal's SIGINT raises, at step 2."""

    def __init__(self) -> None:
        self.seen: list[BaseException] = []

    def on_train_step_end(self, trainer, logs):
        if logs["step"] == 2:
            raise KeyboardInterrupt

    def on_exception(self, trainer, exc):
        self.seen.append(exc)


def test_logging_ctrl_c_finalizes_loggers_as_interrupted_and_tells_callbacks():
    memory, ctrl_c = Memory(), CtrlC()
    trainer = distkit.Trainer("dp", batch_size=4, progress=False, loggers=[memory],
                              callbacks=[ctrl_c])  # fmt: skip
    with pytest.raises(KeyboardInterrupt) as info:
        _fit(trainer)
    assert memory.status == "interrupted"
    assert ctrl_c.seen == [info.value]
