"""Predictions too large to gather: each rank writes its own file, a reader merges them.

A rank's file, ``predictions.rank<r>-of-<N>.pt`` in the folder given as ``write_to``, holds
its outputs batch by batch with the position in the data's order of every sample of each
batch. It is written atomically, with plain containers only, so that
``torch.load(weights_only=True)`` reads it (a file can never run code).
:func:`read_predictions` merges a folder's files into one list in the data's order.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, BinaryIO, cast

import torch

from distkit._atomic import TempFile
from distkit.errors import ConfigurationError
from distkit.runtime._outputs import plain, split_batch_output

FORMAT = "distkit.predictions"
VERSION = 1
_NAME = re.compile(r"^predictions\.rank(\d+)-of-(\d+)\.pt$")


def file_name(rank: int, world_size: int) -> str:
    return f"predictions.rank{rank:05d}-of-{world_size:05d}.pt"


def remove_files(folder: Path) -> None:
    """Remove the prediction files a former call left in ``folder`` (at another world size,
    some would be read with this call's)."""
    for path in folder.glob("predictions.rank*-of-*.pt"):
        if _NAME.match(path.name):
            with contextlib.suppress(FileNotFoundError):  # another rank of this machine's
                path.unlink()


def write_file(
    folder: Path,
    rank: int,
    world_size: int,
    total: int,
    records: Sequence[tuple[torch.Tensor, Any]],
) -> Path:
    """Write this rank's ``records`` (each batch's positions and output) to its file."""
    payload = {
        "format": FORMAT,
        "version": VERSION,
        "rank": rank,
        "world_size": world_size,
        "samples": total,  # over all ranks
        "positions": [positions for positions, _ in records],
        "outputs": [plain(output) for _, output in records],
    }
    path = folder / file_name(rank, world_size)

    def write(handle: BinaryIO) -> None:
        torch.save(payload, handle)

    TempFile(path).publish(path, write)
    return path


def read_predictions(folder: str | os.PathLike[str]) -> list[Any]:
    """The predictions that ``predict(..., gather=None, write_to=folder)`` wrote, merged.

    Returns one output per sample, in the data's order, as ``predict`` with ``gather="all"``
    returns them, except that containers are plain: a mapping (a ``ModelOutput`` too) is a
    ``dict``, a namedtuple a ``tuple``.

    Args:
        folder: the folder every rank wrote its file to (copy the files into one folder where
            the ranks wrote to folders of their own machines).

    Raises:
        ConfigurationError: where a rank's file is missing, or the files do not fit together.
    """
    root = Path(folder)
    if not root.is_dir():
        raise ConfigurationError(f"read_predictions: {root} is not a folder")
    found: dict[int, dict[int, Path]] = {}
    for path in root.iterdir():
        match = _NAME.match(path.name)
        if match:
            found.setdefault(int(match.group(2)), {})[int(match.group(1))] = path
    if not found:
        raise ConfigurationError(
            f"read_predictions: no prediction files (predictions.rank*-of-*.pt) in {root}; "
            "write them with predict(model, data, gather=None, write_to=folder)"
        )
    if len(found) > 1:
        raise ConfigurationError(
            f"read_predictions: {root} holds the files of runs at {sorted(found)} processes; "
            "keep one run's files in a folder"
        )
    ((world_size, paths),) = found.items()
    missing = sorted(set(range(world_size)) - set(paths))
    if missing:
        raise ConfigurationError(
            f"read_predictions: {root} lacks the file(s) of rank(s) {missing} of {world_size}. "
            "Where the ranks wrote on several machines, copy their files into one folder"
        )
    samples: list[Any] = []
    total = None
    for rank in range(world_size):
        content = torch.load(paths[rank], map_location="cpu", weights_only=True)
        if not isinstance(content, dict) or content.get("format") != FORMAT:
            raise ConfigurationError(f"read_predictions: {paths[rank]} is not a prediction file")
        if total is None:
            total = int(content["samples"])
            samples = [_MISSING] * total
        elif int(content["samples"]) != total:
            raise ConfigurationError(
                f"read_predictions: the files in {root} are of different runs ({total} and "
                f"{content['samples']} samples)"
            )
        for positions, output in zip(content["positions"], content["outputs"], strict=True):
            for position, sample in zip(
                cast(torch.Tensor, positions).tolist(),
                split_batch_output(output, len(positions)),
                strict=True,
            ):
                samples[position] = sample
    absent = sum(1 for sample in samples if sample is _MISSING)
    if absent:
        raise ConfigurationError(
            f"read_predictions: {absent} of {total} samples have no prediction in {root}'s "
            "files: they are of different runs"
        )
    return samples


class _Missing:
    """No prediction read yet for a position."""


_MISSING = _Missing()
