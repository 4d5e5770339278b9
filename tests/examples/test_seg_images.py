"""The segmentation example's pictures: input | true mask | predicted mask, one PNG per sample,
with one fixed palette; and the script writing them on rank 0 only."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.support.examples_import import EXAMPLES, LAUNCHER_VARS
from tests.support.examples_import import load_example as _load

pytestmark = pytest.mark.timeout(120)

Image = pytest.importorskip("PIL.Image", reason="the pictures need Pillow (the examples extra)")

seg_data = _load("seg_data", "seg_data.py")
seg_model = _load("seg_model", "seg_model.py")
seg_images = _load("seg_images", "seg_images.py")


def test_palette_is_fixed_distinct_and_ignores_in_white():
    colours = seg_images.palette()
    assert colours.shape == (256, 3) and colours.dtype == np.uint8
    assert colours[:5].tolist() == [[0, 0, 0], [230, 25, 75], [60, 180, 75], [0, 130, 200],
                                     [245, 130, 48]]  # fmt: skip
    assert len({tuple(c) for c in colours[: seg_data.ADE20K_CLASSES]}) == seg_data.ADE20K_CLASSES
    assert colours[seg_data.IGNORE_INDEX].tolist() == [255, 255, 255]
    assert np.array_equal(colours, seg_images.palette())  # the same in every run


def test_side_by_side_puts_input_truth_and_prediction_in_a_row():
    sample = seg_data.SyntheticShapes(1, size=32, seed=0).sample(0)
    image = seg_data.normalize(sample.image)
    target = torch.from_numpy(sample.mask)
    predicted = torch.zeros_like(target)  # all background
    picture = seg_images.side_by_side(image, target, predicted, seg_images.palette())
    scale = seg_images.MIN_HEIGHT // 32  # 8: small samples are scaled up to be seen
    width = 32 * scale
    assert picture.shape == (256, 3 * width + 2 * seg_images.GAP, 3)
    left = picture[:, :width]
    expected = np.round(np.clip(sample.image, 0, 1) * 255).astype(np.uint8)
    assert np.abs(left[::scale, ::scale].astype(int) - expected).max() <= 1  # the input, back
    middle = picture[:, width + seg_images.GAP : 2 * width + seg_images.GAP]
    np.testing.assert_array_equal(middle[::scale, ::scale], seg_images.palette()[sample.mask])
    right = picture[:, -width:]
    assert (right == 0).all()  # background is black
    assert (picture[:, width : width + seg_images.GAP] == 255).all()  # a white gap


def test_save_predictions_writes_count_pngs_of_the_expected_size(tmp_path):
    torch.manual_seed(0)
    model = seg_model.build_model(seg_data.SYNTHETIC_CLASSES)
    data = seg_data.SyntheticShapes(5, size=64, seed=0, split="val")
    paths = seg_images.save_predictions(model, data, tmp_path / "out", count=3)
    assert [p.name for p in paths] == ["val_000.png", "val_001.png", "val_002.png"]
    for path in paths:
        with Image.open(path) as picture:
            assert picture.format == "PNG" and picture.mode == "RGB"
            assert picture.size == (3 * 256 + 2 * seg_images.GAP, 256)
    assert len(seg_images.save_predictions(model, data, tmp_path / "all", count=99)) == 5


def test_script_saves_pictures_on_rank_0_and_says_where(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env["OMP_NUM_THREADS"] = "1"
    out = tmp_path / "pictures"
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(EXAMPLES / "seg.py"), "--epochs", "1", "--num-samples", "32", "--crop-size", "32",
         "--save-images", "3", "--out-dir", str(out)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=100,
    )  # fmt: skip
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    lines = [line for line in done.stdout.splitlines() if line.startswith("predictions: ")]
    assert lines == [
        f"predictions: 3 validation images (input | true mask | predicted mask) in {out}"
    ]
    assert sorted(p.name for p in out.iterdir()) == ["val_000.png", "val_001.png", "val_002.png"]
    with Image.open(out / "val_000.png") as picture:
        assert picture.size == (3 * 256 + 2 * seg_images.GAP, 256)
