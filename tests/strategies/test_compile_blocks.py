"""``Trainer(compile="blocks")``: each repeated block compiled in place, on real processes.

A compiled fit must end with the weights of the same fit run eagerly (aot_eager runs eager's
kernels: exactly; inductor reorders float arithmetic: float64 to ~1e-16 a step), compile one
graph for all blocks of a class, leave the user's keys and modules as they were after close,
and refuse what it cannot do with the reason. Model and data are float64.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

import distkit
from distkit.runtime._compile_blocks import BlockCompiler, repeated_blocks
from tests.strategies.test_compile import CountingBackend
from tests.support.exactness import DTYPE, TOL
from tests.support.gates import needs
from tests.support.workloads import Block, make_dataset, make_mlp, make_stack, max_abs_diff

pytestmark = pytest.mark.timeout(300)

INDUCTOR = 1e-9  # float64: inductor's fused kernels reorder sums (~1e-16 each)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if getattr(m, "_compiled_call_impl", None)]


def fit(strategy: str, batch_size: int, compile: Any = False, **kwargs: Any) -> dict[str, Any]:
    """Fit the stack (3 blocks) for two epochs; its weights, graphs, and what was compiled."""
    backend = CountingBackend()
    if compile == "count":
        compile = {"blocks": True, "backend": backend}
    net = kwargs.pop("net", None) or make_stack(dtype=DTYPE)
    trainer = distkit.Trainer(strategy, batch_size=batch_size, max_epochs=2, progress=False,
                              seed=3, compile=compile, **kwargs)  # fmt: skip
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    result = trainer.fit(
        net, optimizer, make_dataset(48, dtype=DTYPE), loss_fn=nn.functional.cross_entropy
    )
    during = _compiled(net)
    state = trainer.full_state_dict()
    trainer.close()
    return {
        "state": state,
        "graphs": len(backend.graphs),
        "compiled": during,
        "after_close": _compiled(net),
        "history": result.history,
    }


# ---------------------------------------------------------------- which blocks
def test_the_blocks_are_a_stack_s_repeated_composite_children():
    stack = make_stack()
    assert repeated_blocks(stack) == list(stack.layers)
    # torch's own transformer: its layers, not the Linear layers inside them
    encoder = nn.TransformerEncoder(
        nn.TransformerEncoderLayer(8, 2, 16, batch_first=True), num_layers=3
    )
    assert repeated_blocks(encoder) == list(encoder.layers)
    # plain layers in a Sequential are no blocks (no submodules of their own)
    assert repeated_blocks(make_mlp()) == []
    # one class among others in a list: that class's; the outermost where stacks nest
    mixed = nn.ModuleList([Block(4), nn.Sequential(Block(4), Block(4)), Block(4), nn.ReLU()])
    assert repeated_blocks(mixed) == [mixed[0], mixed[2], mixed[1][0], mixed[1][1]]


def test_a_model_without_repeated_blocks_is_refused_naming_its_classes():
    with pytest.raises(distkit.ConfigurationError) as error:
        fit("dp", 8, compile="blocks", net=make_mlp(dtype=DTYPE))
    message = str(error.value)
    assert 'compile="blocks" found no repeated block in Sequential' in message
    assert "Linear, Sequential, Tanh" in message and "Use compile=True" in message


@pytest.mark.parametrize(
    ("value", "words"),
    [
        ({"blocks": "yes"}, "'blocks' is True .* got str"),
        ("block", "or 'blocks' to compile each repeated block"),
    ],
)
def test_compile_blocks_rejects_what_it_cannot_mean(value, words):
    with pytest.raises(distkit.ConfigurationError, match=words):
        distkit.Trainer("dp", progress=False, compile=value)


def test_compile_blocks_refuses_dataparallel_replicas():
    """A stand-in for nn.DataParallel over two GPUs (none here): only its device_ids are
    read. Its replicas would copy each block's compiled call, bound to the original."""
    wrapper = nn.DataParallel.__new__(nn.DataParallel)
    nn.Module.__init__(wrapper)
    wrapper.module, wrapper.device_ids = make_stack(), [0, 1]
    with pytest.raises(distkit.UnsupportedFeatureError, match=r"over 2 GPUs: .* strategy='ddp'"):
        BlockCompiler({})(wrapper)
    assert _compiled(wrapper) == []


# ---------------------------------------------------------------- one process
def test_compile_blocks_dp_equals_eager_with_one_graph_for_every_block():
    eager = fit("dp", 8)
    compiled = fit("dp", 8, compile="count")
    assert compiled["compiled"] == ["layers.0", "layers.1", "layers.2"]
    assert compiled["graphs"] == 1, "each block traced again: its graph was not reused"
    assert max_abs_diff(compiled["state"], eager["state"]) == 0.0  # aot_eager: eager's kernels
    assert not any("_orig_mod" in key for key in compiled["state"])
    assert compiled["after_close"] == [], "closing gives every block its plain call back"


def test_compile_blocks_inductor_matches_eager_and_counts_no_flops():
    eager = fit("dp", 8)
    before = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    compiled = fit("dp", 8, compile="blocks")
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > before
    assert max_abs_diff(compiled["state"], eager["state"]) <= INDUCTOR
    # torch's FLOP counter cannot see into the compiled blocks: no count rather than a wrong one
    assert all("mfu" not in record for record in compiled["history"])
    assert all("mfu" in record for record in eager["history"])


def test_compile_blocks_with_activation_checkpointing_equals_eager():
    """Checkpointed blocks, compiled: dynamo breaks its graph at distkit's running-statistics
    guard inside the checkpoint and runs that part eagerly; the weights stay eager's."""
    eager = fit("dp", 8, activation_checkpointing=[Block])
    compiled = fit("dp", 8, compile="count", activation_checkpointing=[Block])
    assert max_abs_diff(compiled["state"], eager["state"]) == 0.0


# ---------------------------------------------------------------- two processes
def eager_then_blocks(strategy: str, batch_size: int) -> dict[str, Any]:
    """Runs on each rank (torchrun or horovodrun): the same fit eagerly, then per block."""
    return {"off": fit(strategy, batch_size), "count": fit(strategy, batch_size, compile="count")}


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_compile_blocks_two_ranks_equal_eager_and_one_process(strategy, run_on_ranks):
    """Inside DDP's wrapper and inside FSDP's units (each block one): the blocks compile, the
    wrapper's reducer and all-gathers stay outside the graphs."""
    ranks = run_on_ranks(eager_then_blocks, strategy, 4, world_size=2)
    for runs in ranks:
        assert runs["count"]["compiled"] == ["layers.0", "layers.1", "layers.2"]
        assert runs["count"]["graphs"] >= 1
        assert max_abs_diff(runs["count"]["state"], runs["off"]["state"]) == 0.0
        assert runs["count"]["after_close"] == []
    assert max_abs_diff(ranks[0]["count"]["state"], ranks[1]["count"]["state"]) == 0.0
    one = fit("dp", 8)
    assert max_abs_diff(ranks[0]["count"]["state"], one["state"]) <= TOL


# ---------------------------------------------------------------- one CUDA GPU
@needs("cuda")
def test_cuda_compile_blocks_inductor_equals_eager_in_float64():
    """One CUDA GPU (scripts/gpu_check.sh's focus step): inductor compiles the blocks into
    Triton kernels; in float64 the weights stay eager's to the reordering of sums."""
    eager = fit("dp", 8)
    compiled = fit("dp", 8, compile="blocks")
    assert compiled["compiled"] == ["layers.0", "layers.1", "layers.2"]
    assert max_abs_diff(compiled["state"], eager["state"]) <= INDUCTOR
    assert compiled["after_close"] == []
