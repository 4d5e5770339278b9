"""MLflowLogger: an MLflow run through ``MlflowClient`` (no global active run).

``mlflow`` (``mlflow-skinny`` is enough) is an optional extra: its presence is checked when the
logger is created, and it is imported on first use, never when ``distkit.loggers`` is imported.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from collections.abc import Callable, Iterator, Mapping
from importlib.util import find_spec
from typing import Any, TypeVar

from typing_extensions import override

from distkit._imports import require
from distkit._validate import check_seconds
from distkit.errors import ConfigurationError, MissingDependencyError
from distkit.loggers._base import Logger, as_numbers, check_mapping, check_step, check_text
from distkit.loggers._mlflow_uri import check_database_folder, check_scheme, file_store, sqlite_file
from distkit.loggers._tracker import TrackerCalls

INSTALL_HINT = (
    "Install it with: pip install 'distkit[mlflow]' (mlflow-skinny, SQLAlchemy and alembic)."
)

STATUSES = {"success": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}
#: MLflow 3's opt-out of its refusal of the file store (``file:`` URIs, ``./mlruns``)
ALLOW_FILE_STORE = "MLFLOW_ALLOW_FILE_STORE"

# MLflow's limits (mlflow.utils.validation): a batch holds at most 100 params and 1000 metrics
PARAMS_PER_BATCH = 100
METRICS_PER_BATCH = 1000

#: MLflow's HTTP settings, read at each request; distkit's values hold during the logger's
#: calls, for those the user has not set. MLflow's own (7 retries with a back-off of 2, 120 s
#: a try) retry a server that is down for minutes a call.
HTTP_RETRIES = "MLFLOW_HTTP_REQUEST_MAX_RETRIES"
HTTP_BACKOFF = "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR"
HTTP_TIMEOUT = "MLFLOW_HTTP_REQUEST_TIMEOUT"

T = TypeVar("T")


class MLflowLogger(Logger):
    """Sends the hyperparameters (as params) and metrics to an MLflow run.

    The run is created at the first call, in ``experiment`` (created when missing), so the
    logger can be built on every rank and a rank that never logs creates nothing: no run, no
    database. ``finalize`` ends it: ``FINISHED``, ``FAILED`` or ``KILLED`` (an interrupted fit).
    A later call starts a new run, or continues ``run_id``.

    MLflow params are strings that cannot change within a run: a value becomes ``str(value)``
    (``None`` becomes ``"None"``), cut to MLflow's 6,000 characters; logging the same value
    again does nothing, and a changed value is refused (``ConfigurationError`` naming it) while
    the other params are still logged.

    A tracker that is down does not hold training up: each call to MLflow runs on a thread of
    the logger's own and is waited for at most ``timeout`` seconds, and during the calls MLflow
    tries a request twice, ``timeout / 3`` seconds each (unless ``MLFLOW_HTTP_REQUEST_TIMEOUT``,
    ``_MAX_RETRIES`` or ``_BACKOFF_FACTOR`` say otherwise). A call that cannot connect, or runs
    past ``timeout``, raises :class:`~distkit.loggers.TrackerUnavailableError`, and so does
    every later call, at once, until ``finalize``: the trainer reports it once and trains on.

    Args:
        experiment: the experiment's name.
        tracking_uri: where the runs go: ``"sqlite:///runs/mlflow.db"`` (a local database, no
            server; its folder is created at the first call), ``"http://host:5000"`` (a
            tracking server), ``"file:///runs/mlruns"`` or a folder path (MLflow's file store,
            which MLflow 3 keeps in maintenance mode and refuses unless
            ``MLFLOW_ALLOW_FILE_STORE=true``: named here, distkit sets that variable for the
            process unless you set it yourself), ... None: MLflow's default
            (``MLFLOW_TRACKING_URI``, else ``sqlite:///mlflow.db`` in the working directory).
        run_name: the run's name (MLflow picks one when None).
        run_id: continue this run (e.g. the run a resumed fit started); its status is set
            back to ``RUNNING`` at the first call.
        tags: tags of a new run (names and str values).
        timeout: the longest one call may hold up training, in seconds (the first call
            creates a new sqlite database: a few seconds on a busy disk).
        strict: True: an error from MLflow ends the fit (see :class:`Logger`); False: it is
            reported and training goes on; None (default): the class attribute decides.

    Raises:
        MissingDependencyError: ``mlflow`` (or, for a ``sqlite`` URI, SQLAlchemy) is not
            installed.
        ConfigurationError: a bad argument; a ``tracking_uri`` of a scheme no tracking store
            serves; a sqlite database whose folder is a file, or cannot be created or written
            (found by looking, and by one unnamed file made and gone at once: nothing is left).

    Example:
        >>> uri = "sqlite:///runs/mlflow.db"  # a local database: no server
        >>> logger = MLflowLogger("mnist", tracking_uri=uri)  # doctest: +SKIP
    """

    def __init__(
        self,
        experiment: str,
        tracking_uri: str | None = None,
        *,
        run_name: str | None = None,
        run_id: str | None = None,
        tags: Mapping[str, str] | None = None,
        timeout: float = 30.0,
        strict: bool | None = None,
    ) -> None:
        super().__init__(strict=strict)
        self.experiment = check_text("MLflowLogger", "experiment", experiment)
        self.tracking_uri = check_text("MLflowLogger", "tracking_uri", tracking_uri, optional=True)
        self.run_name = check_text("MLflowLogger", "run_name", run_name, optional=True)
        self.run_id: str | None = check_text("MLflowLogger", "run_id", run_id, optional=True)
        self.tags = check_mapping(
            "MLflowLogger", "tags", tags, meaning="a mapping of str to str", str_values=True
        )
        check_seconds("MLflowLogger(timeout=...)", timeout, allow_none=False)
        self.timeout = float(timeout)
        if find_spec("mlflow") is None:
            raise MissingDependencyError(
                f"MLflowLogger needs the 'mlflow' package (mlflow-skinny is enough), which is not "
                f"installed. {INSTALL_HINT} Or log to CSV with distkit.loggers.CSVLogger, which "
                "needs nothing."
            )
        call = f"MLflowLogger(tracking_uri={self.tracking_uri!r})"
        check_scheme(call, self.tracking_uri)
        self._database = sqlite_file(self.tracking_uri)
        if self._database is not None:
            if find_spec("sqlalchemy") is None:
                raise MissingDependencyError(
                    f"{call} needs SQLAlchemy and alembic for MLflow's sqlite store. {INSTALL_HINT}"
                )
            check_database_folder(call, self._database)
        if file_store(self.tracking_uri):
            # named explicitly: MLflow 3 keeps this backend behind an opt-out of its refusal
            os.environ.setdefault(ALLOW_FILE_STORE, "true")
        self._calls = TrackerCalls(
            call,
            self.timeout,
            fix=f"Check that the tracking server runs and tracking_uri names it, or pass a "
            f"larger MLflowLogger(timeout=...) (now {self.timeout:g} s) for a slow one",
        )
        self._http = {
            HTTP_RETRIES: "1",
            HTTP_BACKOFF: "1",
            HTTP_TIMEOUT: str(max(1, int(self.timeout // 3))),  # MLflow reads whole seconds
        }
        self._resume = self.run_id  # the user's run: every fit continues it
        self._client: Any = None
        self._open = False  # a run is started and not yet ended
        self._params: dict[str, str] = {}  # what the run already holds

    @override
    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Log ``params`` as the run's params (strings; see the class)."""
        if not isinstance(params, Mapping):
            raise ConfigurationError(
                f"params must be a mapping of names to values, got {type(params).__name__}"
            )
        texts = {}
        for key, value in params.items():
            if not isinstance(key, str):
                raise ConfigurationError(
                    f"param names must be str, got {type(key).__name__}: {key!r} "
                    f"(value {value!r:.60})"
                )
            texts[key] = _param_value(value)
        self._call("log_hyperparams", functools.partial(self._send_params, texts))

    @override
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Log every value at ``step`` (one batch, with the current time)."""
        step = check_step(step)
        values = as_numbers(metrics)
        now = int(time.time() * 1000)
        send = functools.partial(self._send_metrics, values, step, now)
        self._call(f"log_metrics at step {step}", send)

    @override
    def finalize(self, status: str) -> None:
        """End the run: ``FINISHED``, ``FAILED`` or ``KILLED``; nothing when none is open.

        Ends the logger's thread, and forgets an unavailable tracker: a later call (the
        next fit's) tries it again.
        """
        try:
            if self._open:
                end = functools.partial(self._end, STATUSES.get(status, "FAILED"))
                self._call(f"finalize({status!r})", end)
        finally:
            self._open = False  # not ended, when the tracker is down: the next call starts anew
            self._calls.reset()

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """``fn()`` on the logger's thread, MLflow's HTTP retries bounded while it runs."""
        # imported here, on the caller's thread: an import is no delay of the tracker's
        require("mlflow.tracking", feature="MLflowLogger", hint=INSTALL_HINT)
        require("mlflow.entities", feature="MLflowLogger", hint=INSTALL_HINT)
        with _environment(self._http):
            return self._calls.run(what, fn)

    # what follows runs on the logger's thread (TrackerCalls), one call at a time

    def _send_params(self, texts: dict[str, str]) -> None:
        client = self._start()
        entities = require("mlflow.entities", feature="MLflowLogger", hint=INSTALL_HINT)
        new = {key: text for key, text in texts.items() if key not in self._params}
        changed = [
            f"{key!r}: {self._params[key]!r:.60} -> {text!r:.60}"
            for key, text in texts.items()
            if key in self._params and self._params[key] != text
        ]
        items = [entities.Param(key, text) for key, text in new.items()]
        for start in range(0, len(items), PARAMS_PER_BATCH):
            client.log_batch(self.run_id, params=items[start : start + PARAMS_PER_BATCH])
        self._params.update(new)
        if changed:
            raise ConfigurationError(
                f"MLflow params cannot change within a run, and run {self.run_id} already "
                f"holds other values ({'; '.join(changed)}); the first values are kept. Log "
                "changing values as metrics, or start another run (a new MLflowLogger without "
                "run_id)"
            )

    def _send_metrics(self, values: dict[str, int | float], step: int, now: int) -> None:
        client = self._start()
        entities = require("mlflow.entities", feature="MLflowLogger", hint=INSTALL_HINT)
        items = [entities.Metric(key, float(value), now, step) for key, value in values.items()]
        for start in range(0, len(items), METRICS_PER_BATCH):
            client.log_batch(self.run_id, metrics=items[start : start + METRICS_PER_BATCH])

    def _end(self, status: str) -> None:
        self._open = False
        self._client.set_terminated(self.run_id, status=status)

    def _start(self) -> Any:
        """The client, with a run open (created, or the user's ``run_id`` set running)."""
        if self._open:
            return self._client
        if self._client is None:
            tracking = require("mlflow.tracking", feature="MLflowLogger", hint=INSTALL_HINT)
            if self._database is not None:
                self._database.parent.mkdir(parents=True, exist_ok=True)
            self._client = tracking.MlflowClient(tracking_uri=self.tracking_uri)
        client = self._client
        if self._resume is not None:
            run = client.get_run(self._resume)  # raises when there is no such run
            client.update_run(self._resume, status="RUNNING")
            self.run_id, self._params = self._resume, dict(run.data.params)
        else:
            found = client.get_experiment_by_name(self.experiment)
            experiment_id = (
                found.experiment_id if found else client.create_experiment(self.experiment)
            )
            run = client.create_run(experiment_id, run_name=self.run_name, tags=self.tags)
            self.run_id, self._params = run.info.run_id, {}
        self._open = True
        return client


@contextlib.contextmanager
def _environment(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` set in ``os.environ`` for the block, where the user has set none."""
    added = [name for name in values if name not in os.environ]
    for name in added:
        os.environ[name] = values[name]
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)


def _param_value(value: object) -> str:
    """A param as MLflow keeps it: a string of at most 6,000 characters."""
    text = str(value)  # None -> "None", 0.1 -> "0.1", True -> "True"
    limit = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
    return text if len(text) <= limit else text[: limit - 3] + "..."
