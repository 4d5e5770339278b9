"""One checkpoint layout for the Trainer's files and ``rt.save``'s.

A checkpoint file is a mapping of named entries at its top level, each entry's state as
``state_dict()`` gives it (a module's, an optimizer's, a scheduler's, a loader's position) or a
plain value as it was saved, plus distkit's own records under one reserved key::

    {"model": {...}, "optimizer": {...}, ...,
     "distkit": {"format": "distkit-checkpoint", "version": 2, "producer": {...},
                 "scaler": {...}, "ranks": [...], ...}}

so ``torch.load(path, weights_only=True)["model"]`` is the model's weights, whoever wrote the
file. The Trainer's entries are the ones it owns (``model``, ``optimizer``, ``scheduler``,
``progress``, ``history``, ``validations``, ``callbacks``, ``extra``); ``rt.save``'s are the
names it was given, with their kinds recorded (``kinds``).

Files of the first layout (version 1: the records at the top level, ``rt.save``'s entries
under ``"runtime"``) still load, read into this one, with a note once per file.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from distkit.checkpoint import _shard_files

#: the reserved top-level key of distkit's records
RECORDS = "distkit"
#: the record saying the file carries a digest (so one that lost it is refused)
INTEGRITY = "integrity"
#: the record of ``rt.save``'s entries' kinds (a Trainer's checkpoint has none)
KINDS = "kinds"
#: what a checkpoint's records hold (beside its entries); the rest of a Trainer's payload is
#: its entries
RECORD_KEYS = (
    "format",
    "version",
    "producer",
    "scaler",
    "ranks",
    KINDS,
    _shard_files.KEY,
    _shard_files.DIGESTS,
    INTEGRITY,
)
#: the key of a layout-1 ``rt.save`` file's entries
_RUNTIME_V1 = "runtime"
_NOTED: set[Path] = set()


def stored(payload: Mapping[str, Any]) -> dict[str, Any]:
    """The file's form of ``payload``: one already laid out as it is; a flat one (records
    at the top, as the Trainer builds it) with its records moved under :data:`RECORDS`."""
    if RECORDS in payload:
        return dict(payload)
    records = {key: payload[key] for key in RECORD_KEYS if key in payload}
    entries = {key: value for key, value in payload.items() if key not in RECORD_KEYS}
    return {**entries, RECORDS: records}


def split(
    path: Path, content: dict[str, Any], marker: str
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """A file's ``(entries, records)``, a layout-1 file read into the current layout (noted
    once); None: no distkit checkpoint (no ``marker`` in its records)."""
    records = content.get(RECORDS)
    if isinstance(records, dict) and records.get("format") == marker:
        entries = {key: value for key, value in content.items() if key != RECORDS}
        return entries, dict(records)
    if content.get("format") != marker:
        return None
    records = {key: content[key] for key in RECORD_KEYS if key in content}
    entries = {key: value for key, value in content.items() if key not in RECORD_KEYS}
    runtime = entries.get(_RUNTIME_V1)
    if isinstance(runtime, dict) and isinstance(runtime.get("entries"), dict):
        entries = dict(runtime["entries"])
        records[KINDS] = runtime.get("kinds", {})
        records["ranks"] = runtime.get("ranks")
    _note(path)
    return entries, records


def written_by_trainer(records: Mapping[str, Any]) -> bool:
    """Whether a checkpoint is a Trainer's (its entries named by the Trainer), not
    ``rt.save``'s (whose entries' kinds it records)."""
    return KINDS not in records


def flat(entries: Mapping[str, Any], records: Mapping[str, Any]) -> dict[str, Any]:
    """One mapping of both (a Trainer's entries never share a name with the records; an
    ``rt.save`` entry that does wins over the record)."""
    return {**records, **entries}


def _note(path: Path) -> None:
    where = path.resolve()
    if where in _NOTED:
        return
    _NOTED.add(where)
    warnings.warn(
        f"{path} is a checkpoint of distkit's first layout (its records at the top level): "
        "it loads as before; the next save writes the current layout (each entry at the top "
        "level, distkit's records under 'distkit')",
        stacklevel=4,
    )
