"""MLflowLogger with the real MLflow client and a sqlite store: runs read back with MlflowClient."""

from __future__ import annotations

import functools
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Iterator
from importlib.util import find_spec
from pathlib import Path

import pytest

import distkit
import distkit.loggers
from distkit.errors import ConfigurationError, MissingDependencyError, TrainingInterrupted
from distkit.loggers import Logger, MLflowLogger, TrackerUnavailableError
from tests.support.logger_runs import fit_with_logger

pytestmark = [
    pytest.mark.timeout(120),
    # find_spec, not importorskip: the ranks import this module, and must not import mlflow
    pytest.mark.skipif(find_spec("mlflow") is None, reason="needs mlflow (the test extra)"),
]


def _memory_folder(fallback: Path) -> Iterator[Path]:
    """A folder in memory (/dev/shm) where there is one: a new MLflow database commits each of
    its ~60 migrations to disk, 1 s in memory and 2 to 8 s on a busy disk."""
    if not os.path.isdir("/dev/shm"):
        yield fallback
        return
    folder = Path(tempfile.mkdtemp(prefix="distkit-mlflow-", dir="/dev/shm"))
    try:
        yield folder
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(scope="module")
def tracking_uri(tmp_path_factory) -> Iterator[str]:
    """One database for the module's tests (each uses its own experiment or run)."""
    for folder in _memory_folder(tmp_path_factory.mktemp("mlflow")):
        yield f"sqlite:///{folder}/mlflow.db"


@pytest.fixture
def memory_path(tmp_path) -> Iterator[Path]:
    yield from _memory_folder(tmp_path)


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(uri)


def _history(uri: str, run_id: str, key: str) -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in _client(uri).get_metric_history(run_id, key)]


def test_mlflow_logger_fit_reads_back_metrics_params_and_finished(tracking_uri):
    logger = MLflowLogger(experiment="fit", tracking_uri=tracking_uri, run_name="first")
    assert logger.run_id is None

    result = fit_with_logger(logger)  # 6 steps: log points 2, 4, 6, then the epoch's row at 6

    run = _client(tracking_uri).get_run(logger.run_id)
    assert run.info.status == "FINISHED" and run.info.run_name == "first"
    history = _history(tracking_uri, logger.run_id, "train_loss")
    assert [step for step, _ in history] == [2, 4, 6, 6]  # MLflow keeps both rows of step 6
    epoch_loss = result.history[-1]["train_loss"]
    assert any(value == pytest.approx(epoch_loss) for step, value in history if step == 6)
    assert [step for step, _ in _history(tracking_uri, logger.run_id, "lr")] == [2, 4, 6]
    params = run.data.params
    assert params["strategy"] == "dp" and params["lr"] == "0.1" and params["batch_size"] == "4"
    assert params["gradient_clip_norm"] == "None"  # None, as MLflow keeps it: a string
    experiment = _client(tracking_uri).get_experiment_by_name("fit")
    assert run.info.experiment_id == experiment.experiment_id
    logger.finalize("success")  # again: nothing to do


@pytest.mark.parametrize("form", ["file-uri", "folder"])
def test_mlflow_logger_writes_a_file_store_it_is_given_and_it_reads_back(
    tmp_path, monkeypatch, form
):
    monkeypatch.delenv("MLFLOW_ALLOW_FILE_STORE", raising=False)  # MLflow 3 refuses it then
    folder = tmp_path / "mlruns"
    uri = folder.as_uri() if form == "file-uri" else str(folder)
    logger = MLflowLogger(experiment="files", tracking_uri=uri)
    fit_with_logger(logger)
    run = _client(uri).get_run(logger.run_id)
    assert run.info.status == "FINISHED" and run.data.params["strategy"] == "dp"
    assert [step for step, _ in _history(uri, logger.run_id, "lr")] == [2, 4, 6]
    assert folder.is_dir() and any(folder.rglob("meta.yaml"))  # MLflow's own file layout


@pytest.mark.parametrize(
    ("error", "status"),
    [
        (RuntimeError("boom"), "FAILED"),
        (KeyboardInterrupt(), "KILLED"),
        (TrainingInterrupted("SIGTERM", code=143), "KILLED"),
    ],
    ids=["failed", "ctrl-c", "sigterm"],
)
def test_mlflow_logger_a_fit_that_raises_ends_the_run_with_its_status(tracking_uri, error, status):
    logger = MLflowLogger(experiment="statuses", tracking_uri=tracking_uri)

    with pytest.raises(type(error)):
        fit_with_logger(logger, fail_at=error)

    assert _client(tracking_uri).get_run(logger.run_id).info.status == status
    assert [step for step, _ in _history(tracking_uri, logger.run_id, "train_loss")] == [2]


def test_mlflow_logger_creates_nothing_until_the_first_call(memory_path):
    uri = f"sqlite:///{memory_path}/runs/mlflow.db"
    logger = MLflowLogger(experiment="e", tracking_uri=uri, strict=True)
    logger.finalize("success")  # no call: no run, no database
    logger.finalize("failed")
    assert os.listdir(memory_path) == [] and logger.strict is True

    logger.log_metrics({"loss": 1.0}, step=1)  # the first call creates the folder and the run
    logger.finalize("success")
    assert os.listdir(memory_path / "runs") == ["mlflow.db"]
    assert _client(uri).get_run(logger.run_id).info.status == "FINISHED"


def test_mlflow_logger_params_are_strings_logged_once(tracking_uri):
    logger = MLflowLogger(experiment="params", tracking_uri=tracking_uri)
    params = {"lr": 0.1, "clip": None, "name": "x" * 7000, "flag": True}
    logger.log_hyperparams(params)
    logger.log_hyperparams(params)  # the same values again: nothing to do, no error

    with pytest.raises(ConfigurationError) as info:
        logger.log_hyperparams({"lr": 0.2, "seed": 3})  # a new one is logged, lr is not
    logger.finalize("success")

    assert "MLflow params cannot change within a run" in str(info.value)
    assert "'lr': '0.1' -> '0.2'" in str(info.value)
    stored = _client(tracking_uri).get_run(logger.run_id).data.params
    assert stored == {
        "lr": "0.1", "clip": "None", "name": "x" * 5997 + "...", "flag": "True", "seed": "3",
    }  # fmt: skip


def test_mlflow_logger_many_metrics_and_params_go_in_batches_within_mlflow_limits(tracking_uri):
    logger = MLflowLogger(experiment="batches", tracking_uri=tracking_uri)
    logger.log_hyperparams({f"p{i}": i for i in range(250)})  # MLflow: 100 per batch
    logger.log_metrics({f"m{i}": float(i) for i in range(1200)}, step=5)  # 1000 per batch
    logger.finalize("success")

    data = _client(tracking_uri).get_run(logger.run_id).data
    assert len(data.params) == 250 and data.params["p249"] == "249"
    assert len(data.metrics) == 1200 and data.metrics["m1199"] == 1199.0


def test_mlflow_logger_run_id_continues_the_run_of_an_earlier_fit(tracking_uri):
    first = MLflowLogger(experiment="resume", tracking_uri=tracking_uri)
    first.log_hyperparams({"lr": 0.1})
    first.log_metrics({"train_loss": 1.0}, step=2)
    first.finalize("interrupted")
    assert _client(tracking_uri).get_run(first.run_id).info.status == "KILLED"

    resumed = MLflowLogger(experiment="resume", tracking_uri=tracking_uri, run_id=first.run_id)
    resumed.log_hyperparams({"lr": 0.1})  # the run's own value: accepted
    resumed.log_metrics({"train_loss": 0.5}, step=4)
    assert _client(tracking_uri).get_run(first.run_id).info.status == "RUNNING"
    resumed.finalize("success")

    assert resumed.run_id == first.run_id
    assert _client(tracking_uri).get_run(first.run_id).info.status == "FINISHED"
    assert _history(tracking_uri, first.run_id, "train_loss") == [(2, 1.0), (4, 0.5)]


def test_mlflow_logger_a_call_after_finalize_starts_another_run(tracking_uri):
    logger = MLflowLogger(experiment="two", tracking_uri=tracking_uri)
    logger.log_metrics({"loss": 1.0}, step=1)
    logger.finalize("success")
    first = logger.run_id
    logger.log_metrics({"loss": 2.0}, step=1)
    logger.finalize("failed")

    assert logger.run_id != first
    assert _client(tracking_uri).get_run(first).info.status == "FINISHED"
    assert _client(tracking_uri).get_run(logger.run_id).info.status == "FAILED"


def _rank_logs(uri: str) -> tuple[str | None, bool]:
    logger = MLflowLogger(experiment="ranks", tracking_uri=uri)
    fit_with_logger(logger, strategy="ddp")
    return logger.run_id, "mlflow" in sys.modules


def test_mlflow_logger_only_rank_zero_writes_in_a_two_rank_fit(run_on_ranks, tracking_uri):
    uri = tracking_uri
    run = functools.partial(run_on_ranks, world_size=2, env={"MLFLOW_DISABLE_TELEMETRY": "true"})
    (run_id, rank0_imported), rank1 = run(_rank_logs, uri)

    assert rank0_imported and rank1 == (None, False)  # rank 1: no run, mlflow never imported
    assert _client(uri).get_run(run_id).info.status == "FINISHED"
    # 12 samples a rank: 3 steps, logged at 2 and at the epoch's end
    assert [step for step, _ in _history(uri, run_id, "train_loss")] == [2, 3]
    assert _client(uri).get_run(run_id).data.params["world_size"] == "2"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"experiment": ""}, "MLflowLogger(experiment=...) must be a non-empty str, got str: ''"),
        ({"experiment": None}, "MLflowLogger(experiment=...) must be a non-empty str, got None"),
        (
            {"experiment": "e", "tracking_uri": Path("runs")},
            "MLflowLogger(tracking_uri=...) must be a non-empty str or None, got PosixPath",
        ),
        (
            {"experiment": "e", "tags": {"a": 1}},
            "MLflowLogger(tags=...) must be a mapping of str to str or None",
        ),
        ({"experiment": "e", "run_id": ""}, "MLflowLogger(run_id=...) must be a non-empty str"),
        (
            {"experiment": "e", "timeout": 0},
            "MLflowLogger(timeout=...) must be a positive number of seconds, got 0",
        ),
        (
            {"experiment": "e", "tracking_uri": "bogus://x"},
            "MLflowLogger(tracking_uri='bogus://x'): MLflow has no tracking store for the scheme "
            "'bogus'; allowed: a folder path, or a URI of scheme file, http, https, databricks, "
            "sqlite, postgresql, mysql or mssql",
        ),
        (
            {"experiment": "e", "tracking_uri": "postgres://db/runs"},
            "no tracking store for the scheme 'postgres'",
        ),
    ],
)
def test_mlflow_logger_bad_arguments_are_refused_naming_them(kwargs, message):
    with pytest.raises(ConfigurationError) as info:
        MLflowLogger(**kwargs)
    assert message in str(info.value)


def test_mlflow_logger_sqlite_database_under_a_regular_file_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    uri = f"sqlite:///{tmp_path}/notes.txt/mlflow.db"

    with pytest.raises(ConfigurationError) as info:
        MLflowLogger(experiment="e", tracking_uri=uri)

    assert f"{str(tmp_path / 'notes.txt')!r} is a file, not a folder" in str(info.value)
    assert "pass a tracking_uri" in str(info.value)


MLFLOW_STORES = ["http://host:5000", "HTTPS://host", "postgresql+psycopg2://u@host/db"]
MLFLOW_STORES += ["databricks", "file:///tmp/mlruns", "runs/mlruns", "sqlite://"]


@pytest.mark.parametrize("uri", MLFLOW_STORES)
def test_mlflow_logger_tracking_uris_of_mlflow_stores_are_accepted_creating_nothing(uri, tmp_path):
    MLflowLogger(experiment="e", tracking_uri=uri).finalize("success")
    assert os.listdir(tmp_path) == []


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_mlflow_logger_sqlite_database_in_a_folder_it_cannot_create_is_refused():
    # /proc takes no new file, for root too (whom os.access lets through)
    with pytest.raises(ConfigurationError) as info:
        MLflowLogger(experiment="e", tracking_uri="sqlite:////proc/m.db")

    message = str(info.value)
    assert message.startswith("MLflowLogger(tracking_uri='sqlite:////proc/m.db'): '/proc' cannot")
    assert "the sqlite database '/proc/m.db' is created there at the first call" in message
    assert "pass a tracking_uri whose folder this process can create and write" in message


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed when the block ends: nothing listens there


class _Nothing(Logger):
    def log_metrics(self, metrics, step):
        pass


HTTP_VARIABLES = [
    "MLFLOW_HTTP_REQUEST_TIMEOUT",
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR",
]


@pytest.mark.timeout(60)
def test_mlflow_logger_a_server_that_is_down_costs_the_fit_seconds_and_is_reported_once(
    monkeypatch,
):
    for name in HTTP_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    uri = f"http://127.0.0.1:{_closed_port()}"
    logger = MLflowLogger(experiment="down", tracking_uri=uri)

    started = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fit_with_logger(logger)  # MLflow's own retries: 4 minutes a call, 6 calls
    took = time.monotonic() - started

    assert took < 20, f"the fit took {took:.1f} s"  # about 2 s, most of it importing mlflow
    reports = [str(w.message) for w in caught if "(MLflowLogger)" in str(w.message)]
    assert len(reports) == 1, reports
    assert "failed in log_hyperparams: TrackerUnavailableError: " in reports[0]
    assert f"MLflowLogger(tracking_uri='{uri}') could not reach its tracker" in reports[0]
    assert "Connection refused" in reports[0] and "training goes on" in reports[0]
    assert logger.run_id is None  # no run was created
    expected = fit_with_logger(_Nothing())  # the same fit, with a logger that works
    assert [row["train_loss"] for row in result.history] == [
        row["train_loss"] for row in expected.history
    ]
    assert not any(name in os.environ for name in HTTP_VARIABLES)  # set for its calls only
    for thread in threading.enumerate():  # the logger's thread ends with the fit
        if thread.name == "distkit-MLflowLogger":
            thread.join(timeout=5)
            assert not thread.is_alive()


@pytest.mark.timeout(60)
def test_mlflow_logger_a_server_that_never_answers_is_waited_for_at_most_its_timeout():
    with socket.socket() as silent:  # takes connections (the kernel's backlog), answers none
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        uri = f"http://127.0.0.1:{silent.getsockname()[1]}"
        logger = MLflowLogger(experiment="silent", tracking_uri=uri, timeout=1)
        import mlflow.tracking  # noqa: F401  # imported before the clock starts

        started = time.monotonic()
        with pytest.raises(TrackerUnavailableError) as first:
            logger.log_metrics({"loss": 1.0}, step=1)
        waited = time.monotonic() - started
        with pytest.raises(TrackerUnavailableError) as later:
            logger.log_metrics({"loss": 0.5}, step=2)
        at_once = time.monotonic() - started - waited
        logger.finalize("success")

    assert 1 <= waited < 5 and at_once < 0.5, (waited, at_once)
    assert "log_metrics at step 1 did not return within 1 s" in str(first.value)
    assert "pass a larger MLflowLogger(timeout=...) (now 1 s)" in str(first.value)
    since = "since log_metrics at step 1 did not return within 1 s"
    assert f"log_metrics at step 2 not sent: the tracker is unavailable {since}" in str(later.value)


@pytest.mark.timeout(60)
def test_mlflow_logger_bounds_mlflow_http_retries_for_its_calls_only_keeping_the_users(
    monkeypatch,
):
    from mlflow.tracking import MlflowClient

    for name in HTTP_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # the user's own
    seen = []

    def refused(self, name):
        seen.append({variable: os.environ.get(variable) for variable in HTTP_VARIABLES})
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(MlflowClient, "get_experiment_by_name", refused)
    logger = MLflowLogger(experiment="e", tracking_uri="http://tracker:5000")

    with pytest.raises(TrackerUnavailableError, match="could not reach its tracker"):
        logger.log_hyperparams({"lr": 0.1})
    with pytest.raises(TrackerUnavailableError, match="not sent: the tracker is unavailable"):
        logger.log_metrics({"loss": 1.0}, step=1)  # not tried again in this fit
    logger.finalize("failed")  # no run was started: nothing to end
    with pytest.raises(TrackerUnavailableError, match="could not reach its tracker"):
        logger.log_metrics({"loss": 1.0}, step=1)  # after finalize: tried again
    logger.finalize("failed")

    during = {
        "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",  # timeout=30 s: two tries of 10 s
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    }
    assert seen == [during, during]
    assert {name: os.environ.get(name) for name in HTTP_VARIABLES} == {
        "MLFLOW_HTTP_REQUEST_TIMEOUT": None,
        "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",
        "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": None,
    }


def test_mlflow_logger_without_mlflow_says_which_extra_to_install(monkeypatch):
    real_find_spec = distkit.loggers._mlflow.find_spec
    monkeypatch.setattr(
        distkit.loggers._mlflow,
        "find_spec",
        lambda name, *args: None if name == "mlflow" else real_find_spec(name, *args),
    )

    with pytest.raises(MissingDependencyError) as info:
        MLflowLogger(experiment="e")
    assert "MLflowLogger needs the 'mlflow' package" in str(info.value)
    assert "pip install 'distkit[mlflow]'" in str(info.value)
