"""SLURM's compressed host lists: ``node[01-04,07],login1`` -> the host names, in order."""

from __future__ import annotations

import itertools
import re

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(hostlist: str) -> list[str]:
    """Every host of a SLURM host list, in order.

    Handles several bracket groups per name (``rack[1-2]-node[01-02]``), zero padding kept
    from the range's first number (``[08-10]`` -> ``08 09 10``) and plain names.

    Raises:
        ValueError: the list is malformed (unbalanced brackets, a bad range); the message
            names the list.
    """
    hosts: list[str] = []
    for item in _split_top_level(hostlist):
        hosts += _expand_item(item, hostlist)
    if not hosts:
        raise ValueError(f"SLURM host list {hostlist!r} names no host")
    return hosts


def _split_top_level(hostlist: str) -> list[str]:
    items, depth, current = [], 0, ""
    for char in hostlist.strip():
        if char == "[":
            depth += 1
        elif char == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"SLURM host list {hostlist!r}: ']' without '['")
        if char == "," and depth == 0:
            items.append(current)
            current = ""
        else:
            current += char
    if depth:
        raise ValueError(f"SLURM host list {hostlist!r}: '[' without ']'")
    items.append(current)
    return [item.strip() for item in items if item.strip()]


def _expand_item(item: str, hostlist: str) -> list[str]:
    parts = re.split(r"\[([^\]]*)\]", item)  # literal, range, literal, range, ..., literal
    choices: list[list[str]] = []
    for i, part in enumerate(parts):
        choices.append(_expand_ranges(part, hostlist) if i % 2 else [part])
    return ["".join(combo) for combo in itertools.product(*choices)]


def _expand_ranges(ranges: str, hostlist: str) -> list[str]:
    out: list[str] = []
    for piece in ranges.split(","):
        match = _RANGE.match(piece.strip())
        if not match:
            raise ValueError(f"SLURM host list {hostlist!r}: {piece!r} is not N or N-M")
        first, last = match.group(1), match.group(2) or match.group(1)
        if int(last) < int(first):
            raise ValueError(f"SLURM host list {hostlist!r}: range {piece!r} runs backwards")
        width = len(first)
        out += [str(n).zfill(width) for n in range(int(first), int(last) + 1)]
    return out
