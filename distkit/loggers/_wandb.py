"""WandbLogger: a Weights & Biases run, online or offline (a run folder under ``save_dir``).

``wandb`` is an optional extra: its presence is checked when the logger is created, and it is
imported on first use, never when ``distkit.loggers`` is imported.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from importlib.util import find_spec
from typing import Any

from typing_extensions import override

from distkit._imports import require
from distkit.errors import ConfigurationError, MissingDependencyError
from distkit.loggers._base import (
    Logger,
    as_numbers,
    check_mapping,
    check_no_file_in_the_way,
    check_save_dir,
    check_step,
    check_text,
)
from distkit.loggers._tracker import TrackerUnavailableError

INSTALL_HINT = "Install it with: pip install 'distkit[wandb]' (or pip install wandb)."

# W&B records a run's end as an exit code: 0 is "finished", any other "failed". Its "killed"
# state is set by the server only (a run stopped from the web page), so an interrupted fit
# sends 255, the code wandb itself records for a Ctrl-C.
EXIT_CODES = {"success": 0, "failed": 1, "interrupted": 255}

ERROR_REPORTING = "WANDB_ERROR_REPORTING"

# What distkit sets, before the user's ``settings``: quiet, no capture of the console (its
# "redirect" mode installs a SIGWINCH handler and rewires file descriptors 1 and 2), no code
# saved.
DEFAULT_SETTINGS: dict[str, Any] = {"silent": True, "console": "off", "save_code": False}

# How long wandb.init may wait for W&B, unless the user says (settings or WANDB_INIT_TIMEOUT):
# wandb's own 90 s is spent in full on a server that is down (a refused connection is retried
# until then), at every call, as the run never starts; distkit tries once a fit.
INIT_TIMEOUT = 30.0
INIT_TIMEOUT_ENV = "WANDB_INIT_TIMEOUT"


class WandbLogger(Logger):
    """Sends the hyperparameters (the run's config) and metrics to a Weights & Biases run.

    The run starts at the first call (so the logger can be built on every rank, and a rank
    that never logs starts nothing); ``finalize`` ends it with the fit's status (W&B's exit
    code: 0 finished, 1 failed, 255 interrupted), then stops wandb's service process when no
    other wandb run is open in this process. A later call starts a new run, or continues
    ``run_id``.

    A ``wandb.init`` that fails (a W&B server that is down: wandb retries it until
    ``init_timeout``, 30 s unless ``settings`` or ``WANDB_INIT_TIMEOUT`` say otherwise) raises
    :class:`~distkit.loggers.TrackerUnavailableError`, and so does every later call, at once,
    until ``finalize``: the trainer reports it once and trains on.

    ``offline=True`` writes the run under ``<save_dir>/wandb/offline-run-*`` with no network
    and no login; upload it later with ``wandb sync <folder>``. Online, the API key must
    already be set (``WANDB_API_KEY`` or ``wandb login``): distkit never lets wandb prompt for
    it on rank 0 while the other ranks wait.

    Args:
        project: the W&B project.
        save_dir: the folder the ``wandb`` run folders go in (created at the first call).
        offline: write the run locally only (``wandb sync`` uploads it later).
        name: the run's display name (W&B picks one when None).
        run_id: continue this run (W&B ``resume="allow"``): e.g. the id of the run a resumed
            fit started. W&B drops values logged at a step below the run's last one.
        entity: the W&B user or team (wandb's default when None).
        tags: tags of the run.
        settings: more ``wandb.Settings`` fields, over distkit's (``{"console": "wrap"}``
            captures the console, ``{"init_timeout": 90}`` waits longer for W&B).
        strict: True: an error from wandb ends the fit (see :class:`Logger`); False: it is
            reported and training goes on; None (default): the class attribute decides.

    Raises:
        MissingDependencyError: the ``wandb`` package is not installed.
        ConfigurationError: a bad argument, or a regular file where ``save_dir`` must go
            (found by looking only: nothing is created here).

    Example:
        >>> logger = WandbLogger(project="mnist", save_dir="runs", offline=True)  # doctest: +SKIP
    """

    def __init__(
        self,
        project: str,
        save_dir: str | os.PathLike[str] = ".",
        *,
        offline: bool = False,
        name: str | None = None,
        run_id: str | None = None,
        entity: str | None = None,
        tags: Sequence[str] | None = None,
        settings: Mapping[str, Any] | None = None,
        strict: bool | None = None,
    ) -> None:
        super().__init__(strict=strict)
        self.project = check_text("WandbLogger", "project", project)
        self.save_dir = check_save_dir("WandbLogger", save_dir)
        if not isinstance(offline, bool):
            raise ConfigurationError(
                f"WandbLogger(offline=...) must be True or False, got {type(offline).__name__}: "
                f"{offline!r}; True writes the run under save_dir only, False sends it to W&B"
            )
        self.offline = offline
        self.name = check_text("WandbLogger", "name", name, optional=True)
        self.run_id = check_text("WandbLogger", "run_id", run_id, optional=True)
        self.entity = check_text("WandbLogger", "entity", entity, optional=True)
        self.tags = _check_tags(tags)
        self.settings = check_mapping(
            "WandbLogger",
            "settings",
            settings,
            meaning="a mapping of wandb.Settings field names to values",
        )
        if find_spec("wandb") is None:
            raise MissingDependencyError(
                f"WandbLogger needs the 'wandb' package, which is not installed. {INSTALL_HINT} "
                "Or log to CSV with distkit.loggers.CSVLogger, which needs nothing."
            )
        check_no_file_in_the_way(f"WandbLogger(save_dir={save_dir!r})", self.save_dir, "save_dir")
        self._run: Any = None
        self._hooks: tuple[Any, Any, Any, Any] | None = None  # sys hooks wandb replaced
        self._set_env = False  # ERROR_REPORTING set by this logger, for an offline run
        self._init_failed: str | None = None  # why wandb.init failed in this fit

    @property
    def run(self) -> Any:
        """The open ``wandb`` run (None before the first call and after ``finalize``)."""
        return self._run

    @override
    def log_hyperparams(self, params: Mapping[str, Any]) -> None:
        """Set ``params`` in the run's config (the same values again change nothing)."""
        if not isinstance(params, Mapping):
            raise ConfigurationError(
                f"params must be a mapping of names to values, got {type(params).__name__}"
            )
        self._get_run().config.update(dict(params), allow_val_change=True)

    @override
    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Log the values as one row of the run's history at ``step``."""
        step = check_step(step)
        values = as_numbers(metrics)
        self._get_run().log(values, step=step)

    @override
    def finalize(self, status: str) -> None:
        """End the run with ``status``; then stop wandb's service unless another run is open.

        Does nothing when no run was started (no call reached this logger) or it has ended.
        After a ``wandb.init`` that failed, stops the service only; the next call tries again.
        """
        run, self._run = self._run, None
        failed, self._init_failed = self._init_failed, None
        if run is None and failed is None:
            return
        wandb = require("wandb", feature="WandbLogger", hint=INSTALL_HINT)
        try:
            if run is not None:
                run.finish(exit_code=EXIT_CODES.get(status, 1))
        finally:
            if wandb.run is None:  # no other run of this process uses the service
                wandb.teardown()
                self._restore_hooks()
            if self._set_env:
                self._set_env = False
                os.environ.pop(ERROR_REPORTING, None)

    def _get_run(self) -> Any:
        if self._run is not None:
            return self._run
        if self._init_failed is not None:
            raise TrackerUnavailableError(
                f"WandbLogger(project={self.project!r}): nothing sent: {self._init_failed}. "
                f"{_UNTIL}"
            )
        wandb = require("wandb", feature="WandbLogger", hint=INSTALL_HINT)
        if not self.offline and not wandb.login(prompt=False, verify=False):
            raise ConfigurationError(
                "WandbLogger(offline=False) found no W&B API key: set WANDB_API_KEY or run "
                "`wandb login` first, or pass offline=True to write the run under save_dir and "
                "upload it later with `wandb sync`"
            )
        self.save_dir.mkdir(parents=True, exist_ok=True)
        if self.offline and ERROR_REPORTING not in os.environ:
            # wandb 0.31 still sends its own analytics (to its server, from a thread, at exit)
            # for an offline run unless this is false; only while the run is open
            os.environ[ERROR_REPORTING] = "false"
            self._set_env = True
        before = (sys.excepthook, sys.exit)
        settings = self._settings()
        try:
            self._run = wandb.init(
                project=self.project,
                entity=self.entity,
                dir=str(self.save_dir),
                name=self.name,
                id=self.run_id,
                resume="allow" if self.run_id else None,
                tags=self.tags,
                mode="offline" if self.offline else "online",
                reinit="create_new",  # beside a run the user opened, not instead of it
                settings=wandb.Settings(**settings),
            )
        except Exception as exc:
            waited = settings.get("init_timeout", os.environ.get(INIT_TIMEOUT_ENV))
            self._init_failed = f"wandb.init failed ({type(exc).__name__}: {exc})"
            raise TrackerUnavailableError(
                f"WandbLogger(project={self.project!r}): {self._init_failed}. {_UNTIL}. Each "
                f"try waits up to init_timeout ({waited} s) for W&B: check that its server "
                "(WANDB_BASE_URL) can be reached, pass settings={'init_timeout': ...} for a "
                "slow one, or offline=True to write the run under save_dir and upload it "
                "later with `wandb sync`"
            ) from exc
        finally:
            if self._hooks is None and (sys.excepthook, sys.exit) != before:
                # starting its service, wandb replaced sys.excepthook and sys.exit with its
                # own recorders of the exit code (not restored by wandb.teardown); put them
                # back then
                self._hooks = (*before, sys.excepthook, sys.exit)
        return self._run

    def _settings(self) -> dict[str, Any]:
        """The ``wandb.Settings`` fields: distkit's, the bound on init, then the user's."""
        settings = dict(DEFAULT_SETTINGS)
        if INIT_TIMEOUT_ENV not in os.environ:  # wandb reads the variable when it is set
            settings["init_timeout"] = INIT_TIMEOUT
        return {**settings, **self.settings}

    def _restore_hooks(self) -> None:
        hooks, self._hooks = self._hooks, None
        if hooks is None:
            return
        excepthook, exit_, wandb_excepthook, wandb_exit = hooks
        if sys.excepthook == wandb_excepthook:  # unless somebody replaced them since
            sys.excepthook = excepthook
        if sys.exit == wandb_exit:
            sys.exit = exit_


_UNTIL = (
    "The logger starts no run again, and raises this at once, until its finalize (the end of "
    "the fit)"
)


def _check_tags(tags: object) -> list[str] | None:
    if tags is None:
        return None
    if (
        isinstance(tags, Sequence)
        and not isinstance(tags, str)
        and all(isinstance(tag, str) and tag for tag in tags)
    ):
        return list(tags)
    raise ConfigurationError(
        f"WandbLogger(tags=...) must be a list of non-empty str or None, got "
        f"{type(tags).__name__}: {tags!r:.80}"
    )
