"""WandbLogger with the real wandb, offline: the run file read back after a fit."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import warnings
from importlib.util import find_spec
from pathlib import Path

import pytest
import torch

import distkit
import distkit.loggers
from distkit.errors import ConfigurationError, MissingDependencyError, TrainingInterrupted
from distkit.loggers import Logger, TrackerUnavailableError, WandbLogger
from tests.support.logger_runs import fit_with_logger
from tests.support.paths import ROOT
from tests.support.wandb_runs import offline_runs, read_run

pytestmark = [
    pytest.mark.timeout(120),
    # find_spec, not importorskip: the ranks import this module, and must not import wandb
    pytest.mark.skipif(find_spec("wandb") is None, reason="needs wandb (the test extra)"),
]


def _wandb_children() -> list[str]:
    """This process's wandb-core children still alive (not zombies)."""
    found = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            fields = dict(
                line.split(":\t", 1) for line in status.read_text().splitlines() if ":\t" in line
            )
        except OSError:
            continue
        mine = fields.get("PPid") == str(os.getpid()) and fields.get("State", "")[:1] != "Z"
        if mine and "wandb" in fields.get("Name", ""):
            found.append(f"{status.parent.name}: {fields['Name']}")
    return found


def test_wandb_logger_offline_fit_reads_back_metrics_config_and_exit_code(tmp_path):
    hooks = (sys.excepthook, sys.exit)
    logger = WandbLogger(project="distkit-tests", save_dir=tmp_path / "wb", offline=True)
    assert not (tmp_path / "wb").exists()  # nothing before the first call

    result = fit_with_logger(logger)  # 6 steps: log points 2, 4, 6

    (folder,) = offline_runs(tmp_path / "wb")
    run = read_run(folder)
    assert run.project == "distkit-tests"
    assert [step for step, _ in run.history["train_loss"]] == [2, 4, 6]
    assert run.history["train_loss"][-1][1] == pytest.approx(result.history[-1]["train_loss"])
    assert run.history["lr"] == [(2, 0.1), (4, 0.1), (6, 0.1)]
    assert run.config["strategy"] == "dp" and run.config["lr"] == 0.1
    assert run.config["batch_size"] == 4 and run.config["gradient_clip_norm"] is None
    assert run.exit_code == 0  # W&B: finished
    # the fit's end stopped wandb's service: no process left, no token, sys hooks back
    assert _wandb_children() == []
    assert "WANDB_SERVICE" not in os.environ
    assert (sys.excepthook, sys.exit) == hooks
    assert logger.run is None
    logger.finalize("success")  # again: nothing to do


@pytest.mark.parametrize(
    ("error", "exit_code"),
    [
        (RuntimeError("boom"), 1),  # W&B: failed
        (KeyboardInterrupt(), 255),  # wandb's own code for Ctrl-C
        (TrainingInterrupted("SIGTERM", code=143), 255),
    ],
    ids=["failed", "ctrl-c", "sigterm"],
)
def test_wandb_logger_a_fit_that_raises_ends_the_run_with_its_status(tmp_path, error, exit_code):
    logger = WandbLogger(project="distkit-tests", save_dir=tmp_path, offline=True)

    with pytest.raises(type(error)):
        fit_with_logger(logger, fail_at=error)

    run = read_run(*offline_runs(tmp_path))
    assert run.exit_code == exit_code
    assert [step for step, _ in run.history["train_loss"]] == [2]  # then step 3 raised
    assert _wandb_children() == []


def test_wandb_logger_finalize_without_a_call_creates_nothing(tmp_path):
    logger = WandbLogger(project="p", save_dir=tmp_path / "wb", offline=True, strict=True)
    logger.finalize("success")
    logger.finalize("failed")
    assert not (tmp_path / "wb").exists() and logger.strict is True


def test_wandb_logger_direct_calls_then_a_second_run_after_finalize(tmp_path):
    logger = WandbLogger(project="p", save_dir=tmp_path, offline=True, name="first", tags=["a"])
    logger.log_hyperparams({"lr": 0.1, "note": None})
    logger.log_hyperparams({"lr": 0.1, "note": None})  # the same values again: no change
    logger.log_metrics({"loss": torch.tensor(0.5), "epoch": 0}, step=1)
    assert len(_wandb_children()) == 1  # wandb-core, while the run is open
    logger.finalize("success")
    assert _wandb_children() == []
    logger.log_metrics({"loss": 0.25}, step=1)  # a later call opens another run
    logger.finalize("interrupted")

    # told apart by their exit codes: two runs started within one second share a timestamp
    first, second = sorted(map(read_run, offline_runs(tmp_path)), key=lambda r: r.exit_code)
    assert first.config == {"lr": 0.1, "note": None} and first.exit_code == 0
    assert first.history == {"loss": [(1, 0.5)], "epoch": [(1, 0)]}
    assert second.history == {"loss": [(1, 0.25)]} and second.exit_code == 255


def _rank_logs(root: str) -> tuple[list[str], bool]:
    save_dir = Path(root)
    fit_with_logger(WandbLogger(project="p", save_dir=save_dir, offline=True), strategy="ddp")
    return sorted(p.name for p in save_dir.glob("*")), "wandb" in sys.modules


def test_wandb_logger_only_rank_zero_writes_in_a_two_rank_fit(run_on_ranks, tmp_path):
    run = functools.partial(run_on_ranks, world_size=2)
    rank0, rank1 = run(_rank_logs, str(tmp_path))

    assert rank0 == (["wandb"], True)
    assert rank1[1] is False  # rank 1 never imported wandb
    (folder,) = offline_runs(tmp_path)
    run = read_run(folder)  # 12 samples a rank: 3 steps, logged at 2 and at the epoch's end
    assert [step for step, _ in run.history["train_loss"]] == [2, 3]
    assert run.config["world_size"] == 2 and run.config["strategy"] == "ddp"
    assert run.exit_code == 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"project": ""}, "WandbLogger(project=...) must be a non-empty str, got str: ''"),
        ({"project": 3}, "WandbLogger(project=...) must be a non-empty str, got int: 3"),
        ({"project": "p", "save_dir": None}, "WandbLogger(save_dir=...) must be a folder path"),
        ({"project": "p", "offline": "yes"}, "WandbLogger(offline=...) must be True or False"),
        ({"project": "p", "tags": "a"}, "WandbLogger(tags=...) must be a list of non-empty str"),
        ({"project": "p", "name": ""}, "WandbLogger(name=...) must be a non-empty str or None"),
        ({"project": "p", "settings": ["x"]}, "WandbLogger(settings=...) must be a mapping"),
    ],
)
def test_wandb_logger_bad_arguments_are_refused_naming_them(kwargs, message):
    with pytest.raises(ConfigurationError) as info:
        WandbLogger(**kwargs)
    assert message in str(info.value)


def test_wandb_logger_save_dir_under_a_regular_file_is_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")

    with pytest.raises(ConfigurationError) as info:
        WandbLogger(project="p", save_dir=tmp_path / "notes.txt" / "runs", offline=True)

    assert f"{str(tmp_path / 'notes.txt')!r} is a file, not a folder; pass a save_dir" in str(
        info.value
    )


def test_wandb_logger_without_wandb_says_which_extra_to_install(tmp_path, monkeypatch):
    real_find_spec = distkit.loggers._wandb.find_spec
    monkeypatch.setattr(
        distkit.loggers._wandb,
        "find_spec",
        lambda name, *args: None if name == "wandb" else real_find_spec(name, *args),
    )

    with pytest.raises(MissingDependencyError) as info:
        WandbLogger(project="p", save_dir=tmp_path)
    assert "WandbLogger needs the 'wandb' package" in str(info.value)
    assert "pip install 'distkit[wandb]'" in str(info.value)


class _Nothing(Logger):
    def log_metrics(self, metrics, step):
        pass


@pytest.mark.parametrize(
    ("environment", "settings", "init_timeout"),
    [({}, None, 30.0), ({"WANDB_INIT_TIMEOUT": "5"}, None, None), ({}, {"init_timeout": 7}, 7.0)],
    ids=["distkit's", "the user's variable", "the user's setting"],
)
def test_wandb_logger_a_failed_wandb_init_is_tried_once_a_fit_and_reported_once(
    tmp_path, monkeypatch, environment, settings, init_timeout
):
    import wandb

    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)  # online: the key is there, the server is not
    monkeypatch.setenv("WANDB_SILENT", "true")  # else wandb.login asks the server who it is (5 s)
    monkeypatch.delenv("WANDB_INIT_TIMEOUT", raising=False)
    for name, value in environment.items():
        monkeypatch.setenv(name, value)
    tries = []

    def server_down(**kwargs):
        chosen = kwargs["settings"]
        tries.append(chosen.init_timeout if "init_timeout" in chosen.model_fields_set else None)
        # what wandb 0.31 raises once init_timeout (90 s by default) has passed, each call
        raise wandb.errors.CommError('Timed out while retrying: Post "http://127.0.0.1:9/graphql"')

    monkeypatch.setattr(wandb, "init", server_down)
    logger = WandbLogger(project="p", save_dir=tmp_path, settings=settings)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fit_with_logger(logger)  # hyperparams, 3 log points, the epoch's row

    assert tries == [init_timeout]  # not tried again in this fit
    reports = [str(w.message) for w in caught if "(WandbLogger)" in str(w.message)]
    assert len(reports) == 1, reports
    assert (
        "failed in log_hyperparams: TrackerUnavailableError: WandbLogger(project='p'): "
        "wandb.init failed (CommError: Timed out while retrying" in reports[0]
    )
    assert "pass settings={'init_timeout': ...} for a slow one, or offline=True" in reports[0]
    expected = fit_with_logger(_Nothing())
    assert [row["train_loss"] for row in result.history] == [
        row["train_loss"] for row in expected.history
    ]
    assert _wandb_children() == [] and logger.run is None
    with pytest.raises(TrackerUnavailableError, match=r"wandb\.init failed"):
        logger.log_metrics({"loss": 1.0}, step=1)  # after finalize: tried again
    logger.finalize("success")
    assert tries == [init_timeout, init_timeout]


def test_wandb_logger_online_without_an_api_key_raises_instead_of_prompting(tmp_path):
    probe = (
        "from distkit.loggers import WandbLogger\n"
        "logger = WandbLogger(project='p', save_dir='runs')\n"
        "try:\n"
        "    logger.log_metrics({'loss': 1.0}, step=1)\n"
        "except Exception as exc:\n"
        "    print(type(exc).__name__, exc)\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), NETRC=str(tmp_path / "netrc"), PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=tmp_path, env=env, stdin=subprocess.DEVNULL,
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert result.stdout.startswith("ConfigurationError WandbLogger(offline=False) found no W&B")
    assert not (tmp_path / "runs").exists()


_NO_NETWORK_PROBE = """
import atexit, socket
tried = []
def report():
    print(tried)
atexit.register(report)  # registered first: runs last, after wandb's own exit hooks
real_connect, real_lookup = socket.socket.connect, socket.getaddrinfo
def connect(sock, address):
    if sock.family != socket.AF_UNIX:
        tried.append(("connect", address))
    return real_connect(sock, address)
def lookup(host, *args, **kwargs):
    tried.append(("getaddrinfo", host))
    return real_lookup(host, *args, **kwargs)
socket.socket.connect, socket.getaddrinfo = connect, lookup
from distkit.loggers import WandbLogger
logger = WandbLogger(project="p", save_dir="runs", offline=True)
logger.log_hyperparams({"lr": 0.1})
logger.log_metrics({"loss": 1.0}, step=1)
logger.finalize("success")
"""


def test_wandb_logger_offline_tries_no_network_and_prompts_for_nothing(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(HOME=str(tmp_path), NETRC=str(tmp_path / "netrc"), PYTHONPATH=str(ROOT))
    result = subprocess.run(
        [sys.executable, "-c", _NO_NETWORK_PROBE], cwd=tmp_path, env=env,
        stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert result.stdout.strip() == "[]", result.stdout
    assert len(offline_runs(tmp_path / "runs")) == 1


def test_loggers_import_leaves_wandb_and_mlflow_unimported():
    probe = (
        "import sys, distkit, distkit.loggers; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'wandb', 'mlflow'}))"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True
    )
    assert result.stdout.strip() == "[]"
