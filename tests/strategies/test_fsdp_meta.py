"""A model built on the meta device, handed to fit as it is (issue 28, part 2): fsdp shards it
first, then each rank materialises and initialises its own slices; the result equals the same
model built normally after the same seed. Backends that cannot do this refuse it.

Built and trained in float64 (tests/support/exactness.py): the runs compared hold to 1e-9."""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any

import pytest
import torch
from torch import nn

import distkit
from tests.support.exactness import DTYPE, TOL
from tests.support.meta_models import Net, NoReset, build, fit_on_meta
from tests.support.workloads import make_dataset, max_abs_diff

pytestmark = pytest.mark.timeout(300)


def fit(name: str, batch: int, meta: str, epochs: int = 2, **settings: Any) -> dict[str, Any]:
    model = build(meta, dtype=DTYPE)
    trainer = distkit.Trainer(name, batch_size=batch, seed=3, max_epochs=epochs,
                              progress=False, **settings)  # fmt: skip
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = make_dataset(21, dtype=DTYPE)
    trainer.fit(model, optimizer, data, loss_fn=nn.functional.cross_entropy)
    out = {"state": trainer.full_state_dict(), "steps": trainer.global_step}
    trainer.close()
    return out


def test_a_meta_model_under_fsdp_x2_trains_like_the_normally_built_one(run_on_ranks):
    """(Its BatchNorm keeps per-rank statistics, so both differ from one process at 2x the
    batch: what must match is the two builds.)"""
    normal = run_on_ranks(fit, "fsdp", 4, "normal", world_size=2)
    built = run_on_ranks(fit, "fsdp", 4, "init_empty", world_size=2)
    for a, b in zip(normal, built, strict=True):
        assert max_abs_diff(b["state"], a["state"]) <= TOL


def initial(name: str, meta: str) -> dict[str, torch.Tensor]:
    """The weights right after the set-up (no step)."""
    with distkit.Runtime(name, seed=0) as rt:
        if meta == "rt.init_module":
            torch.manual_seed(0)
            with rt.init_module(empty=True):
                model = Net(dtype=DTYPE)
            assert all(p.is_meta for p in model.parameters())
        else:
            model = build(meta, dtype=DTYPE)
        model, _ = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        return rt.full_state_dict(model)


@pytest.mark.parametrize(
    ("world", "meta"), [(1, "init_empty"), (2, "rt.init_module"), (2, "torch")]
)
def test_a_meta_model_is_materialised_with_the_normal_builds_initial_values(
    run_on_ranks, world, meta
):
    """Exactly (bitwise), in a world of one (not sharded) and of two (each rank its slice),
    built under distkit.init_empty(), rt.init_module(empty=True) or torch.device("meta")."""
    normal = run_on_ranks(initial, "fsdp", "normal", world_size=world)
    built = run_on_ranks(initial, "fsdp", meta, world_size=world)
    for a, b in zip(normal, built, strict=True):
        assert a.keys() == b.keys()
        assert all(torch.equal(a[k], b[k]) for k in a), max_abs_diff(a, b)


@pytest.mark.parametrize("kind", ["full", "sharded"])
def test_a_meta_model_resumes_from_a_checkpoint(run_on_ranks, tmp_path, kind):
    """The checkpoint is loaded before the set-up, into a model with no values: it waits
    for the materialisation (else the weights would be the initial ones, silently), whether
    the file holds the full state or names a shards folder."""
    whole = run_on_ranks(fit, "fsdp", 4, "normal", world_size=2)[0]
    folder = str(tmp_path / "ckpt")
    strategy = distkit.FSDPStrategy(checkpoint=kind)
    run_on_ranks(partial(fit, checkpoint_dir=folder, max_steps=3), strategy, 4, "normal",
                 world_size=2)  # fmt: skip
    resumed = run_on_ranks(partial(fit, checkpoint_dir=folder, resume="auto"), strategy, 4,
                           "init_empty", world_size=2)  # fmt: skip
    params = [k for k in whole["state"] if "running" not in k and "num_batches" not in k]
    # BatchNorm's running statistics are each rank's own: a full checkpoint holds rank 0's,
    # a sharded one the copy of whichever rank torch.distributed.checkpoint kept
    for rank in resumed[:1] if kind == "full" else []:
        assert rank["steps"] == whole["steps"]
        assert max_abs_diff(rank["state"], whole["state"]) <= TOL
    for rank in resumed:
        assert rank["steps"] == whole["steps"]
        assert max_abs_diff({k: rank["state"][k] for k in params},
                            {k: whole["state"][k] for k in params}) <= TOL  # fmt: skip


class TiedLM(nn.Module):
    """An embedding, a hidden layer, and an output layer sharing the embedding's weight, tied
    as GPT-style models tie it (``head.weight = emb.weight``), or the other way round
    (``reverse``: the output layer's weight handed to the embedding)."""

    def __init__(self, reverse: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(11, 8, dtype=DTYPE)
        self.hidden = nn.Linear(8, 8, dtype=DTYPE)
        self.head = nn.Linear(8, 11, bias=False, dtype=DTYPE)
        if reverse:
            self.emb.weight = self.head.weight
        else:
            self.head.weight = self.emb.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.hidden(self.emb(tokens))))


def root_only(name: str, module: nn.Module) -> bool:
    return False  # no unit but the root, which holds every parameter


def fit_tied(world: int) -> list[dict[str, Any]]:
    """A TiedLM each way, built normally and under init_empty(), fit 2 steps (SGD, lr 0.1)
    under fsdp with the default units (and, sharded, with the root alone); the weights and
    whether the two modules still hold one parameter."""
    g = torch.Generator().manual_seed(5)
    data = torch.utils.data.TensorDataset(torch.randint(0, 11, (16,), generator=g),
                                          torch.randint(0, 11, (16,), generator=g))  # fmt: skip
    out = []
    for reverse in (False, True):
        for shard in (None, root_only) if world > 1 else (None,):
            for meta in (False, True):
                torch.manual_seed(0)
                with distkit.init_empty() if meta else contextlib.nullcontext():
                    model = TiedLM(reverse)
                trainer = distkit.Trainer(distkit.FSDPStrategy(shard=shard), batch_size=4,
                                          seed=3, max_epochs=1, progress=False)  # fmt: skip
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
                trainer.fit(model, optimizer, data, loss_fn=nn.functional.cross_entropy)
                out.append({"case": (reverse, shard is None, meta),
                            "state": trainer.full_state_dict(),
                            "tied": model.head.weight is model.emb.weight})  # fmt: skip
                trainer.close()
    return out


@pytest.mark.parametrize("world", [1, 2])
def test_a_tied_model_built_on_meta_stays_tied_and_equals_the_normal_build(run_on_ranks, world):
    """Bitwise, tied (one parameter object after the fit), either way the tie is made, with
    the default units and (sharded) the root alone. Before, the materialisation gave each
    module its own parameter in a world of one, and the reversed tie took the embedding's
    initial values, where the normal build keeps those of the layer that made it."""
    for rank in run_on_ranks(fit_tied, world, world_size=world):
        for normal, built in zip(rank[0::2], rank[1::2], strict=True):
            assert normal["tied"] and built["tied"], built["case"]
            assert max_abs_diff(built["state"], normal["state"]) == 0.0, built["case"]


def test_a_meta_module_without_reset_parameters_is_refused_naming_it(run_on_ranks):
    (message,) = run_on_ranks(fit_on_meta, "fsdp", NoReset, world_size=1)
    assert "NoReset holds" in message and "reset_parameters()" in message, message


def test_a_meta_model_under_a_backend_that_needs_it_whole_is_refused(run_on_ranks):
    (message,) = run_on_ranks(fit_on_meta, "ddp", Net, world_size=1)
    assert "meta device" in message and "strategy='fsdp'" in message, message
