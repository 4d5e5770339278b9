"""The throughput figures users compare: tokens/s and MFU, in the epoch record.

- **FLOPs per sample** are counted once, on the fit's first micro-batch that holds samples,
  with torch's ``FlopCounterMode`` around its forward and backward (the matmuls and
  convolutions torch counts: what "model FLOPs" means in MFU), divided by its samples. A
  model whose cost per sample changes from batch to batch (sequences of other lengths) is
  counted at its first batch.
- **The peak** is the device's dense matmul peak in the dtype the matmuls run in (the
  autocast's under ``precision="bf16"``/``"fp16"``; under ``"32"`` the parameters' own, so
  a float64 or a bf16-cast model is measured against its own peak): for a GPU from
  a table of published figures (:data:`GPU_PEAKS`, TFLOP/s per device; a GPU not in it gets
  no MFU); on a CPU a matmul measured once per process with the process's threads, labelled
  as measured.
- **MFU** = FLOPs per sample x the epoch's samples/s (every rank's) / the sum of the peaks
  of every device that trained (each rank's, gathered with the epoch's record, so that every
  rank reports the same figure; a rank's measured CPU peak is its own).
- **tokens/s**, for token-exact losses (``distkit.Loss(total, count)``): the epoch's items
  over every rank, over the same wall time as samples/s.

At each log point the progress bar shows, with :class:`RateWindow`, the same figures over
the steps since the previous log point (the loggers' rows stay the loss, the learning rate
and the norm; they get the figures with each epoch's record): samples/s from the samples every
rank took (known on the host), tokens/s from the window's items summed in the log point's
existing sum, MFU over this rank's peak times the world's devices (the epoch record's uses
every rank's own). A window that spans an epoch's end (its validation, its checkpoint) gives
no figures: the next log point's window starts clean.

Nothing here runs per step: the count is one step's, the peak is measured once, the rest is
arithmetic on numbers the log points and the epoch's gather already have.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

import torch

T = TypeVar("T")

#: dense (no sparsity) matmul peaks, TFLOP/s per device, by the device name's marker, the
#: most specific first; "tf32" is fp32 training with TF32 matmuls allowed, "64" FP64 (tensor
#: cores where the GPU has them; left out where NVIDIA publishes no figure)
GPU_PEAKS: tuple[tuple[str, dict[str, float]], ...] = (
    ("H100 PCIe", {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "32": 51.2, "64": 51.2}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "32": 66.9, "64": 66.9}),
    ("H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "32": 66.9, "64": 66.9}),
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "32": 19.5, "64": 19.5}),
    ("L40S", {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "32": 91.6}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "32": 30.3}),
    ("V100", {"fp16": 125.0, "32": 15.7, "64": 7.8}),
)
_DTYPES = {"32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "64": torch.float64}
_KINDS = {dtype: kind for kind, dtype in _DTYPES.items()}
#: the epoch record's entries (each only where it applies)
THROUGHPUT_KEYS = ("tokens_per_s", "flops_per_sample", "mfu")


@dataclass(frozen=True)
class Peak:
    """A device's matmul peak in FLOP/s, and where the figure comes from."""

    flops: float
    source: str  # "published: NVIDIA H100 80GB HBM3, bf16", "measured: CPU fp32 matmul, ..."

    def text(self) -> str:
        return f"{_flops_text(self.flops)}/s ({self.source})"


def count_flops(run: Callable[[], T]) -> tuple[T, int]:
    """``run()``'s result and the FLOPs torch counted while it ran (forward and backward).

    The total only: torch's counter also tracks which module each FLOP is in, with hooks on
    every module's inputs and outputs for the backward, and those hooks fail inside
    ``torch.autograd.grad`` on a leaf input (a pipeline stage's backward). The tracker is
    replaced by one that puts every FLOP in the total (its "Global" entry), as the tracker
    always does too."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    if hasattr(counter, "mod_tracker"):
        counter.mod_tracker = _TotalOnly()  # type: ignore[assignment]
    with counter:
        result = run()
    return result, int(counter.get_total_flops())


class _TotalOnly:
    """A stand-in for torch's module tracker in :func:`count_flops`: no hooks, one parent."""

    parents = frozenset({"Global"})

    def __enter__(self) -> _TotalOnly:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def matmul_kind(precision: str, parameters: torch.dtype | None) -> str:
    """The dtype a fit's matmuls run in, as :func:`device_peak` names it: ``precision``'s
    autocast dtype ("bf16", "fp16"), or under "32" the parameters' own ("64" for a float64
    model, "bf16" for a model cast to bf16)."""
    if precision != "32" or parameters is None:
        return precision
    return _KINDS.get(parameters, "32")


def device_peak(device: torch.device, precision: str) -> Peak | None:
    """The matmul peak of one ``device`` in ``precision`` ("32", "bf16", "fp16", "64": see
    :func:`matmul_kind`); None for a GPU the table does not know in it (its MFU is then not
    reported)."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        kind = precision
        if precision == "32" and torch.backends.cuda.matmul.allow_tf32:
            kind = "tf32"
        for marker, peaks in GPU_PEAKS:
            if marker in name and kind in peaks:
                return Peak(peaks[kind] * 1e12, f"published: {name}, {kind}")
        return None
    if device.type != "cpu":
        return None
    name = {"32": "fp32", "64": "fp64"}.get(precision, precision)
    threads = torch.get_num_threads()
    flops = cpu_matmul_peak(precision, threads)
    threads_text = f"{threads} thread{'s' if threads > 1 else ''}"
    return Peak(flops, f"measured: CPU {name} matmul, {threads_text}")


@functools.lru_cache(maxsize=8)
def cpu_matmul_peak(precision: str, threads: int, size: int = 512) -> float:
    """FLOP/s of a ``size`` x ``size`` matmul on this process's CPU threads (``threads``
    keys the cache), the best of a few timed runs of about 20 ms each."""
    dtype = _DTYPES[precision]
    # a generator of its own: drawing from torch's global one would change the training
    # that follows (its dropout, its shuffles), which determinism and resume rely on
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(dtype)
    b = torch.randn(size, size, generator=generator).to(dtype)
    torch.mm(a, b)  # warm-up: the kernel's first call chooses its path
    start = time.perf_counter()
    torch.mm(a, b)
    once = max(time.perf_counter() - start, 1e-6)
    reps = max(1, min(200, int(0.02 / once)))
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        best = min(best, (time.perf_counter() - start) / reps)
    return 2.0 * size**3 / best


def throughput_record(
    *,
    flops_per_sample: float | None,
    samples_per_s: float,
    peak_sum: float,
    items: float | None,
    wall_s: float,
) -> dict[str, float]:
    """The epoch record's entries: ``flops_per_sample`` and ``mfu`` (where counted and the
    peak of every device that trained, ``peak_sum``, is known: else 0), ``tokens_per_s``
    (``items``: a token-exact epoch's items, every rank's)."""
    record: dict[str, float] = {}
    if items is not None and wall_s > 0:
        record["tokens_per_s"] = items / wall_s
    if flops_per_sample:
        record["flops_per_sample"] = flops_per_sample
        if peak_sum > 0:
            record["mfu"] = flops_per_sample * samples_per_s / peak_sum
    return record


class RateWindow:
    """Throughput between two log points of one epoch (see the module's docstring)."""

    def __init__(self) -> None:
        self._since: tuple[float, int] | None = None  # (clock, position); None: not clean
        self._logged_at: int | None = None  # the global step of the last log point

    def open(self, position: int, global_step: int) -> None:
        """An epoch's training starts at ``position``: the window is clean when nothing
        trained since the last log point (or the fit has not logged yet)."""
        clean = self._logged_at is None or self._logged_at == global_step
        self._since = (time.perf_counter(), position) if clean else None

    def close(
        self,
        *,
        position: int,
        global_step: int,
        items: float | None,
        flops_per_sample: float | None,
        peak_sum: float,
    ) -> dict[str, float]:
        """The figures since the window opened (empty where it spans an epoch's end), and a
        new window from here. ``items``: the window's summed items (token-exact losses;
        None otherwise), ``peak_sum``: the peaks of every device that trains (0: unknown)."""
        now = time.perf_counter()
        since, self._since, self._logged_at = self._since, (now, position), global_step
        if since is None or now <= since[0] or position <= since[1]:
            return {}
        wall = now - since[0]
        samples_per_s = (position - since[1]) / wall
        # the epoch record's arithmetic over the window, less its count (a fit's constant)
        figures = throughput_record(
            flops_per_sample=flops_per_sample,
            samples_per_s=samples_per_s,
            peak_sum=peak_sum,
            items=items,
            wall_s=wall,
        )
        figures.pop("flops_per_sample", None)
        return {"samples_per_s": samples_per_s, **figures}


def rates_text(rates: dict[str, float]) -> dict[str, str]:
    """A log point's figures as the progress bar shows them."""
    shown = {}
    if "samples_per_s" in rates:
        shown["samples/s"] = f"{rates['samples_per_s']:,.0f}"
    if "tokens_per_s" in rates:
        shown["tokens/s"] = f"{rates['tokens_per_s']:,.0f}"
    if "mfu" in rates:
        shown["MFU"] = _percent_text(rates["mfu"])
    return shown


def throughput_text(record: dict[str, float], peak: Peak | None) -> str:
    """The epoch report's line (empty when nothing was counted)."""
    parts = []
    if "tokens_per_s" in record:
        parts.append(f"{record['tokens_per_s']:,.0f} tokens/s")
    if "flops_per_sample" in record:
        parts.append(f"{_flops_text(record['flops_per_sample'])} per sample")
    if "mfu" in record and peak is not None:
        parts.append(f"MFU {_percent_text(record['mfu'])} of {peak.text()}")
    elif "flops_per_sample" in record:
        parts.append("MFU: no peak known for this device")
    return ("  " + "; ".join(parts)) if parts else ""


def _percent_text(share: float) -> str:
    """41.2%; below 0.1% three significant digits (a small model on a CPU: 0.000512%)."""
    return f"{share:.1%}" if share >= 1e-3 else f"{100 * share:.3g}%"


def _flops_text(flops: float) -> str:
    units = (("PFLOP", 1e15), ("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6), ("kFLOP", 1e3))
    for unit, scale in units:
        if flops >= scale:
            return f"{flops / scale:.3g} {unit}"
    return f"{flops:.3g} FLOP"
