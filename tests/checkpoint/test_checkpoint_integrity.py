"""Checkpoints prove their bytes (digests) and the trained state is on disk when fit returns.

A checkpoint that changed after it was written (one flipped bit) is refused, naming the file,
and ``resume="auto"`` falls back to the newest one that verifies, on every rank alike; a
sharded checkpoint's shard files are verified too. With ``checkpoint_dir`` set, a fit that
ends for any reason but an error leaves its final state in the folder, and resuming it
continues exactly.
"""

from __future__ import annotations

import warnings
import zipfile
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import IterableDataset

import distkit
from distkit import checkpoint as ckpt
from distkit.checkpoint import _digest
from distkit.strategies.fsdp import FSDPStrategy
from tests.support.exactness import DTYPE, TOL
from tests.support.paths import ROOT
from tests.support.workloads import make_dataset, make_mlp, max_abs_diff, without_timing

pytestmark = [pytest.mark.timeout(300)]


def _flip_a_bit_in_the_first_tensor(path: Path, byte: int = 3, bit: int = 4) -> None:
    """Flip one bit inside the data of the archive's first tensor record."""
    with zipfile.ZipFile(path) as archive:
        record = next(i for i in archive.infolist() if "/data/" in i.filename)
    start = record.header_offset + 30 + len(record.filename) + len(record.extra)
    data = bytearray(path.read_bytes())
    data[start + byte] ^= 1 << bit
    path.write_bytes(bytes(data))


def _fit(
    strategy: distkit.Strategy | str, batch: int, folder: str | None, **kwargs: Any
) -> dict[str, Any]:
    data = kwargs.pop("data", None) or make_dataset(40, dtype=DTYPE)
    trainer = distkit.Trainer(strategy, batch_size=batch, seed=5, progress=False,
                              checkpoint_dir=folder, **kwargs)  # fmt: skip
    net = make_mlp(dtype=DTYPE)  # float64: resumed runs against whole ones at 1e-9
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = trainer.fit(net, optimizer, data, loss_fn=nn.functional.cross_entropy)
    out = {
        "state": trainer.full_state_dict(),
        "history": result.history,
        "steps": trainer.global_step,
        "warnings": [str(w.message) for w in caught if "resume='auto'" in str(w.message)],
    }
    trainer.close()
    return out


def _same_history(a: list[dict], b: list[dict]) -> bool:
    """Equal epoch records (losses to float noise: one process sums in another order)."""
    a, b = without_timing(a), without_timing(b)
    return len(a) == len(b) and all(
        x == pytest.approx(y, abs=TOL) for x, y in zip(a, b, strict=True)
    )


# ---------------------------------------------------------------- digests
def test_checkpoint_with_one_flipped_bit_is_refused_naming_the_file(tmp_path):
    _fit("dp", 4, str(tmp_path), max_epochs=1)
    path = ckpt.CheckpointFolder(tmp_path).checkpoints()[-1]
    assert _digest.stored(path) is not None
    ckpt.load(path)  # verifies
    _flip_a_bit_in_the_first_tensor(path)
    with pytest.raises(ckpt.CheckpointError, match="is corrupt: its bytes differ") as caught:
        ckpt.load(path)
    assert str(path) in str(caught.value)
    # without the digest, torch would have read it: the flip lands in a weight
    assert torch.load(path, weights_only=True)[ckpt.RECORDS]["format"] == ckpt.FORMAT


def test_checkpoint_digest_stays_readable_by_plain_torch_and_zip(tmp_path):
    path = tmp_path / "c.pt"
    ckpt.atomic_save({"format": ckpt.FORMAT, "version": 1, "w": torch.arange(5.0)}, path)
    assert torch.load(path, weights_only=True)["w"].tolist() == [0, 1, 2, 3, 4]
    with zipfile.ZipFile(path) as archive:
        assert archive.testzip() is None
        assert archive.comment.startswith(_digest.MARKER)
    assert ckpt.load(path)[ckpt.INTEGRITY] == "sha256"


def test_checkpoint_whose_digest_was_cut_off_is_refused(tmp_path):
    path = tmp_path / "c.pt"
    ckpt.atomic_save({"format": ckpt.FORMAT, "version": 1, "w": torch.ones(3)}, path)
    data = path.read_bytes()
    comment = len(_digest.MARKER) + 64
    path.write_bytes(data[: -comment - 2] + b"\x00\x00")  # a zip without its comment
    with pytest.raises(ckpt.CheckpointError, match="digest at its end, and that digest is"):
        ckpt.load(path)


def test_checkpoint_without_a_digest_loads_and_says_so_once(tmp_path):
    path = tmp_path / "old.pt"
    torch.save({"format": ckpt.FORMAT, "version": 1, "w": torch.ones(2)}, path)  # as before
    with pytest.warns(UserWarning, match="carries no digest"):
        assert ckpt.load(path)["w"].tolist() == [1.0, 1.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ckpt.load(path)  # said once


def _whole_and_fallback(batch: int, folder: str) -> dict[str, Any]:
    return _fit("ddp", batch, folder, max_epochs=3, resume="auto")


def test_resume_auto_falls_back_past_a_flipped_bit_on_every_rank(tmp_path, run_on_ranks):
    whole = run_on_ranks(partial(_fit, max_epochs=3), "dp", 8, None, world_size=1)[0]
    folder = tmp_path / "ckpt"
    run_on_ranks(partial(_fit, max_epochs=2), "ddp", 4, str(folder), world_size=2)
    files = ckpt.CheckpointFolder(folder).checkpoints()
    assert [f.name for f in files] == ["step-000000005.pt", "step-000000010.pt"]
    _flip_a_bit_in_the_first_tensor(files[-1])
    resumed = run_on_ranks(_whole_and_fallback, 4, str(folder), world_size=2)
    for rank, result in enumerate(resumed):
        assert max_abs_diff(result["state"], whole["state"]) <= TOL, rank
        assert _same_history(result["history"], whole["history"]), rank
    said = resumed[0]["warnings"]
    assert len(said) == 1 and "resuming from step-000000005.pt (step 5)" in said[0]
    assert "step-000000010.pt is corrupt" in said[0]
    assert resumed[1]["warnings"] == []  # rank 0 says it


def test_resume_auto_refuses_a_folder_where_no_checkpoint_loads(tmp_path):
    _fit("dp", 4, str(tmp_path), max_epochs=1)
    for path in ckpt.CheckpointFolder(tmp_path).checkpoints():
        _flip_a_bit_in_the_first_tensor(path)
    with pytest.raises(ckpt.CheckpointError, match="none loads") as caught:
        _fit("dp", 4, str(tmp_path), max_epochs=2, resume="auto")
    assert "Move the folder aside" in str(caught.value)


def _sharded(batch: int, folder: str, **kwargs: Any) -> dict[str, Any]:
    return _fit(FSDPStrategy(checkpoint="sharded"), batch, folder, **kwargs)


def test_sharded_checkpoint_verifies_its_shard_files(tmp_path, run_on_ranks):
    folder = tmp_path / "ckpt"
    run_on_ranks(partial(_sharded, max_epochs=2), 4, str(folder), world_size=2)
    newest = ckpt.CheckpointFolder(folder).checkpoints()[-1]
    payload = ckpt.load(newest)
    shards = Path(payload["shards"])
    on_disk = sorted(p.name for p in shards.iterdir())
    assert sorted(payload["shard_digests"]) == on_disk  # every file, both ranks' included
    assert any(name.startswith("__1_") for name in on_disk)
    data = bytearray((shards / "__1_0.distcp").read_bytes())
    data[len(data) // 2] ^= 0x01
    (shards / "__1_0.distcp").write_bytes(bytes(data))
    with pytest.raises(ckpt.CheckpointError, match="has damaged shards") as caught:
        ckpt.load(newest)
    assert "__1_0.distcp" in str(caught.value)
    # resume="auto" falls back to the previous checkpoint, whose shards are intact
    found = distkit.trainer._resume.find_resume("auto", ckpt.CheckpointFolder(folder), "cpu",
                                        announce=False)  # fmt: skip
    assert found is not None and found.payload["progress"]["global_step"] == 5


def test_sharded_checkpoint_without_its_shards_folder_is_refused(tmp_path, run_on_ranks):
    folder = tmp_path / "ckpt"
    run_on_ranks(partial(_sharded, max_epochs=1), 4, str(folder), world_size=2)
    newest = ckpt.CheckpointFolder(folder).checkpoints()[-1]
    copy = tmp_path / "copied" / newest.name
    copy.parent.mkdir()
    copy.write_bytes(newest.read_bytes())  # the file without its folder
    with pytest.raises(ckpt.CheckpointError, match=r"shards folder .* is not beside it"):
        ckpt.load(copy)


# ---------------------------------------------------------------- the final checkpoint
def _steps_in(folder: Path) -> list[int]:
    return [int(ckpt.load(p)["progress"]["global_step"]) for p in
            ckpt.CheckpointFolder(folder).checkpoints()]  # fmt: skip


@pytest.mark.parametrize(("max_steps", "saved"), [(25, [10, 20, 25]), (20, [10, 20])])
def test_fit_ending_at_max_steps_leaves_its_final_checkpoint(tmp_path, max_steps, saved):
    # 40 samples in batches of 4: 10 steps an epoch; checkpoints at every epoch's end
    _fit("dp", 4, str(tmp_path), max_epochs=5, max_steps=max_steps)
    assert _steps_in(tmp_path) == saved


def test_final_checkpoint_mid_epoch_resumes_exactly(tmp_path, run_on_ranks):
    whole = run_on_ranks(partial(_fit, max_epochs=4), "dp", 8, None, world_size=1)[0]
    folder = tmp_path / "ckpt"
    run_on_ranks(partial(_fit, max_epochs=4, max_steps=13), "ddp", 4, str(folder), world_size=2)
    assert _steps_in(folder)[-1] == 13
    resumed = run_on_ranks(partial(_fit, max_epochs=4, resume="auto"), "ddp", 4, str(folder),
                           world_size=2)  # fmt: skip
    assert max_abs_diff(resumed[0]["state"], whole["state"]) <= TOL
    assert _same_history(resumed[0]["history"], whole["history"])


def test_fit_that_saved_its_last_step_writes_no_second_checkpoint(tmp_path):
    _fit("dp", 4, str(tmp_path), max_epochs=2)
    folder = ckpt.CheckpointFolder(tmp_path)
    stamps = {p.name: p.stat().st_mtime_ns for p in folder.checkpoints()}
    assert list(stamps) == ["step-000000010.pt", "step-000000020.pt"]
    _fit("dp", 4, str(tmp_path), max_epochs=2, resume="auto")  # nothing left to train
    assert {p.name: p.stat().st_mtime_ns for p in folder.checkpoints()} == stamps


class _Endless(IterableDataset):
    """An endless stream: the 40 samples of the workload, over and over."""

    def __iter__(self):
        data = make_dataset(40, dtype=DTYPE)
        i = 0
        while True:
            yield data[i % 40]
            i += 1


def test_endless_stream_with_max_steps_leaves_a_checkpoint_that_resumes(tmp_path):
    whole = _fit("dp", 4, None, max_epochs=1, max_steps=18, data=_Endless())
    _fit("dp", 4, str(tmp_path), max_epochs=1, max_steps=7, data=_Endless())
    assert _steps_in(tmp_path) == [7]
    resumed = _fit("dp", 4, str(tmp_path), max_epochs=1, max_steps=18, data=_Endless(),
                   resume="auto")  # fmt: skip
    assert resumed["steps"] == 18 and _steps_in(tmp_path) == [7, 18]
    assert max_abs_diff(resumed["state"], whole["state"]) <= TOL


class _StopAt(distkit.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_step_end(self, trainer, logs):
        if logs["step"] == self.step:
            trainer.should_stop = True


def test_fit_stopped_by_a_callback_mid_epoch_leaves_its_final_checkpoint(tmp_path):
    _fit("dp", 4, str(tmp_path), max_epochs=3, callbacks=[_StopAt(14)])
    assert _steps_in(tmp_path) == [10, 14]


# ---------------------------------------------------------------- a write that fails
_FULL_DISK = """
import resource, signal, sys
import torch
from torch import nn
import distkit
from distkit import checkpoint as ckpt
from tests.support.workloads import make_dataset, make_mlp

folder = sys.argv[1]
net = make_mlp()
trainer = distkit.Trainer("dp", batch_size=4, max_epochs=1, progress=False, checkpoint_dir=folder)
trainer.fit(net, torch.optim.SGD(net.parameters(), lr=0.1), make_dataset(40),
            loss_fn=nn.functional.cross_entropy)
size = ckpt.CheckpointFolder(folder).checkpoints()[-1].stat().st_size
# from here on no file may grow past half a checkpoint: the next save runs out of room
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (size // 2, size // 2))
trainer = distkit.Trainer("dp", batch_size=4, max_epochs=2, progress=False, checkpoint_dir=folder,
                          resume="auto")
try:
    trainer.fit(net, torch.optim.SGD(net.parameters(), lr=0.1), make_dataset(40),
                loss_fn=nn.functional.cross_entropy)
except ckpt.CheckpointError as exc:
    print("ERROR", exc)
"""


def test_checkpoint_write_that_runs_out_of_room_names_the_file_and_keeps_the_old(tmp_path):
    import subprocess
    import sys

    folder = tmp_path / "ckpt"
    done = subprocess.run([sys.executable, "-c", _FULL_DISK, str(folder)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(x for x in done.stdout.splitlines() if x.startswith("ERROR"))
    assert f"cannot write the checkpoint {folder}/step-000000020.pt" in line, line
    assert "(OSError: File too large; " in line and "GB free there" in line, line
    assert "the previous file, if any, is unchanged" in line
    assert _steps_in(folder) == [10]  # the old checkpoint is intact and verifies
    assert sorted(p.name for p in folder.iterdir()) == ["latest", "step-000000010.pt"]


# ---------------------------------------------------------------- records across a resume
def _with_validations(folder: str | None, epochs: int, resume: str | None = None) -> list:
    trainer = distkit.Trainer("dp", batch_size=4, max_epochs=epochs, progress=False, seed=5,
                              checkpoint_dir=folder, resume=resume,
                              val_every_n_steps=4)  # fmt: skip
    net = make_mlp()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    result = trainer.fit(net, optimizer, make_dataset(40), loss_fn=nn.functional.cross_entropy,
                         val_data=make_dataset(12))  # fmt: skip
    trainer.close()
    return result.validations


def test_resumed_fit_result_holds_the_earlier_validations(tmp_path):
    whole = _with_validations(None, 3)
    _with_validations(str(tmp_path), 2)
    resumed = _with_validations(str(tmp_path), 3, resume="auto")
    assert [v["step"] for v in resumed] == [v["step"] for v in whole] == [4, 8, 10, 12, 16, 20,
                                                                          24, 28, 30]  # fmt: skip
    assert all(r == pytest.approx(w) for r, w in zip(resumed, whole, strict=True))
