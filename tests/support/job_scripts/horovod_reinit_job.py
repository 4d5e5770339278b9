"""Horovod started and stopped many times in one ``horovodrun`` job, with distkit Trainers.

    horovodrun -np 2 -H localhost:2 --gloo \
        python -m tests.support.job_scripts.horovod_reinit_job OUT [--cycles N]

Each cycle: two Trainers with ``strategy="horovod"`` one after another, each fitting the shared
tiny workload and closing (``Trainer.close()``), then ``hvd.shutdown()``. The first Trainer of
the next cycle starts Horovod again: a fresh ``hvd.init()`` that meets in horovodrun's
rendezvous server. Horovod 0.28.1's server kept the keys of a finished init there (its
``do_DELETE`` cleared every scope's finished list instead of its own), and a later init could
connect to a dead address and abort in gloo ("Connection refused", "Connect timeout").

Aborts are a race, so the job also looks at the cause. Before each cycle, each rank looks for
its own keys of the previous init in the server's three scopes (``global``, ``local_<host>``,
``cross_<local rank>``). Every rank finished its part of that init before the previous fit's
first collective, so with a server that forgets finished scopes none is left. Whether the
released server keeps them depends on the order of the ranks' requests too: 4 of the 6 runs
here that did not abort saw some.

After each cycle, each rank writes ``OUT/rank<r>.pt``: the cycles it finished, the stale keys it
saw, whether every Trainer ended with the same parameters, the first Trainer's parameters, and
each Trainer's wall time (the first of a cycle includes starting Horovod). Rank 0 prints one line
per cycle.
"""

from __future__ import annotations

import argparse
import os
import time
import urllib.error
import urllib.request
from pathlib import Path

import horovod.torch as hvd
import torch

from tests.support.workloads import max_abs_diff, train_with_distkit

BATCH = 4  # per process: 2 processes train like one with 8
SAMPLES = 24


def leftover_keys() -> list[str]:
    """This rank's keys of the last ``hvd.init()`` still in horovodrun's rendezvous server."""
    env = os.environ
    server = f"http://{env['HOROVOD_GLOO_RENDEZVOUS_ADDR']}:{env['HOROVOD_GLOO_RENDEZVOUS_PORT']}"
    local_rank = env["HOROVOD_LOCAL_RANK"]
    mine = {  # scope: this rank's rank in it (gloo's keys are "<rank>" and "rank_<rank>")
        "global": env["HOROVOD_RANK"],
        f"local_{env['HOROVOD_HOSTNAME']}": local_rank,
        f"cross_{local_rank}": env["HOROVOD_CROSS_RANK"],
    }
    found = []
    for scope, rank in mine.items():
        for key in (rank, f"rank_{rank}"):
            try:
                with urllib.request.urlopen(f"{server}/{scope}/{key}", timeout=10):
                    found.append(f"{scope}/{key}")  # the value is a binary address: not read
            except urllib.error.HTTPError as exc:
                if exc.code != 404:
                    raise
    return found


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--cycles", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    args.out.mkdir(parents=True, exist_ok=True)
    rank = int(os.environ["HOROVOD_RANK"])
    record: dict = {"cycles": 0, "stale": [], "identical": True, "state": None, "seconds": []}
    for cycle in range(args.cycles):
        record["stale"].append(leftover_keys())
        for _ in range(2):  # the first Trainer starts Horovod, the second finds it running
            start = time.perf_counter()
            out = train_with_distkit("horovod", BATCH, n=SAMPLES, epochs=1)  # fits, closes
            record["seconds"].append(time.perf_counter() - start)
            if record["state"] is None:
                record["state"] = out["state"]
            record["identical"] &= max_abs_diff(out["state"], record["state"]) == 0.0
        hvd.shutdown()
        record["cycles"] = cycle + 1
        # after every cycle: a job that aborts later still says what it saw
        torch.save(record, args.out / f"rank{rank}.pt.tmp")
        os.replace(args.out / f"rank{rank}.pt.tmp", args.out / f"rank{rank}.pt")
        if rank == 0:
            first_s, second_s = record["seconds"][-2:]
            print(f"cycle {cycle} done ({first_s:.2f}s, {second_s:.2f}s)", flush=True)


if __name__ == "__main__":
    main()
