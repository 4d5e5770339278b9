"""Where things are: the repository root, for the tests and their helpers at any depth."""

from __future__ import annotations

from pathlib import Path

#: the repository root (the folder that holds ``distkit/``, ``tests/`` and ``examples/``)
ROOT = Path(__file__).resolve().parents[2]
