"""The segmentation example: synthetic and ADE20K data, the DeepLabV3+ model, the script end to end.

The ADE20K tests write a tiny fake folder with Pillow and are skipped where Pillow (an optional
dependency of this example) is not installed.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import distkit
from distkit.data import GlobalBatchPlan
from tests.support.examples_import import EXAMPLES, LAUNCHER_VARS
from tests.support.examples_import import load_example as _load

pytestmark = pytest.mark.timeout(180)


example_cli = _load("example_cli", "example_cli.py")
seg_data = _load("seg_data", "seg_data.py")
seg_model = _load("seg_model", "seg_model.py")
seg_images = _load("seg_images", "seg_images.py")
seg = _load("seg_example", "seg.py")


# ------------------------------------------------------------------------------------ synthetic
def _equal_samples(a, b, indices) -> bool:
    return all(torch.equal(a[i][0], b[i][0]) and torch.equal(a[i][1], b[i][1]) for i in indices)


def test_synthetic_same_seed_gives_identical_tensors_in_any_order():
    a = seg_data.SyntheticShapes(16, size=32, seed=7)
    b = seg_data.SyntheticShapes(16, size=32, seed=7)
    later = b[9]  # generated per index: no state carried from one sample to the next
    assert _equal_samples(a, b, range(16))
    assert torch.equal(a[9][0], later[0]) and torch.equal(a[9][1], later[1])


def test_synthetic_different_seed_or_split_gives_different_samples():
    a = seg_data.SyntheticShapes(8, size=32, seed=0)
    other_seed = seg_data.SyntheticShapes(8, size=32, seed=1)
    val = seg_data.SyntheticShapes(8, size=32, seed=0, split="val")
    for other in (other_seed, val):
        assert not any(torch.equal(a[i][0], other[i][0]) for i in range(8))
        assert not all(torch.equal(a[i][1], other[i][1]) for i in range(8))


def test_synthetic_sample_types_shapes_and_class_ids():
    data = seg_data.SyntheticShapes(64, size=48, seed=0)
    seen = torch.zeros(seg_data.SYNTHETIC_CLASSES, dtype=torch.long)
    for image, mask in (data[i] for i in range(len(data))):
        assert image.shape == (3, 48, 48) and image.dtype == torch.float32
        assert mask.shape == (48, 48) and mask.dtype == torch.int64
        assert mask.min() >= 0 and mask.max() < seg_data.SYNTHETIC_CLASSES
        seen += torch.bincount(mask.flatten(), minlength=seg_data.SYNTHETIC_CLASSES)
    assert (seen > 0).all(), f"every class appears: {seen.tolist()}"
    assert seg_data.SyntheticShapes.num_classes == 5


def test_synthetic_mask_is_exactly_the_painted_pixels():
    # Without noise every shape's fill is one exact colour, so the mask can be rebuilt from the
    # image alone: paint-order replay of "pixels of this shape's colour". Any shift, resampling
    # or different inside-test between painting and labelling breaks the equality.
    clean = seg_data.SyntheticShapes(24, size=40, seed=3, noise=0.0)
    noisy = seg_data.SyntheticShapes(24, size=40, seed=3)
    for i in range(len(clean)):
        sample = clean.sample(i)
        rebuilt = np.zeros_like(sample.mask)
        for shape in sample.shapes:
            painted = np.all(sample.image == np.float32(shape.color), axis=-1)
            rebuilt[painted] = shape.class_id
        np.testing.assert_array_equal(rebuilt, sample.mask)
        # the topmost shape is whole: every pixel of its region carries its class
        top = sample.shapes[-1]
        assert (sample.mask[seg_data.shape_region(top, 40)] == top.class_id).all()
        # noise changes pixels, never the layout
        np.testing.assert_array_equal(noisy.sample(i).mask, sample.mask)


def test_shape_region_circle_matches_pixel_centres():
    cx, cy, r = 12.3, 17.8, 6.4
    circle = seg_data.Shape("circle", (cx, cy, r), (1.0, 0.0, 0.0))
    region = seg_data.shape_region(circle, 32)
    expected = np.zeros((32, 32), dtype=bool)
    for row in range(32):
        for col in range(32):
            expected[row, col] = (col + 0.5 - cx) ** 2 + (row + 0.5 - cy) ** 2 <= r * r
    np.testing.assert_array_equal(region, expected)
    assert abs(region.sum() - math.pi * r * r) < 2 * math.pi * r  # area, up to the rim
    rows, cols = np.nonzero(region)
    assert abs(cols.mean() + 0.5 - cx) < 0.5 and abs(rows.mean() + 0.5 - cy) < 0.5


def test_shape_region_ring_has_a_hole_and_triangle_is_convex_hull():
    ring = seg_data.Shape("ring", (16.0, 16.0, 8.0, 4.0), (0.0, 1.0, 0.0))
    region = seg_data.shape_region(ring, 32)
    assert not region[16, 16] and region[16, 16 + 6] and not region[16, 16 + 9]
    triangle = seg_data.Shape("triangle", (2.0, 2.0, 30.0, 2.0, 2.0, 30.0), (0.0, 0.0, 1.0))
    region = seg_data.shape_region(triangle, 32)
    assert region[3, 3] and not region[29, 29]
    assert abs(region.sum() - 28 * 28 / 2) < 30


# ------------------------------------------------------------------------------------ ADE20K
QUADRANT_VALUES = {"top_left": 0, "top_right": 150, "bottom_left": 1, "bottom_right": 77}
QUADRANT_TARGETS = {"top_left": 255, "top_right": 149, "bottom_left": 0, "bottom_right": 76}


def _quadrant_mask(height: int, width: int) -> np.ndarray:
    mask = np.empty((height, width), dtype=np.uint8)
    h, w = height // 2, width // 2
    mask[:h, :w] = QUADRANT_VALUES["top_left"]
    mask[:h, w:] = QUADRANT_VALUES["top_right"]
    mask[h:, :w] = QUADRANT_VALUES["bottom_left"]
    mask[h:, w:] = QUADRANT_VALUES["bottom_right"]
    return mask


def write_ade20k(root: Path, *, size: tuple[int, int] = (48, 40)) -> Path:
    """Two training pairs and one validation pair, as ADEChallengeData2016 lays them out."""
    image_module = pytest.importorskip("PIL.Image")
    width, height = size
    for split, names in (
        ("training", ["ADE_train_1", "ADE_train_2"]),
        ("validation", ["ADE_val_1"]),
    ):
        (root / "images" / split).mkdir(parents=True, exist_ok=True)
        (root / "annotations" / split).mkdir(parents=True, exist_ok=True)
        for name in names:
            pixels = np.full((height, width, 3), (200, 30, 30), dtype=np.uint8)
            image_module.fromarray(pixels).save(root / "images" / split / f"{name}.jpg")
            mask = image_module.fromarray(_quadrant_mask(height, width), mode="L")
            mask.save(root / "annotations" / split / f"{name}.png")
    return root


def test_ade20k_to_train_ids_maps_other_to_ignore_and_shifts_classes():
    values = np.array([[0, 1, 2], [149, 150, 151]], dtype=np.uint8)
    targets = seg_data.to_train_ids(values)
    assert targets.dtype == np.int64
    assert targets.tolist() == [[255, 0, 1], [148, 149, 255]]


def test_ade20k_validation_sample_is_resized_centre_cropped_and_mapped(tmp_path):
    root = write_ade20k(tmp_path)
    val = seg_data.ADE20K(root, split="val", crop_size=32)
    assert len(val) == 1
    image, target = val[0]
    assert image.shape == (3, 32, 32) and image.dtype == torch.float32
    assert target.shape == (32, 32) and target.dtype == torch.int64
    assert target[0, 0] == QUADRANT_TARGETS["top_left"] == 255  # 0 ("other") -> ignored
    assert target[0, -1] == QUADRANT_TARGETS["top_right"] == 149  # class 150 -> 149
    assert target[-1, 0] == QUADRANT_TARGETS["bottom_left"] == 0  # class 1 -> 0
    assert target[-1, -1] == QUADRANT_TARGETS["bottom_right"] == 76
    assert set(target.unique().tolist()) == set(QUADRANT_TARGETS.values())
    red = (200 / 255 - seg_data.MEAN[0]) / seg_data.STD[0]  # normalised with ImageNet's stats
    assert abs(image[0].mean().item() - red) < 0.1


def test_ade20k_training_samples_are_random_crops_with_valid_targets(tmp_path):
    root = write_ade20k(tmp_path)
    train = seg_data.ADE20K(root, split="train", crop_size=24)
    assert len(train) == 2
    torch.manual_seed(0)
    for _ in range(6):
        image, target = train[1]
        assert image.shape == (3, 24, 24) and target.shape == (24, 24)
        assert set(target.unique().tolist()) <= set(QUADRANT_TARGETS.values())


def test_load_seg_data_finds_ade20k_and_its_subfolder(tmp_path):
    write_ade20k(tmp_path / seg_data.ADE20K_SUBDIR)
    data = seg_data.load_seg_data(tmp_path, crop_size=32)
    assert data.kind == "ade20k" and data.num_classes == 150
    assert (len(data.train), len(data.val)) == (2, 1)
    assert data.describe() == (
        f"ADE20K from {tmp_path / seg_data.ADE20K_SUBDIR} (2 train / 1 val images, 150 classes)"
    )


def test_ade20k_partial_layout_names_what_is_missing(tmp_path):
    (tmp_path / "images" / "training").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match="lacks images/validation, annotations/training"):
        seg_data.load_seg_data(tmp_path)


def test_ade20k_image_without_mask_is_named(tmp_path):
    root = write_ade20k(tmp_path)
    (root / "annotations" / "training" / "ADE_train_2.png").unlink()
    with pytest.raises(seg_data.SegDataError, match=r"1 image\(s\) .* ADE_train_2\.jpg"):
        seg_data.ADE20K(root, split="train")


def test_ade20k_without_pillow_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "PIL", None)  # import PIL now fails, installed or not
    with pytest.raises(ImportError, match="optional dependency of this example: pip install"):
        seg_data.ADE20K(tmp_path, split="train")


def test_no_ade20k_folder_gives_labelled_synthetic_data(tmp_path):
    data = seg_data.load_seg_data(tmp_path / "empty", crop_size=32, num_samples=40, seed=1)
    assert data.kind == "synthetic" and data.num_classes == 5
    assert (len(data.train), len(data.val)) == (40, 10)
    assert data.describe().startswith(
        f"no ADE20K folder at {tmp_path / 'empty'}; using a synthetic shapes dataset "
        "(40 train / 10 val, 5 classes"
    )
    assert "(no --data-dir)" in seg_data.load_seg_data(None, num_samples=8).describe()


# ------------------------------------------------------------------------------------ the model
def test_model_output_has_input_size_and_one_channel_per_class():
    model = seg_model.build_model(num_classes=7).eval()
    with torch.no_grad():
        for h, w in ((64, 64), (50, 70)):
            assert model(torch.randn(2, 3, h, w)).shape == (2, 7, h, w)
    assert 100_000 < sum(p.numel() for p in model.parameters()) < 1_000_000


def test_model_has_atrous_encoder_aspp_and_a_skip_connection():
    model = seg_model.build_model(num_classes=5)
    dilated_in_encoder = [
        m for m in model.encoder.modules() if isinstance(m, torch.nn.Conv2d) and m.dilation[0] > 1
    ]
    assert len(dilated_in_encoder) >= 2
    aspp = model.aspp
    assert isinstance(aspp, seg_model.ASPP)
    rates = sorted(
        m.dilation[0]
        for branch in aspp.branches
        for m in branch.modules()
        if isinstance(m, torch.nn.Conv2d) and m.kernel_size == (3, 3)
    )
    assert len(rates) >= 3 and rates[0] > 1 and len(set(rates)) == len(rates)
    assert any(isinstance(m, torch.nn.AdaptiveAvgPool2d) for m in aspp.pool.modules())

    seen: dict[str, tuple[torch.Size, ...]] = {}

    def record(name):
        return lambda module, inputs, output: seen.update({name: tuple(t.shape for t in inputs)})

    model.aspp.register_forward_hook(record("aspp"))
    model.decoder.register_forward_hook(record("decoder"))
    model.eval()
    with torch.no_grad():
        model(torch.randn(2, 3, 64, 64))
    (aspp_in,) = seen["aspp"]
    high, low = seen["decoder"]
    assert aspp_in[2:] == (8, 8)  # output stride 8
    assert high[2:] == (8, 8) and low[2:] == (16, 16)  # the skip brings stride-4 features
    assert low[1] == model.encoder.low_channels


def test_model_trains_on_a_one_sample_batch():
    # distkit hands a rank with no sample left a one-sample placeholder batch
    model = seg_model.build_model(num_classes=5).train()
    model(torch.randn(1, 3, 32, 32)).sum().backward()


# ------------------------------------------------------------------------------------ the script
def test_script_parses_resume_and_legacy_local_rank():
    assert seg.parse_args(["--local_rank", "1"]).strategy == "auto"
    args = seg.parse_args(["--local-rank=0", "--checkpoint-dir", "d", "--resume"])
    assert args.resume == "auto"
    assert seg.parse_args(["--resume", "ck.pt"]).resume == "ck.pt"
    assert seg.parse_args([]).crop_size == 64 and seg.parse_args([]).resume is None
    for bad in (["--resume"], ["--epochs", "0"], ["--crop-size", "8"], ["--save-images", "-1"]):
        with pytest.raises(SystemExit):
            seg.parse_args(bad)


def test_script_defaults_are_the_tuned_ones():
    # 10 epochs x 512 samples at 0.1: mIoU about 0.76 with 2 processes in about 20 s here
    args = seg.parse_args([])
    assert (args.epochs, args.num_samples, args.batch_size, args.lr) == (10, 512, 16, 0.1)
    assert (args.save_images, args.out_dir) == (4, "seg_predictions")


@pytest.mark.parametrize(
    ("samples", "world", "batch", "accum"),
    [(256, 1, 16, 1), (256, 2, 16, 1), (33, 2, 16, 1), (100, 2, 8, 3), (7, 4, 2, 2)],
)
def test_script_steps_per_epoch_matches_distkit(samples, world, batch, accum):
    plan = GlobalBatchPlan(
        samples, batch_size=batch, world_size=world, rank=0, grad_accum_steps=accum
    )
    assert (
        seg.steps_per_epoch(samples, world_size=world, batch_size=batch, grad_accum=accum)
        == plan.steps_per_epoch
    )


def test_script_warmup_then_poly_decay_to_zero():
    factor = seg.warmup_poly(total_steps=100, warmup_steps=10)
    assert factor(0) == pytest.approx(seg.WARMUP_START)
    warm = [factor(s) for s in range(11)]
    assert warm == sorted(warm) and factor(10) == pytest.approx(1.0)
    decay = [factor(s) for s in range(10, 101)]
    assert decay == sorted(decay, reverse=True)
    assert factor(55) == pytest.approx(0.5**seg.POLY_POWER)
    assert factor(100) == 0.0 and factor(150) == 0.0


def test_script_loss_ignores_255_and_is_finite_when_all_is_ignored():
    logits = torch.randn(2, 5, 4, 4)
    target = torch.randint(0, 5, (2, 4, 4))
    target[0, 0] = 255
    expected = F.cross_entropy(logits, target, ignore_index=255)
    torch.testing.assert_close(seg.seg_loss(logits, target), expected)
    assert seg.seg_loss(logits, torch.full((2, 4, 4), 255)).item() == 0.0


def test_script_reports_divergence_with_nonzero_status(capsys):
    args = argparse.Namespace(lr=10.0, epochs=1)
    data = seg_data.load_seg_data(None, num_samples=4)
    diverged = distkit.FitResult([{"epoch": 0, "train_loss": float("nan")}])
    assert seg.report(diverged, data, args, 1.0, is_main=True) == 1
    assert "training diverged" in capsys.readouterr().err
    fine = distkit.FitResult(
        [{"epoch": 0, "train_loss": 0.5, "val_seg_miou": 0.4, "val_seg_pixel_acc": 0.9}]
    )
    assert seg.report(fine, data, args, 1.0, is_main=True) == 0
    assert "val mIoU: 0.4000  pixel accuracy: 0.9000  train loss: 0.5000" in capsys.readouterr().out


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.update(extra)
    return env


def _run_script(
    args: list[str], *, cwd: Path, torchrun: bool = False
) -> subprocess.CompletedProcess[str]:
    """seg.py in ``cwd`` (its pictures go to ``cwd/seg_predictions`` by default)."""
    launcher = [sys.executable]
    if torchrun:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    done = subprocess.run(
        [*launcher, str(EXAMPLES / "seg.py"), *args],
        cwd=cwd,
        env=clean_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=150,
    )
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done


def _lines(output: str, prefix: str) -> list[str]:
    return [line for line in output.splitlines() if line.startswith(prefix)]


TINY = ["--epochs", "1", "--num-samples", "32", "--crop-size", "32"]


def test_script_trains_in_one_process(tmp_path):
    done = _run_script(["--strategy", "dp", *TINY], cwd=tmp_path)
    (data_line,) = _lines(done.stdout, "data: ")
    assert (
        "no ADE20K folder" in data_line
        and "synthetic shapes dataset (32 train / 8 val" in data_line
    )
    (final,) = _lines(done.stdout, "val mIoU: ")
    miou = float(final.split()[2])
    assert 0.0 <= miou <= 1.0
    assert "strategy=dp, world_size=1" in done.stdout
    pictures = tmp_path / "seg_predictions"  # the default folder, in the working directory
    assert _lines(done.stdout, "predictions: ") == [
        f"predictions: 4 validation images (input | true mask | predicted mask) in {pictures}"
    ]
    assert len(list(pictures.glob("val_*.png"))) == 4


def test_script_trains_under_torchrun_with_sync_bn_and_only_rank_0_prints(tmp_path):
    done = _run_script([*TINY, "--sync-bn"], cwd=tmp_path, torchrun=True)
    assert len(_lines(done.stdout, "data: no ADE20K folder")) == 1, done.stdout
    assert len(_lines(done.stdout, "val mIoU: ")) == 1, done.stdout
    assert len(_lines(done.stdout, "epoch 1/1 ")) == 1, done.stdout
    assert "strategy=ddp, world_size=2" in done.stdout and "sync_bn=True" in done.stdout
    assert len(_lines(done.stdout, "predictions: 4 validation images")) == 1, done.stdout


def test_script_resumes_from_its_checkpoint_and_trains_only_what_is_left(tmp_path):
    folder = str(tmp_path / "ckpt")
    small = ["--strategy", "dp", "--num-samples", "32", "--crop-size", "32"]
    first = _run_script([*small, "--epochs", "1", "--checkpoint-dir", folder], cwd=tmp_path)
    assert len(_lines(first.stdout, "epoch 1/1 ")) == 1
    assert any(Path(folder).glob("*.pt")), "a checkpoint was saved"
    second = _run_script(
        [*small, "--epochs", "2", "--checkpoint-dir", folder, "--resume"], cwd=tmp_path
    )
    assert len(_lines(second.stdout, "epoch 2/2 ")) == 1, second.stdout
    assert "epoch 1/2" not in second.stdout
    assert len(_lines(second.stdout, "val mIoU: ")) == 1


def test_script_trains_on_an_ade20k_folder(tmp_path):
    write_ade20k(tmp_path)  # skipped without Pillow
    done = _run_script(
        ["--strategy", "dp", "--epochs", "1", "--batch-size", "2", "--crop-size", "32",
         "--data-dir", str(tmp_path)], cwd=tmp_path,
    )  # fmt: skip
    assert _lines(done.stdout, "data: ") == [
        f"data: ADE20K from {tmp_path} (2 train / 1 val images, 150 classes)"
    ]
    assert len(_lines(done.stdout, "val mIoU: ")) == 1
