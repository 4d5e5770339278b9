"""Loggers and the built-in callbacks inside fit: rank 0 writes, no per-step host sync,
BestCheckpoint files, LearningRateMonitor rows."""

from __future__ import annotations

import csv
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import distkit
from distkit.callbacks import BestCheckpoint, LearningRateMonitor
from distkit.loggers import CSVLogger, Logger
from distkit.trainer import _logging
from tests.support.workloads import make_dataset, make_mlp

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


# ---------------------------------------------------------------- loggers that fail (issue 23)
class Flaky(Logger):
    """A tracker that raises ``errors[i]`` at its i-th call (None: the call works)."""

    def __init__(self, *errors: BaseException | None, hyperparams_error=None, finalize_error=None):
        self.errors = list(errors)
        self.hyperparams_error, self.finalize_error = hyperparams_error, finalize_error
        self.calls = 0
        self.rows: list[tuple[int, dict]] = []
        self.params: dict = {}
        self.statuses: list[str] = []

    def log_hyperparams(self, params):
        if self.hyperparams_error is not None:
            raise self.hyperparams_error
        self.params = dict(params)

    def log_metrics(self, metrics, step):
        self.calls += 1
        error = self.errors[self.calls - 1] if self.calls <= len(self.errors) else None
        if error is not None:
            raise error
        self.rows.append((step, dict(metrics)))

    def finalize(self, status):
        self.statuses.append(status)
        if self.finalize_error is not None:
            raise self.finalize_error


def _logger_warnings(record) -> list[str]:
    return [str(w.message) for w in record if str(w.message).startswith("loggers[")]


def _weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _fit_model(trainer: distkit.Trainer, **kwargs) -> tuple[nn.Module, distkit.FitResult]:
    model = make_mlp()
    result = trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), make_dataset(24),
                         loss_fn=nn.functional.cross_entropy, **kwargs)  # fmt: skip
    return model, result


def _trainer(*loggers: Logger, **kwargs) -> distkit.Trainer:
    kwargs = {"batch_size": 4, "max_epochs": 2, "progress": False, "log_every_n_steps": 1, **kwargs}
    return distkit.Trainer("dp", loggers=list(loggers), **kwargs)


def _row_steps(epochs: int = 2) -> list[int]:
    """The step of each log_metrics call of a _trainer fit: a row per step (6 an epoch), then
    the epoch's own row at its last step."""
    return [
        step
        for epoch in range(epochs)
        for step in [*range(6 * epoch + 1, 6 * epoch + 7), 6 * epoch + 6]
    ]


def test_logging_a_raising_logger_is_reported_once_and_retried_and_training_goes_on():
    down = ConnectionError("tracker down")
    flaky, memory = Flaky(down, down, None, down), Memory()
    with pytest.warns(UserWarning) as record:
        model, result = _fit_model(_trainer(flaky, memory))
    bare, bare_result = _fit_model(_trainer())

    assert torch.equal(_weights(model), _weights(bare))
    losses = [record["train_loss"] for record in result.history]
    assert losses == [record["train_loss"] for record in bare_result.history]
    steps = _row_steps()
    assert [step for step, _ in memory.rows] == steps
    assert [step for step, _ in flaky.rows] == [3, *steps[4:]]  # the rows of 1, 2 and 4 are lost
    assert flaky.statuses == ["success"] and memory.status == "success"
    [warning] = _logger_warnings(record)  # three failures of one kind: one report
    assert warning.startswith(
        "loggers[0] (Flaky) failed in log_metrics at step 1: ConnectionError: tracker down; "
        "training goes on; distkit calls it again at the next log point and stops calling it "
        "after 10 failures in a row"
    )
    assert "set strict=True on it" in warning


def test_logging_each_kind_of_error_is_reported_once():
    flaky = Flaky(ConnectionError("refused"), TimeoutError("slow"), ConnectionError("reset"))
    with pytest.warns(UserWarning) as record:
        _fit_model(_trainer(flaky))
    warnings = _logger_warnings(record)
    assert [w.split(";")[0] for w in warnings] == [
        "loggers[0] (Flaky) failed in log_metrics at step 1: ConnectionError: refused",
        "loggers[0] (Flaky) failed in log_metrics at step 2: TimeoutError: slow",
    ]


def test_logging_a_logger_failing_every_call_is_disabled_after_the_bound_and_still_finalized():
    always = Flaky(*[OSError("no route")] * 100)
    memory = Memory()
    with pytest.warns(UserWarning) as record:
        model, _ = _fit_model(_trainer(always, memory))
    bare, _ = _fit_model(_trainer())

    assert torch.equal(_weights(model), _weights(bare))
    assert always.calls == _logging.MAX_FAILURES == 10  # then never called again in this fit
    assert always.statuses == ["success"]  # a disabled logger still gets the final status
    assert [step for step, _ in memory.rows] == _row_steps()
    first, disabled = _logger_warnings(record)
    assert first.startswith("loggers[0] (Flaky) failed in log_metrics at step 1: OSError")
    assert disabled.startswith(
        "loggers[0] (Flaky) failed 10 times in a row (the last in log_metrics at step 9: "
        "OSError: no route); distkit stops calling it for the rest of this fit"
    )


def test_logging_a_call_that_works_resets_the_count_of_failures_in_a_row():
    down = ConnectionError("down")
    flaky = Flaky(*[down] * 9, None, *[down] * 9)  # never 10 in a row
    with pytest.warns(UserWarning) as record:
        _fit_model(_trainer(flaky, max_epochs=4))  # 28 log_metrics calls
    steps = _row_steps(4)
    assert flaky.calls == len(steps) == 28
    assert [step for step, _ in flaky.rows] == [steps[9], *steps[19:]]
    assert len(_logger_warnings(record)) == 1


def test_logging_a_failing_log_hyperparams_is_reported_and_metrics_still_arrive():
    flaky = Flaky(hyperparams_error=PermissionError("read-only project"))
    with pytest.warns(UserWarning) as record:
        _fit_model(_trainer(flaky))
    [warning] = _logger_warnings(record)
    assert warning.startswith(
        "loggers[0] (Flaky) failed in log_hyperparams: PermissionError: read-only project"
    )
    assert [step for step, _ in flaky.rows] == _row_steps() and flaky.statuses == ["success"]


def test_logging_a_failing_finalize_after_success_is_reported_and_the_result_stands():
    flaky = Flaky(finalize_error=OSError("flush failed"))
    with pytest.warns(UserWarning) as record:
        _, result = _fit_model(_trainer(flaky, Memory()))
    assert len(result.history) == 2
    [warning] = _logger_warnings(record)
    assert warning.startswith(
        "loggers[0] (Flaky) failed in finalize('success'): OSError: flush failed; "
        "the fit's result stands"
    )


class StrictFlaky(Flaky):
    strict = True


def test_logging_a_strict_logger_ends_the_fit_and_every_logger_hears_failed():
    strict, memory = StrictFlaky(None, None, ConnectionError("tracker down")), Memory()
    trainer = _trainer(strict, memory)
    with pytest.raises(ConnectionError, match="tracker down"):
        _fit_model(trainer)
    assert trainer.global_step == 3  # the third log point raised
    assert [step for step, _ in memory.rows] == [1, 2, 3]  # the row still reached the others
    assert strict.statuses == ["failed"] and memory.status == "failed"


def test_logging_strict_set_per_instance_or_through_the_base_init(tmp_path):
    class Forwarding(Flaky):
        def __init__(self, *errors, strict):
            Logger.__init__(self, strict=strict)
            super().__init__(*errors)

    per_instance = Flaky(ConnectionError("down"))
    per_instance.strict = True
    for logger in (per_instance, Forwarding(ConnectionError("down"), strict=True)):
        with pytest.raises(ConnectionError, match="down"):
            _fit_model(_trainer(logger))
    # the built-in loggers take it too: a CSV file that cannot be written ends the fit
    csv_logger = CSVLogger(tmp_path, strict=True)
    csv_logger.path.mkdir()  # made a folder after the logger was built
    with pytest.raises(IsADirectoryError):
        _fit_model(_trainer(csv_logger))


def test_logging_a_strict_attribute_that_is_not_a_bool_is_refused_by_the_trainer():
    flaky = Flaky()
    flaky.strict = "yes"  # type: ignore[assignment]
    with pytest.raises(distkit.ConfigurationError) as info:
        _trainer(flaky)
    assert "loggers[0] (Flaky) has strict='yes' (str); it must be True" in str(info.value)
    assert "set logger.strict = True or False" in str(info.value)


def test_logging_a_bad_value_is_refused_even_with_a_best_effort_logger():
    # a value distkit cannot log is the caller's error, not the logger's: raised, not reported
    flaky = Flaky()
    trainer = _trainer(flaky, callbacks=[LogsAString()])
    with pytest.raises(distkit.ConfigurationError, match="metric 'note' is a str"):
        _fit_model(trainer)
    assert flaky.statuses == ["failed"]


class Boom(distkit.Callback):
    """The fit's real error, at step 2 (a full disk's CheckpointError in the issue)."""

    stops_training = False

    def on_train_step_end(self, trainer, logs):
        if logs["step"] == 2:
            trainer.log_metrics({"disk_free": 0})  # a pending row: written by finalize("failed")
            raise distkit.checkpoint.CheckpointError("no space left on device writing step-2.pt")


@pytest.mark.parametrize("strict", [False, True])
def test_logging_a_logger_failing_while_the_fit_fails_never_replaces_the_real_error(strict):
    broken = StrictFlaky() if strict else Flaky()
    broken.errors = [None, OSError("disk full")]  # the pending row, written by finalize
    broken.finalize_error = OSError("cannot close")
    memory = Memory()
    real_error = pytest.raises(distkit.checkpoint.CheckpointError, match="no space left")
    with pytest.warns(UserWarning) as record, real_error:
        _fit_model(_trainer(broken, memory, callbacks=[Boom()]))
    assert broken.statuses == ["failed"] and memory.status == "failed"
    assert memory.rows == [(1, pytest.approx(memory.rows[0][1])), (2, {"disk_free": 0})]
    assert broken.calls == 2 and len(broken.rows) == 1
    assert [w.split(";")[0] for w in _logger_warnings(record)] == [
        f"loggers[0] ({type(broken).__name__}) failed in log_metrics at step 2: OSError: disk full",
    ]  # one kind of error (OSError): reported once, though finalize failed too


def test_logging_warnings_made_errors_never_replace_the_real_error():
    broken = Flaky(finalize_error=OSError("cannot close"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # python -W error
        with pytest.raises(distkit.checkpoint.CheckpointError, match="no space left"):
            _fit_model(_trainer(broken, callbacks=[Boom()]))
    assert broken.statuses == ["failed"]


def _two_ranks_with_a_raising_logger() -> tuple[list[float], list[float], list[str], int]:
    def fit(*loggers: Logger) -> list[float]:
        trainer = distkit.Trainer("ddp", batch_size=4, max_epochs=3, progress=False,
                                  log_every_n_steps=1, loggers=list(loggers))  # fmt: skip
        model, _ = _fit_model(trainer)
        trainer.close()
        return _weights(model).tolist()

    always = Flaky(*[ConnectionError("tracker down")] * 100)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        logged = fit(always)
    bare = fit()
    return logged, bare, _logger_warnings(record), always.calls


def test_logging_a_raising_logger_on_rank_zero_does_not_stop_a_two_rank_ddp_fit(run_on_ranks):
    rank0, rank1 = run_on_ranks(_two_ranks_with_a_raising_logger, world_size=2)
    logged, bare, reports, calls = rank0
    assert logged == bare and rank1[:2] == (bare, bare)  # every rank, bit for bit
    assert calls == 10 and len(reports) == 2  # rank 0: reported, then disabled
    assert reports[1].startswith("loggers[0] (Flaky) failed 10 times in a row")
    assert rank1[2:] == ([], 0)  # the other rank calls no logger and reports nothing
