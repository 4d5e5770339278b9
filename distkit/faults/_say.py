"""One line for the job's log: stderr, flushed at once (a rank may be killed right after)."""

from __future__ import annotations

import sys


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
