"""What the checkpoint digest costs: saving and loading a 100 MB checkpoint with and without.

"With" is distkit's path (``checkpoint.atomic_save``: SHA-256 hashed while ``torch.save``
writes, then sealed in the zip comment; ``checkpoint.load``: the file hashed again before
it is read). "Without" is the same path with the digest taken out: the same temp file,
fsync, weights-only check and rename around a plain ``torch.save``, and ``load(...,
verify=False)``. Rounds alternate the two so that a busy machine slows both alike; the
table shows medians and the ratio.

    python benchmarks/checkpoint_digest.py [--mb 100] [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from distkit import checkpoint as ckpt
from distkit._atomic import TempFile
from distkit.checkpoint import _digest

RESULTS = Path(__file__).resolve().parent / "results"


def _payload(mb: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(0)
    numel = mb * 1_000_000 // 4
    half = numel // 2  # two tensors, as a model and its optimizer state
    optimizer = {
        "state": {0: {"momentum_buffer": torch.randn(numel - half)}},
        "param_groups": [{"params": [0], "lr": 0.1}],
    }
    return {
        "format": ckpt.FORMAT,
        "version": ckpt.VERSION,
        "model": {"weight": torch.randn(half, generator=generator)},
        "optimizer": optimizer,
    }


def _save_without_digest(payload: dict[str, Any], path: Path) -> None:
    tmp = TempFile(path)
    tmp.publish(path, lambda handle: torch.save(payload, handle), ckpt.require_weights_only)


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    payload = _payload(args.mb)
    times: dict[str, list[float]] = {k: [] for k in ("save", "save_digest", "load", "load_digest")}
    with tempfile.TemporaryDirectory() as folder:
        plain, sealed = Path(folder) / "plain.pt", Path(folder) / "sealed.pt"
        for _ in range(args.rounds):
            times["save"].append(_timed(lambda: _save_without_digest(payload, plain)))
            times["save_digest"].append(_timed(lambda: ckpt.atomic_save(payload, sealed)))
            times["load"].append(_timed(lambda: ckpt.load(plain, verify=False)))
            times["load_digest"].append(_timed(lambda: ckpt.load(sealed)))
        size = sealed.stat().st_size
        assert _digest.verify(sealed) and _digest.stored(plain) is None
        hash_only = _timed(lambda: _digest.file_digest(sealed))
    medians = {key: statistics.median(values) for key, values in times.items()}
    print(f"checkpoint of {size / 1e6:.1f} MB, {args.rounds} rounds, medians:")
    print("| | without digest | with digest | ratio |")
    print("| --- | --- | --- | --- |")
    for what in ("save", "load"):
        base, with_digest = medians[what], medians[f"{what}_digest"]
        print(f"| {what} | {base:.3f} s | {with_digest:.3f} s | {with_digest / base:.2f} |")
    print(f"SHA-256 of the file alone: {hash_only:.3f} s ({size / 1e6 / hash_only:.0f} MB/s)")
    RESULTS.mkdir(exist_ok=True)
    out = {"bytes": size, "rounds": args.rounds, "times": times, "medians": medians}
    (RESULTS / "checkpoint_digest.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
