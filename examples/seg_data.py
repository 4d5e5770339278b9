"""Segmentation data for the examples: ADE20K from a folder, else synthetic shapes made on the fly.

Sources, in order:

1. ADE20K's scene-parsing layout (``ADEChallengeData2016``) in ``data_dir`` or in
   ``data_dir/ADEChallengeData2016``: ``images/{training,validation}/*.jpg`` with
   ``annotations/{training,validation}/*.png`` of the same stem. A mask pixel holds 0 for
   "other" (ignored: mapped to 255) or a class 1..150 (mapped to 0..149). Reading it needs
   Pillow, an optional dependency of this example only (``pip install pillow``).
2. Without such a folder, :class:`SyntheticShapes`: circles, rectangles, triangles and rings on
   textured, noisy, greyish backgrounds, with exact masks. Each kind of shape is painted in its
   own (overlapping) family of hues, so that a small model learns the task in a few epochs on
   a CPU; where hues overlap, only the outline tells the kinds apart. Sample ``i`` is drawn
   from its own generator seeded with ``(seed, split, i)``, so it is the same in every process
   and worker, and nothing is kept in memory.
"""

from __future__ import annotations

import colorsys
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import Dataset

IGNORE_INDEX = 255
ADE20K_CLASSES = 150
ADE20K_SUBDIR = "ADEChallengeData2016"
ADE20K_SPLITS = {"train": "training", "val": "validation"}
# ImageNet's statistics, for both sources, so a model moves from one to the other unchanged
MEAN = (0.485, 0.456, 0.406)
STD = (0.229, 0.224, 0.225)
PILLOW_HINT = (
    "reading ADE20K needs Pillow, an optional dependency of this example: pip install pillow"
)

SHAPES = ("circle", "rectangle", "triangle", "ring")  # class ids 1..4; 0 is the background
SYNTHETIC_CLASSES = 1 + len(SHAPES)
SPLIT_CODES = {"train": 0, "val": 1}
HUE_SPREAD = 0.15  # each shape kind's hues: its centre +- this (centres a quarter turn apart)


class SegDataError(ValueError):
    """A data folder exists but does not hold what it should (unpaired files, bad masks)."""


def normalize(image: np.ndarray) -> torch.Tensor:
    """``(H, W, 3)`` floats in [0, 1] -> a normalised float32 ``(3, H, W)`` tensor."""
    x = torch.from_numpy(np.ascontiguousarray(image, dtype=np.float32)).permute(2, 0, 1)
    mean = torch.tensor(MEAN).view(3, 1, 1)
    std = torch.tensor(STD).view(3, 1, 1)
    return (x - mean) / std


# ------------------------------------------------------------------------------ synthetic
@dataclass(frozen=True)
class Shape:
    """One drawn shape, in pixel units (pixel ``(row, col)`` has its centre at ``+0.5``).

    Attributes:
        kind: one of :data:`SHAPES`; its class id is ``SHAPES.index(kind) + 1``.
        params: circle ``(cx, cy, r)``; rectangle ``(cx, cy, half_w, half_h, angle)``;
            triangle ``(x0, y0, x1, y1, x2, y2)``; ring ``(cx, cy, r_outer, r_inner)``.
        color: RGB fill in [0, 1].
    """

    kind: str
    params: tuple[float, ...]
    color: tuple[float, float, float]

    @property
    def class_id(self) -> int:
        return SHAPES.index(self.kind) + 1


def shape_region(shape: Shape, size: int) -> np.ndarray:
    """The boolean ``(size, size)`` region a shape covers (the same test paints and labels)."""
    ys, xs = np.mgrid[0:size, 0:size].astype(np.float64) + 0.5
    p = shape.params
    if shape.kind == "circle":
        cx, cy, r = p
        return (xs - cx) ** 2 + (ys - cy) ** 2 <= r * r
    if shape.kind == "ring":
        cx, cy, outer, inner = p
        d2 = (xs - cx) ** 2 + (ys - cy) ** 2
        return (d2 <= outer * outer) & (d2 > inner * inner)
    if shape.kind == "rectangle":
        cx, cy, half_w, half_h, angle = p
        cos, sin = np.cos(angle), np.sin(angle)
        u = (xs - cx) * cos + (ys - cy) * sin
        v = -(xs - cx) * sin + (ys - cy) * cos
        return (np.abs(u) <= half_w) & (np.abs(v) <= half_h)
    if shape.kind == "triangle":
        x0, y0, x1, y1, x2, y2 = p

        def side(ax: float, ay: float, bx: float, by: float) -> np.ndarray:
            return (bx - ax) * (ys - ay) - (by - ay) * (xs - ax)

        d0, d1, d2 = side(x0, y0, x1, y1), side(x1, y1, x2, y2), side(x2, y2, x0, y0)
        return ((d0 >= 0) & (d1 >= 0) & (d2 >= 0)) | ((d0 <= 0) & (d1 <= 0) & (d2 <= 0))
    raise ValueError(f"unknown shape kind {shape.kind!r}; allowed: {', '.join(SHAPES)}")


@dataclass
class ShapesSample:
    """One synthetic sample before normalisation.

    Attributes:
        image: ``(H, W, 3)`` float32 in [0, 1].
        mask: ``(H, W)`` int64 class ids (0 background, 1..4 :data:`SHAPES`).
        shapes: the shapes in drawing order (a later one covers an earlier one).
    """

    image: np.ndarray
    mask: np.ndarray
    shapes: list[Shape] = field(default_factory=list)


class SyntheticShapes(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Shapes on textured backgrounds, with exact masks, generated per index.

    Args:
        num_samples: the dataset's length.
        size: images are ``size x size``.
        seed: with ``split`` and the index, what fixes every sample.
        split: ``"train"`` or ``"val"`` (different samples for the same seed).
        noise: standard deviation of the per-pixel Gaussian noise added to the image.
    """

    num_classes = SYNTHETIC_CLASSES

    def __init__(
        self, num_samples: int, *, size: int = 64, seed: int = 0, split: str = "train",
        noise: float = 0.08,
    ) -> None:  # fmt: skip
        if split not in SPLIT_CODES:
            raise ValueError(f"split={split!r}; allowed: {', '.join(SPLIT_CODES)}")
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if size < 16:
            raise ValueError(f"size must be >= 16 pixels, got {size}")
        self.num_samples = num_samples
        self.size = size
        self.seed = seed
        self.split = split
        self.noise = noise

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        sample = self.sample(index)
        return normalize(sample.image), torch.from_numpy(sample.mask)

    def sample(self, index: int) -> ShapesSample:
        """Sample ``index`` with its shapes, unnormalised."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        rng = np.random.default_rng([self.seed, SPLIT_CODES[self.split], index])
        image = self._background(rng)
        mask = np.zeros((self.size, self.size), dtype=np.int64)
        shapes = []
        for _ in range(int(rng.integers(1, 4))):
            shape = self._random_shape(rng, image)
            region = shape_region(shape, self.size)
            # the painted pixels and the labelled pixels are one and the same array
            image[region] = shape.color
            mask[region] = shape.class_id
            shapes.append(shape)
        if self.noise:
            image += rng.normal(0.0, self.noise, image.shape)
        return ShapesSample(np.clip(image, 0.0, 1.0).astype(np.float32), mask, shapes)

    def _background(self, rng: np.random.Generator) -> np.ndarray:
        """A random base colour with two overlaid sinusoidal gratings (a texture)."""
        ys, xs = np.mgrid[0 : self.size, 0 : self.size].astype(np.float64) / self.size
        image = np.empty((self.size, self.size, 3))
        image[:] = colorsys.hsv_to_rgb(rng.uniform(), rng.uniform(0.0, 0.3), rng.uniform(0.3, 0.8))
        for _ in range(2):
            fx, fy = rng.uniform(-12.0, 12.0, 2)
            grating = np.sin(2 * np.pi * (fx * xs + fy * ys) / 2 + rng.uniform(0, 2 * np.pi))
            image += rng.uniform(0.05, 0.15) * grating[..., None] * rng.uniform(-1.0, 1.0, 3)
        return image

    def _random_shape(self, rng: np.random.Generator, image: np.ndarray) -> Shape:
        size = self.size
        kind = SHAPES[int(rng.integers(len(SHAPES)))]
        r = rng.uniform(0.12, 0.25) * size
        cx, cy = rng.uniform(r, size - r, 2)
        color = self._shape_color(rng, SHAPES.index(kind), image.reshape(-1, 3).mean(0))
        params: tuple[float, ...]
        if kind == "circle":
            params = (cx, cy, r)
        elif kind == "ring":
            params = (cx, cy, r, r * rng.uniform(0.45, 0.65))
        elif kind == "rectangle":
            half_w, half_h = r * rng.uniform(0.55, 0.95, 2)
            params = (cx, cy, half_w, half_h, rng.uniform(0, np.pi / 2))
        else:  # triangle: three corners on the circle, spread around it
            angles = (
                rng.uniform(0, 2 * np.pi) + np.array([0.0, 2.1, 4.2]) + rng.uniform(-0.3, 0.3, 3)
            )
            params = tuple(
                float(v) for a in angles for v in (cx + r * np.cos(a), cy + r * np.sin(a))
            )
        return Shape(kind, tuple(float(v) for v in params), color)

    @staticmethod
    def _shape_color(
        rng: np.random.Generator, shape_index: int, background: np.ndarray
    ) -> tuple[float, float, float]:
        """A saturated colour in the shape's hue family, visible against the background.

        Each kind's hues spread +-0.15 around its own centre (a quarter turn apart), so
        neighbouring families overlap: colour is a strong cue, the outline settles the rest.
        """
        while True:
            hue = (shape_index / len(SHAPES) + rng.uniform(-HUE_SPREAD, HUE_SPREAD)) % 1.0
            sat, val = rng.uniform(0.5, 1.0, 2)
            rgb = np.asarray(colorsys.hsv_to_rgb(hue, sat, val), dtype=np.float32)
            if np.abs(rgb - background).max() >= 0.3:
                # float32, as the image stores it, so a painted pixel compares equal to it
                return (float(rgb[0]), float(rgb[1]), float(rgb[2]))


# ------------------------------------------------------------------------------ ADE20K
def find_ade20k(data_dir: str | os.PathLike[str] | None) -> Path | None:
    """The ADE20K root under ``data_dir`` (itself or ``ADEChallengeData2016/``), or None.

    Raises:
        FileNotFoundError: the folder has part of the layout (``images/`` or
            ``annotations/``) but not all of it; the message names what is missing.
    """
    if data_dir is None:
        return None
    given = Path(data_dir).expanduser()
    for root in (given, given / ADE20K_SUBDIR):
        if not ((root / "images").is_dir() or (root / "annotations").is_dir()):
            continue
        wanted = [
            f"{top}/{sub}" for top in ("images", "annotations") for sub in ADE20K_SPLITS.values()
        ]
        missing = [w for w in wanted if not (root / w).is_dir()]
        if missing:
            raise FileNotFoundError(
                f"{root} looks like an ADE20K folder but lacks {', '.join(missing)}; expected "
                "images/{training,validation}/*.jpg and annotations/{training,validation}/*.png"
            )
        return root
    return None


def _require_pillow() -> Any:
    try:
        from PIL import Image
    except ImportError as exc:
        raise ImportError(PILLOW_HINT) from exc
    return Image


class ADE20K(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """ADE20K scene parsing (150 classes), resized and cropped to ``crop_size`` squares.

    Training samples: the shorter side scaled to ``crop_size`` times a random factor in
    [1, 1.5], a random ``crop_size`` crop and a random horizontal flip (torch's generator,
    which distkit seeds per rank and worker). Validation samples: the shorter side scaled to
    ``crop_size`` and the centre crop. Images are resized bilinearly, masks by nearest
    neighbour. Targets: 0 ("other") -> 255 (ignored), class ``k`` in 1..150 -> ``k - 1``.

    Raises:
        ImportError: Pillow is not installed (the message says how to install it).
        SegDataError: an image has no mask of the same name, or a split is empty.
    """

    num_classes = ADE20K_CLASSES

    def __init__(self, root: str | os.PathLike[str], *, split: str, crop_size: int = 64) -> None:
        if split not in ADE20K_SPLITS:
            raise ValueError(f"split={split!r}; allowed: {', '.join(ADE20K_SPLITS)}")
        _require_pillow()
        self.root = Path(root)
        self.split = split
        self.crop_size = crop_size
        folder = ADE20K_SPLITS[split]
        images = sorted((self.root / "images" / folder).glob("*.jpg"))
        masks_dir = self.root / "annotations" / folder
        unpaired = [p.name for p in images if not (masks_dir / f"{p.stem}.png").is_file()]
        if unpaired:
            shown = ", ".join(unpaired[:3]) + (", ..." if len(unpaired) > 3 else "")
            raise SegDataError(
                f"{len(unpaired)} image(s) in {self.root / 'images' / folder} have no mask of "
                f"the same name in {masks_dir}: {shown}"
            )
        if not images:
            raise SegDataError(f"no *.jpg images in {self.root / 'images' / folder}")
        self.pairs = [(p, masks_dir / f"{p.stem}.png") for p in images]

    def __len__(self) -> int:
        return len(self.pairs)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        image_module = _require_pillow()
        image_path, mask_path = self.pairs[index]
        with image_module.open(image_path) as img:
            image = img.convert("RGB")
        with image_module.open(mask_path) as m:
            if m.mode not in ("L", "P", "I;16", "I"):
                raise SegDataError(
                    f"{mask_path}: a {m.mode} image; expected a single-channel class-index PNG "
                    "(ADE20K scene-parsing annotations)"
                )
            mask = m.copy()
        if image.size != mask.size:
            raise SegDataError(f"{image_path} is {image.size} but {mask_path} is {mask.size}")
        image, mask = self._resize_crop(image_module, image, mask)
        pixels = np.asarray(image, dtype=np.float32) / 255.0
        return normalize(pixels), torch.from_numpy(to_train_ids(np.asarray(mask)))

    def _resize_crop(self, image_module: Any, image: Any, mask: Any) -> tuple[Any, Any]:
        crop = self.crop_size
        train = self.split == "train"
        scale = crop / min(image.size) * (1.0 + 0.5 * torch.rand(()).item() if train else 1.0)
        width = max(crop, round(image.size[0] * scale))
        height = max(crop, round(image.size[1] * scale))
        image = image.resize((width, height), image_module.Resampling.BILINEAR)
        mask = mask.resize((width, height), image_module.Resampling.NEAREST)
        if train:
            left = int(torch.randint(width - crop + 1, ()).item())
            top = int(torch.randint(height - crop + 1, ()).item())
        else:
            left, top = (width - crop) // 2, (height - crop) // 2
        box = (left, top, left + crop, top + crop)
        image, mask = image.crop(box), mask.crop(box)
        if train and torch.rand(()).item() < 0.5:
            flip = image_module.Transpose.FLIP_LEFT_RIGHT
            image, mask = image.transpose(flip), mask.transpose(flip)
        return image, mask


def to_train_ids(mask: np.ndarray) -> np.ndarray:
    """ADE20K mask values -> targets: 0 and anything above 150 -> 255, ``k`` -> ``k - 1``."""
    values = mask.astype(np.int64)
    return np.where((values >= 1) & (values <= ADE20K_CLASSES), values - 1, IGNORE_INDEX)


# ------------------------------------------------------------------------------ choosing
@dataclass(frozen=True)
class SegData:
    """Train and validation sets and where they come from.

    Attributes:
        kind: ``"ade20k"`` or ``"synthetic"``.
        train, val: the datasets, yielding ``(image (3, H, W) float32, mask (H, W) int64)``.
        num_classes: classes the model predicts (255 marks ignored pixels).
        data_dir: what the user passed (``None`` for nothing).
        root: the ADE20K folder read (``None`` for synthetic data).
    """

    kind: Literal["ade20k", "synthetic"]
    train: Dataset[tuple[torch.Tensor, torch.Tensor]]
    val: Dataset[tuple[torch.Tensor, torch.Tensor]]
    num_classes: int
    data_dir: str | None = None
    root: Path | None = None

    def describe(self) -> str:
        """One line naming the source and its size, for the user."""
        counts = f"{len(self.train):,} train / {len(self.val):,} val"  # type: ignore[arg-type]
        if self.kind == "ade20k":
            return f"ADE20K from {self.root} ({counts} images, {self.num_classes} classes)"
        where = f"at {self.data_dir}" if self.data_dir else "(no --data-dir)"
        return (
            f"no ADE20K folder {where}; using a synthetic shapes dataset "
            f"({counts}, {self.num_classes} classes: background, {', '.join(SHAPES)})"
        )


def load_seg_data(
    data_dir: str | os.PathLike[str] | None, *, crop_size: int = 64, num_samples: int = 256,
    seed: int = 0,
) -> SegData:  # fmt: skip
    """ADE20K from ``data_dir`` if it holds the layout, else synthetic shapes.

    Args:
        data_dir: a folder with ADE20K's layout (or ``ADEChallengeData2016/`` in it), or None.
        crop_size: the side of the square samples.
        num_samples: synthetic training samples (validation gets a quarter, at least one).
        seed: fixes the synthetic samples.

    Raises:
        FileNotFoundError: a partial ADE20K layout (see :func:`find_ade20k`).
        SegDataError: unpaired or malformed ADE20K files.
        ImportError: an ADE20K folder but no Pillow.
    """
    shown = None if data_dir is None else str(data_dir)
    root = find_ade20k(data_dir)
    if root is not None:
        train = ADE20K(root, split="train", crop_size=crop_size)
        val = ADE20K(root, split="val", crop_size=crop_size)
        return SegData("ade20k", train, val, ADE20K_CLASSES, shown, root)
    num_val = max(1, num_samples // 4)
    return SegData(
        "synthetic",
        SyntheticShapes(num_samples, size=crop_size, seed=seed, split="train"),
        SyntheticShapes(num_val, size=crop_size, seed=seed, split="val"),
        SYNTHETIC_CLASSES,
        shown,
    )
