"""MLflowLogger: an MLflow run through ``MlflowClient`` (no global active run).

``mlflow`` (``mlflow-skinny`` is enough) is an optional extra: its presence is checked when the
logger is created, and it is imported on first use, never when ``distkit.loggers`` is imported.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from importlib.util import find_spec
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlparse

from typing_extensions import override

from distkit._imports import require
from distkit.errors import ConfigurationError, MissingDependencyError
from distkit.loggers._base import (
    Logger,
    as_numbers,
    check_mapping,
    check_no_file_in_the_way,
    check_step,
    check_text,
)

INSTALL_HINT = (
    "Install it with: pip install 'distkit[mlflow]' (mlflow-skinny, SQLAlchemy and alembic)."
)

STATUSES = {"success": "FINISHED", "failed": "FAILED", "interrupted": "KILLED"}
#: MLflow 3's opt-out of its refusal of the file store (``file:`` URIs, ``./mlruns``)
ALLOW_FILE_STORE = "MLFLOW_ALLOW_FILE_STORE"

# MLflow's limits (mlflow.utils.validation): a batch holds at most 100 params and 1000 metrics
PARAMS_PER_BATCH = 100
METRICS_PER_BATCH = 1000


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
        strict: True: an error from MLflow ends the fit (see :class:`Logger`); False: it is
            reported and training goes on; None (default): the class attribute decides.

    Raises:
        MissingDependencyError: ``mlflow`` (or, for a ``sqlite`` URI, SQLAlchemy) is not
            installed.
        ConfigurationError: a bad argument, or a regular file where the database's folder
            must go (found by looking only: nothing is created here).

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
        if find_spec("mlflow") is None:
            raise MissingDependencyError(
                f"MLflowLogger needs the 'mlflow' package (mlflow-skinny is enough), which is not "
                f"installed. {INSTALL_HINT} Or log to CSV with distkit.loggers.CSVLogger, which "
                "needs nothing."
            )
        self._database = _sqlite_file(self.tracking_uri)
        if self._database is not None:
            if find_spec("sqlalchemy") is None:
                raise MissingDependencyError(
                    f"MLflowLogger(tracking_uri={self.tracking_uri!r}) needs SQLAlchemy and "
                    f"alembic for MLflow's sqlite store. {INSTALL_HINT}"
                )
            check_no_file_in_the_way(
                f"MLflowLogger(tracking_uri={tracking_uri!r})",
                self._database.parent,
                "tracking_uri",
            )
        if _file_store(self.tracking_uri):
            # named explicitly: MLflow 3 keeps this backend behind an opt-out of its refusal
            os.environ.setdefault(ALLOW_FILE_STORE, "true")
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
        client = self._start()
        entities = require("mlflow.entities", feature="MLflowLogger", hint=INSTALL_HINT)
        new: dict[str, str] = {}
        changed = []
        for key, value in params.items():
            if not isinstance(key, str):
                raise ConfigurationError(
                    f"param names must be str, got {type(key).__name__}: {key!r} "
                    f"(value {value!r:.60})"
                )
            text = _param_value(value)
            if key not in self._params:
                new[key] = text
            elif self._params[key] != text:
                changed.append(f"{key!r}: {self._params[key]!r:.60} -> {text!r:.60}")
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

    @override
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Log every value at ``step`` (one batch, with the current time)."""
        step = check_step(step)
        values = as_numbers(metrics)
        client = self._start()
        entities = require("mlflow.entities", feature="MLflowLogger", hint=INSTALL_HINT)
        now = int(time.time() * 1000)
        items = [entities.Metric(key, float(value), now, step) for key, value in values.items()]
        for start in range(0, len(items), METRICS_PER_BATCH):
            client.log_batch(self.run_id, metrics=items[start : start + METRICS_PER_BATCH])

    @override
    def finalize(self, status: str) -> None:
        """End the run: ``FINISHED``, ``FAILED`` or ``KILLED``; nothing when none is open."""
        if not self._open:
            return
        self._open = False
        self._client.set_terminated(self.run_id, status=STATUSES.get(status, "FAILED"))

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


def _param_value(value: object) -> str:
    """A param as MLflow keeps it: a string of at most 6,000 characters."""
    text = str(value)  # None -> "None", 0.1 -> "0.1", True -> "True"
    limit = 6000  # mlflow.utils.validation.MAX_PARAM_VAL_LENGTH
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _file_store(uri: str | None) -> bool:
    """Whether ``uri`` names MLflow's file store: a ``file:`` URI or a folder path."""
    if uri is None:
        return False
    scheme = urlparse(uri).scheme
    return scheme == "file" or scheme == "" or (len(scheme) == 1 and os.name == "nt")


def _sqlite_file(uri: str | None) -> Path | None:
    """The database file of a ``sqlite:///`` URI (None for other URIs and in-memory ones).

    ``sqlite:///runs/mlflow.db`` is relative to the working directory,
    ``sqlite:////abs/mlflow.db`` absolute. None is MLflow's default, ``sqlite:///mlflow.db``
    in the working directory, unless ``MLFLOW_TRACKING_URI`` says otherwise.
    """
    if uri is None:
        return None
    parsed = urlparse(uri)
    if parsed.scheme.split("+")[0] != "sqlite":
        return None
    path = unquote(parsed.path)
    if path.startswith("/"):
        path = path[1:]  # sqlite:///x -> "x", sqlite:////x -> "/x"
    if not path or path == ":memory:":
        return None
    return Path(path)
