"""The streaming example: its tar shards and seekable stream in-process, then the script end to
end under every CPU launcher (the same final weights as one process with the global batch),
resumed mid-stream (it seeks, and ends where the uninterrupted run ends) and sharded by rank."""

from __future__ import annotations

import os
import re
import sys
import tarfile
from pathlib import Path

import pytest
import torch

from tests.support.examples_import import EXAMPLES
from tests.support.examples_import import load_example as _load
from tests.support.gates import needs
from tests.support.horovod_runner import horovodrun_path
from tests.support.jobs import run_example
from tests.support.mpi import mpirun_path
from tests.support.workloads import max_abs_diff

# above two jobs of run_example's 150 s: a hang shows its stacks
pytestmark = pytest.mark.timeout(420)

example_cli = _load("example_cli", "example_cli.py")
stream_data = _load("stream_data", "stream_data.py")
stream = _load("stream_example", "stream.py")

SCRIPT = str(EXAMPLES / "stream.py")
# 4 train shards of 250 (+ 2 val shards): 32 global batches of 32 per epoch, the last one of 8
SMALL = ["--shards", "4", "--shard-size", "250", "--epochs", "2"]
BATCH = 16  # per process, 2 processes; one process takes 32
#: the example trains float32 (its shards are float32 arrays): 2 ranks against one process
#: differ by summation order only, measured 1.2e-7 for every launch here (2026-12-03, 2 epochs
#: of SGD); a sample counted twice or missed moves the weights by 1e-3 or more
TOLERANCE = 1e-5
MIN_ACCURACY = 0.9  # chance is 1/8
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _accuracy(output: str) -> float:
    found = re.findall(r"^val accuracy: (\d\.\d+)", output, flags=re.MULTILINE)
    assert len(found) == 1, output[-3000:]  # rank 0 only
    return float(found[0])


def _weights(path: Path) -> dict[str, torch.Tensor]:
    return torch.load(path, weights_only=True)


@pytest.fixture(scope="module")
def one_process(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor], str]:
    """A plain python run at batch 32 (the reference); it writes the shards, as a first run."""
    folder = tmp_path_factory.mktemp("one")
    output = run_example([sys.executable, SCRIPT, *SMALL, "--batch-size", str(2 * BATCH),
                          "--data-dir", "shards", "--save-weights", "w.pt"], folder)  # fmt: skip
    return folder / "shards", _weights(folder / "w.pt"), output


def _launch(launcher: list[str], data: Path, out: Path, *extra: str) -> tuple[str, dict]:
    output = run_example([*launcher, SCRIPT, *SMALL, "--batch-size", str(BATCH), "--data-dir",
                          str(data), "--save-weights", str(out / "w.pt"), *extra], out)  # fmt: skip
    return output, _weights(out / "w.pt")


def _same_as_one_process(output: str, weights: dict, one_process) -> None:
    _, reference, reference_output = one_process
    assert "data: found 4 train and 2 val shards" in output  # not written again
    assert max_abs_diff(weights, reference) <= TOLERANCE
    assert _accuracy(output) == _accuracy(reference_output)


# ------------------------------------------------------------------------------ in-process
def test_stream_data_shards_are_tars_of_npy_and_cls_with_an_index(tmp_path):
    layout = stream_data.Layout(train_shards=3, val_shards=1, shard_size=20)
    index, wrote = stream_data.ensure_shards(tmp_path, layout)
    assert wrote and [e["samples"] for e in index["train"]] == [20, 20, 20]
    with tarfile.open(tmp_path / "train-000001.tar") as tar:
        names = tar.getnames()
    assert names[:2] == ["train000001000000.x.npy", "train000001000000.cls"] and len(names) == 40
    assert not list(tmp_path.glob(".writing-*"))  # the scratch folder is gone
    x, y = next(iter(stream_data.ShardStream.from_index(tmp_path, index, "val")))
    assert x.shape == (layout.features,) and x.dtype == torch.float32
    assert y.dtype == torch.int64 and 0 <= int(y) < layout.classes
    # found again as written; another layout, or no index (an unfinished write), rewrites
    assert stream_data.ensure_shards(tmp_path, layout) == (index, False)
    assert stream_data.ensure_shards(tmp_path, stream_data.Layout(train_shards=2))[1]
    (tmp_path / stream_data.INDEX).unlink()
    assert stream_data.ensure_shards(tmp_path, layout)[1]


def test_stream_iter_from_skips_shards_unopened_and_samples_undecoded(tmp_path, monkeypatch):
    layout = stream_data.Layout(train_shards=3, val_shards=1, shard_size=20)
    index = stream_data.write_shards(tmp_path, layout)
    reader = stream_data.ShardStream.from_index(tmp_path, index, "train", shuffle_seed=5)
    reader.set_epoch(1)
    whole = list(reader)
    decoded: list[str] = []
    opened: list[str] = []
    decode, read_shard = stream_data._decode, stream_data.read_shard
    monkeypatch.setattr(stream_data, "_decode", lambda p, k, parts: decoded.append(k) or
                        decode(p, k, parts))  # fmt: skip
    monkeypatch.setattr(stream_data, "read_shard", lambda path, *a, **k: opened.append(path.name)
                        or read_shard(path, *a, **k))  # fmt: skip
    lines: list[str] = []
    reader.log = lines.append
    for position in (0, 7, 20, 47, 60):
        decoded.clear()
        opened.clear()
        tail = list(reader.iter_from(position))
        assert len(tail) == 60 - position and len(decoded) == 60 - position
        assert all(torch.equal(a[0], b[0]) for a, b in zip(tail, whole[position:], strict=True))
        assert len(opened) == 3 - position // 20  # the skipped shards are never opened
    assert lines[3] == "stream: seeking: skipped 2 shard(s) unopened, then to 7 samples into " + (
        reader.files()[2][0] + " undecoded"
    )


def test_stream_shards_by_rank_split_each_epochs_order(tmp_path):
    index = stream_data.write_shards(tmp_path, stream_data.Layout(train_shards=5, shard_size=4))

    def files(epoch: int, rank: int, world: int) -> list[str]:
        reader = stream_data.ShardStream.from_index(
            tmp_path, index, "train", shuffle_seed=0, rank=rank, world_size=world
        )
        reader.set_epoch(epoch)
        return [name for name, _ in reader.files()]

    for epoch in (0, 1):
        shares = [files(epoch, rank, 2) for rank in (0, 1)]
        assert [len(s) for s in shares] == [3, 2]
        assert sorted(shares[0] + shares[1]) == sorted(files(epoch, 0, 1))
    assert files(0, 0, 1) != files(1, 0, 1)  # shuffled per epoch, the same on every rank


def test_stream_a_shard_shorter_than_its_index_is_refused(tmp_path):
    index = stream_data.write_shards(tmp_path, stream_data.Layout(train_shards=1, shard_size=4))
    reader = stream_data.ShardStream(tmp_path, [(index["train"][0]["file"], 5)])
    with pytest.raises(stream_data.ShardError, match="holds 4 samples, its index says 5"):
        list(reader)


def test_stream_example_an_unwritable_data_dir_is_one_error_line(tmp_path, capsys):
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    assert stream.main(["--strategy", "dp", "--data-dir", str(not_a_folder)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_stream_example_options_are_checked():
    with pytest.raises(SystemExit):
        stream.parse_args(["--checkpoint-every", "5"])  # needs --checkpoint-dir
    with pytest.raises(SystemExit):
        stream.parse_args(["--shards", "0"])


# ------------------------------------------------------------------------------ launchers
def test_stream_example_one_process_writes_the_shards_and_learns(one_process):
    data, _, output = one_process
    assert "data: wrote 4 train and 2 val shards" in output and (data / "index.json").is_file()
    assert "strategy=dp, world_size=1" in output and "sharded by distkit" in output
    assert _accuracy(output) >= MIN_ACCURACY


def test_stream_example_torchrun_with_workers_ends_like_one_process(tmp_path, one_process):
    output, weights = _launch(TORCHRUN, one_process[0], tmp_path, "--num-workers", "2")
    assert "strategy=ddp, world_size=2" in output and "2 worker(s) per process" in output
    _same_as_one_process(output, weights, one_process)


@needs("horovod")
def test_stream_example_horovodrun_ends_like_one_process(tmp_path, one_process):
    hvd = [horovodrun_path(), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable]
    output, weights = _launch(hvd, one_process[0], tmp_path, "--num-workers", "2")
    assert "strategy=horovod, world_size=2" in output
    _same_as_one_process(output, weights, one_process)


@needs("mpirun")
def test_stream_example_mpirun_ends_like_one_process(tmp_path, one_process):
    as_root = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    # one thread per rank: example_cli.limit_threads does not recognise mpirun
    mpirun = [mpirun_path(), *as_root, "--oversubscribe", "-x", "OMP_NUM_THREADS=1", "-np", "2",
              sys.executable]  # fmt: skip
    output, weights = _launch(mpirun, one_process[0], tmp_path, "--strategy", "ddp")
    assert "strategy=ddp, world_size=2" in output and "0 worker(s) per process" in output
    _same_as_one_process(output, weights, one_process)


def test_stream_example_resumes_mid_stream_by_seeking(tmp_path, one_process):
    """40 steps (8 into epoch 2: 256 samples, 1 shard and 6 samples), then the rest."""
    data, reference, reference_output = one_process
    common = ["--num-workers", "2", "--checkpoint-dir", str(tmp_path / "ckpt")]
    first = run_example([*TORCHRUN, SCRIPT, *SMALL, "--batch-size", str(BATCH), "--data-dir",
                         str(data), *common, "--max-steps", "40", "--checkpoint-every", "20"],
                        tmp_path)  # fmt: skip
    assert "stopped at step 40 (--max-steps)" in first and "seeking" not in first
    output, weights = _launch(TORCHRUN, data, tmp_path, *common, "--resume")
    assert "resumed: at step 40 (epoch 2)" in output
    seek = "seeking: skipped 1 shard(s) unopened, then to 6 samples into train-0000"
    assert output.count(seek) == 2  # rank 0's two workers, each once (the others are quiet)
    assert max_abs_diff(weights, reference) <= TOLERANCE
    assert _accuracy(output) == _accuracy(reference_output)


def test_stream_example_sharded_by_rank_writes_once_and_learns(tmp_path):
    output, weights = _launch(TORCHRUN, tmp_path / "fresh", tmp_path, "--shard-by-rank")
    assert output.count("data: wrote 4 train and 2 val shards") == 1  # rank 0; rank 1 waited
    assert "sharded by rank: each process reads 2 of the shards" in output
    assert _accuracy(output) >= MIN_ACCURACY
    assert set(weights) == {"0.weight", "0.bias", "2.weight", "2.bias"}
