"""examples/gan.py: a GAN (two models, two optimizers) in a user loop on distkit.Runtime, end
to end under python, torchrun and horovodrun: each epoch's losses from rank 0 only, a PNG
grid of samples per epoch, and the generator's weights."""

from __future__ import annotations

import math
import re
import sys

import pytest
import torch

from tests.support.examples_import import EXAMPLES
from tests.support.gates import needs
from tests.support.horovod_runner import horovodrun_path
from tests.support.jobs import run_example

pytestmark = pytest.mark.timeout(300)
Image = pytest.importorskip("PIL.Image", reason="the sample grids need Pillow (the examples extra)")

SCRIPT = str(EXAMPLES / "gan.py")
SMALL = ["--epochs", "2", "--max-samples", "256", "--batch-size", "16"]
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]


def _check(output: str, folder, strategy: str, world: int) -> None:
    assert f"strategy={strategy}, world_size={world}" in output
    epochs = re.findall(r"^epoch (\d)/2: d_loss=(\S+) g_loss=(\S+)", output, flags=re.MULTILINE)
    assert [e[0] for e in epochs] == ["1", "2"]  # rank 0 only
    assert all(math.isfinite(float(d)) and math.isfinite(float(g)) for _, d, g in epochs)
    grids = sorted((folder / "gan_samples").glob("epoch-*.png"))
    assert [p.name for p in grids] == ["epoch-001.png", "epoch-002.png"]
    with Image.open(grids[-1]) as grid:
        assert grid.size == (2 * (8 * 30 + 2), 2 * (8 * 30 + 2))  # 8 x 8 tiles of 28 + gaps
    weights = torch.load(folder / "gen.pt", weights_only=True)
    assert "upsample.3.weight" in weights and all(torch.isfinite(w).all() for w in weights.values())


def test_gan_example_in_one_process(tmp_path):
    output = run_example([sys.executable, SCRIPT, *SMALL, "--save-weights", "gen.pt"], tmp_path)
    _check(output, tmp_path, "dp", 1)


def test_gan_example_under_torchrun(tmp_path):
    output = run_example([*TORCHRUN, SCRIPT, *SMALL, "--save-weights", "gen.pt"], tmp_path)
    _check(output, tmp_path, "ddp", 2)


@needs("horovod")
def test_gan_example_under_horovodrun(tmp_path):
    hvd = [horovodrun_path(), "-np", "2", "-H", "localhost:2", "--gloo", sys.executable]
    output = run_example([*hvd, SCRIPT, *SMALL, "--save-weights", "gen.pt"], tmp_path)
    _check(output, tmp_path, "horovod", 2)
