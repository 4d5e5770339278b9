"""Read an offline W&B run back from its ``.wandb`` file, with wandb's own record type.

wandb 0.31 ships no Python reader for the file (its ``datastore`` module went with the Python
backend; the Go ``wandb-core`` writes it), so this walks the framing and parses each record
with ``wandb.proto.wandb_internal_pb2.Record``. The framing is LevelDB's log format: a 7-byte
file header (``:W&B``, magic 0xBEE1, version 0), then 32 KiB blocks of chunks, each with a
7-byte header (CRC, length, type: 1 full, 2 first, 3 middle, 4 last); a block's tail shorter
than a header is padding.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_BLOCK = 32768
_HEADER = struct.Struct("<IHB")  # checksum, length, chunk type
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


@dataclass
class WandbRun:
    """What an offline run holds: its history by metric, its config and its exit code."""

    folder: Path
    project: str = ""
    history: dict[str, list[tuple[int, Any]]] = field(default_factory=dict)
    config: dict[str, Any] = field(default_factory=dict)
    exit_code: int | None = None


def offline_runs(save_dir: Path) -> list[Path]:
    """The offline run folders under ``save_dir``, oldest first.

    A folder's name holds its start to the second, then a random id, so two runs of one
    second would sort by their id: they are ordered by their ``.wandb`` file's last write
    instead (the tests' runs follow one another, never overlap)."""

    def started(folder: Path) -> tuple[str, int]:
        stamp = folder.name.split("-")[2]  # offline-run-<date_time>-<id>
        files = sorted(folder.glob("run-*.wandb"))
        return stamp, min((f.stat().st_mtime_ns for f in files), default=0)

    return sorted((Path(save_dir) / "wandb").glob("offline-run-*"), key=started)


def read_run(folder: Path) -> WandbRun:
    """Parse the one ``run-*.wandb`` file of ``folder``."""
    from wandb.proto import wandb_internal_pb2

    (path,) = Path(folder).glob("run-*.wandb")
    run = WandbRun(Path(folder))
    for payload in _records(path.read_bytes()):
        record = wandb_internal_pb2.Record()
        record.ParseFromString(payload)
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.project = record.run.project
            _update(run.config, record.run.config.update)
        elif kind == "config":
            _update(run.config, record.config.update)
        elif kind == "history":
            items = {_name(item): json.loads(item.value_json) for item in record.history.item}
            step = record.history.step.num
            for name, value in items.items():
                if not name.startswith("_"):
                    run.history.setdefault(name, []).append((step, value))
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    run.config.pop("_wandb", None)
    return run


def _records(data: bytes):
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    pos, pending = 7, b""
    while pos + _HEADER.size <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER.size:  # the block's padding
            pos += left
            continue
        _, length, kind = _HEADER.unpack_from(data, pos)
        if kind == 0:  # zeros: the end of what was written
            return
        start = pos + _HEADER.size
        pending += data[start : start + length]
        pos = start + length
        if kind in (_FULL, _LAST):
            yield pending
            pending = b""


def _name(item: Any) -> str:
    return item.key or ".".join(item.nested_key)


def _update(config: dict[str, Any], updates: Any) -> None:
    for item in updates:
        config[_name(item)] = json.loads(item.value_json)
