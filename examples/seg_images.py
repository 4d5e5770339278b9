"""Pictures of the segmentation example's predictions: input | true mask | predicted mask.

Masks are coloured with one fixed palette, so the same colour means the same class in every
picture and every run. For the synthetic shapes: background black, circle red, rectangle green,
triangle blue, ring orange; further classes (ADE20K's 150) get the PASCAL VOC colour scheme;
ignored pixels (255) are white. Writing PNGs needs Pillow (the ``examples`` extra).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from seg_data import IGNORE_INDEX, MEAN, STD
from torch import nn
from torch.utils.data import Dataset

# black, red, green, blue, orange: far apart, and the synthetic classes' order
FIRST_COLOURS = [(0, 0, 0), (230, 25, 75), (60, 180, 75), (0, 130, 200), (245, 130, 48)]
GAP = 4  # white pixels between the three panels
MIN_HEIGHT = 256  # small samples are scaled up (nearest neighbour) to at least this height
PILLOW_HINT = "saving the prediction images needs Pillow: pip install pillow"


def palette() -> np.ndarray:
    """``(256, 3)`` uint8 colours: class ``k`` at row ``k``, white for 255 (ignored)."""
    colours = np.zeros((256, 3), dtype=np.uint8)
    for k in range(256):
        colours[k] = FIRST_COLOURS[k] if k < len(FIRST_COLOURS) else _voc_colour(k)
    colours[IGNORE_INDEX] = (255, 255, 255)
    return colours


def _voc_colour(k: int) -> tuple[int, int, int]:
    """PASCAL VOC's palette: the bits of ``k`` spread over the high bits of R, G and B."""
    rgb = [0, 0, 0]
    for shift in range(8):
        for channel in range(3):
            rgb[channel] |= ((k >> (3 * shift + channel)) & 1) << (7 - shift)
    return rgb[0], rgb[1], rgb[2]


def to_pixels(image: torch.Tensor) -> np.ndarray:
    """A normalised ``(3, H, W)`` image back to ``(H, W, 3)`` uint8."""
    mean = torch.tensor(MEAN).view(3, 1, 1)
    std = torch.tensor(STD).view(3, 1, 1)
    rgb = (image.detach().cpu().float() * std + mean).clamp(0, 1).permute(1, 2, 0)
    return (rgb.numpy() * 255).round().astype(np.uint8)


def side_by_side(
    image: torch.Tensor, target: torch.Tensor, predicted: torch.Tensor, colours: np.ndarray
) -> np.ndarray:
    """``(H * s, 3 * W * s + 2 * GAP, 3)`` uint8: the three panels, scaled by ``s``."""
    height = target.shape[0]
    scale = max(1, -(-MIN_HEIGHT // height))
    panels = [
        to_pixels(image),
        colours[target.cpu().numpy().astype(np.int64) % 256],
        colours[predicted.cpu().numpy().astype(np.int64) % 256],
    ]
    panels = [p.repeat(scale, axis=0).repeat(scale, axis=1) for p in panels]
    gap = np.full((height * scale, GAP, 3), 255, dtype=np.uint8)
    return np.concatenate([panels[0], gap, panels[1], gap, panels[2]], axis=1)


def save_predictions(
    model: nn.Module,
    data: Dataset[tuple[torch.Tensor, torch.Tensor]],
    out_dir: str | os.PathLike[str],
    *,
    count: int,
) -> Sequence[Path]:
    """The first ``count`` samples of ``data`` as ``val_000.png`` ... in ``out_dir``.

    ``model`` runs in eval mode on the CPU, one sample at a time.

    Raises:
        ImportError: no Pillow (the message says how to install it).
    """
    try:
        from PIL import Image
    except ImportError as exc:
        raise ImportError(PILLOW_HINT) from exc
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    colours = palette()
    model = model.cpu().eval()
    written = []
    with torch.no_grad():
        for index in range(min(count, len(data))):  # type: ignore[arg-type]
            image, target = data[index]
            predicted = model(image.unsqueeze(0))[0].argmax(0)
            path = out / f"val_{index:03d}.png"
            Image.fromarray(side_by_side(image, target, predicted, colours)).save(path)
            written.append(path)
    return written
