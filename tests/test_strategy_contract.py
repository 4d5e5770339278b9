"""One contract, written once, that every registered CPU-capable strategy must pass.

Each case runs on real processes (gloo on loopback for ddp; a single process for dp).
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import distkit

pytestmark = pytest.mark.timeout(180)

# (strategy, world size)
CPU_STRATEGIES = [("ddp", 2), ("dp", 1)]


def _on_rank_check_contract(strategy_name: str) -> dict:
    trainer = distkit.Trainer(strategy_name, progress=False, grad_accum_steps=2)
    s = trainer.strategy
    rank, world = s.rank, s.world_size
    out: dict = {"rank": rank, "world": world, "local_rank": s.local_rank, "is_main": s.is_main}
    out["device"] = str(s.device)

    # collectives
    t = torch.tensor([rank + 1.0, 2.0])
    out["sum"] = s.all_reduce(t, op="sum").tolist()
    out["mean"] = s.all_reduce(t, op="mean").tolist()
    out["input_unchanged"] = t.tolist() == [rank + 1.0, 2.0]
    out["int_mean"] = s.all_reduce(torch.tensor([rank * 2]), op="mean").tolist()
    out["broadcast"] = s.broadcast({"from": rank, "payload": [1, 2]}, src=0)
    out["gather"] = s.all_gather(torch.tensor([rank, 10 + rank])).tolist()
    out["gather_obj"] = s.all_gather_object(f"r{rank}")
    s.barrier()
    with s.main_process_first():
        entered = time.time()
        if s.is_main:
            time.sleep(0.3)
        left = time.time()
    out["first"] = s.all_gather(torch.tensor([entered, left], dtype=torch.float64)).tolist()
    out["sampler"] = s.sampler_kwargs()
    with pytest.raises(distkit.ConfigurationError, match="reduce op"):
        s.all_reduce(t, op="max")
    with pytest.raises(distkit.ConfigurationError, match=r"torch\.Tensor"):
        s.all_reduce(3.0, op="sum")  # type: ignore[arg-type]

    # set-up: identical weights everywhere, unwrap gives the user's module back
    torch.manual_seed(100 + rank)  # deliberately different initial weights per rank
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    wrapped, optimizer = s.setup(model, optimizer)
    out["unwrap_is_model"] = s.unwrap(wrapped) is model
    out["weights_after_setup"] = s.all_gather(model.weight.detach()).tolist()

    # accumulation: no communication inside no_sync, mean over ranks after the step
    x = torch.full((2, 4), float(rank + 1))
    with s.no_sync(wrapped):
        with s.autocast():
            loss = wrapped(x).sum()
        s.backward(loss, optimizer)
    assert model.weight.grad is not None
    out["grads_inside"] = s.all_gather(model.weight.grad.detach().clone()).tolist()
    with s.autocast():
        loss = wrapped(x).sum()
    s.backward(loss, optimizer)
    out["stepped"] = s.optimizer_step(optimizer)
    out["grads_after"] = s.all_gather(model.weight.grad.detach().clone()).tolist()
    trainer.close()
    return out


@pytest.mark.parametrize(("strategy", "world"), CPU_STRATEGIES)
def test_strategy_contract(strategy, world, run_on_ranks):
    """ddp and dp here; horovod runs the same body under horovodrun (tests/test_horovod.py)."""
    check_contract_results(run_on_ranks(_on_rank_check_contract, strategy, world_size=world), world)


def check_contract_results(results: list[dict], world: int) -> None:
    ranks = list(range(world))
    assert [r["rank"] for r in results] == ranks
    assert [r["local_rank"] for r in results] == ranks
    assert all(r["world"] == world for r in results)
    assert [r["is_main"] for r in results] == [rank == 0 for rank in ranks]
    assert all(r["device"] == "cpu" for r in results)
    total = sum(rank + 1.0 for rank in ranks)
    for r in results:
        assert r["sum"] == [total, 2.0 * world]
        assert r["mean"] == pytest.approx([total / world, 2.0])
        assert r["input_unchanged"]
        assert r["int_mean"] == pytest.approx([sum(2 * k for k in ranks) / world])
        assert r["broadcast"] == {"from": 0, "payload": [1, 2]}
        assert r["gather"] == [[k, 10 + k] for k in ranks]
        assert r["gather_obj"] == [f"r{k}" for k in ranks]
        assert r["sampler"] == {"num_replicas": world, "rank": r["rank"]}
        main_left = r["first"][0][1]
        assert all(entered >= main_left for entered, _ in r["first"][1:]), "rank 0 went first"
        assert r["unwrap_is_model"]
        weights = r["weights_after_setup"]
        assert all(w == weights[0] for w in weights), "ranks start from different weights"
        assert r["stepped"] is True
        # d(sum(Wx))/dW = sum of x rows = 2 * (rank + 1) per backward, two backwards
        inside = r["grads_inside"]
        assert inside == [[[2.0 * (k + 1)] * 4] for k in ranks]
        expected = 4.0 * total / world
        assert r["grads_after"] == [[[pytest.approx(expected)] * 4] for _ in ranks]
    if world > 1:
        inside = results[0]["grads_inside"]
        assert inside[0] != inside[1], "gradients were synchronised inside no_sync"
