"""Promises about the process group: where each process sits, the collectives, ordering.

Each body creates its own Trainer (so one broken promise does not break the next body) and
returns plain numbers and lists; each verifier compares every rank's results.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from distkit.errors import ConfigurationError
from distkit.testing._promise import Promise, close, expect
from distkit.testing._target import StrategyUnderTest


# ---------------------------------------------------------------- topology
def _topology_body(target: StrategyUnderTest, workdir: Path) -> dict[str, Any]:
    with target.trainer() as trainer:
        s = trainer.strategy
        return {
            "strategy": (s.rank, s.local_rank, s.world_size, s.is_main),
            "trainer": (trainer.rank, trainer.world_size, trainer.is_main),
            "device": str(s.device),
        }


def _verify_topology(results: list[dict[str, Any]], world: int) -> None:
    devices = [torch.device(r["device"]) for r in results]
    for rank, r in enumerate(results):
        expected = (rank, rank, world, rank == 0)
        expect(
            r["strategy"] == expected,
            f"process {rank} of {world} reports (rank, local_rank, world_size, is_main) = "
            f"{r['strategy']}; expected {expected}",
        )
        expect(
            r["trainer"] == (rank, world, rank == 0),
            f"rank {rank}: the Trainer reports (rank, world_size, is_main) = {r['trainer']}",
        )
        expect(
            devices[rank].type == devices[0].type,
            f"ranks run on different kinds of device: {[str(d) for d in devices]}",
        )
        if devices[rank].type == "cuda" and world > 1:
            expect(
                devices[rank].index == rank,
                f"rank {rank} (local rank {rank}) runs on {devices[rank]}; expected cuda:{rank}",
            )


# ---------------------------------------------------------------- collectives
def _refusal(call: Any) -> str:
    try:
        call()
    except ConfigurationError as exc:
        return f"ConfigurationError: {exc}"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    return "no error"


def _collectives_body(target: StrategyUnderTest, workdir: Path) -> dict[str, Any]:
    with target.trainer() as trainer:
        s = trainer.strategy
        rank = s.rank
        t = torch.tensor([rank + 1.0, 2.0], device=s.device)
        out: dict[str, Any] = {
            "sum": s.all_reduce(t, op="sum").tolist(),
            "mean": s.all_reduce(t, op="mean").tolist(),
            "int_mean": s.all_reduce(torch.tensor([rank * 2], device=s.device)).tolist(),
        }
        out["input_unchanged"] = t.tolist() == [rank + 1.0, 2.0]
        out["broadcast"] = s.broadcast({"from": rank, "payload": [1, 2]}, src=0)
        out["gather"] = s.all_gather(torch.tensor([rank, 10 + rank], device=s.device)).tolist()
        out["gather_object"] = s.all_gather_object(f"r{rank}")
        s.barrier()
        out["bad_op"] = _refusal(lambda: s.all_reduce(t, op="max"))
        out["not_a_tensor"] = _refusal(lambda: s.all_reduce(3.0, op="sum"))  # type: ignore[arg-type]
        return out


def _verify_collectives(results: list[dict[str, Any]], world: int) -> None:
    ranks = range(world)
    total = sum(k + 1.0 for k in ranks)
    expected = {
        "sum": [total, 2.0 * world],
        "mean": [total / world, 2.0],
        "int_mean": [sum(2 * k for k in ranks) / world],
    }
    for rank, r in enumerate(results):
        for op, want in expected.items():
            expect(
                close(r[op], want), f"rank {rank}: all_reduce ({op}) gave {r[op]}; expected {want}"
            )
        expect(r["input_unchanged"], f"rank {rank}: all_reduce changed its input tensor")
        want_b = {"from": 0, "payload": [1, 2]}
        expect(r["broadcast"] == want_b, f"rank {rank}: broadcast gave {r['broadcast']}")
        want_g = [[k, 10 + k] for k in ranks]
        expect(
            r["gather"] == want_g, f"rank {rank}: all_gather gave {r['gather']}; expected {want_g}"
        )
        want_o = [f"r{k}" for k in ranks]
        expect(
            r["gather_object"] == want_o,
            f"rank {rank}: all_gather_object gave {r['gather_object']}",
        )
        for case, words in (("bad_op", "reduce op"), ("not_a_tensor", "torch.Tensor")):
            expect(
                r[case].startswith("ConfigurationError") and words in r[case],
                f"rank {rank}: all_reduce with {case.replace('_', ' ')} should raise "
                f"ConfigurationError naming {words!r}; got {r[case]}",
            )


# ---------------------------------------------------------------- main_process_first
def _main_process_first_body(target: StrategyUnderTest, workdir: Path) -> list[list[float]]:
    with target.trainer() as trainer:
        s = trainer.strategy
        with s.main_process_first():
            entered = time.time()
            if s.is_main:
                time.sleep(0.3)
            left = time.time()
        both = torch.tensor([entered, left], dtype=torch.float64, device=s.device)
        return s.all_gather(both).tolist()


def _verify_main_process_first(results: list[list[list[float]]], world: int) -> None:
    times = results[0]
    rank0_left = times[0][1]
    for rank, (entered, _) in enumerate(times[1:], start=1):
        expect(
            entered >= rank0_left,
            f"rank {rank} entered the block {rank0_left - entered:.3f}s before rank 0 left it",
        )


TOPOLOGY = Promise(
    "topology",
    "rank, local_rank, world_size, is_main and device follow the launcher",
    _topology_body,
    _verify_topology,
)
COLLECTIVES = Promise(
    "collectives",
    "all_reduce (sum, mean), broadcast, all_gather, all_gather_object, barrier; bad calls refused",
    _collectives_body,
    _verify_collectives,
)
MAIN_PROCESS_FIRST = Promise(
    "main_process_first",
    "rank 0 finishes the block before the other ranks enter it",
    _main_process_first_body,
    _verify_main_process_first,
)
