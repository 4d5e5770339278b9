"""A user script that trains from a stream, run under real launchers by tests/data/test_streams.py.

    torchrun --nproc_per_node 3 -m tests.support.job_scripts.stream_job ddp 2 2 OUT  # 2 workers
    horovodrun -np 3 -H localhost:3 --gloo \
        python -m tests.support.job_scripts.stream_job horovod 2 0 OUT

Trains the shared workload's 61 samples as a stream (uneven at 2 and 3 ranks), validating on
the stream, then takes the exact-once census of a 61-sample stream. Each rank writes
``OUT/rank<r>.pt``: final weights, history, steps and the census.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.support.stream_workloads import census, save_result, train_stream


def main(strategy: str, batch_size: int, workers: int, out: Path) -> None:
    result = train_stream(strategy, batch_size, num_workers=workers)
    result["census"] = census(strategy, 61)
    save_result(result, out)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
