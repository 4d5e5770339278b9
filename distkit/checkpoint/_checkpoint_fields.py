"""The fields of a checkpoint a resume reads, checked when it is loaded.

A checkpoint edited by hand, or written by a tool that changed its layout, would otherwise
fail deep inside a resume with a bare ``KeyError`` or ``TypeError`` (or, for an RNG state
of the wrong size, torch's ``RuntimeError``). Each check here names the file, the field
and what it should hold. Fields a payload lacks are not checked here: which ones a resume
needs is the resume's business (``distkit.trainer._resume.check_fits``).
"""

from __future__ import annotations

import numbers
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from distkit.checkpoint import _layout
from distkit.errors import CheckpointError

#: torch ``GradScaler.state_dict()``'s keys (a scaler state is empty or has them all)
SCALER_KEYS = ("scale", "growth_factor", "backoff_factor", "growth_interval", "_growth_tracker")
_MT_KEYS = 624  # numpy's and Python's Mersenne Twister: 624 words of state


class _Field:
    """One place in a payload, for messages: ``progress.epoch``, ``ranks[1].rng.torch``."""

    def __init__(self, path: Path, name: str) -> None:
        self.path, self.name = path, name

    def __truediv__(self, part: str | int) -> _Field:
        name = f"{self.name}[{part}]" if isinstance(part, int) else f"{self.name}.{part}"
        return _Field(self.path, name)

    def fail(self, value: Any, expected: str) -> CheckpointError:
        return CheckpointError(
            f"{self.path} is damaged: its field '{self.name}' is {_shown(value)}; it should be "
            f"{expected}. Resume from another checkpoint (resume='auto' falls back to the "
            "newest one that loads)"
        )


def _shown(value: Any) -> str:
    if value is _MISSING:
        return "missing"
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of {value.numel()} elements"
    if isinstance(value, (int, float, str, bool)) or value is None:
        return f"{type(value).__name__} {value!r:.40}"
    return f"a {type(value).__name__}"


_MISSING = object()


def _int(field: _Field, value: Any, *, optional: bool = False) -> None:
    if optional and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise field.fail(value, "an int >= 0" + (" or None" if optional else ""))


def _number(field: _Field, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise field.fail(value, "a number")


def _dict(field: _Field, value: Any, *, optional: bool = False) -> dict[Any, Any]:
    if optional and value is None:
        return {}
    if not isinstance(value, dict):
        raise field.fail(value, "a dict" + (" or None" if optional else ""))
    return value


def _entry(record: dict[Any, Any], key: str) -> Any:
    return record.get(key, _MISSING)


def _tensor(field: _Field, value: Any, dtype: torch.dtype, numel: int) -> None:
    if not isinstance(value, torch.Tensor) or value.dtype != dtype or value.numel() != numel:
        raise field.fail(value, f"a {dtype} tensor of {numel} elements")


def _progress(field: _Field, value: Any) -> None:
    record = _dict(field, value)
    for key in ("epoch", "position", "global_step"):
        _int(field / key, _entry(record, key))
    _int(field / "skipped_steps", record.get("skipped_steps", 0))
    _int(field / "train_samples", record.get("train_samples"), optional=True)


def _history(field: _Field, value: Any) -> None:
    if not isinstance(value, list):
        raise field.fail(value, "a list of dicts of numbers (one per epoch or validation)")
    for i, record in enumerate(value):
        for key, number in _dict(field / i, record).items():
            if not isinstance(key, str):
                raise (field / i).fail(key, "a dict keyed by metric names (str)")
            _number(field / i / key, number)


def _rng(field: _Field, value: Any) -> None:
    record = _dict(field, value)
    _tensor(field / "torch", _entry(record, "torch"), torch.uint8, torch.get_rng_state().numel())
    np_state = _dict(field / "numpy", _entry(record, "numpy"))
    _tensor(field / "numpy" / "keys", _entry(np_state, "keys"), torch.int64, _MT_KEYS)
    _int(field / "numpy" / "pos", _entry(np_state, "pos"))
    _int(field / "numpy" / "has_gauss", _entry(np_state, "has_gauss"))
    _number(field / "numpy" / "cached_gaussian", _entry(np_state, "cached_gaussian"))
    py = _dict(field / "python", _entry(record, "python"))
    _int(field / "python" / "version", _entry(py, "version"))
    internal = _entry(py, "internal")
    if not (
        isinstance(internal, list)
        and len(internal) == _MT_KEYS + 1
        and all(isinstance(v, int) and not isinstance(v, bool) for v in internal)
    ):
        raise (field / "python" / "internal").fail(internal, f"a list of {_MT_KEYS + 1} ints")
    gauss = _entry(py, "gauss")
    if gauss is not None:
        _number(field / "python" / "gauss", gauss)


def _ranks(field: _Field, value: Any) -> None:
    if not isinstance(value, list):
        raise field.fail(value, "a list with one dict per rank")
    for i, record in enumerate(value):
        rank = _dict(field / i, record)
        _rng(field / i / "rng", _entry(rank, "rng"))
        _number(field / i / "loss_sum", _entry(rank, "loss_sum"))
        _int(field / i / "samples", _entry(rank, "samples"))
        _int(field / i / "local_position", rank.get("local_position"), optional=True)


def _scaler(field: _Field, value: Any) -> None:
    record = _dict(field, value, optional=True)
    if not record:
        return  # no scaler
    for key in SCALER_KEYS:
        _number(field / key, _entry(record, key))


def _model(field: _Field, value: Any) -> None:
    record = _dict(field, value)
    for key, tensor in record.items():
        if not isinstance(key, str):
            raise field.fail(key, "a dict of parameter names (str) to tensors")
        # a module's get_extra_state() may store plain values under <name>._extra_state
        if not isinstance(tensor, torch.Tensor) and not key.endswith("_extra_state"):
            raise (field / key).fail(tensor, "a tensor")


def _optimizer(field: _Field, value: Any) -> None:
    record = _dict(field, value, optional=True)
    if not record:
        return
    _dict(field / "state", _entry(record, "state"))
    groups = _entry(record, "param_groups")
    if not isinstance(groups, list):
        raise (field / "param_groups").fail(groups, "a list of dicts")
    for i, group in enumerate(groups):
        params = _entry(_dict(field / "param_groups" / i, group), "params")
        if not isinstance(params, list):
            raise (field / "param_groups" / i / "params").fail(params, "a list of ints")


def _plain_dict(field: _Field, value: Any) -> None:
    _dict(field, value)


_CHECKS: dict[str, Callable[[_Field, Any], None]] = {
    "progress": _progress,
    "history": _history,
    "validations": _history,
    "model": _model,
    "optimizer": _optimizer,
    "scheduler": lambda field, value: None if value is None else _plain_dict(field, value),
    "extra": _plain_dict,
    "callbacks": _plain_dict,
}


def _loop_ranks(field: _Field, value: Any) -> None:
    """``rt.save``'s per-rank records: each rank's RNG states."""
    if not isinstance(value, list):
        raise field.fail(value, "a list with one dict per rank")
    for i, record in enumerate(value):
        _rng(field / i / "rng", _entry(_dict(field / i, record), "rng"))


def _kinds(field: _Field, value: Any) -> dict[Any, Any]:
    kinds = _dict(field, value)
    for name, kind in kinds.items():
        if not isinstance(name, str) or not isinstance(kind, str):
            raise (field / str(name)).fail(kind, "a dict of entry names (str) to kinds (str)")
    return kinds


#: the records of any checkpoint (beside its entries)
_RECORD_CHECKS: dict[str, Callable[[_Field, Any], None]] = {
    "scaler": _scaler,
    "producer": _plain_dict,
}
#: how an rt.save entry of each kind is checked
_ENTRY_CHECKS: dict[str, Callable[[_Field, Any], None]] = {
    "model": _model,
    "optimizer": _optimizer,
}


def check(path: Path, entries: dict[str, Any], records: dict[str, Any]) -> None:
    """Raise :class:`CheckpointError` naming the first damaged field of a checkpoint: its
    records, and its entries (a Trainer's by name; ``rt.save``'s by their recorded kind)."""
    for key, checker in _RECORD_CHECKS.items():
        if key in records:
            checker(_Field(path, key), records[key])
    if _layout.written_by_trainer(records):
        if "ranks" in records:
            _ranks(_Field(path, "ranks"), records["ranks"])
        for key, checker in _CHECKS.items():
            if key in entries:
                checker(_Field(path, key), entries[key])
        return
    kinds = _kinds(_Field(path, _layout.KINDS), records[_layout.KINDS])
    if records.get("ranks") is not None:
        _loop_ranks(_Field(path, "ranks"), records["ranks"])
    for name, kind in kinds.items():
        entry_check = _ENTRY_CHECKS.get(kind)
        if entry_check is not None and name in entries:
            entry_check(_Field(path, name), entries[name])
