"""Both examples under the launchers the other example tests do not cover: horovodrun (the
script picks Horovod by itself) and the legacy torch.distributed.launch."""

from __future__ import annotations

import sys

import pytest

from tests.support.gates import needs
from tests.support.horovod_runner import horovodrun_path
from tests.support.jobs import run_example
from tests.support.paths import ROOT

pytestmark = pytest.mark.timeout(300)

needs_horovod = needs("horovod")


@needs_horovod
def test_examples_mnist_under_horovodrun_picks_horovod(tmp_path):
    hvd = [horovodrun_path(), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable]
    out = run_example([*hvd, str(ROOT / "examples" / "mnist.py"), "--epochs", "1",
                       "--max-samples", "512"], tmp_path)  # fmt: skip
    assert "strategy=horovod, world_size=2" in out
    assert out.count("test accuracy:") == 1  # rank 0 only


@needs_horovod
def test_examples_seg_under_horovodrun_with_sync_bn(tmp_path):
    hvd = [horovodrun_path(), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable]
    out = run_example([*hvd, str(ROOT / "examples" / "seg.py"), "--epochs", "1", "--sync-bn",
                       "--num-samples", "32", "--crop-size", "32", "--clip-norm", "0.5",
                       "--checkpoint-dir", str(tmp_path / "ckpt"), "--best-checkpoint",
                       "--log-dir", str(tmp_path / "logs"), "--log-every", "1",
                       "--val-every", "1"], tmp_path)  # fmt: skip
    assert "strategy=horovod, world_size=2" in out and "sync_bn=True" in out
    assert "clip_norm=0.5" in out and out.count("val mIoU:") == 1
    # 32 samples / (2 x 16): 1 step; BestCheckpoint on mIoU and the CSV log, by rank 0 only
    assert len(list((tmp_path / "ckpt").glob("best-val_seg_miou=*-step-000000001.pt"))) == 1
    rows = (tmp_path / "logs" / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("step,train_loss,lr,epoch,grad_norm") and len(rows) == 3


def test_examples_mnist_under_legacy_torch_distributed_launch(tmp_path):
    launch = [sys.executable, "-m", "torch.distributed.launch", "--nproc_per_node", "2"]
    out = run_example([*launch, str(ROOT / "examples" / "mnist.py"), "--epochs", "1",
                       "--max-samples", "256"], tmp_path)  # fmt: skip
    assert "strategy=ddp, world_size=2" in out
