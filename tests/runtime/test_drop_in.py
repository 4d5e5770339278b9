"""Issue 44's "done when": a hand loop that touches what the Runtime hands back as it would
touch torch's own objects (no ``torch.manual_seed``; torch's ``LambdaLR`` on the set-up
optimizer; a warm-up write to ``optimizer.defaults``; ``loader.batch_size``, ``.dataset`` and
``.sampler.set_epoch``; ``torch.load(rt.save's file)["model"]``) runs unchanged on one process,
on ddp x2 and on fsdp x2 with the batch halved, and the parameters agree. The same loop over a
plain DataLoader under 2 ranks stops, naming ``rt.loader``. Real gloo processes."""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

import distkit
from distkit.errors import ConfigurationError
from tests.support import exactness
from tests.support.workloads import make_dataset, max_abs_diff

pytestmark = pytest.mark.timeout(300)
GLOBAL_BATCH = 8


def hand_loop(strategy: str, folder: str, plain: bool = False) -> dict[str, Any]:
    torch.manual_seed(os.getpid())  # whatever the process left: the Runtime's seed decides
    data = make_dataset(29, dtype=exactness.DTYPE)
    with distkit.Runtime(strategy, seed=11) as rt:
        world = rt.world_size
        model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(data[0][0].dtype)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
        model, optimizer = rt.setup(model, optimizer)
        schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.8**step)
        if plain:
            loader: Any = DataLoader(data, batch_size=GLOBAL_BATCH, shuffle=True)
        else:
            loader = rt.loader(data, batch_size=GLOBAL_BATCH // world)
            assert loader.batch_size == GLOBAL_BATCH // world and loader.dataset is data
        seen = 0
        try:
            for epoch in range(2):
                if not plain:
                    loader.sampler.set_epoch(epoch)
                optimizer.defaults["lr"] = optimizer.param_groups[0]["lr"]  # a warm-up's write
                for x, y in loader:
                    rt.backward(nn.functional.cross_entropy(model(x), y))
                    optimizer.step()
                    optimizer.zero_grad()
                    schedule.step()
                    seen += len(x)
        except ConfigurationError as error:
            return {"error": str(error)}
        path = os.path.join(folder, "loop.pt")
        rt.save(path, {"model": model, "optimizer": optimizer, "schedule": schedule.state_dict()})
        weights = torch.load(path, weights_only=True)["model"]  # without distkit
        return {
            "error": None,
            "device": rt.device.type,
            "state": rt.full_state_dict(model),
            "file": weights,
            "seen": seen,
            "lr": optimizer.param_groups[0]["lr"],
            "defaults_lr": optimizer.optimizer.defaults["lr"],
        }


@pytest.fixture(scope="module")
def one_process(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from tests.support.multiprocess import run_on_ranks

    folder = str(tmp_path_factory.mktemp("one"))
    return run_on_ranks(hand_loop, "ddp", folder, world_size=1, agent_store=True)[0]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_the_hand_loop_runs_unchanged_at_two_ranks_and_agrees(
    run_on_ranks, one_process, strategy, tmp_path
):
    assert one_process["error"] is None
    assert max_abs_diff(one_process["file"], one_process["state"]) == 0.0
    assert one_process["lr"] == pytest.approx(0.2 * 0.8**8)  # 4 steps an epoch, 2 epochs
    assert one_process["defaults_lr"] == pytest.approx(0.2 * 0.8**4)
    ranks = run_on_ranks(hand_loop, strategy, str(tmp_path), world_size=2)
    assert sum(rank["seen"] for rank in ranks) == one_process["seen"] == 58
    for rank in ranks:
        assert rank["error"] is None
        assert max_abs_diff(rank["state"], one_process["state"]) <= exactness.TOL
        assert max_abs_diff(rank["file"], one_process["state"]) <= exactness.TOL
        assert rank["lr"] == one_process["lr"]
        assert rank["defaults_lr"] == one_process["defaults_lr"]


def test_the_same_loop_over_a_plain_dataloader_stops_naming_rt_loader(run_on_ranks, tmp_path):
    for rank in run_on_ranks(hand_loop, "ddp", str(tmp_path), True, world_size=2):
        assert rank["error"] is not None and "rt.loader" in rank["error"]
