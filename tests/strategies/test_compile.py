"""``Trainer(compile=...)``: torch.compile in the order each strategy needs, on real processes.

Every test proves that graphs were compiled (a backend that counts them): torch.compile around
a DDP or FSDP wrapper compiles nothing at all for a plain ``nn.Sequential`` (dynamo does not
trace into torch's own container from the wrapper's frame), so the models here are classes of
the test's own. A compiled fit must end with the weights of the same fit run eagerly, and
checkpoints keep the user's module keys (no ``_orig_mod.``).

Model and data are float64 (tests/support/exactness.py), so the comparisons hold on any CPU.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import distkit
from distkit import checkpoint as ckpt
from tests.support.exactness import DTYPE, TOL
from tests.support.workloads import make_dataset, max_abs_diff

pytestmark = pytest.mark.timeout(300)

EXACT = 1e-9  # aot_eager runs the same kernels as eager: the weights agree to rounding
INDUCTOR = 1e-9  # inductor fuses kernels, which reorders float arithmetic (float64: ~1e-16)


class Net(nn.Module):
    """A small MLP as users write one: a class of their own, not ``nn.Sequential``."""

    def __init__(self, features: int = 6, hidden: int = 16, classes: int = 3) -> None:
        super().__init__()
        self.hidden = nn.Linear(features, hidden)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.hidden(x)))


def make_net(seed: int = 0) -> Net:
    torch.manual_seed(seed)
    return Net().to(DTYPE)


class CountingBackend:
    """aot_eager, counting the graphs it compiles.

    Its repr is the same on every rank: fit checks that the ranks' settings agree, and a plain
    function's repr holds its address, which differs between processes.
    """

    def __init__(self) -> None:
        self.graphs: list[int] = []  # each compiled graph's node count

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        from torch._dynamo.backends.registry import lookup_backend

        self.graphs.append(len(gm.graph.nodes))
        return lookup_backend("aot_eager")(gm, example_inputs)

    def __repr__(self) -> str:
        return "CountingBackend(aot_eager)"


def fit(
    strategy: str,
    batch_size: int,
    *,
    compile: str = "off",  # "off", "count" (CountingBackend) or "default" (True)
    n: int = 48,
    epochs: int = 2,
    grad_accum_steps: int = 1,
    net: nn.Module | None = None,
    **trainer_kwargs: Any,
) -> dict[str, Any]:
    """Fit :class:`Net` on the shared data; the final weights and the graphs compiled."""
    backend = CountingBackend()
    options: bool | dict[str, Any] = {
        "off": False,
        "count": {"backend": backend},
        "default": True,
    }[compile]
    net = make_net() if net is None else net
    module = getattr(net, "_orig_mod", net)  # a model the user compiled: its parameters
    trainer = distkit.Trainer(
        strategy,
        batch_size=batch_size,
        max_epochs=epochs,
        grad_accum_steps=grad_accum_steps,
        progress=False,
        seed=3,
        compile=options,
        **trainer_kwargs,
    )
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    result = trainer.fit(
        net, optimizer, make_dataset(n, dtype=DTYPE), loss_fn=nn.functional.cross_entropy
    )
    out = {
        "state": trainer.full_state_dict(),
        "graphs": len(backend.graphs),
        "losses": [record["train_loss"] for record in result.history],
        "trainer": trainer,
    }
    return out


def eager_then_compiled(strategy: str, batch_size: int, grad_accum_steps: int) -> dict:
    """Runs on each rank (torchrun or horovodrun): the same fit eagerly, then compiled."""
    runs = {}
    for mode in ("off", "count"):
        run = fit(strategy, batch_size, compile=mode, grad_accum_steps=grad_accum_steps)
        run.pop("trainer").close()
        runs[mode] = run
    return runs


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles from scratch: no graph cached by an earlier test, no recompile
    limit reached by the models of earlier tests."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _no_orig_mod(keys: Any) -> bool:
    return not any("_orig_mod" in key for key in keys)


# ---------------------------------------------------------------- one process
def test_compile_dp_equals_eager_and_checkpoints_keep_module_keys(tmp_path):
    eager = fit("dp", 8)
    compiled = fit("dp", 8, compile="count")
    assert compiled["graphs"] > 0, "nothing was compiled"
    assert max_abs_diff(compiled["state"], eager["state"]) <= EXACT
    assert _no_orig_mod(compiled["state"])
    assert list(compiled["state"]) == list(make_net().state_dict())

    path = tmp_path / "compiled.pt"
    compiled["trainer"].save_checkpoint(path)
    saved = ckpt.load(path)["model"]
    assert _no_orig_mod(saved)
    fresh = make_net(seed=1)
    fresh.load_state_dict(saved, strict=True)  # a plain, uncompiled model takes it as is
    assert max_abs_diff(fresh.state_dict(), eager["state"]) <= EXACT


def test_compile_resumed_compiled_fit_equals_uninterrupted_eager_fit(tmp_path):
    path = tmp_path / "epoch1.pt"
    first = fit("dp", 8, compile="count", epochs=1)
    first["trainer"].save_checkpoint(path)
    # a new trainer continues from the checkpoint into a new, compiled model
    backend = CountingBackend()
    trainer = distkit.Trainer(
        "dp",
        batch_size=8,
        max_epochs=2,
        progress=False,
        seed=3,
        compile={"backend": backend},
    )
    trainer.load_checkpoint(path)
    net = make_net(seed=1)
    result = trainer.fit(
        net,
        torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9),
        make_dataset(48, dtype=DTYPE),
        loss_fn=nn.functional.cross_entropy,
    )
    assert backend.graphs, "the resumed fit was not compiled"
    assert len(result.history) == 2  # epoch 0 from the checkpoint, epoch 1 trained here
    uninterrupted = fit("dp", 8, epochs=2)
    assert max_abs_diff(trainer.full_state_dict(), uninterrupted["state"]) <= EXACT
    assert max_abs_diff(net.state_dict(), uninterrupted["state"]) <= EXACT


def test_compile_user_compiled_model_trains_its_module_with_clean_keys():
    eager = fit("dp", 8)
    net = make_net()
    users_backend = CountingBackend()
    compiled_by_user = torch.compile(net, backend=users_backend)
    run = fit("dp", 8, compile="count", net=compiled_by_user)
    # distkit unwraps the user's OptimizedModule and compiles the module itself
    assert run["graphs"] > 0 and users_backend.graphs == []
    assert _no_orig_mod(run["state"]) and _no_orig_mod(run["trainer"].model.state_dict())
    assert run["trainer"].model is net
    assert max_abs_diff(net.state_dict(), eager["state"]) <= EXACT  # the user's net trained
    assert max_abs_diff(run["state"], eager["state"]) <= EXACT


def test_compile_user_compiled_model_keeps_the_users_own_settings():
    eager = fit("dp", 8)
    net = make_net()
    users_backend = CountingBackend()
    # compile=False: distkit recompiles the module in the backend's order, with the user's
    # backend (not torch's default inductor)
    run = fit("dp", 8, net=torch.compile(net, backend=users_backend))
    assert users_backend.graphs and run["graphs"] == 0
    assert _no_orig_mod(run["state"])
    assert max_abs_diff(net.state_dict(), eager["state"]) <= EXACT


def aot_eager_function(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
    """A backend as a plain function: its repr holds an address that differs per process."""
    from torch._dynamo.backends.registry import lookup_backend

    return lookup_backend("aot_eager")(gm, example_inputs)


def _fit_with_function_backend() -> float:
    trainer = distkit.Trainer("ddp", batch_size=4, progress=False,
                              compile={"backend": aot_eager_function})  # fmt: skip
    net = make_net()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    result = trainer.fit(
        net, optimizer, make_dataset(16, dtype=DTYPE), loss_fn=nn.functional.cross_entropy
    )
    return result.history[-1]["train_loss"]


def test_compile_function_backend_agrees_across_ranks(run_on_ranks):
    """The ranks compare their settings by the function's name, not its address."""
    losses = run_on_ranks(_fit_with_function_backend, world_size=2)
    assert losses[0] == losses[1]


def test_compile_default_inductor_backend_matches_eager():
    # inductor (torch.compile's default) generates C++: one slow compile, on a tiny run
    graphs = torch._dynamo.utils.counters["stats"]
    eager = fit("dp", 8, n=24, epochs=1)
    before = graphs["unique_graphs"]
    compiled = fit("dp", 8, n=24, epochs=1, compile="default")
    assert graphs["unique_graphs"] > before, "compile=True compiled nothing"
    assert max_abs_diff(compiled["state"], eager["state"]) <= INDUCTOR
    assert all(torch.isfinite(torch.tensor(compiled["losses"])))
    # a model the user compiled, with compile=False: recompiled with torch's defaults (the
    # same graph: inductor's cache makes this one quick)
    torch._dynamo.reset()
    before = graphs["unique_graphs"]
    net = make_net()
    user = fit("dp", 8, n=24, epochs=1, net=torch.compile(net))
    assert graphs["unique_graphs"] > before, "the user's compiled model ran uncompiled"
    assert _no_orig_mod(user["state"])
    assert max_abs_diff(net.state_dict(), eager["state"]) <= INDUCTOR


@pytest.mark.parametrize("value", ["yes", {1: 2}, 1, ["backend"]])
def test_compile_rejects_values_other_than_bool_or_options_dict(value):
    with pytest.raises(distkit.ConfigurationError) as error:
        distkit.Trainer("dp", progress=False, compile=value)
    message = str(error.value)
    assert "compile must be True, False or a dict of torch.compile arguments" in message
    assert f"got {value!r}" in message


# ---------------------------------------------------------------- two processes
def test_compile_ddp_with_accumulation_equals_eager_ddp(run_on_ranks):
    ranks = run_on_ranks(eager_then_compiled, "ddp", 2, 2, world_size=2)
    for runs in ranks:
        assert runs["count"]["graphs"] > 0, "nothing was compiled around the DDP wrapper"
        assert max_abs_diff(runs["count"]["state"], runs["off"]["state"]) <= EXACT
    assert max_abs_diff(ranks[0]["count"]["state"], ranks[1]["count"]["state"]) == 0.0
    # and both equal one process with the whole global batch
    one = fit("dp", 8)
    assert max_abs_diff(ranks[0]["count"]["state"], one["state"]) <= TOL


def test_compile_fsdp_equals_eager_fsdp(run_on_ranks):
    ranks = run_on_ranks(eager_then_compiled, "fsdp", 4, 1, world_size=2)
    for runs in ranks:
        assert runs["count"]["graphs"] > 0, "nothing was compiled around the sharded module"
        assert max_abs_diff(runs["count"]["state"], runs["off"]["state"]) <= EXACT
    assert max_abs_diff(ranks[0]["count"]["state"], ranks[1]["count"]["state"]) == 0.0
