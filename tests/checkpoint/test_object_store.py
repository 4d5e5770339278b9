"""Checkpoints and weights on an object store, and saves that persist in the background.

S3 is real here: moto's server on loopback (tests/support/s3_server.py), reached by s3fs as
any S3 endpoint is, through ``AWS_ENDPOINT_URL``. Exactness: float64 runs, 1e-9 (a resumed
run takes the same operations in the same order as the uninterrupted one).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import sys
import threading
import time
import warnings

import pytest
import torch
from torch import nn

import distkit
from distkit import checkpoint as ckpt
from distkit.checkpoint import _shard_files, _writes
from distkit.errors import CheckpointError, ConfigurationError
from tests.support.exactness import DTYPE
from tests.support.jobs import run_job
from tests.support.paths import ROOT
from tests.support.workloads import make_dataset, max_abs_diff

TOL = 1e-9
JOB = ["-m", "tests.support.job_scripts.async_save_job"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 3)).to(DTYPE)


def _fit(folder: str | None, epochs: int, *, keep_last: int = 3, sharded: bool = False,
         **options) -> dict:  # fmt: skip
    world = int(os.environ.get("WORLD_SIZE", "1"))
    strategy = "ddp" if world > 1 else "auto"
    if sharded:
        strategy = distkit.FSDPStrategy(checkpoint="sharded")
    trainer = distkit.Trainer(
        strategy, batch_size=16 // world, max_epochs=epochs, seed=3,
        progress=False, checkpoint_dir=folder, keep_last=keep_last, **options,
    )  # fmt: skip
    model = _model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    result = trainer.fit(model, optimizer, make_dataset(64, dtype=DTYPE), loss_fn=_loss)
    out = {"state": trainer.full_state_dict(), "history": result.history}
    trainer.close()
    return out


def _loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits, target)


def _two_then_three(folder: str) -> dict:
    """2 epochs with async saves to ``folder``, then ``resume="auto"`` to 3."""
    _fit(folder, 2, checkpoint_async=True, resume="auto", keep_last=2)
    return _fit(folder, 3, checkpoint_async=True, resume="auto", keep_last=2)


def _objects(s3_endpoint, url: str) -> list[str]:
    fs = s3_endpoint.filesystem()
    return sorted(path.rsplit("/", 1)[-1] for path in fs.ls(url.removeprefix("s3://")))


# ---------------------------------------------------------------------- the Done-when run
def test_ddp_x2_async_on_s3_two_epochs_then_resume_to_three_equals_three(
    run_on_ranks, s3_bucket, s3_endpoint
):
    whole = run_on_ranks(_fit, None, 3, world_size=2)
    folder = f"{s3_bucket}/run1"
    # the ranks start from a fork server older than this test: the AWS variables go to them
    resumed = run_on_ranks(_two_then_three, folder, world_size=2, env=s3_endpoint.env())
    for rank in (0, 1):
        assert max_abs_diff(resumed[rank]["state"], whole[0]["state"]) <= TOL
    assert [r["epoch"] for r in resumed[0]["history"]] == [0, 1, 2]
    for got, want in zip(resumed[0]["history"], whole[0]["history"], strict=True):
        assert got["train_loss"] == pytest.approx(want["train_loss"], abs=TOL)
    # 4 steps an epoch at world size 2: the bucket holds the last two, and the pointer
    assert _objects(s3_endpoint, folder) == ["latest", "step-000000008.pt", "step-000000012.pt"]
    assert ckpt.load(f"{folder}/step-000000012.pt")["progress"]["epoch"] == 3


def _sharded_two_then_three(folder: str) -> dict:
    _fit(folder, 2, checkpoint_async=True, resume="auto", sharded=True)
    return _fit(folder, 3, checkpoint_async=True, resume="auto", sharded=True)


def test_fsdp_x2_sharded_async_saves_resume_exactly(run_on_ranks, tmp_path):
    """Sharded: every rank writes its shards before the save returns, the file that commits
    them persists in the background; the resumed run equals the uninterrupted one."""
    whole = run_on_ranks(functools.partial(_fit, sharded=True), None, 3, world_size=2)
    resumed = run_on_ranks(_sharded_two_then_three, str(tmp_path / "run"), world_size=2)
    assert max_abs_diff(resumed[0]["state"], whole[0]["state"]) <= TOL
    newest = ckpt.CheckpointFolder(tmp_path / "run").checkpoints()[-1]
    assert ckpt.load(newest)["shards"].endswith(".shards")


# ---------------------------------------------------------------------- one process
def test_a_checkpoint_round_trips_through_s3_and_a_damaged_object_is_refused(
    s3_bucket, s3_endpoint
):
    url = f"{s3_bucket}/a/model.pt"
    weights = {"w": torch.arange(1000, dtype=torch.float64)}
    ckpt.atomic_save({"format": ckpt.FORMAT, "version": ckpt.VERSION, "model": weights}, url)
    assert torch.equal(ckpt.load(url)["model"]["w"], weights["w"])
    fs = s3_endpoint.filesystem()
    data = bytearray(fs.cat_file(url))
    data[len(data) // 2] ^= 0x01  # one flipped bit inside the tensor's bytes
    fs.pipe_file(url, bytes(data))
    with pytest.raises(CheckpointError, match=r"s3://.*/a/model\.pt is corrupt"):
        ckpt.load(url)
    with pytest.raises(CheckpointError, match=r"no checkpoint at s3://.*/nothing\.pt"):
        ckpt.load(f"{s3_bucket}/nothing.pt")


def test_resume_auto_falls_back_from_a_damaged_object_to_the_one_before(s3_bucket, s3_endpoint):
    folder = f"{s3_bucket}/run"
    _fit(folder, 2)  # checkpoints of steps 4 and 8
    fs = s3_endpoint.filesystem()
    newest = f"{folder}/step-000000008.pt"
    data = bytearray(fs.cat_file(newest))
    data[-200] ^= 0xFF
    fs.pipe_file(newest, bytes(data))
    with pytest.warns(UserWarning, match=r"resuming from step-000000004\.pt.*skipped 1 newer"):
        resumed = _fit(folder, 2, resume="auto")
    whole = _fit(None, 2)
    assert max_abs_diff(resumed["state"], whole["state"]) <= TOL


def test_retention_on_s3_keeps_the_last_k_and_the_pointer(s3_bucket, s3_endpoint):
    folder = f"{s3_bucket}/keep"
    _fit(folder, 3, keep_last=1, checkpoint_every=2)
    assert _objects(s3_endpoint, folder) == ["latest", "step-000000012.pt"]
    assert ckpt.checkpoint_folder(folder).latest() == f"{folder}/step-000000012.pt"


def test_weights_round_trip_through_s3(s3_bucket):
    model = _model()
    with distkit.Runtime("auto", fault_timeout=None) as rt:
        written = rt.save_weights(model, f"{s3_bucket}/model", max_shard_size=1000)
    assert written[-1] == f"{s3_bucket}/model/model.safetensors.index.json"
    assert all(str(path).startswith(f"{s3_bucket}/model/") for path in written)
    fresh = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Dropout(0.2), nn.Linear(16, 3))
    loaded = distkit.load_weights(fresh.to(DTYPE), f"{s3_bucket}/model")
    assert sorted(loaded.loaded) == sorted(model.state_dict())
    assert max_abs_diff(fresh.state_dict(), model.state_dict()) == 0.0
    with pytest.raises(CheckpointError, match=r"no such file or folder: s3://.*/absent"):
        distkit.load_weights(fresh, f"{s3_bucket}/absent")


def test_storage_options_reach_the_filesystem(s3_endpoint, tmp_path, monkeypatch):
    """No AWS environment at all: the endpoint and keys come from storage_options alone."""
    for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    bucket = s3_endpoint.new_bucket()
    options = {"key": "testing", "secret": "testing", "endpoint_url": s3_endpoint.url}
    with distkit.Runtime("auto", fault_timeout=None, storage_options=options) as rt:
        model = rt.setup(_model())
        rt.save(f"{bucket}/state.pt", {"model": model, "epoch": 2})
        assert rt.load(f"{bucket}/state.pt", {"model": model}) == {"epoch": 2}
    with pytest.raises(ConfigurationError, match="storage_options must be a dict"):
        distkit.Runtime("auto", storage_options="key=testing")


def test_a_url_whose_filesystem_is_missing_names_the_extra():
    if importlib.util.find_spec("gcsfs") is not None:
        pytest.skip("gcsfs is installed here: the missing-filesystem error cannot be met")
    with pytest.raises(ConfigurationError, match=r"pip install 'distkit\[gcs\]'"):
        ckpt.load("gs://bucket/run/step-000000001.pt")
    with pytest.raises(ConfigurationError, match="does not know the scheme nosuch://"):
        ckpt.atomic_save({"a": 1}, "nosuch://bucket/x.pt")


def test_a_sharded_checkpoint_to_a_url_is_refused_naming_the_alternatives():
    with pytest.raises(CheckpointError, match=r"sharded checkpoint to s3://b/step\.pt.*'full'"):
        _shard_files.folder_for("s3://b/step.pt", "0123456789ab")


# ---------------------------------------------------------------------- rt.save(blocking=False)
def test_a_background_save_holds_the_state_of_its_call_not_what_training_did_next(tmp_path):
    path = tmp_path / "state.pt"
    gate = threading.Event()
    real = _writes.save_new

    def slow(*args, **kwargs):  # the write waits until training has changed the weights
        assert gate.wait(30)
        return real(*args, **kwargs)

    with distkit.Runtime("auto", fault_timeout=None) as rt:
        model = rt.setup(_model())
        before = {k: v.clone() for k, v in model.state_dict().items()}
        _writes.save_new = slow
        try:
            handle = rt.save(path, {"model": model, "step": 1}, blocking=False)
            assert handle is not None and not handle.done() and not path.exists()
            with torch.no_grad():
                for param in model.parameters():
                    param.add_(1.0)  # training goes on while the save persists
            gate.set()
            assert handle.wait() >= 0.0
        finally:
            _writes.save_new = real
        assert handle.done() and handle.wait() == 0.0  # a second wait returns at once
        saved = torch.load(path, weights_only=True)["model"]
    assert max_abs_diff(saved, before) == 0.0


def test_a_background_save_that_fails_raises_at_its_wait(tmp_path):
    (tmp_path / "file").write_text("not a folder")
    with distkit.Runtime("auto", fault_timeout=None) as rt:
        handle = rt.save(tmp_path / "file" / "state.pt", {"epoch": 1}, blocking=False)
        assert handle is not None
        with pytest.raises(CheckpointError, match="cannot write the checkpoint"):
            handle.wait()
        # the next save is not held up by the failed one, and a later load reads it
        rt.save(tmp_path / "ok.pt", {"epoch": 2}, blocking=False)
        assert rt.load(tmp_path / "ok.pt", {}) == {"epoch": 2}


def test_rt_save_blocking_must_be_a_bool(tmp_path):
    with distkit.Runtime("auto", fault_timeout=None) as rt:
        with pytest.raises(ConfigurationError, match="blocking must be True or False, got 'no'"):
            rt.save(tmp_path / "x.pt", {"epoch": 1}, blocking="no")
        assert not (tmp_path / "x.pt").exists()


def test_checkpoint_async_needs_a_checkpoint_dir():
    with pytest.raises(ConfigurationError, match=r"checkpoint_async=True .* checkpoint_dir"):
        distkit.Trainer(checkpoint_async=True)
    with pytest.raises(ConfigurationError, match="checkpoint_async must be"):
        distkit.Trainer(checkpoint_async="yes", checkpoint_dir="/tmp/x")


def test_the_time_a_fit_waited_for_its_last_save_is_logged(tmp_path):
    rows: list[dict] = []

    class Rows(distkit.loggers.Logger):
        def log_metrics(self, metrics, step):
            rows.append(dict(metrics))

    trainer = distkit.Trainer(
        batch_size=16, max_epochs=1, progress=False, checkpoint_dir=tmp_path,
        checkpoint_async=True, loggers=[Rows()],
    )  # fmt: skip
    model = _model()
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), make_dataset(64, dtype=DTYPE),
                loss_fn=_loss)  # fmt: skip
    trainer.close()
    assert any("checkpoint_wait_s" in row for row in rows)
    assert [p.name for p in ckpt.CheckpointFolder(tmp_path).checkpoints()] == ["step-000000004.pt"]


# ---------------------------------------------------------------------- SIGKILL mid-persist
def _job(folder: str, out, *args: str, env):
    cmd = [*TORCHRUN, *JOB, folder, str(out), *args]
    return run_job(cmd, env=env, timeout=240, cwd=ROOT)


def _job_env() -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[str, torch.Tensor]:
    """The job's final weights, never killed (once per module)."""
    where = tmp_path_factory.mktemp("whole")
    whole = _job(str(where / "checkpoints"), where, env=_job_env())
    assert whole.returncode == 0, (whole.stdout + whole.stderr)[-4000:]
    return torch.load(where / "final.pt", weights_only=True)


@pytest.mark.parametrize(
    ("store", "point"), [("local", "write"), ("s3", "write"), ("s3", "upload")]
)
def test_sigkill_during_a_background_persist_leaves_the_previous_checkpoint_newest(
    store, point, request, tmp_path, uninterrupted
):
    """torchrun x2: rank 0 is SIGKILLed while its writer persists the 2nd checkpoint (step
    8); the folder's newest committed checkpoint is step 4, and the rerun from it ends where
    the uninterrupted job ends."""
    if store == "s3":
        folder = f"{request.getfixturevalue('s3_bucket')}/killed"
    else:
        folder = str(tmp_path / "killed")
    env = _job_env()
    killed = _job(folder, tmp_path / "out", "--kill-at", f"2:{point}", env=env)
    assert killed.returncode != 0
    assert not (tmp_path / "out" / "final.pt").exists()
    listed = ckpt.checkpoint_folder(folder).checkpoints()
    assert [ckpt.step_of(p) for p in listed] == [4], killed.stderr[-3000:]
    again = _job(folder, tmp_path / "out", env=env)
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    assert max_abs_diff(torch.load(tmp_path / "out" / "final.pt"), uninterrupted) <= TOL
    if store == "local":  # the killed write's temp file is gone after the next saves
        assert not [p for p in (tmp_path / "killed").iterdir() if p.name.endswith(".tmp")]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the rerun's checkpoints all verify
        newest = ckpt.checkpoint_folder(folder).checkpoints()[-1]
        assert ckpt.load(newest)["progress"]["global_step"] == 12


def test_best_checkpoint_on_an_object_store_is_refused_before_training(s3_bucket):
    trainer = distkit.Trainer(
        batch_size=16, progress=False, checkpoint_dir=f"{s3_bucket}/best",
        callbacks=[distkit.callbacks.BestCheckpoint(monitor="train_loss")],
    )  # fmt: skip
    model = _model()
    with pytest.raises(ConfigurationError, match=r"BestCheckpoint.*on an object store"):
        trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1),
                    make_dataset(64, dtype=DTYPE), loss_fn=_loss)  # fmt: skip
    trainer.close()


def test_staging_copies_what_aliases_training_tensors_and_no_fresh_copy_twice():
    from distkit.runtime._background_save import PendingSave, stage_payload, storages

    model = _model()
    live = model.state_dict()  # the parameters themselves (a backend that returns them)
    fresh = {key: value.clone() for key, value in live.items()}  # a gathered copy
    extra = torch.zeros(3)
    staged = stage_payload(
        {"model": live, "copy": fresh, "extra": extra}, {"model": storages(model), "copy": set()}
    )
    for key, value in live.items():  # aliases of the live storages: copied
        assert staged["model"][key].data_ptr() != value.data_ptr()
        assert torch.equal(staged["model"][key], value)
    for key, value in fresh.items():  # a model entry's fresh copies: kept as they are
        assert staged["copy"][key] is value
    assert staged["extra"] is not extra and torch.equal(staged["extra"], extra)  # any other: copied
    assert repr(PendingSave(None, "x", None)) == "PendingSave('x', done)"  # type: ignore[arg-type]


def test_the_end_of_a_runtime_block_waits_for_its_background_save(tmp_path, capfd):
    real = _writes.save_new

    def slow(*args, **kwargs):
        time.sleep(1.2)
        return real(*args, **kwargs)

    _writes.save_new = slow
    try:
        with distkit.Runtime("auto", fault_timeout=None) as rt:
            model = rt.setup(_model())
            rt.save(tmp_path / "state.pt", {"model": model}, blocking=False)
            assert not (tmp_path / "state.pt").exists()
    finally:
        _writes.save_new = real
    assert ckpt.load(tmp_path / "state.pt")["model"].keys() == model.state_dict().keys()
    assert "for the checkpoint" in capfd.readouterr().err  # rank 0 says it waited
