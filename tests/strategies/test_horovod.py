"""HorovodStrategy on real Horovod processes (``horovodrun -np 2 --gloo``).

All Horovod bodies share one horovodrun launch (module fixture); each test checks its part.
The promises of every strategy run under horovodrun in tests/contract/test_strategy_contract.py.
They skip only where Horovod is not installed; ``nox -s tests`` and CI install it.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

import distkit
from tests.support.checkpoint_runs import make_source_checkpoint, train_run
from tests.support.exactness import DTYPE, TOL  # the runs compared train in float64
from tests.support.gates import needs
from tests.support.horovod_runner import RankError, run_with_horovodrun
from tests.support.multiprocess import run_on_ranks
from tests.support.workloads import make_dataset, make_mlp, max_abs_diff, train_with_distkit

pytestmark = pytest.mark.timeout(600)

needs_horovod = needs("horovod")

W = "tests.support.workloads"
H = "tests.strategies.test_horovod"  # this module, as the Horovod ranks import it
CALLS = {
    "b4": (W, "train_with_distkit", ("horovod", 4), {"n": 61}),
    "accum": (W, "train_with_distkit", ("horovod", 2), {"n": 61, "grad_accum_steps": 2}),
    "adamw": (W, "train_with_distkit", ("horovod", 4), {"n": 61, "optimizer": "adamw"}),
    "syncbn": (W, "train_with_distkit", ("horovod", 4), {"n": 64, "model": "bn",
                                                         "sync_batchnorm": True}),
    "fp16": (W, "train_with_distkit", ("horovod", 4), {"n": 64, "precision": "fp16",
                                                       "epochs": 3}),
    "refit": (H, "fit_twice_then_new_optimizer", (), {}),
    "clip": (H, "train_clipped", ("horovod", 2), {"grad_accum_steps": 2}),
    "clip_fp16": (H, "train_clipped", ("horovod", 4), {"precision": "fp16"}),
    "compile": ("tests.strategies.test_compile", "eager_then_compiled", ("horovod", 4, 1), {}),
    "compile_blocks": ("tests.strategies.test_compile_blocks", "eager_then_blocks",
                       ("horovod", 4), {}),
    "schedulers": (H, "scheduler_warnings", (), {}),
}  # fmt: skip


def scheduler_warnings() -> list[str]:
    """Runs on Horovod ranks: per-step and per-epoch schedulers; the warnings torch gave."""
    import warnings

    messages = []
    for interval in ("step", "epoch"):
        net = make_mlp()
        optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.9)
        trainer = distkit.Trainer("horovod", batch_size=8, max_epochs=2, progress=False,
                                  scheduler_interval=interval)  # fmt: skip
        with trainer, warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.fit(net, optimizer, make_dataset(32), scheduler=scheduler,
                        loss_fn=nn.functional.cross_entropy)  # fmt: skip
        messages += [str(w.message) for w in caught]
    return messages


def fit_twice_then_new_optimizer() -> dict:
    """Runs on Horovod ranks: a second fit reuses the set-up; a new optimizer is refused."""
    import torch
    from torch import nn
    from torch.utils.data import TensorDataset

    trainer = distkit.Trainer("horovod", batch_size=4, progress=False)
    model = nn.Linear(3, 1)
    data = TensorDataset(torch.randn(16, 3), torch.randn(16, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = [
        trainer.fit(model, optimizer, data, loss_fn=nn.functional.mse_loss).history[-1][
            "train_loss"
        ]
        for _ in range(2)
    ]
    try:
        trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), data,
                    loss_fn=nn.functional.mse_loss)  # fmt: skip
        error = "no error"
    except distkit.UnsupportedFeatureError as exc:
        error = str(exc)
    trainer.close()
    return {"losses": losses, "error": error}


class StepRecorder(distkit.Callback):
    """Keeps every step's logs: gradient norm, skipped or not."""

    stops_training = False  # reads the steps only: no stop agreement per step

    def __init__(self) -> None:
        self.steps: list[dict] = []

    def on_train_step_end(self, trainer, logs) -> None:
        self.steps.append({"grad_norm": float(logs["grad_norm"]), "skipped": bool(logs["skipped"])})


def train_clipped(
    strategy: str, batch_size: int, *, grad_accum_steps: int = 1, precision: str = "32"
) -> dict:
    """Runs on Horovod ranks (and in one process): the shared workload, clipped to norm 0.5;
    in float64 at full precision (the runs are compared), float32 for fp16."""
    dtype = DTYPE if precision == "32" else torch.float32
    net, recorder = make_mlp(dtype=dtype), StepRecorder()
    trainer = distkit.Trainer(
        strategy,
        batch_size=batch_size,
        max_epochs=2,
        grad_accum_steps=grad_accum_steps,
        precision=precision,
        progress=False,
        seed=3,
        gradient_clip_norm=0.5,
        callbacks=[recorder],
    )
    result = trainer.fit(
        net,
        torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
        make_dataset(61, dtype=dtype),
        loss_fn=nn.functional.cross_entropy,
    )
    out = {
        "state": trainer.full_state_dict(),
        "steps": recorder.steps,
        "losses": [record["train_loss"] for record in result.history],
    }
    trainer.close()
    return out


@pytest.fixture(scope="module")
def horovod(tmp_path_factory):
    """{name: [rank0 result, rank1 result]} for every call in CALLS, from one launch."""
    names = list(CALLS)
    per_rank = run_with_horovodrun(
        [CALLS[name] for name in names], tmp_path_factory.mktemp("horovod"), np=2
    )
    return {name: [per_rank[r][i] for r in range(2)] for i, name in enumerate(names)}


@needs_horovod
def test_horovod_schedulers_see_the_wrapped_optimizer_step(horovod):
    """torch watches the user's optimizer's step; Horovod steps a DistributedOptimizer, so
    without distkit's note torch warns that the schedule skipped its first value."""
    for messages in _ok(horovod["schedulers"]):
        assert not [m for m in messages if "lr_scheduler.step()" in m]


def _ok(results: list) -> list:
    for value in results:
        if isinstance(value, RankError):
            raise AssertionError(str(value))
    return results


@needs_horovod
def test_horovod_two_processes_equal_one_process_with_double_batch(horovod):
    two = _ok(horovod["b4"])
    one = train_with_distkit("dp", 8, n=61)
    assert max_abs_diff(two[0]["state"], two[1]["state"]) == 0.0
    assert max_abs_diff(two[0]["state"], one["state"]) <= TOL
    assert two[0]["history"] == two[1]["history"]


@needs_horovod
def test_horovod_and_ddp_end_with_the_same_parameters(horovod):
    ddp = run_on_ranks(partial(train_with_distkit, n=61), "ddp", 4, world_size=2)[0]
    assert max_abs_diff(_ok(horovod["b4"])[0]["state"], ddp["state"]) <= TOL


@needs_horovod
def test_horovod_accumulation_equals_bigger_batch(horovod):
    one = train_with_distkit("dp", 8, n=61)
    assert max_abs_diff(_ok(horovod["accum"])[0]["state"], one["state"]) <= TOL


@needs_horovod
def test_horovod_fresh_adamw_is_not_stepped_by_the_optimizer_broadcast(horovod):
    # hvd.broadcast_optimizer_state on a fresh optimizer takes a zero-gradient step, which
    # applies AdamW's weight decay and advances its step count: distkit must not do that.
    one = train_with_distkit("dp", 8, n=61, optimizer="adamw")
    assert max_abs_diff(_ok(horovod["adamw"])[0]["state"], one["state"]) <= TOL


@needs_horovod
def test_horovod_sync_batchnorm_on_cpu_matches_full_batch(horovod):
    one = train_with_distkit("dp", 8, n=64, model="bn")
    assert max_abs_diff(_ok(horovod["syncbn"])[0]["state"], one["state"]) <= TOL


@needs_horovod
def test_horovod_fp16_gradscaler_sequencing_trains(horovod):
    history = _ok(horovod["fp16"])[0]["history"]
    losses = [h["train_loss"] for h in history]
    assert all(loss == loss for loss in losses)  # no NaN
    assert losses[-1] < losses[0]


@needs_horovod
def test_horovod_second_fit_reuses_hooks_and_new_optimizer_is_refused(horovod):
    for result in _ok(horovod["refit"]):
        assert result["losses"][1] < result["losses"][0]
        assert "one optimizer per process" in result["error"]


@needs_horovod
def test_horovod_clipping_sees_the_gradients_of_one_process_with_the_whole_batch(horovod):
    two = _ok(horovod["clip"])
    one = train_clipped("dp", 8)
    norms = [step["grad_norm"] for step in one["steps"]]
    assert max(norms) > 0.5, "the clip never bit: the test would not see a wrong norm"
    for rank in two:
        assert len(rank["steps"]) == len(norms)
        rank_norms = [step["grad_norm"] for step in rank["steps"]]
        assert rank_norms == pytest.approx(norms, abs=TOL)
        assert max_abs_diff(rank["state"], one["state"]) <= TOL


@needs_horovod
def test_horovod_fp16_clipping_trains_with_the_same_norm_on_every_rank(horovod):
    ranks = _ok(horovod["clip_fp16"])
    assert all(torch.isfinite(torch.tensor(ranks[0]["losses"])))
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]
    norms = [torch.tensor([step["grad_norm"] for step in rank["steps"]]) for rank in ranks]
    torch.testing.assert_close(norms[0], norms[1], rtol=0, atol=0, equal_nan=True)
    # unscaled: the norms fp32 sees (a norm of the scaled gradients would be 2**16 larger)
    fp32 = torch.tensor([step["grad_norm"] for step in train_clipped("dp", 8)["steps"]])
    stepped = ~torch.tensor([step["skipped"] for step in ranks[0]["steps"]])
    torch.testing.assert_close(norms[0][stepped], fp32[stepped], rtol=2e-2, atol=0)
    assert [s["skipped"] for s in ranks[0]["steps"]] == [s["skipped"] for s in ranks[1]["steps"]]
    assert max_abs_diff(ranks[0]["state"], ranks[1]["state"]) == 0.0


@needs_horovod
def test_horovod_compiled_model_equals_eager(horovod):
    for runs in _ok(horovod["compile"]):
        assert runs["count"]["graphs"] > 0, "nothing was compiled"
        assert max_abs_diff(runs["count"]["state"], runs["off"]["state"]) <= TOL  # float64
    ranks = _ok(horovod["compile"])
    assert max_abs_diff(ranks[0]["count"]["state"], ranks[1]["count"]["state"]) == 0.0


@needs_horovod
def test_horovod_compiled_blocks_equal_eager(horovod):
    """compile="blocks" under Horovod's hooks: each block compiled, the weights eager's."""
    for runs in _ok(horovod["compile_blocks"]):
        assert runs["count"]["compiled"] == ["layers.0", "layers.1", "layers.2"]
        assert runs["count"]["graphs"] >= 1
        assert max_abs_diff(runs["count"]["state"], runs["off"]["state"]) == 0.0
    ranks = _ok(horovod["compile_blocks"])
    assert max_abs_diff(ranks[0]["count"]["state"], ranks[1]["count"]["state"]) == 0.0


def _expect_launcher_mismatch(strategy: str) -> str:
    try:
        distkit.Trainer(strategy, progress=False)
    except distkit.LauncherMismatchError as exc:
        return str(exc)
    return "no error"


def _horovodrun_env(rank: int, world_size: int, port: int) -> dict[str, str]:
    return {
        "HOROVOD_RANK": str(rank),
        "HOROVOD_SIZE": str(world_size),
        "HOROVOD_LOCAL_RANK": str(rank),
    }


def test_horovod_under_torchrun_fails_fast_naming_both_launchers():
    for message in run_on_ranks(_expect_launcher_mismatch, "horovod", world_size=2):
        assert "started by torchrun" in message and "horovodrun -np N" in message
        assert "strategy='ddp'" in message


def test_ddp_under_horovodrun_fails_fast_naming_both_launchers():
    results = run_on_ranks(
        _expect_launcher_mismatch, "ddp", world_size=2, launcher_env=_horovodrun_env
    )
    for message in results:
        assert "started by horovodrun" in message and "torchrun --nproc_per_node" in message
        assert "strategy='horovod'" in message


@pytest.fixture(scope="module")
def portability(tmp_path_factory):
    """Checkpoints crossing between Horovod and the other strategies, one horovodrun launch."""
    base = tmp_path_factory.mktemp("portability")
    sources = {
        "dp": make_source_checkpoint("dp", 1, 8, base / "dp", run_on_ranks),
        "ddp": make_source_checkpoint("ddp", 2, 4, base / "ddp", run_on_ranks),
        "fsdp": make_source_checkpoint("fsdp", 2, 4, base / "fsdp", run_on_ranks),
    }
    train = ("tests.support.checkpoint_runs", "train_run")
    calls = [
        (*train, ("horovod", 4, str(base / "hvd")), {"max_steps": 5, "every": 5, "model": "plain"}),
        *[(*train, ("horovod", 4, None), {"resume": str(path), "model": "plain"})
          for path in sources.values()],
        (*train, ("horovod", 4, str(base / "hvd")), {"resume": "auto", "model": "plain"}),
    ]  # fmt: skip
    per_rank = run_with_horovodrun(calls, base / "run", np=2)
    return {"base": base, "results": [per_rank[0][i] for i in range(len(calls))]}


@needs_horovod
def test_horovod_checkpoints_port_to_and_from_other_strategies(portability):
    from distkit import checkpoint as ckpt

    reference = train_run("dp", 8, model="plain")
    results = _ok(portability["results"])
    names = ["dp -> horovod", "ddp -> horovod", "fsdp -> horovod", "horovod -> horovod"]
    for name, result in zip(names, results[1:], strict=True):
        assert max_abs_diff(result["state"], reference["state"]) <= TOL, name
    horovod_ckpt = ckpt.CheckpointFolder(portability["base"] / "hvd").checkpoints()[0]
    assert ckpt.load(horovod_ckpt)["producer"]["strategy"] == "horovod"
    for target, world, batch in (("dp", 1, 8), ("ddp", 2, 4), ("fsdp", 2, 4)):
        resumed = run_on_ranks(partial(train_run, resume=str(horovod_ckpt), model="plain"),
                               target, batch, None, world_size=world)  # fmt: skip
        diff = max_abs_diff(resumed[0]["state"], reference["state"])
        assert diff <= TOL, f"horovod -> {target}: {diff}"


def test_horovod_finalize_gradients_alone_is_refused_naming_the_step_hook():
    """Horovod's steps run through its one step hook (all-reduce once, clip, step without a
    second all-reduce); finalize_gradients alone would leave the next step to guess whether
    the gradients were averaged (it once read Horovod's private _synchronized flag)."""
    from distkit.errors import UnsupportedFeatureError
    from distkit.strategies.horovod import HorovodStrategy

    optimizer = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)
    with pytest.raises(UnsupportedFeatureError, match=r"strategy\.step\(optimizer, clip="):
        HorovodStrategy().finalize_gradients(optimizer)
