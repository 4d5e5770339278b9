"""Peak memory per rank, once per epoch: the epoch record's ``peak_mem_*`` entries.

Each rank resets its peak when an epoch starts (:func:`reset_peak`) and reads it when the
epoch ends (:func:`peak_mib`); the values travel in the epoch's existing all-gather
(:meth:`~distkit.trainer._step_loop.StepLoop.epoch_record`), so measuring costs no
collective and no host synchronisation of its own, and nothing per step.

What is measured:

* **CUDA**: ``torch.cuda.max_memory_allocated`` (tensors) and ``max_memory_reserved`` (what
  the caching allocator holds from the driver) of this rank's device, since the epoch's
  start (``torch.cuda.reset_peak_memory_stats`` there). Memory outside PyTorch's allocator
  (the CUDA context, NCCL's buffers) is in neither.
* **CPU**: the process's peak resident set size (``VmHWM`` in ``/proc/self/status``). Linux
  resets it when ``5`` is written to ``/proc/self/clear_refs``, done at each epoch's start;
  where that cannot be done (not Linux, a locked-down ``/proc``) it is the peak since the
  process started (``getrusage``'s ``ru_maxrss``), which never goes down. It counts the
  whole process (the model, the optimizer, Python, the libraries), not the DataLoader's
  worker processes.
"""

from __future__ import annotations

import contextlib
import re
import sys
from collections.abc import Sequence

import torch

#: the epoch record's entries (peak_reserved_mib: CUDA only)
MEMORY_KEYS = ("peak_mem_mib", "peak_mem_rank", "peak_mem_min_mib", "peak_reserved_mib")
_MIB = 2.0**20
_HWM = re.compile(r"^VmHWM:\s+(\d+)\s+kB", re.MULTILINE)


def reset_peak(device: torch.device) -> None:
    """Start a new peak on this rank (at an epoch's start)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    # a reset the kernel refuses leaves the peak since the process started
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")


def peak_mib(device: torch.device) -> list[float]:
    """``[peak, reserved]`` MiB on this rank since :func:`reset_peak` (reserved: CUDA's
    caching allocator; 0 on CPU)."""
    if device.type == "cuda":
        allocated = torch.cuda.max_memory_allocated(device)
        return [allocated / _MIB, torch.cuda.max_memory_reserved(device) / _MIB]
    return [_peak_rss_bytes() / _MIB, 0.0]


def memory_record(
    per_rank: torch.Tensor | Sequence[Sequence[float]], device: torch.device
) -> dict[str, float]:
    """The epoch record's entries from one :func:`peak_mib` row per rank: the largest peak
    and its rank, the smallest, and (CUDA) the largest reserved."""
    rows = per_rank.tolist() if isinstance(per_rank, torch.Tensor) else per_rank
    peaks = [row[0] for row in rows]
    rank = peaks.index(max(peaks))  # the first of equal peaks
    record = {
        "peak_mem_mib": float(peaks[rank]),
        "peak_mem_rank": rank,
        "peak_mem_min_mib": float(min(peaks)),
    }
    if device.type == "cuda":
        record["peak_reserved_mib"] = float(max(row[1] for row in rows))
    return record


def memory_text(record: dict[str, float]) -> str:
    """The epoch line's part: ``peak_mem=1234 MiB (rank 1)`` (``""``: not measured)."""
    if "peak_mem_mib" not in record:
        return ""
    where = f"rank {int(record['peak_mem_rank'])}"
    if "peak_reserved_mib" in record:
        where += f"; reserved {record['peak_reserved_mib']:.0f} MiB"
    return f"peak_mem={record['peak_mem_mib']:.0f} MiB ({where})"


def _peak_rss_bytes() -> float:
    with contextlib.suppress(OSError):
        with open("/proc/self/status") as status:
            found = _HWM.search(status.read())
        if found is not None:
            return float(found.group(1)) * 1024
    try:
        import resource
    except ImportError:  # Windows: the peak is unknown
        return 0.0
    usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return float(usage) if sys.platform == "darwin" else float(usage) * 1024  # macOS: bytes
