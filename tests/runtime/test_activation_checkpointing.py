"""Activation checkpointing (issue 28, part 4): the same weights as without it on every
backend that can (ddp, fsdp, horovod, deepspeed x2), less memory saved for backward, and the
argument's refusals."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
from torch import nn

import distkit
from distkit.errors import ConfigurationError
from distkit.runtime._checkpointing import apply_checkpointing, checkpoint_policy
from tests.support.gates import needs
from tests.support.horovod_runner import run_with_horovodrun
from tests.support.workloads import make_dataset, max_abs_diff

pytestmark = pytest.mark.timeout(300)

FEATURES = make_dataset(1).tensors[0].shape[1]


class Block(nn.Module):
    """A residual block with dropout: recomputing it must draw the same mask."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.drop = nn.Dropout(0.2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.drop(torch.tanh(self.linear(x)))


class Net(nn.Module):
    def __init__(self, width: int = 32, depth: int = 4) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, width)
        self.blocks = nn.Sequential(*[Block(width) for _ in range(depth)])
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


def strategy_of(name: str) -> Any:
    if name.startswith("deepspeed"):
        small = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}
        return distkit.DeepSpeedStrategy(stage=int(name[-1]), config=small)
    return name


def fit(name: str, checkpointing: Any, batch: int = 4) -> dict[str, Any]:
    torch.manual_seed(0)
    trainer = distkit.Trainer(strategy_of(name), batch_size=batch, grad_accum_steps=2, seed=3,
                              max_epochs=2, progress=False,
                              activation_checkpointing=checkpointing)  # fmt: skip
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer.fit(model, optimizer, make_dataset(21), loss_fn=nn.functional.cross_entropy)
    state = trainer.full_state_dict()
    trainer.close()
    return {"state": state, "keys": sorted(model.state_dict())}


@pytest.mark.parametrize(
    "name",
    [
        "ddp",
        "fsdp",
        pytest.param("deepspeed2", marks=needs("deepspeed")),
        pytest.param("deepspeed3", marks=needs("deepspeed")),
    ],
)
def test_checkpointing_gives_the_weights_of_training_without_it(run_on_ranks, name):
    """Two ranks, accumulation 2, dropout in every checkpointed block: the same weights as
    without checkpointing, bitwise, and the same state_dict keys. Bitwise because the
    recomputed forward is the same arithmetic in the same order (measured 0.0 on every backend
    here): any difference would mean the recomputation saw other weights or other dropout."""
    plain = run_on_ranks(fit, name, None, world_size=2)
    checked = run_on_ranks(fit, name, [Block], world_size=2)
    for without, with_ in zip(plain, checked, strict=True):
        assert max_abs_diff(with_["state"], without["state"]) == 0.0
        assert with_["keys"] == without["keys"]


class NormBlock(nn.Module):
    """A block with a BatchNorm: its running statistics change in every training forward."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.norm(self.linear(x)))


class NormNet(nn.Module):
    def __init__(self, width: int = 16, depth: int = 2) -> None:
        super().__init__()
        self.inp = nn.Linear(FEATURES, width)
        self.blocks = nn.Sequential(*[NormBlock(width) for _ in range(depth)])
        self.out = nn.Linear(width, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.blocks(self.inp(x)))


def fit_norm(name: str, checkpointing: Any) -> dict[str, Any]:
    """A fit of a model with BatchNorm inside its blocks; its state (running statistics
    and num_batches_tracked included) and its evaluation outputs."""
    torch.manual_seed(0)
    trainer = distkit.Trainer(name, batch_size=4, seed=3, max_epochs=2, progress=False,
                              drop_last=True, activation_checkpointing=checkpointing)  # fmt: skip
    model = NormNet().double()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    data = make_dataset(24, dtype=torch.float64)
    trainer.fit(model, optimizer, data, loss_fn=nn.functional.cross_entropy)
    state = trainer.full_state_dict()
    trainer.close()
    model.eval()
    with torch.no_grad():
        outputs = model(data.tensors[0])
    return {"state": state, "outputs": outputs, "forward": "forward" in vars(model.blocks[0])}


@pytest.mark.parametrize("name", ["ddp", "fsdp"])
def test_checkpointing_a_block_with_batchnorm_updates_its_statistics_once(run_on_ranks, name):
    """The recomputation in backward is no second forward: the running mean, variance and
    num_batches_tracked are those of training without checkpointing, bitwise (they are the
    same arithmetic), and so are the evaluation outputs. Before, every step updated them
    twice (num_batches_tracked 2x, eval loss 0.516 against 0.556) with no word."""
    plain = run_on_ranks(fit_norm, name, None, world_size=2)
    checked = run_on_ranks(fit_norm, name, [NormBlock], world_size=2)
    for without, with_ in zip(plain, checked, strict=True):
        assert int(with_["state"]["blocks.0.norm.num_batches_tracked"]) == 6  # 3 steps x 2
        assert max_abs_diff(with_["state"], without["state"]) == 0.0
        assert torch.equal(with_["outputs"], without["outputs"])


def test_closing_gives_the_model_its_own_forward_back():
    """The checkpointed forward is the set-up's, not the model's for good: after close a
    later fit with activation_checkpointing=None keeps every activation again."""
    result = fit_norm("dp", [NormBlock])
    assert not result["forward"]
    torch.manual_seed(0)
    model = Net(width=64, depth=16)
    plain = copy.deepcopy(model)
    with distkit.Runtime("dp", activation_checkpointing=[Block]) as rt:
        rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        assert "forward" in vars(model.blocks[0])
    assert all("forward" not in vars(block) for block in model.blocks)
    assert _saved_bytes(model) == _saved_bytes(plain)


@needs("horovod")
def test_checkpointing_under_horovod_gives_the_weights_of_training_without_it(tmp_path):
    calls = [
        ("tests.runtime.test_activation_checkpointing", "fit", ("horovod", None), {}),
        ("tests.runtime.test_activation_checkpointing", "fit", ("horovod", (Block,)), {}),
    ]
    for plain, checked in run_with_horovodrun(calls, tmp_path):
        assert max_abs_diff(checked["state"], plain["state"]) == 0.0  # bitwise, as above


def user_loop(checkpointing: Any) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    with distkit.Runtime("ddp", seed=3, activation_checkpointing=checkpointing) as rt:
        model = Net()
        model, optimizer = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        for x, y in rt.loader(make_dataset(21), batch_size=4):
            rt.backward(nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        return rt.full_state_dict(model)


def is_block(module: nn.Module) -> bool:
    return isinstance(module, Block)


def test_checkpointing_in_a_user_loop_with_a_predicate(run_on_ranks):
    plain = run_on_ranks(user_loop, None, world_size=2)
    checked = run_on_ranks(user_loop, is_block, world_size=2)
    for without, with_ in zip(plain, checked, strict=True):
        assert max_abs_diff(with_, without) == 0.0  # bitwise, as above


def _saved_bytes(model: nn.Module) -> int:
    """Bytes of the tensors autograd keeps for backward during one forward."""
    total = 0

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    torch.manual_seed(1)  # the same inputs and dropout masks for both models
    x = torch.randn(256, FEATURES)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(x).sum().backward()
    return total


def test_checkpointing_keeps_less_for_backward():
    """The activations kept for backward of a 16-block model: without checkpointing each
    block keeps its linear's input, tanh's output and dropout's mask; with it, only each
    block's input (plus the head's)."""
    torch.manual_seed(0)
    plain = Net(width=64, depth=16)
    checked = copy.deepcopy(plain)
    assert len(apply_checkpointing(checked, checkpoint_policy([Block]))) == 16
    without, with_ = _saved_bytes(plain), _saved_bytes(checked)
    assert with_ < without / 2, (with_, without)
    for p, q in zip(plain.parameters(), checked.parameters(), strict=True):
        assert torch.allclose(p.grad, q.grad)


def test_a_checkpointed_model_copies_and_evaluates_as_itself():
    """A deepcopy runs its own weights (not the original's); the keys and the outputs are
    those of the same model unchecked."""
    torch.manual_seed(0)
    model = Net()
    plain = copy.deepcopy(model)
    apply_checkpointing(model, checkpoint_policy([Block]))
    assert list(model.state_dict()) == list(plain.state_dict())
    twin = copy.deepcopy(model)
    x = torch.randn(5, FEATURES)
    with torch.no_grad():
        for p in twin.parameters():
            p.add_(1.0)
        model.eval(), twin.eval(), plain.eval()
        assert torch.equal(model(x), plain(x))
        assert not torch.allclose(model(x), twin(x))


def test_activation_checkpointing_refuses_what_it_cannot_take_naming_what_it_can():
    with pytest.raises(ConfigurationError, match="module classes"):
        distkit.Trainer("dp", activation_checkpointing="Block")
    with pytest.raises(ConfigurationError, match=r"not a torch\.nn\.Module subclass"):
        distkit.Trainer("dp", activation_checkpointing=[Block, "Linear"])
    assert checkpoint_policy([]) is None and checkpoint_policy(None) is None
    policy = checkpoint_policy(Block)
    assert policy is not None and policy(Block(3)) and not policy(nn.Linear(3, 3))


def test_a_class_that_matches_nothing_is_said_once():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert apply_checkpointing(Net(), checkpoint_policy([nn.Conv2d])) == []
    assert any("matched no module of Net" in str(w.message) for w in caught)


def test_a_runtime_and_a_trainer_must_agree_on_checkpointing():
    with distkit.Runtime("dp", activation_checkpointing=[Block]) as rt:
        with pytest.raises(ConfigurationError, match="activation_checkpointing"):
            distkit.Trainer(runtime=rt, activation_checkpointing=[nn.Linear])
        trainer = distkit.Trainer(runtime=rt, progress=False)  # the runtime's
        trainer.close()
