"""What token-exact losses cost per step against plain (batch-mean) losses.

The same Trainer fit of a small causal language model on padded variable-length sequences,
with three step functions: the batch-mean token loss (``plain``: what distkit weights by
samples), ``distkit.Loss(total, count)`` with the count left on the device (``tensor``: one
device all-reduce of the count per step, plus the host-side tag sum every step makes), and
with the count read as an int (``int``: the user's ``int(...)`` reads the device, and the
step's count is summed on the host). Modes alternate round by round (plain, tensor, int,
plain, ...) so that machine noise hits them alike; a step is timed from one
``on_train_step_end`` to the next; the ratio is median(mode) / median(plain).

    PYTHONPATH=. python benchmarks/token_exact.py                # 1 process and 2 (gloo)
    PYTHONPATH=. python benchmarks/token_exact.py --nprocs 1 --steps 40 --rounds 2

Writes benchmarks/results/token_exact.json (``--results DIR`` elsewhere).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import distkit  # noqa: E402
from distkit.testing import run_on_ranks  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
MODES = ("plain", "tensor", "int")
VOCAB, LENGTH, WIDTH = 256, 64, 128


class Lines(torch.utils.data.Dataset):
    """Padded sequences of random real lengths (labels -100 on the padding)."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(2, LENGTH + 1, (n,), generator=g)
        self.ids = torch.randint(1, VOCAB, (n, LENGTH), generator=g)
        self.labels = self.ids.roll(-1, dims=1)
        pad = torch.arange(LENGTH) >= (lengths[:, None] - 1)
        self.labels[pad] = -100

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, WIDTH), nn.Linear(WIDTH, WIDTH), nn.GELU(),
                         nn.Linear(WIDTH, WIDTH), nn.GELU(), nn.Linear(WIDTH, VOCAB))  # fmt: skip


def _sums(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model(batch["input_ids"])
    labels = batch["labels"]
    total = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")
    return total, (labels != -100).sum()


def plain_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    total, count = _sums(model, batch)
    return total / count


def tensor_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> distkit.Loss:
    return distkit.Loss(*_sums(model, batch))


def int_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> distkit.Loss:
    total, count = _sums(model, batch)
    return distkit.Loss(total, int(count))


STEPS = {"plain": plain_step, "tensor": tensor_step, "int": int_step}


class Clock(distkit.Callback):
    stops_training = False

    def __init__(self) -> None:
        self.marks: list[float] = []

    def on_train_step_end(self, trainer: Any, logs: Any) -> None:
        self.marks.append(time.perf_counter())


def fit_ms(mode: str, steps: int, batch: int) -> list[float]:
    """One fit of ``steps`` steps with ``mode``'s step function: its step times (ms)."""
    clock = Clock()
    trainer = distkit.Trainer("auto", batch_size=batch, max_epochs=1, progress=False,
                              shuffle=False, callbacks=[clock], log_every_n_steps=1000)  # fmt: skip
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = Lines(steps * batch * trainer.world_size)
    trainer.fit(model, optimizer, data, step_fn=STEPS[mode])
    trainer.close()
    marks = clock.marks[2:]  # the first steps warm up
    return [(b - a) * 1e3 for a, b in itertools.pairwise(marks)]


def rounds(steps: int, batch: int, count: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {mode: [] for mode in MODES}
    for _ in range(count):
        for mode in MODES:
            times[mode] += fit_ms(mode, steps, batch)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nprocs", type=int, nargs="*", default=[1, 2])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--results", type=Path, default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    report: dict[str, Any] = {}
    for nprocs in args.nprocs:
        body = partial(rounds, args.steps, args.batch_size, args.rounds)
        per_rank = run_on_ranks(body, world_size=nprocs, timeout=1800, agent_store=True)
        times = per_rank[0]  # rank 0's steps (every rank steps together)
        plain = statistics.median(times["plain"])
        entry = {}
        for mode in MODES:
            median = statistics.median(times[mode])
            entry[mode] = {"median_ms": median, "ratio": median / plain, "steps": len(times[mode])}
            print(f"{nprocs} proc  {mode:>6}: {median:7.3f} ms/step  x{median / plain:.3f}")
        report[str(nprocs)] = entry
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "token_exact.json").write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
