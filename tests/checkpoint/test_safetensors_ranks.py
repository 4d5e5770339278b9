"""save_weights on real gloo processes: ddp and fsdp (sharded, one gathered shard at a time on
rank 0) write the one-process model's weights; every rank returns with the files complete; a
call on some ranks only fails instead of hanging; a transformers model trained on 2 ranks
reloads with from_pretrained giving identical logits; horovod where it is built.

The trained models are float64 (``tests/support/exactness.py``): ranks against one process
within 1e-9 on any CPU."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import distkit
from distkit.errors import RankDisagreementError
from distkit.runtime import _weights
from tests.support.exactness import DTYPE, TOL
from tests.support.fakes import use_fake_apex
from tests.support.gates import needs
from tests.support.horovod_runner import run_with_horovodrun
from tests.support.workloads import make_dataset, max_abs_diff

safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = pytest.mark.timeout(180)

N = 16
#: bytes per shard: a 16x16 float64 weight (2048) and its bias (128), so each block is a shard
LIMIT = 2400


def _model() -> nn.Module:
    """Three equal 16x16 blocks between two small ones: each of the three is a shard of its
    own at ``max_shard_size=LIMIT``."""
    torch.manual_seed(0)
    blocks = [nn.Linear(6, 16), nn.Tanh()]
    for _ in range(3):
        blocks += [nn.Linear(16, 16), nn.Tanh()]
    return nn.Sequential(*blocks, nn.Linear(16, 3)).to(DTYPE)


def _read(folder: Path) -> dict[str, torch.Tensor]:
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    out: dict[str, torch.Tensor] = {}
    for file in files:
        out.update(safetensors_torch.load_file(str(folder / file)))
    return out


def train_and_save(strategy: str, batch: int, folder: str | None, limit: int) -> dict[str, Any]:
    """A short user loop, then save_weights (sharded at ``limit`` bytes); each rank reads the
    files back right after its call returned (they must be complete on every rank)."""
    with distkit.Runtime(strategy, seed=1) as rt:
        model = _model()
        model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for x, y in rt.loader(make_dataset(N, dtype=DTYPE), batch_size=batch):
            rt.backward(nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        state = rt.full_state_dict(model)
        if folder is None:
            return {"state": state}
        written = _weights.save_weights(rt.strategy, model, folder, max_shard_size=limit)
        return {
            "state": state,
            "files": [p.name for p in written.files],
            "peak_held": written.peak_held,
            "total": written.total_size,
            "read_back": _read(Path(folder)),  # at once: no rank returns before rank 0 wrote
        }


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_save_weights_on_two_ranks_writes_the_one_process_weights_shard_by_shard(
    strategy, run_on_ranks, tmp_path
):
    limit = LIMIT
    one = run_on_ranks(train_and_save, "ddp", 8, None, limit, world_size=1)[0]
    ranks = run_on_ranks(train_and_save, strategy, 4, str(tmp_path / "w"), limit)
    main = ranks[0]
    assert len(main["files"]) >= 4, main["files"]
    assert sorted(p.name for p in (tmp_path / "w").iterdir()) == sorted(
        [*main["files"], "model.safetensors.index.json"]
    )
    for rank in ranks:
        assert max_abs_diff(rank["read_back"], one["state"]) <= TOL
        assert max_abs_diff(rank["read_back"], rank["state"]) == 0.0
    # rank 0 held one shard at a time: never more than the largest shard, far below the model
    sizes = [
        sum(t.numel() * t.element_size() for t in safetensors_torch.load_file(str(path)).values())
        for path in (tmp_path / "w" / file for file in main["files"])
    ]
    largest = max(sizes)
    assert 0 < main["peak_held"] <= largest <= limit
    assert main["peak_held"] * 3 < main["total"] == sum(sizes)
    assert ranks[1]["peak_held"] == 0  # the other rank keeps nothing


def save_on_rank_0_only(path: str) -> str:
    with distkit.Runtime("ddp") as rt:
        model = rt.setup(_model())
        try:
            if rt.rank == 0:
                rt.save_weights(model, path)
            else:
                rt.barrier()
        except RankDisagreementError as exc:
            return str(exc)
        return "no error"


def test_save_weights_on_some_ranks_only_fails_instead_of_hanging(run_on_ranks, tmp_path):
    messages = run_on_ranks(save_on_rank_0_only, str(tmp_path / "w.safetensors"))
    for message in messages:
        assert "the ranks are in different calls" in message
        assert "rank 0 in save_weights" in message and "rank 1 in rt.barrier" in message
    assert not (tmp_path / "w.safetensors").exists()


def save_where_rank_0_cannot_write(folder: str) -> str:
    with distkit.Runtime("fsdp") as rt:
        model = rt.setup(_model())
        try:
            rt.save_weights(model, folder, max_shard_size=LIMIT)
        except distkit.errors.CheckpointError as exc:
            return str(exc)
        return "no error"


def test_a_failed_write_on_rank_0_fails_every_rank_after_the_gathers(run_on_ranks, tmp_path):
    """fsdp: rank 0 cannot write the first shard; it still joins every gather (or rank 1
    would wait in one), and rank 1 learns of the failure at the end."""
    (tmp_path / "a_file").write_text("x")
    messages = run_on_ranks(save_where_rank_0_cannot_write, str(tmp_path / "a_file" / "w"))
    assert "cannot write the weights file" in messages[0]
    assert messages[1].startswith("rank 0 could not write the weights to")
    assert "cannot write the weights file" in messages[1]


def trainer_fit_and_save(path: str, strategy: str = "ddp", batch: int = 4) -> dict[str, Any]:
    trainer = distkit.Trainer(strategy, batch_size=batch, max_epochs=1, seed=2, progress=False)
    model = _model()
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.2), make_dataset(N, dtype=DTYPE),
                loss_fn=nn.functional.cross_entropy)  # fmt: skip
    written = trainer.save_weights(path)
    state = trainer.full_state_dict()
    trainer.close()
    return {"written": written, "state": state, "read": safetensors_torch.load_file(path)}


def apex_fit_and_save(path: str) -> dict[str, Any]:
    """The same under the FAKE legacy apex package and FAKE CUDA (tests/support/fakes)."""
    import distkit.strategies.apex as apex_strategy

    apex_strategy._require_cuda = lambda choices: None
    with use_fake_apex("legacy"):
        return trainer_fit_and_save(path, "apex")


@pytest.mark.parametrize("run", [trainer_fit_and_save, apex_fit_and_save], ids=["ddp", "apex"])
def test_trainer_save_weights_after_a_fit_on_two_ranks(run, run_on_ranks, tmp_path):
    path = str(tmp_path / "fit.safetensors")
    ranks = run_on_ranks(run, path)
    for rank in ranks:
        assert rank["written"] == [Path(path)]
        assert max_abs_diff(rank["read"], rank["state"]) == 0.0
    one = str(tmp_path / "one.safetensors")
    reference = run_on_ranks(trainer_fit_and_save, one, "ddp", 8, world_size=1)[0]
    assert max_abs_diff(ranks[0]["read"], reference["state"]) <= TOL


# ---------------------------------------------------------------- a transformers model
def _gpt2() -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(config)


def _tokens() -> torch.Tensor:
    return torch.randint(0, 100, (8, 12), generator=torch.Generator().manual_seed(7))


def train_gpt2_and_save(folder: str) -> dict[str, Any]:
    with distkit.Runtime("ddp", seed=3) as rt:
        model = _gpt2()
        model, optimizer = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        tokens = _tokens()
        for step in range(2):
            batch = tokens[rt.rank * 4 : rt.rank * 4 + 4].roll(step, dims=1)
            logits = model(batch).logits
            loss = nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())
            rt.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        written = rt.save_weights(model, folder, max_shard_size="40KB")
        model.eval()
        with torch.no_grad():
            logits = model(tokens).logits
        return {"written": [p.name for p in written], "logits": logits}


def test_a_transformers_model_trained_on_two_ranks_reloads_with_from_pretrained(
    run_on_ranks, tmp_path
):
    transformers = pytest.importorskip("transformers")
    folder = tmp_path / "gpt2"
    ranks = run_on_ranks(train_gpt2_and_save, str(folder), timeout=150)
    written = ranks[0]["written"]
    assert "config.json" in written and "model.safetensors.index.json" in written
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]  # tied to the embedding: saved once
    assert "transformer.wte.weight" in index["weight_map"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(folder))
    assert type(loaded).__name__ == "GPT2LMHeadModel"
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    loaded.eval()
    with torch.no_grad():
        logits = loaded(_tokens()).logits
    assert torch.equal(logits, ranks[0]["logits"])
    assert torch.equal(ranks[1]["logits"], ranks[0]["logits"])
    fresh = _gpt2()  # distkit.load_weights reads the same folder into a model built by hand
    result = distkit.load_weights(fresh, folder)
    assert "lm_head.weight" in result.loaded
    fresh.eval()
    with torch.no_grad():
        assert torch.equal(fresh(_tokens()).logits, logits)


# ---------------------------------------------------------------- horovod
def horovod_save(folder: str) -> dict[str, Any]:
    return train_and_save("horovod", 4, folder, LIMIT)


@needs("horovod")
def test_save_weights_on_horovod_writes_the_one_process_weights(run_on_ranks, tmp_path):
    one = run_on_ranks(train_and_save, "ddp", 8, None, LIMIT, world_size=1)[0]
    folder = str(tmp_path / "w")
    calls = [("tests.checkpoint.test_safetensors_ranks", "horovod_save", (folder,), {})]
    for (result,) in run_with_horovodrun(calls, tmp_path):
        assert max_abs_diff(result["read_back"], one["state"]) <= TOL
