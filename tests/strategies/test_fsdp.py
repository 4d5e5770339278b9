"""FSDPStrategy (torch's FSDP2, ``fully_shard``) on real processes joined by gloo on loopback.

The promises of every strategy (world-size invariance, accumulation, evaluation counting each
sample once, mixed precision, sync BatchNorm, full_state_dict) and FSDP's own (sharded
memory, sharded checkpoints resumed at another world size, no hang on uneven eval shards).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import distkit
from distkit import checkpoint as ckpt
from distkit.strategies.fsdp import FSDPStrategy
from tests.support.exactness import DTYPE, TOL  # the runs compared train in float64
from tests.support.workloads import make_dataset, make_mlp, max_abs_diff, train_with_distkit

pytestmark = pytest.mark.timeout(240)


def _train(strategy: str, batch_size: int, n: int, accum: int = 1, **kwargs) -> dict:
    return train_with_distkit(strategy, batch_size, n=n, grad_accum_steps=accum, **kwargs)


# ---------------------------------------------------------------- the world-size rule
@pytest.mark.parametrize("n", [64, 61])  # 61: a short last global batch, split unevenly
def test_fsdp_two_processes_equal_one_process_with_double_batch(n, run_on_ranks):
    two = run_on_ranks(_train, "fsdp", 4, n, world_size=2)
    one = run_on_ranks(_train, "ddp", 8, n, world_size=1)[0]
    assert max_abs_diff(two[0]["state"], two[1]["state"]) == 0.0
    assert max_abs_diff(two[0]["state"], one["state"]) <= TOL
    assert two[0]["history"] == two[1]["history"], "history differs between ranks"
    for a, b in zip(two[0]["history"], one["history"], strict=True):
        assert a["train_loss"] == pytest.approx(b["train_loss"], abs=TOL)
        assert a["val_loss"] == pytest.approx(b["val_loss"], abs=TOL)
        assert a["val_acc"] == b["val_acc"]


def test_fsdp_accumulation_equals_bigger_batch(run_on_ranks):
    accumulated = run_on_ranks(_train, "fsdp", 2, 61, 2, world_size=2)
    big = run_on_ranks(_train, "ddp", 8, 61, world_size=1)[0]
    assert max_abs_diff(accumulated[0]["state"], big["state"]) <= TOL


def test_fsdp_adamw_and_a_world_of_one(run_on_ranks):
    two = run_on_ranks(partial(_train, optimizer="adamw"), "fsdp", 4, 61, world_size=2)[0]
    one = run_on_ranks(partial(_train, optimizer="adamw"), "fsdp", 8, 61, world_size=1)[0]
    assert max_abs_diff(two["state"], one["state"]) <= TOL


def test_fsdp_sync_batchnorm_makes_bn_models_world_size_invariant(run_on_ranks):
    two = run_on_ranks(
        partial(_train, model="bn", sync_batchnorm=True), "fsdp", 4, 64, world_size=2
    )
    one = run_on_ranks(partial(_train, model="bn"), "ddp", 8, 64, world_size=1)[0]
    assert max_abs_diff(two[0]["state"], one["state"]) <= TOL  # running stats included


# ---------------------------------------------------------------- what FSDP does per step
def _on_rank_shard_and_accumulate() -> dict:
    trainer = distkit.Trainer("fsdp", progress=False, grad_accum_steps=2)
    s = trainer.strategy
    rank = s.rank
    torch.manual_seed(100 + rank)  # deliberately different initial weights per rank
    model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    wrapped, optimizer = s.setup(model, optimizer)
    out: dict = {"unwrap_is_model": s.unwrap(wrapped) is model}
    out["local_rows"] = [p.to_local().shape[0] for p in model.parameters()]
    out["optimizer_holds_model_params"] = [id(p) for p in optimizer.param_groups[0]["params"]] == [
        id(p) for p in model.parameters()
    ]
    x = torch.full((2, 4), float(rank + 1))
    with s.no_sync(wrapped):
        wrapped(x).sum().backward()
    out["grad_inside_no_sync"] = model[0].weight.grad  # nothing reduce-scattered yet
    wrapped(x).sum().backward()
    out["grads_after"] = model[1].weight.grad.full_tensor()
    out["weights"] = s.state_io.model_state_dict(model)
    trainer.close()
    return out


def test_fsdp_shards_parameters_starts_from_rank_zero_and_accumulates_locally(run_on_ranks):
    results = run_on_ranks(_on_rank_shard_and_accumulate, world_size=2)
    for r in results:
        assert r["unwrap_is_model"] and r["optimizer_holds_model_params"]
        assert r["grad_inside_no_sync"] is None
    # Linear(4, 6): 6 rows as 3 + 3; Linear(6, 1): 1 row as 1 + 0
    assert results[0]["local_rows"] == [3, 3, 1, 1] and results[1]["local_rows"] == [3, 3, 0, 0]
    assert max_abs_diff(results[0]["weights"], results[1]["weights"]) == 0.0
    torch.manual_seed(100)  # rank 0's initial weights
    reference = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 1))
    assert max_abs_diff(results[0]["weights"], reference.state_dict()) == 0.0
    # mean over ranks of each rank's two accumulated backward passes
    grads = []
    for rank in (0, 1):
        model = nn.Sequential(nn.Linear(4, 6), nn.Linear(6, 1))
        model.load_state_dict(reference.state_dict())
        x = torch.full((2, 4), float(rank + 1))
        (2 * model(x).sum()).backward()
        grads.append(model[1].weight.grad)
    expected = (grads[0] + grads[1]) / 2
    for r in results:
        assert torch.allclose(r["grads_after"], expected, atol=1e-6)


def _nan_on_rank_one_then_fit_again() -> dict:
    trainer = distkit.Trainer("fsdp", batch_size=4, nonfinite="skip", progress=False)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 8), nn.Tanh(), nn.Linear(8, 1))
    data = TensorDataset(torch.randn(32, 3), torch.randn(32, 1))
    stale = torch.optim.SGD(model.parameters(), lr=0.1)  # over the parameters before sharding
    calls = {"n": 0}

    def step_fn(m, batch):
        calls["n"] += 1
        loss = nn.functional.mse_loss(m(batch[0]), batch[1])
        return loss * float("nan") if trainer.rank == 1 and calls["n"] == 2 else loss

    first = trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), data, step_fn=step_fn)
    out: dict = {"skipped": first.history[0]["skipped_steps"], "after": trainer.full_state_dict()}
    # a second fit reuses the set-up: a new optimizer over the (now sharded) parameters works,
    # one built over the parameters the model had before sharding is refused
    again = trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.05), data,
                        loss_fn=nn.functional.mse_loss)  # fmt: skip
    out["second_loss"] = again.history[0]["train_loss"]
    try:
        trainer.fit(model, stale, data, loss_fn=nn.functional.mse_loss)
        out["stale"] = "no error"
    except distkit.ConfigurationError as exc:
        out["stale"] = str(exc)
    trainer.close()
    return out


def test_fsdp_nonfinite_skip_and_a_second_fit(run_on_ranks):
    results = run_on_ranks(_nan_on_rank_one_then_fit_again, world_size=2)
    for r in results:
        assert r["skipped"] == 1  # rank 1's NaN step skipped on both ranks
        assert all(torch.isfinite(v).all() for v in r["after"].values())
        assert "not parameters of the model" in r["stale"]
    assert max_abs_diff(results[0]["after"], results[1]["after"]) == 0.0
    assert results[0]["second_loss"] == results[1]["second_loss"]


# ---------------------------------------------------------------- evaluation
class _Recorder(nn.Module):
    """Predicts class = sample id % 3 for even ids, a wrong class for odd ones."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(4))
        self.seen: list[int] = []

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        self.seen.extend(ids.view(-1).tolist())
        good = (ids.view(-1) % 2 == 0).long()
        pred = (ids.view(-1) % 3 + 1 - good) % 3
        return nn.functional.one_hot(pred, 3).float() + self.weight[:3]


def _evaluate_after_fit(n_eval: int, batch_size: int) -> dict:
    trainer = distkit.Trainer("fsdp", batch_size=batch_size, progress=False)
    model = _Recorder()
    ids = torch.arange(64)
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.0), TensorDataset(ids, ids % 3),
                loss_fn=nn.functional.cross_entropy)  # fmt: skip
    model.seen.clear()
    ids = torch.arange(n_eval)
    scores = trainer.evaluate(
        model, TensorDataset(ids, ids % 3), metrics={"acc": distkit.Accuracy()}
    )
    trainer.close()
    return {"scores": scores, "seen": model.seen}


@pytest.mark.parametrize(
    ("n_eval", "batch_size"),
    [(61, 5), (1, 4)],  # rank 0: 7 batches, rank 1: 6; one sample: rank 1 has no batch
)
def test_fsdp_evaluate_uneven_shards_do_not_hang_and_count_once(n_eval, batch_size, run_on_ranks):
    results = run_on_ranks(_evaluate_after_fit, n_eval, batch_size, world_size=2, timeout=60)
    # rank 1 ran one spare forward pass (on sample 0) to join rank 0's last all-gather
    assert results[0]["seen"] == list(range(0, n_eval, 2))
    assert results[1]["seen"] == [*range(1, n_eval, 2), 0]
    expected = sum(1 for i in range(n_eval) if i % 2 == 0) / n_eval
    assert results[0]["scores"]["acc"] == pytest.approx(expected)  # the spare counted for nothing
    assert results[0]["scores"] == results[1]["scores"]


# ---------------------------------------------------------------- precision
def test_fsdp_bf16_is_fsdp_mixed_precision_and_trains(run_on_ranks):
    bf16 = run_on_ranks(partial(_train, precision="bf16", epochs=3), "fsdp", 4, 64, world_size=2)
    fp32 = run_on_ranks(partial(_train, epochs=3), "fsdp", 4, 64, world_size=2)[0]
    losses = [h["train_loss"] for h in bf16[0]["history"]]
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert bf16[0]["history"] == bf16[1]["history"]
    diff = max_abs_diff(bf16[0]["state"], fp32["state"])
    assert 0.0 < diff < 0.05, "bf16 compute should differ slightly from fp32, not wildly"
    assert all(v.dtype == torch.float32 for v in bf16[0]["state"].values())  # fp32 master


def test_fsdp_fp16_trains_with_a_grad_scaler(run_on_ranks):
    fp16 = run_on_ranks(partial(_train, precision="fp16", epochs=3), "fsdp", 4, 64, world_size=2)
    losses = [h["train_loss"] for h in fp16[0]["history"]]
    assert all(loss == loss for loss in losses) and losses[-1] < losses[0]
    assert max_abs_diff(fp16[0]["state"], fp16[1]["state"]) == 0.0


# ---------------------------------------------------------------- full_state_dict
def _full_state_dict_and_own(strategy: str, batch: int) -> dict:
    trainer = distkit.Trainer(strategy, batch_size=batch, max_epochs=1, progress=False, seed=3)
    net = make_mlp(dtype=DTYPE)
    trainer.fit(net, torch.optim.SGD(net.parameters(), lr=0.1), make_dataset(64, dtype=DTYPE),
                loss_fn=nn.functional.cross_entropy)  # fmt: skip
    full = trainer.full_state_dict()
    own = None if strategy == "fsdp" else {k: v.clone() for k, v in net.state_dict().items()}
    trainer.close()
    return {"full": full, "own": own}


def test_full_state_dict_is_the_same_for_every_strategy(run_on_ranks):
    fsdp = run_on_ranks(_full_state_dict_and_own, "fsdp", 4, world_size=2)
    ddp = run_on_ranks(_full_state_dict_and_own, "ddp", 4, world_size=2)
    dp = run_on_ranks(_full_state_dict_and_own, "dp", 8, world_size=1)
    for results in (fsdp, ddp, dp):
        for r in results:
            assert all(v.device.type == "cpu" for v in r["full"].values())
            if r["own"] is not None:  # ddp, dp: the unwrapped model's state_dict()
                assert r["full"].keys() == r["own"].keys()
                assert all(torch.equal(r["full"][k], r["own"][k]) for k in r["own"])
        assert max_abs_diff(results[0]["full"], results[-1]["full"]) == 0.0
    assert max_abs_diff(fsdp[0]["full"], ddp[0]["full"]) <= TOL
    assert max_abs_diff(fsdp[0]["full"], dp[0]["full"]) <= TOL


def test_full_state_dict_needs_a_fit():
    trainer = distkit.Trainer("dp", progress=False)
    with pytest.raises(distkit.ConfigurationError, match=r"call fit\(\.\.\.\) first"):
        trainer.full_state_dict()


# ---------------------------------------------------------------- checkpoints
def _train_ckpt(strategy: distkit.Strategy | str, batch: int, folder: str | None, **kwargs) -> dict:
    trainer = distkit.Trainer(strategy, batch_size=batch, max_epochs=2, seed=11, progress=False,
                              checkpoint_dir=folder, **kwargs)  # fmt: skip
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(DTYPE)
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    data = make_dataset(64, dtype=DTYPE)
    result = trainer.fit(net, optimizer, data, loss_fn=nn.functional.cross_entropy)
    out = {"state": trainer.full_state_dict(), "history": result.history}
    trainer.close()
    return out


def _sharded() -> FSDPStrategy:
    return FSDPStrategy(checkpoint="sharded")


def _sharded_run(batch: int, folder: str | None, **kwargs) -> dict:
    return _train_ckpt(_sharded(), batch, folder, **kwargs)


def test_fsdp_sharded_checkpoint_resumes_at_another_world_size(tmp_path, run_on_ranks):
    whole = run_on_ranks(_train_ckpt, "dp", 8, None, world_size=1)[0]
    folder = tmp_path / "ckpt"
    run_on_ranks(partial(_sharded_run, max_steps=5, checkpoint_every=5), 4, str(folder),
                 world_size=2)  # fmt: skip
    saved_path = ckpt.CheckpointFolder(folder).latest()
    assert saved_path is not None
    saved = ckpt.load(saved_path)
    assert saved["producer"]["strategy"] == "fsdp" and Path(saved["shards"]).is_dir()
    assert all(t.device.type == "meta" for t in saved["model"].values())  # no data in the file
    assert saved["model"]["0.weight"].shape == (16, 6)
    resumed_fsdp_one = run_on_ranks(
        partial(_sharded_run, resume=str(saved_path)), 8, None, world_size=1
    )[0]
    resumed_fsdp_two = run_on_ranks(partial(_sharded_run, resume="auto"), 4, str(folder),
                                    world_size=2)[0]  # fmt: skip
    other = partial(_train_ckpt, resume=str(saved_path))  # unsharded strategies read it too
    resumed_dp = run_on_ranks(other, "dp", 8, None, world_size=1)[0]
    resumed_ddp = run_on_ranks(other, "ddp", 4, None, world_size=2)[0]
    for name, resumed in [("fsdp x1", resumed_fsdp_one), ("fsdp x2", resumed_fsdp_two),
                          ("dp", resumed_dp), ("ddp x2", resumed_ddp)]:  # fmt: skip
        assert max_abs_diff(resumed["state"], whole["state"]) <= TOL, name
    # the later saves' folders replaced the first one's; keep_last=3 files, their shards only
    files = ckpt.CheckpointFolder(folder).checkpoints()
    shards = sorted(p.name for p in folder.iterdir() if p.name.endswith(".shards"))
    assert len(shards) <= len(files) + 1


def _load_mid_run(path: str) -> dict:
    trainer = distkit.Trainer(
        "fsdp", batch_size=4, max_epochs=2, seed=11, progress=False, max_steps=5
    )
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to(DTYPE)
    optimizer = torch.optim.Adam(net.parameters(), lr=0.01)
    data = make_dataset(64, dtype=DTYPE)
    trainer.fit(net, optimizer, data, loss_fn=nn.functional.cross_entropy)
    trainer.save_checkpoint(path)
    with torch.no_grad():  # spoil the sharded weights and optimizer state
        for p in net.parameters():
            p.zero_()
            optimizer.state[p]["exp_avg"].zero_()
    trainer.load_checkpoint(path)  # into the set-up (sharded) objects, at once
    trainer.max_steps = None
    result = trainer.fit(net, optimizer, data, loss_fn=nn.functional.cross_entropy)
    out = {"state": trainer.full_state_dict(), "history": result.history}
    trainer.close()
    return out


def test_fsdp_load_checkpoint_after_setup_restores_sharded_state(tmp_path, run_on_ranks):
    whole = run_on_ranks(_train_ckpt, "dp", 8, None, world_size=1)[0]
    resumed = run_on_ranks(_load_mid_run, str(tmp_path / "mid.pt"), world_size=2)
    assert max_abs_diff(resumed[0]["state"], whole["state"]) <= TOL
    assert ckpt.load(tmp_path / "mid.pt")["model"]["0.weight"].shape == (16, 6)  # full


# ---------------------------------------------------------------- arguments
@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"checkpoint": "zip"}, "checkpoint='zip'; allowed: full, sharded"),
        ({"mesh": None}, "sets mesh itself: .* replicate=R"),
        ({"mp_policy": "bf16"}, "allowed: a torch.distributed.fsdp.MixedPrecisionPolicy"),
        ({"shard": 3}, "shard=3; allowed: None"),
    ],
)
def test_fsdp_strategy_rejects_bad_arguments(kwargs, words):
    with pytest.raises(distkit.ConfigurationError, match=words.replace("(", r"\(")):
        FSDPStrategy(**kwargs)


def test_fsdp_shard_policy_chooses_the_units():
    policy = FSDPStrategy(shard=(nn.Linear,)).shard
    assert policy("0", nn.Linear(2, 2)) and not policy("1", nn.Tanh())
    default = FSDPStrategy().shard
    assert default("0", nn.Linear(2, 2)) and not default("1", nn.Tanh())
    assert not default("0.sub", nn.Linear(2, 2))  # top-level children only


def test_fsdp_shards_each_layer_of_a_top_level_module_list_and_equals_one_process(
    run_on_ranks,
):
    """``self.layers = nn.ModuleList(...)`` at the top: the default units used to name the
    list itself, which fully_shard refuses ("containers that do not implement forward")."""
    from distkit.strategies.fsdp._units import default_units
    from tests.support.workloads import make_stack

    assert default_units(make_stack()) == {"inp", "layers.0", "layers.1", "layers.2", "out"}
    two = run_on_ranks(partial(_train, model="stack"), "fsdp", 4, 61, world_size=2)
    one = run_on_ranks(partial(_train, model="stack"), "ddp", 8, 61, world_size=1)[0]
    assert max_abs_diff(two[0]["state"], two[1]["state"]) == 0.0
    assert max_abs_diff(two[0]["state"], one["state"]) <= TOL


class _Tied(nn.Module):
    """An embedding, two blocks in a module list, and an output layer tied to the embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.blocks = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 5, bias=False)
        self.head.weight = self.embed.weight


def test_fsdp_default_units_keep_tied_weights_out_of_two_units():
    from distkit.strategies.fsdp._units import default_units

    # untied: each top-level child with parameters
    assert default_units(nn.Sequential(nn.Linear(2, 2), nn.Tanh(), nn.Linear(2, 2))) == {"0", "2"}
    # tied: embed and head share a weight, so neither is a unit; norm is whole, and the
    # blocks' module list (no forward of its own: fully_shard refuses it) gives its items
    assert default_units(_Tied()) == {"blocks.0", "blocks.1", "norm"}
    wrapper = nn.Module()
    wrapper.model = _Tied()  # the tie inside one child: that child is a unit
    wrapper.other = nn.Linear(2, 2)
    assert default_units(wrapper) == {"model", "other"}
    outer = nn.Module()
    outer.body = _Tied()
    outer.out = nn.Linear(4, 5)
    outer.out.weight = outer.body.embed.weight  # tied across children: the body's blocks
    assert default_units(outer) == {"body.blocks.0", "body.blocks.1"}
