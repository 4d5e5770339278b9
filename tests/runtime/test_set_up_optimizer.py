"""The optimizer ``rt.setup`` returns is a ``torch.optim.Optimizer`` and an instance of the
user's optimizer class, sharing its ``param_groups``, ``state`` and ``defaults``: torch's and
transformers' LR schedulers built on it, and a warm-up that writes ``defaults`` and
``param_groups`` (seed 001's), drive the real step on every backend, and the loop at two ranks
still ends where one process ends. Real gloo / horovodrun processes; apex is the FAKE one of
tests/support/fakes (apex is CUDA-only), with FAKE CUDA."""

from __future__ import annotations

import copy
import pickle
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.optim import lr_scheduler

import distkit
from distkit.errors import ConfigurationError, UnsupportedFeatureError
from tests.support import exactness
from tests.support.gates import needs
from tests.support.horovod_runner import run_with_horovodrun
from tests.support.multiprocess import run_on_ranks
from tests.support.workloads import make_dataset, make_mlp, max_abs_diff

pytestmark = [
    pytest.mark.timeout(600),
    pytest.mark.filterwarnings("ignore:distkit apex:UserWarning"),
]
N = 21  # global batches of 8: 8 + 8 + 5 (an uneven last step); 3 steps an epoch
EPOCHS = 2
#: float32, where DeepSpeed trains (it refuses a float64 model): 2 ranks against one process
#: differ by 6e-8 to 9e-8 on this workload (tests/strategies/test_deepspeed.py's measurement);
#: a wrong learning rate moves the weights by 1e-3 or more
FLOAT32_TOL = 1e-5


class Warmup:
    """Seed 001's (BiSeNet's) warm-up wrapper: it writes the learning rate into the
    optimizer's ``defaults`` and into every group, each step."""

    def __init__(self, optim: torch.optim.Optimizer, warmup_steps: int = 3) -> None:
        self.optim, self.warmup_steps, self.it = optim, warmup_steps, 0
        self.lr0 = optim.defaults["lr"]

    def lr(self) -> float:
        return float(self.lr0 * min(1.0, (self.it + 1) / self.warmup_steps) * 0.9**self.it)

    def step(self) -> None:
        lr = self.lr()
        self.optim.defaults["lr"] = lr
        for group in self.optim.param_groups:
            group["lr"] = lr
        self.optim.step()
        self.it += 1


def _schedulers() -> dict[str, Callable[[torch.optim.Optimizer], Any]]:
    from transformers import get_linear_schedule_with_warmup

    steps = EPOCHS * 3
    return {
        "LambdaLR": lambda o: lr_scheduler.LambdaLR(o, lambda s: 0.5**s),
        "OneCycleLR": lambda o: lr_scheduler.OneCycleLR(o, max_lr=0.3, total_steps=steps),
        "SequentialLR": lambda o: lr_scheduler.SequentialLR(
            o,
            [lr_scheduler.LinearLR(o, 0.2, total_iters=2), lr_scheduler.ExponentialLR(o, 0.7)],
            milestones=[2],
        ),
        # a metric every rank sees alike (a per-rank loss would split the ranks' rates)
        "ReduceLROnPlateau": lambda o: lr_scheduler.ReduceLROnPlateau(o, patience=0, factor=0.5),
        "transformers": lambda o: get_linear_schedule_with_warmup(o, 2, steps),
        "Warmup": Warmup,
    }


KINDS = ["LambdaLR", "OneCycleLR", "SequentialLR", "ReduceLROnPlateau", "transformers", "Warmup"]


def _strategy(name: str) -> Any:
    if name == "deepspeed":
        return distkit.DeepSpeedStrategy(stage=3, config={"zero_optimization": {
            "stage3_param_persistence_threshold": 0}})  # fmt: skip
    return name


def scheduled(strategy: str, batch: int, dtype: torch.dtype = exactness.DTYPE) -> dict[str, Any]:
    """Per scheduler kind: the loop with it built on the set-up optimizer, its weights, the
    learning rates it stepped with, and torch's scheduler warnings."""
    results = {}
    for kind in KINDS:
        with (
            distkit.Runtime(_strategy(strategy), seed=3) as rt,
            warnings.catch_warnings(record=True) as caught,
        ):
            warnings.simplefilter("always")
            model = make_mlp(dtype=dtype)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            model, optimizer = rt.setup(model, optimizer)
            assert isinstance(optimizer, torch.optim.SGD)
            schedule = _schedulers()[kind](optimizer)
            lrs = []
            for _ in range(EPOCHS):
                for x, y in rt.loader(make_dataset(N, dtype=dtype), batch_size=batch):
                    rt.backward(nn.functional.cross_entropy(model(x), y))
                    lrs.append(optimizer.param_groups[0]["lr"])
                    if kind == "Warmup":
                        schedule.step()  # it steps the optimizer itself
                    else:
                        optimizer.step()
                        if kind == "ReduceLROnPlateau":
                            schedule.step(1.0)  # never better: the rate halves each step
                        else:
                            schedule.step()
                    optimizer.zero_grad()
            results[kind] = {
                "state": rt.full_state_dict(model),
                "lrs": lrs,
                "defaults_lr": optimizer.optimizer.defaults["lr"],
                "warnings": [str(w.message) for w in caught if "lr_scheduler" in str(w.message)],
            }
    return results


def _reference(kind: str) -> tuple[list[float], float]:
    """The rates a plain optimizer gets from the same scheduler, with no distkit, and its
    ``defaults["lr"]`` at the end."""
    optimizer = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1, momentum=0.9)
    schedule = _schedulers()[kind](optimizer)
    lrs = []
    for _ in range(EPOCHS * 3):
        lrs.append(optimizer.param_groups[0]["lr"])
        if kind == "Warmup":
            schedule.step()
        else:
            optimizer.step()
            schedule.step(1.0) if kind == "ReduceLROnPlateau" else schedule.step()
    return lrs, optimizer.defaults["lr"]


def _check(ranks: list[dict[str, Any]], one: dict[str, Any], tol: float) -> None:
    for kind in KINDS:
        expected, defaults_lr = _reference(kind)
        assert len(set(expected)) > 2, kind  # the rate does move: a scheduler ignored fails
        assert one[kind]["lrs"] == pytest.approx(expected, rel=1e-12), kind
        for rank in ranks:
            assert rank[kind]["lrs"] == pytest.approx(expected, rel=1e-12), kind
            assert rank[kind]["warnings"] == [], kind
            assert max_abs_diff(rank[kind]["state"], one[kind]["state"]) <= tol, kind
            # Warmup's write to defaults reached the user's optimizer
            assert rank[kind]["defaults_lr"] == pytest.approx(defaults_lr, rel=1e-12), kind
    # the schedules differ, so the weights do: a test blind to the rate would not see it
    assert max_abs_diff(one["LambdaLR"]["state"], one["OneCycleLR"]["state"]) > 1e-3


@pytest.fixture(scope="module")
def one_process() -> dict[str, Any]:
    """The loops at one process with the whole batch (float64), compared by several tests."""
    return run_on_ranks(scheduled, "ddp", 8, world_size=1, agent_store=True)[0]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_schedulers_on_the_set_up_optimizer_at_two_ranks_equal_one_process(one_process, strategy):
    ranks = run_on_ranks(scheduled, strategy, 4, world_size=2, agent_store=True)
    _check(ranks, one_process, exactness.TOL)


@needs("deepspeed")
def test_schedulers_on_deepspeeds_set_up_optimizer_equal_one_process():
    one = run_on_ranks(scheduled, "ddp", 8, torch.float32, world_size=1, agent_store=True)[0]
    two = run_on_ranks(scheduled, "deepspeed", 4, torch.float32, world_size=2, agent_store=True)
    _check(two, one, FLOAT32_TOL)


@needs("horovod")
def test_schedulers_on_horovods_set_up_optimizer_equal_one_process(one_process, tmp_path):
    calls = [("tests.runtime.test_set_up_optimizer", "scheduled", ("horovod", 4), {})]
    _check([result for (result,) in run_with_horovodrun(calls, tmp_path)], one_process,
           exactness.TOL)  # fmt: skip


def on_fake_apex(kind: str) -> dict[str, Any]:
    from tests.runtime.test_user_loop_apex import _on_fake_apex

    return _on_fake_apex(kind, scheduled, "apex", 4)


@pytest.mark.parametrize("kind", ["legacy", "modern"])
def test_schedulers_on_apexs_set_up_optimizer_equal_one_process(one_process, kind):
    ranks = run_on_ranks(on_fake_apex, kind, world_size=2, agent_store=True)
    _check([{k: v for k, v in r.items() if k != "calls"} for r in ranks], one_process,
           exactness.TOL)  # fmt: skip


# -- one process: what the set-up optimizer is, and what it refuses --------------------------


def _set_up(kind: type[torch.optim.Optimizer] = torch.optim.AdamW) -> tuple[Any, Any, Any]:
    rt = distkit.Runtime("dp", seed=0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    model, optimizer = rt.setup(model, kind(model[0].parameters(), lr=0.1))
    return rt, model, optimizer


def test_it_is_the_users_optimizer_class_sharing_its_state():
    rt, model, optimizer = _set_up()
    with rt:
        user = optimizer.optimizer
        assert isinstance(optimizer, torch.optim.AdamW)
        assert isinstance(optimizer, torch.optim.Optimizer)
        assert optimizer.param_groups is user.param_groups
        assert optimizer.state is user.state
        assert optimizer.defaults is user.defaults
        optimizer.defaults = {**user.defaults, "lr": 0.5}  # a rebinding reaches it too
        assert user.defaults["lr"] == 0.5
        optimizer.my_counter = 3  # a user's own attribute: on the user's optimizer
        assert user.my_counter == 3 and optimizer.my_counter == 3
        fired = []
        optimizer.register_step_post_hook(lambda opt, args, kwargs: fired.append(opt))
        rt.backward(model(torch.randn(5, 3)).sum())
        optimizer.step()
        assert fired == [user]  # hooks run where the real step runs
        assert len(optimizer.state) == 2  # AdamW's moments, for the 2 parameters it holds


def test_add_param_group_takes_the_models_parameters_and_they_train():
    rt, model, optimizer = _set_up(torch.optim.SGD)
    with rt:
        optimizer.add_param_group({"params": model.module[1].parameters(), "lr": 0.2})
        before = model.module[1].weight.detach().clone()
        rt.backward(model(torch.randn(5, 3)).sum())
        optimizer.step()
        assert not torch.equal(before, model.module[1].weight)
        with pytest.raises(ConfigurationError, match="not parameters of the set-up model"):
            optimizer.add_param_group({"params": [nn.Parameter(torch.zeros(2))]})


def test_a_set_up_optimizer_is_not_set_up_again_nor_copied():
    rt, model, optimizer = _set_up()
    with rt:
        with pytest.raises(ConfigurationError, match="set up already"):
            rt.setup(nn.Linear(1, 1), optimizer)
        for attempt in (copy.deepcopy, copy.copy, pickle.dumps):
            with pytest.raises(TypeError, match="cannot be copied or pickled"):
                attempt(optimizer)
    trainer = distkit.Trainer("dp", max_epochs=1, progress=False)
    with pytest.raises(ConfigurationError, match="set up already"):
        trainer.fit(model.module, optimizer, make_dataset(8, features=3), nn.functional.mse_loss)
    trainer.close()


@needs("horovod")
def test_horovod_refuses_add_param_group_naming_the_way_out(tmp_path):
    calls = [("tests.runtime.test_set_up_optimizer", "horovod_add_group", (), {})]
    for (message,) in run_with_horovodrun(calls, tmp_path):
        assert "HorovodStrategy" in message and "before rt.setup" in message


def horovod_add_group() -> str:
    with distkit.Runtime("horovod", seed=0) as rt:
        model = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
        model, optimizer = rt.setup(model, torch.optim.SGD(model[0].parameters(), lr=0.1))
        try:
            optimizer.add_param_group({"params": model.module[1].parameters()})
        except UnsupportedFeatureError as error:
            return str(error)
    return "not refused"
