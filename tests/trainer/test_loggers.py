"""Loggers: the CSV file's exact content, TensorBoard events read back, and the Logger base."""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
import torch

import distkit.loggers
from distkit.errors import ConfigurationError, DistkitError, MissingDependencyError
from distkit.loggers import CSVLogger, Logger, TensorBoardLogger
from tests.support.paths import ROOT

pytestmark = pytest.mark.timeout(60)


def _rows(path: Path) -> list[list[str]]:
    with open(path, newline="", encoding="utf-8") as handle:
        return list(csv.reader(handle))


# --- CSVLogger -----------------------------------------------------------------------------


def test_csv_logger_writes_step_then_names_in_first_seen_order(tmp_path):
    logger = CSVLogger(tmp_path)

    logger.log_metrics({"train_loss": 0.5, "lr": 0.1}, step=1)
    logger.log_metrics({"lr": 0.05, "train_loss": 0.25}, step=2)
    logger.finalize("success")

    assert logger.path == tmp_path / "metrics.csv"
    assert logger.save_dir == tmp_path
    assert logger.path.read_text() == "step,train_loss,lr\n1,0.5,0.1\n2,0.25,0.05\n"


def test_csv_logger_creates_nothing_until_the_first_write(tmp_path):
    save_dir = tmp_path / "runs" / "exp1"
    logger = CSVLogger(save_dir, filename="train.csv")
    logger.finalize("success")  # a rank that never writes closes nothing and creates nothing

    assert not (tmp_path / "runs").exists()
    logger.log_metrics({"train_loss": 1.0}, step=1)
    assert os.listdir(save_dir) == ["train.csv"]


def test_csv_logger_flushes_each_row_before_finalize(tmp_path):
    logger = CSVLogger(tmp_path)

    logger.log_metrics({"train_loss": 1.0}, step=1)
    logger.log_metrics({"train_loss": 0.5}, step=2)

    assert _rows(logger.path) == [["step", "train_loss"], ["1", "1.0"], ["2", "0.5"]]
    logger.finalize("failed")


def test_csv_logger_new_name_widens_header_and_leaves_earlier_cells_empty(tmp_path):
    logger = CSVLogger(tmp_path)

    logger.log_metrics({"train_loss": 1.0, "epoch": 0}, step=1)
    logger.log_metrics({"train_loss": 0.5, "val_loss": 0.75, "val_acc": 0.5}, step=2)
    logger.log_metrics({"train_loss": 0.25}, step=3)
    logger.finalize("success")

    assert _rows(logger.path) == [
        ["step", "train_loss", "epoch", "val_loss", "val_acc"],
        ["1", "1.0", "0", "", ""],
        ["2", "0.5", "", "0.75", "0.5"],
        ["3", "0.25", "", "", ""],
    ]
    assert os.listdir(tmp_path) == ["metrics.csv"]  # the rewrite's temp file is gone


def test_csv_logger_failed_rewrite_keeps_the_old_file_and_no_temp_file(tmp_path, monkeypatch):
    logger = CSVLogger(tmp_path)
    logger.log_metrics({"train_loss": 1.0}, step=1)
    before = logger.path.read_text()

    def refuse(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        logger.log_metrics({"train_loss": 0.5, "val_loss": 0.75}, step=2)

    assert logger.path.read_text() == before
    assert os.listdir(tmp_path) == ["metrics.csv"]


def test_csv_logger_resumed_run_continues_the_file_and_drops_repeated_steps(tmp_path):
    first = CSVLogger(tmp_path)
    for step in range(1, 6):
        first.log_metrics({"train_loss": 1.0 / step}, step=step)
    first.finalize("interrupted")

    resumed = CSVLogger(tmp_path)  # resumed from the checkpoint of step 3
    resumed.log_metrics({"train_loss": 0.3, "val_loss": 0.4}, step=4)
    resumed.log_metrics({"train_loss": 0.2}, step=5)
    resumed.finalize("success")

    assert _rows(resumed.path) == [
        ["step", "train_loss", "val_loss"],
        ["1", "1.0", ""],
        ["2", "0.5", ""],
        ["3", "0.3333333333333333", ""],
        ["4", "0.3", "0.4"],
        ["5", "0.2", ""],
    ]


def test_csv_logger_resumed_run_appends_without_rewriting_when_nothing_changes(tmp_path):
    path = tmp_path / "metrics.csv"
    path.write_text("step,train_loss\n1,1.0\n2,0.5\n")
    inode = path.stat().st_ino

    logger = CSVLogger(tmp_path)
    logger.log_metrics({"train_loss": 0.25}, step=3)
    logger.finalize("success")

    assert path.read_text() == "step,train_loss\n1,1.0\n2,0.5\n3,0.25\n"
    assert path.stat().st_ino == inode


@pytest.mark.parametrize("cut_off", ["2,0.", "2"])
def test_csv_logger_resumed_run_drops_a_half_written_last_row(tmp_path, cut_off):
    (tmp_path / "metrics.csv").write_text(f"step,train_loss\n1,1.0\n{cut_off}")

    logger = CSVLogger(tmp_path)
    logger.log_metrics({"train_loss": 0.5}, step=2)
    logger.finalize("success")

    assert logger.path.read_text() == "step,train_loss\n1,1.0\n2,0.5\n"


def test_csv_logger_refuses_to_continue_a_file_it_did_not_write(tmp_path):
    (tmp_path / "metrics.csv").write_text("epoch,loss\n1,0.5\n")
    logger = CSVLogger(tmp_path)

    with pytest.raises(ConfigurationError, match="not a CSVLogger file"):
        logger.log_metrics({"train_loss": 0.5}, step=1)
    assert (tmp_path / "metrics.csv").read_text() == "epoch,loss\n1,0.5\n"


def test_csv_logger_converts_tensors_bools_and_numpy_numbers(tmp_path):
    logger = CSVLogger(tmp_path)

    logger.log_metrics(
        {"loss": torch.tensor(0.5), "skipped": True, "acc": np.float32(0.25), "n": np.int64(7)},
        step=np.int64(1),
    )
    logger.finalize("success")

    assert _rows(logger.path)[1] == ["1", "0.5", "1", "0.25", "7"]


def test_csv_logger_writes_nan_and_inf_as_words(tmp_path):
    logger = CSVLogger(tmp_path)

    logger.log_metrics({"a": math.nan, "b": math.inf, "c": -math.inf}, step=1)
    logger.finalize("success")

    assert logger.path.read_text() == "step,a,b,c\n1,nan,inf,-inf\n"


@pytest.mark.parametrize(
    ("value", "type_name"),
    [("0.5", "str"), (None, "NoneType"), ([0.5], "list"), (torch.ones(2), "tensor of shape (2,)")],
)
def test_csv_logger_rejects_a_value_that_is_not_a_number(tmp_path, value, type_name):
    logger = CSVLogger(tmp_path)

    with pytest.raises(ConfigurationError, match="metric 'val_acc' is") as info:
        logger.log_metrics({"train_loss": 0.5, "val_acc": value}, step=1)
    assert type_name in str(info.value)
    assert not tmp_path.joinpath("metrics.csv").exists()  # nothing of the bad call is written


@pytest.mark.parametrize("step", [1.0, True, -1, "3"])
def test_csv_logger_rejects_a_step_that_is_not_a_non_negative_int(tmp_path, step):
    with pytest.raises(ConfigurationError, match="step must be a non-negative integer"):
        CSVLogger(tmp_path).log_metrics({"train_loss": 0.5}, step=step)


def test_csv_logger_rejects_a_metric_named_step(tmp_path):
    with pytest.raises(ConfigurationError, match="'step' is the CSV's own first column"):
        CSVLogger(tmp_path).log_metrics({"step": 3}, step=3)


@pytest.mark.parametrize("save_dir", [None, 3, b"runs", ""])
def test_csv_logger_rejects_a_save_dir_that_is_not_a_path(save_dir):
    with pytest.raises(ConfigurationError, match=r"CSVLogger\(save_dir=...\) must be") as info:
        CSVLogger(save_dir)
    assert repr(save_dir) in str(info.value)


@pytest.mark.parametrize("filename", ["", "logs/metrics.csv", 3])
def test_csv_logger_rejects_a_filename_with_folders(tmp_path, filename):
    with pytest.raises(ConfigurationError, match="file name without folders"):
        CSVLogger(tmp_path, filename=filename)


@pytest.mark.parametrize("below", ["", "logs", "logs/exp1"])
def test_csv_logger_under_a_regular_file_is_refused_at_construction_creating_nothing(
    tmp_path, below
):
    (tmp_path / "notes.txt").write_text("mine")
    save_dir = tmp_path / "notes.txt" / below if below else tmp_path / "notes.txt"

    with pytest.raises(ConfigurationError) as info:
        CSVLogger(save_dir)

    message = str(info.value)
    assert f"{str(tmp_path / 'notes.txt')!r} is a file, not a folder" in message
    assert "pass a save_dir whose existing parts are folders, or move the file away" in message
    assert os.listdir(tmp_path) == ["notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "mine"


def test_csv_logger_filename_that_is_a_folder_is_refused_at_construction(tmp_path):
    (tmp_path / "metrics.csv").mkdir()

    with pytest.raises(ConfigurationError, match=r"is a folder, not a file; pass another filename"):
        CSVLogger(tmp_path)


def test_csv_logger_missing_folders_are_created_at_the_first_write_only(tmp_path):
    logger = CSVLogger(tmp_path / "a" / "b")  # nothing in the way: accepted, nothing created
    assert os.listdir(tmp_path) == []

    logger.log_metrics({"train_loss": 1.0}, step=1)
    logger.finalize("success")
    assert _rows(tmp_path / "a" / "b" / "metrics.csv") == [["step", "train_loss"], ["1", "1.0"]]


def test_csv_logger_finalize_twice_then_log_again_appends(tmp_path):
    logger = CSVLogger(tmp_path)
    logger.log_metrics({"train_loss": 1.0}, step=1)
    logger.finalize("success")
    logger.finalize("success")

    logger.log_metrics({"train_loss": 0.5}, step=2)
    logger.finalize("success")

    assert logger.path.read_text() == "step,train_loss\n1,1.0\n2,0.5\n"


# --- TensorBoardLogger ---------------------------------------------------------------------


def _events(log_dir: Path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir))
    events.Reload()
    return events


def test_tensorboard_logger_scalars_read_back_with_their_steps(tmp_path):
    logger = TensorBoardLogger(tmp_path, name="run1")
    assert not tmp_path.joinpath("run1").exists()  # nothing is created before the first write

    logger.log_metrics({"train_loss": 0.5, "lr": 0.1}, step=1)
    logger.log_metrics({"train_loss": 0.25, "lr": torch.tensor(0.05)}, step=2)
    logger.log_metrics({"val_acc": 0.75, "epoch": 1}, step=2)
    logger.finalize("success")
    logger.finalize("success")

    events = _events(tmp_path / "run1")
    read = {
        tag: [(event.step, event.value) for event in events.Scalars(tag)]
        for tag in events.Tags()["scalars"]
    }
    assert read == {
        "train_loss": [(1, 0.5), (2, 0.25)],
        "lr": [(1, pytest.approx(0.1)), (2, pytest.approx(0.05))],
        "val_acc": [(2, 0.75)],
        "epoch": [(2, 1.0)],
    }


def test_tensorboard_logger_hyperparams_are_one_markdown_table(tmp_path):
    logger = TensorBoardLogger(tmp_path)

    logger.log_hyperparams({"lr": 0.1, "strategy": "ddp", "note": "a|b"})
    logger.finalize("success")

    events = _events(tmp_path)
    (event,) = events.Tensors("hparams/text_summary")
    table = event.tensor_proto.string_val[0].decode()
    assert table.splitlines() == [
        "| name | value |",
        "|---|---|",
        "| lr | 0.1 |",
        "| strategy | ddp |",
        "| note | a\\|b |",
    ]
    assert [name for name in os.listdir(tmp_path) if not name.startswith("events.")] == []


def test_tensorboard_logger_rejects_a_value_that_is_not_a_number(tmp_path):
    with pytest.raises(ConfigurationError, match="metric 'lr' is a str"):
        TensorBoardLogger(tmp_path).log_metrics({"lr": "0.1"}, step=1)


@pytest.mark.parametrize(
    ("save_dir", "name"), [("notes.txt", None), (".", "notes.txt"), ("notes.txt/runs", "exp1")]
)
def test_tensorboard_logger_under_a_regular_file_is_refused_at_construction(
    tmp_path, save_dir, name
):
    (tmp_path / "notes.txt").write_text("mine")

    with pytest.raises(ConfigurationError) as info:
        TensorBoardLogger(tmp_path / save_dir, name=name)

    assert f"{str(tmp_path / 'notes.txt')!r} is a file, not a folder; pass a save_dir" in str(
        info.value
    )
    assert os.listdir(tmp_path) == ["notes.txt"]


def test_tensorboard_logger_without_tensorboard_says_which_extra_to_install(tmp_path, monkeypatch):
    """Fakes the absence of tensorboard: the logger's find_spec answers None for it."""
    real_find_spec = distkit.loggers._tensorboard.find_spec

    def find_spec(name, *args):
        return None if name == "tensorboard" else real_find_spec(name, *args)

    monkeypatch.setattr(distkit.loggers._tensorboard, "find_spec", find_spec)

    with pytest.raises(MissingDependencyError) as info:
        TensorBoardLogger(tmp_path)
    assert isinstance(info.value, ImportError)
    assert "TensorBoardLogger needs the 'tensorboard' package" in str(info.value)
    assert "pip install 'distkit[tensorboard]'" in str(info.value)
    assert os.listdir(tmp_path) == []


def test_loggers_import_leaves_tensorboard_unimported():
    probe = (
        "import json, sys, distkit.loggers; "
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] == 'tensorboard' "
        "or m.startswith('torch.utils.tensorboard'))))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert json.loads(result.stdout) == []


# --- Logger, the base ----------------------------------------------------------------------


class HandWrittenMLflow(Logger):
    """What a user writes to send the trainer's records to MLflow (the module is passed in)."""

    _STATUS = {"success": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}

    def __init__(self, mlflow):
        self.mlflow = mlflow

    def log_hyperparams(self, params):
        self.mlflow.log_params(dict(params))

    def log_metrics(self, metrics, step):
        self.mlflow.log_metrics(dict(metrics), step=step)

    def finalize(self, status):
        self.mlflow.end_run(status=self._STATUS[status])  # no active run: mlflow does nothing


def test_logger_subclass_adapts_another_tracker_in_a_few_lines():
    mlflow = mock.Mock()
    logger = HandWrittenMLflow(mlflow)

    logger.log_hyperparams({"lr": 0.1})
    logger.log_metrics({"train_loss": 0.5}, step=1)
    logger.finalize("interrupted")

    assert mlflow.mock_calls == [
        mock.call.log_params({"lr": 0.1}),
        mock.call.log_metrics({"train_loss": 0.5}, step=1),
        mock.call.end_run(status="KILLED"),
    ]


def test_logger_needs_only_log_metrics_the_rest_do_nothing():
    class Recorder(Logger):
        def __init__(self):
            self.records = []

        def log_metrics(self, metrics, step):
            self.records.append((step, dict(metrics)))

    recorder = Recorder()
    recorder.log_hyperparams({"lr": 0.1})
    recorder.log_metrics({"lr": 0.1}, step=1)
    recorder.finalize("success")
    recorder.finalize("success")

    assert recorder.records == [(1, {"lr": 0.1})]


def test_logger_without_log_metrics_cannot_be_created():
    class Forgetful(Logger):
        pass

    with pytest.raises(TypeError, match="log_metrics"):
        Forgetful()


def test_logger_is_not_strict_even_when_a_subclass_skips_the_base_init():
    class NoInit(Logger):
        def __init__(self, url):  # no super().__init__(): the class attribute answers
            self.url = url

        def log_metrics(self, metrics, step):
            pass

    class StrictByClass(NoInit):
        strict = True

    class StrictWithTheBaseInit(Logger):  # Logger.__init__ runs: it keeps the class's choice
        strict = True

        def log_metrics(self, metrics, step):
            pass

    class StrictCSV(CSVLogger):
        strict = True

    assert NoInit("http://tracker").strict is False
    assert StrictByClass("http://tracker").strict is True
    assert StrictWithTheBaseInit().strict is True
    assert StrictCSV("runs").strict is True and StrictCSV("runs", strict=False).strict is False
    loose = NoInit("http://tracker")
    loose.strict = True  # per instance
    assert loose.strict is True and NoInit("x").strict is False


def test_logger_strict_is_a_keyword_of_the_base_and_the_built_ins(tmp_path):
    class Forwarding(Logger):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)

        def log_metrics(self, metrics, step):
            pass

    assert Forwarding(strict=True).strict is True and Forwarding().strict is False
    assert CSVLogger(tmp_path, strict=True).strict is True
    assert CSVLogger(tmp_path).strict is False
    assert TensorBoardLogger(tmp_path, strict=True).strict is True
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("strict", [1, "yes", "False"])
def test_logger_strict_that_is_not_a_bool_is_refused(tmp_path, strict):
    with pytest.raises(ConfigurationError) as info:
        CSVLogger(tmp_path, strict=strict)
    message = str(info.value)
    assert f"CSVLogger(strict=...) must be True or False, got {type(strict).__name__}" in message
    assert repr(strict) in message and "pass strict=True" in message


def test_loggers_public_names_are_pinned():
    assert distkit.loggers.__all__ == [
        "CSVLogger", "Logger", "MLflowLogger", "TensorBoardLogger", "TrackerUnavailableError",
        "WandbLogger",
    ]  # fmt: skip
    assert issubclass(distkit.loggers.TrackerUnavailableError, (DistkitError, ConnectionError))
