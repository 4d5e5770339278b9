"""distkit.Runtime as a public object: created on its own (the Trainer's strategy, precision
and fault arguments, validated the same way), this rank's place, the collectives, a rank-0
print, full weights, closing; and Trainers that share one Runtime (a sweep of fits joins the
process group once). Real gloo processes for everything multi-rank."""

from __future__ import annotations

import contextlib
import io
from typing import Any

import pytest
import torch
from torch import nn

import distkit
from tests.support.workloads import make_dataset, make_mlp

pytestmark = pytest.mark.timeout(120)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


# ---------------------------------------------------------------- one process
def test_a_runtime_alone_says_where_it_runs_and_closes():
    with distkit.Runtime("dp") as rt:
        assert (rt.rank, rt.world_size, rt.local_rank, rt.is_main) == (0, 1, 0, True)
        # dp over every local GPU (the first holds the model), else the CPU
        here = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
        assert rt.device == here and rt.strategy.name == "dp"
        assert repr(rt).startswith("Runtime(strategy=")
        assert not rt.closed
    assert rt.closed
    rt.close()  # idempotent
    with pytest.raises(distkit.errors.TrainerClosedError, match=r"barrier\(\) on a closed"):
        rt.barrier()


def test_a_closed_runtimes_model_and_optimizer_say_it_is_closed():
    """Before, they ran on as if set up (a DDP forward would meet a destroyed group)."""
    with distkit.Runtime("dp") as rt:
        plain = make_mlp()
        model, optimizer = rt.setup(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
        x, y = make_dataset(4).tensors
        rt.backward(_loss(model(x), y))
        optimizer.step()
    with pytest.raises(distkit.errors.TrainerClosedError, match="used on a closed Runtime"):
        model(x)
    with pytest.raises(distkit.errors.TrainerClosedError, match="used on a closed Runtime"):
        optimizer.step()
    plain(x)  # the user's own module is theirs again


def test_a_module_is_set_up_by_one_open_runtime_at_a_time():
    """A second open Runtime setting the same module up (with an optimizer: the set-up that
    hooks its parameters) would hook them twice."""
    plain = make_mlp()
    first = distkit.Runtime("dp")
    first.setup(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    second = distkit.Runtime("dp")
    with pytest.raises(distkit.ConfigurationError, match="set up by another Runtime"):
        second.setup(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    first.close()
    second.setup(
        plain, torch.optim.SGD(plain.parameters(), lr=0.1)
    )  # the first is closed: the module is free
    second.close()
    third = distkit.Runtime("dp")
    third.setup(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    del third  # dropped without close(), as a sweep drops its last Trainer
    fourth = distkit.Runtime("dp")
    fourth.setup(plain, torch.optim.SGD(plain.parameters(), lr=0.1))
    fourth.close()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"grad_accum_steps": 0}, "grad_accum_steps must be an integer >= 1, got 0"),
        ({"seed": -1}, "seed must be an integer >= 0, got -1"),
        ({"precision": "fp8"}, "unknown precision 'fp8'"),
        ({"fault_timeout": 0}, "fault_timeout must be a positive number of seconds"),
        ({"sync_batchnorm": "yes"}, "sync_batchnorm must be True or False, got 'yes'"),
        ({"collective_timeout": -5}, "collective_timeout must be a positive number"),
    ],
)
def test_a_runtime_refuses_what_a_trainer_refuses(kwargs, message):
    with pytest.raises(distkit.ConfigurationError, match=message):
        distkit.Runtime("dp", **kwargs)
    with pytest.raises(distkit.ConfigurationError, match=message):
        distkit.Trainer("dp", **kwargs)


def test_print_is_rank_0s_and_full_state_dict_is_the_users_keys():
    with distkit.Runtime("dp") as rt:
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            rt.print("hello", 3)
        assert out.getvalue() == "hello 3\n"
        model = make_mlp()
        weights = rt.full_state_dict(nn.DataParallel(model))  # a wrapper's prefix never shows
        assert weights.keys() == model.state_dict().keys()
        with pytest.raises(distkit.ConfigurationError, match=r"takes a torch\.nn\.Module"):
            rt.full_state_dict({"w": torch.ones(1)})  # type: ignore[arg-type]


def test_trainers_share_a_runtime_and_leave_it_open():
    rt = distkit.Runtime("dp", grad_accum_steps=2)
    results = []
    for lr in (0.1, 0.05):  # a sweep: two fits, one runtime
        with distkit.Trainer(runtime=rt, progress=False, batch_size=4) as trainer:
            assert trainer.runtime is rt and trainer.strategy is rt.strategy
            assert trainer.grad_accum_steps == 2 and trainer.config.grad_accum_steps == 2
            model = make_mlp()
            optimizer = torch.optim.SGD(model.parameters(), lr=lr)
            results.append(trainer.fit(model, optimizer, make_dataset(16), _loss))
        assert trainer.closed and not rt.closed  # the trainer closed, the runtime did not
    assert all(len(r.history) == 1 for r in results)
    rt.close()
    with pytest.raises(distkit.errors.TrainerClosedError, match="closed Runtime"):
        distkit.Trainer(runtime=rt)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"strategy": "ddp"}, "the runtime already runs 'dp'"),
        ({"precision": "bf16"}, r"precision='bf16', runtime=...\): the runtime was created with"),
        ({"grad_accum_steps": 3}, "grad_accum_steps=3"),
        ({"runtime": "dp"}, "runtime must be a distkit.Runtime, got str"),
    ],
)
def test_a_trainer_refuses_arguments_that_contradict_its_runtime(kwargs, message):
    with distkit.Runtime("dp") as rt:
        kwargs = {"runtime": rt, **kwargs}
        with pytest.raises(distkit.ConfigurationError, match=message):
            distkit.Trainer(**kwargs)
        # the same values as the runtime's are fine
        distkit.Trainer(runtime=rt, precision="32", grad_accum_steps=1).close()
        assert not rt.closed


# ---------------------------------------------------------------- two processes
def _collectives() -> dict[str, Any]:
    with distkit.Runtime("ddp") as rt:
        mine = torch.tensor([float(rt.rank + 1)])
        out = {
            "place": (rt.rank, rt.world_size, rt.local_rank, rt.is_main),
            "mean": rt.all_reduce(mine).item(),
            "sum": rt.all_reduce(mine, op="sum").item(),
            "gathered": rt.all_gather(mine).flatten().tolist(),
            "broadcast": rt.broadcast({"from": rt.rank}, src=1),
        }
        order = []
        with rt.main_process_first():
            order.append(rt.rank)
        rt.barrier()
        torch.manual_seed(rt.rank)  # different weights per rank before set-up ...
        model = make_mlp()
        trainer = distkit.Trainer(runtime=rt, progress=False, batch_size=4)
        trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), make_dataset(16), _loss)
        trainer.close()
        # ... the same after: rank 0's were broadcast at set-up, then trained alike
        out["weights"] = rt.full_state_dict(model)
        # 13 samples over 2 ranks (7 and 6): every sample once
        scores = rt.evaluate(model, make_dataset(13), _loss, {"acc": distkit.Accuracy()})
        out["scores"] = scores
        buffer = io.StringIO()
        with contextlib.redirect_stdout(buffer):
            rt.print("only rank 0")
        out["printed"] = buffer.getvalue()
    return out


def test_the_collectives_and_print_on_two_ranks(run_on_ranks):
    ranks = run_on_ranks(_collectives)
    assert [r["place"] for r in ranks] == [(0, 2, 0, True), (1, 2, 1, False)]
    assert [r["mean"] for r in ranks] == [1.5, 1.5] and [r["sum"] for r in ranks] == [3.0, 3.0]
    assert [r["gathered"] for r in ranks] == [[1.0, 2.0], [1.0, 2.0]]
    assert [r["broadcast"] for r in ranks] == [{"from": 1}, {"from": 1}]
    assert [r["printed"] for r in ranks] == ["only rank 0\n", ""]
    first, second = (r["weights"] for r in ranks)
    assert all(torch.equal(first[k], second[k]) for k in first)
    # rt.evaluate on 2 ranks equals the whole set on one process
    model = make_mlp()
    model.load_state_dict(first)
    x, y = make_dataset(13).tensors
    with torch.no_grad():
        out = model(x)
    expected = {"loss": _loss(out, y).item(), "acc": (out.argmax(1) == y).float().mean().item()}
    for rank in ranks:
        assert rank["scores"].keys() == expected.keys()
        assert all(abs(rank["scores"][k] - v) < 1e-6 for k, v in expected.items())
