"""Models the user places across devices (seed 003): kept by ddp and horovod, refused by dp,
apex and fsdp, and a model built on the CPU moved as always.

``torch.device("cuda:1")`` can be named without a GPU, so every decision is tested here on
the devices it would meet; the training itself across two GPUs is the last test, which
needs them.
"""

from __future__ import annotations

import functools
import os
import socket

import pytest
import torch
from torch import nn
from torch.utils.data import TensorDataset

import distkit
from distkit.errors import ConfigurationError
from distkit.strategies import _placement, _torch_dist
from distkit.strategies._placement import (
    Claim,
    Placement,
    check_claims,
    follow_output,
    input_device_override,
    output_device,
)
from distkit.strategies.apex import ApexStrategy
from distkit.strategies.ddp import DDPStrategy
from distkit.strategies.dp import DataParallelStrategy
from distkit.strategies.fsdp import FSDPStrategy
from distkit.strategies.horovod import HorovodStrategy
from tests.support.fakes import use_fake_apex
from tests.support.gates import needs
from tests.support.horovod_runner import RankError, run_with_horovodrun

CPU, META = torch.device("cpu"), torch.device("meta")
GPU0, GPU1, GPU2 = (torch.device("cuda", i) for i in range(3))


# ---------------------------------------------------------------- the decision
@pytest.mark.parametrize(
    ("devices", "target", "placed", "inputs"),
    [
        ((), CPU, False, CPU),  # no parameters: nothing to move, inputs to the rank's device
        ((CPU,), CPU, False, CPU),  # today's CPU training
        ((CPU,), GPU1, False, GPU1),  # built on the CPU: distkit moves it to the rank's GPU
        ((GPU1,), GPU1, False, GPU1),  # already on the rank's GPU (model.to(trainer.device))
        ((GPU2,), GPU1, True, GPU2),  # one GPU of the user's choice: kept
        ((GPU0, GPU1), GPU0, True, GPU0),  # seed 003: net1 on one GPU, net2 on another
        ((GPU1, GPU0), GPU0, True, GPU1),  # inputs go to the first parameter's device
        ((CPU, GPU0), GPU0, True, CPU),  # an embedding kept on the CPU on purpose: kept
    ],
)
def test_placement_decides_who_moves_the_model(devices, target, placed, inputs):
    placement = Placement(devices, target)
    assert placement.user_placed is placed
    assert placement.input_device == inputs


def test_placement_of_a_model_lists_its_devices_parameters_first():
    model = nn.Sequential(nn.Linear(2, 3, device="meta"), nn.BatchNorm1d(3))
    model.register_buffer("scale", torch.ones(1, device="meta"))
    assert Placement.of(model, CPU).devices == (META, CPU)
    assert Placement.of(nn.Linear(2, 2), CPU).devices == (CPU,)
    assert Placement.of(nn.ReLU(), GPU0) == Placement((), GPU0)
    assert not Placement.of(nn.Linear(2, 2), CPU).user_placed


@pytest.mark.parametrize("strategy", [DataParallelStrategy, FSDPStrategy, ApexStrategy])
def test_dp_fsdp_and_apex_refuse_a_placed_model_naming_the_devices(strategy):
    placement = Placement((GPU0, GPU1), GPU0)
    with pytest.raises(ConfigurationError) as caught:
        placement.check(strategy.name, strategy.placement_refusal)
    message = str(caught.value)
    assert f"strategy {strategy.name!r} cannot train a model you placed on cuda:0, cuda:1" in (
        message
    )
    assert "this rank's device is cuda:0" in message
    assert "strategy='ddp' or strategy='horovod'" in message and "model.cpu()" in message
    # the same model built on the CPU is theirs to place
    Placement((CPU,), GPU0).check(strategy.name, strategy.placement_refusal)


def test_each_refusal_says_why_that_backend_cannot():
    assert "copies the whole model from its first GPU" in DataParallelStrategy.placement_refusal
    assert "fully_shard splits every parameter" in FSDPStrategy.placement_refusal
    assert "master weights" in ApexStrategy.placement_refusal


def test_a_strategy_from_a_plugin_refuses_unless_it_declares_it_can():
    class Plugin(DDPStrategy):
        placement_refusal = distkit.Strategy.placement_refusal

    with pytest.raises(ConfigurationError, match="sets placement_refusal = None"):
        Placement((GPU2,), GPU0).check("plugin", Plugin.placement_refusal)


@pytest.mark.parametrize("strategy", [DDPStrategy, HorovodStrategy])
def test_ddp_and_horovod_keep_a_placed_model(strategy):
    assert strategy.placement_refusal is None
    Placement((GPU0, GPU1), GPU0).check(strategy.name, strategy.placement_refusal)
    Placement((GPU2,), GPU0).check(strategy.name, strategy.placement_refusal)


def test_meta_parameters_are_refused_with_the_way_to_materialise_them():
    for strategy in (DDPStrategy, DataParallelStrategy):
        with pytest.raises(ConfigurationError, match=r"meta device \(found on: meta, cpu\)"):
            Placement((META, CPU), CPU).check(strategy.name, strategy.placement_refusal)
    with pytest.raises(ConfigurationError, match="to_empty"):
        Placement((META,), CPU).check("ddp", None)


@pytest.mark.parametrize(
    ("devices", "target", "expected"),
    [
        ([GPU1, GPU1], GPU1, [1]),  # whole on the rank's GPU: DDP's usual single-device wrap
        ([GPU0, GPU1], GPU0, None),  # several devices: torch requires device_ids=None
        ([GPU2], GPU0, None),  # one GPU of the user's: DDP finds it from the parameters
        ([CPU], CPU, None),  # CPU: DDP takes no device_ids
        ([], GPU0, [0]),
    ],
)
def test_ddp_wraps_a_placed_model_without_device_ids(devices, target, expected):
    assert _torch_dist.ddp_device_ids(devices, target) == expected


# ---------------------------------------------------------------- ranks sharing a GPU
def _claim(host: str, device: str, placed: bool = True, physical: str | None = None) -> Claim:
    return Claim(host, device, physical or device, placed)


def test_ranks_holding_a_whole_model_on_one_gpu_are_refused():
    """The model.cuda()-before-Trainer mistake: rank 1's model lands on rank 0's GPU."""
    claims = [
        _claim("node1", "cuda:0", placed=False),  # rank 0: cuda:0 is its own, distkit's choice
        _claim("node1", "cuda:0"),  # rank 1: moved there before the Trainer chose cuda:1
        _claim("node2", "cuda:0"),
    ]
    with pytest.raises(ConfigurationError) as caught:
        check_claims(claims)
    message = str(caught.value)
    assert "ranks 0, 1 on host 'node1' each hold their whole model on one GPU (cuda:0)" in (message)
    assert "model.to(trainer.device)" in message and "Build the model on the CPU" in message


@pytest.mark.parametrize(
    "claims",
    [
        [None, None],  # CPU training, or models spread over several devices
        [_claim("n", "cuda:0", False), _claim("n", "cuda:1", False)],  # distkit's placement
        [_claim("n", "cuda:0"), _claim("n", "cuda:1")],  # a GPU of each rank's choosing
        [_claim("n1", "cuda:0"), _claim("n2", "cuda:0")],  # the same index on two hosts
        # per-rank CUDA_VISIBLE_DEVICES: both see their own GPU as cuda:0
        [_claim("n", "cuda:0", physical="GPU-a"), _claim("n", "cuda:0", physical="GPU-b")],
    ],
)
def test_distinct_or_spread_placements_pass(claims):
    check_claims(claims)


def test_a_claim_names_the_one_accelerator_a_model_trains_on():
    assert Placement((CPU,), CPU).claim() is None  # CPU training claims nothing
    assert Placement((GPU0, GPU1), GPU0).claim() is None  # spread: left alone
    host = socket.gethostname()
    if torch.cuda.is_available():  # a GPU is known by its UUID
        uuid = str(torch.cuda.get_device_properties(0).uuid)
        assert Placement((CPU,), GPU0).claim() == Claim(host, "cuda:0", uuid, False)
        return
    # no CUDA here: a GPU is known by its name
    assert Placement((CPU,), GPU1).claim() == Claim(host, "cuda:1", "cuda:1", False)
    assert Placement((GPU2,), GPU0).claim() == Claim(host, "cuda:2", "cuda:2", True)


# ---------------------------------------------------------------- inputs and outputs
def test_output_device_finds_the_first_tensor():
    t = torch.zeros(1)
    assert output_device(t) == CPU
    assert output_device((None, {"logits": t})) == CPU
    assert output_device({"aux": [1, 2], "out": t}) == CPU
    assert output_device(["no", "tensor"]) is None and output_device(3) is None


def test_targets_follow_the_output_to_its_device():
    """No second device here: the meta device stands in for the output's GPU."""
    output = torch.zeros(2, 3, device="meta")
    target = {"labels": torch.zeros(2), "weights": [torch.ones(2)]}
    moved = follow_output(target, (output, "aux"))
    assert moved["labels"].device == META and moved["weights"][0].device == META
    assert follow_output(target, "no tensor") is target


def test_input_device_accepts_devices_strings_and_indices_and_names_bad_values():
    assert input_device_override(None) is None
    assert input_device_override("cuda:1") == GPU1 and input_device_override(GPU2) == GPU2
    assert input_device_override("cpu") == CPU
    for bad, says in ((True, "bool"), (1.5, "float"), ("gpu-one", "is not a device")):
        with pytest.raises(ConfigurationError, match=r"allowed: None, a torch\.device") as caught:
            input_device_override(bad)
        assert says in str(caught.value) and repr(bad) in str(caught.value)
    with pytest.raises(ConfigurationError, match="input_device=True"):
        distkit.Trainer("dp", input_device=True)


# ---------------------------------------------------------------- real fits on the CPU
def _data() -> TensorDataset:
    generator = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(16, 4, generator=generator), torch.randn(16, 2))


MSE = nn.functional.mse_loss


def _train(trainer: distkit.Trainer, model: nn.Module) -> None:
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), _data(), loss_fn=MSE)


def _fit(strategy: str | distkit.Strategy, model: nn.Module, **trainer_args) -> nn.Module:
    settings = {"batch_size": 4, "progress": False, **trainer_args}
    with distkit.Trainer(strategy, **settings) as trainer:
        _train(trainer, model)
    return model


def test_input_device_is_refused_for_a_model_distkit_places():
    with pytest.raises(ConfigurationError) as caught:
        _fit("dp", nn.Linear(4, 2), input_device="cpu")
    message = str(caught.value)
    assert "input_device='cpu' is for a model you placed on devices of your own" in message
    assert "this model is on cpu" in message and "Leave input_device=None" in message


def test_a_model_with_meta_parameters_fails_before_training():
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2, device="meta"))
    with pytest.raises(ConfigurationError, match="meta tensors hold no values"):
        _fit("ddp", model)
    refused = pytest.raises(ConfigurationError, match="meta tensors hold no values")
    with distkit.Trainer("dp", progress=False) as trainer, refused:
        trainer.evaluate(model, _data(), loss_fn=MSE)


def _reported_as(*devices: torch.device) -> classmethod:
    """A stand-in for ``Placement.of`` where CUDA cannot exist: every model "is" on
    ``devices``."""
    return classmethod(lambda cls, model, target: cls(devices, target))


def _fit_reporting(strategy: str, devices: tuple[torch.device, ...]) -> str:
    """Runs on every rank: a fit whose model reports ``devices`` (Placement.of stands in
    where CUDA cannot exist); the error it raised."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_placement.Placement, "of", _reported_as(*devices))
        try:
            _fit(strategy, nn.Linear(4, 2))
        except ConfigurationError as exc:
            return str(exc)
    return "trained"


def test_fsdp_refuses_a_placed_model_on_every_rank(run_on_ranks):
    """Fake: Placement.of reports two GPUs (none exist here); the refusal, its agreement over
    real gloo ranks and its message are real."""
    for message in run_on_ranks(_fit_reporting, "fsdp", (GPU0, GPU1), world_size=2):
        assert "strategy 'fsdp' cannot train a model you placed on cuda:0, cuda:1" in message


def test_dp_refuses_a_placed_model():
    """Fake: Placement.of reports two GPUs (none exist here)."""
    assert "strategy 'dp' cannot train a model you placed on cuda:0, cuda:1" in _fit_reporting(
        "dp", (GPU0, GPU1)
    )


def test_a_set_up_model_keeps_the_placement_it_was_set_up_with(monkeypatch):
    """After set-up a strategy may move parts of the model (FSDP's CPU offload: parameters on
    the CPU, buffers on the GPU); later fits and evaluations must not take that for the
    user's placement. Fake: Placement.of reports a GPU beside the CPU after the first fit."""
    model = nn.Linear(4, 2)
    with distkit.Trainer("dp", batch_size=4, progress=False) as trainer:
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        trainer.fit(model, optimizer, _data(), loss_fn=MSE)
        monkeypatch.setattr(_placement.Placement, "of", _reported_as(CPU, GPU0))
        trainer.fit(model, optimizer, _data(), loss_fn=MSE)  # not refused
        assert trainer.evaluate(model, _data(), loss_fn=MSE)["loss"] > 0
        with pytest.raises(ConfigurationError, match="strategy 'dp' cannot train"):
            trainer.evaluate(nn.Linear(4, 2), _data(), loss_fn=MSE)


@pytest.mark.filterwarnings("ignore:distkit apex:UserWarning")
def test_apex_refuses_a_placed_model(monkeypatch):
    """FAKE legacy apex (tests/support/fakes), FAKE CUDA (the strategy's CUDA check patched
    out), and Placement.of reporting two GPUs: none of them exists here."""
    import distkit.strategies.apex as apex_strategy

    monkeypatch.setattr(apex_strategy, "_require_cuda", lambda choices: None)
    with use_fake_apex("legacy"):
        message = _fit_reporting("apex", (GPU0, GPU1))
    assert "strategy 'apex' cannot train a model you placed on cuda:0, cuda:1" in message
    assert "master weights" in message


def test_ddp_ranks_that_put_their_model_on_one_gpu_all_fail_alike(run_on_ranks):
    """Fake: Placement.of reports each rank's model whole on cuda:0 (none exist here), as
    model.cuda() before Trainer() would; the claims travel in the fit's real agreement."""
    messages = run_on_ranks(_fit_reporting, "ddp", (GPU0,), world_size=2)
    assert messages[0] == messages[1]
    assert "ranks 0, 1 on host" in messages[0]
    assert "each hold their whole model on one GPU (cuda:0)" in messages[0]


def _cpu_model_trains_as_before(batch_size: int, strategy: str = "ddp") -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    _fit(strategy, model, batch_size=batch_size)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_a_model_on_the_cpu_trains_as_before(run_on_ranks):
    """A CPU model under ddp x2 is distkit's to place: the same weights as one process."""
    two = run_on_ranks(_cpu_model_trains_as_before, 4, world_size=2)
    one = run_on_ranks(_cpu_model_trains_as_before, 8, world_size=1)[0]
    for key, value in one.items():
        assert torch.allclose(two[0][key], value, atol=1e-6), key
        assert torch.equal(two[0][key], two[1][key]), key


def _train_as_placed(batch_size: int, strategy: str = "ddp") -> dict[str, object]:
    """Runs on every rank: the CPU model of the test above, reported as spread over the CPU
    and a GPU, so that fit and evaluate take the placed path (kept where it is, inputs to
    the first parameter's device, targets to the output's)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(_placement.Placement, "of", _reported_as(CPU, GPU0))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
        settings = {"batch_size": batch_size, "progress": False}
        with distkit.Trainer(strategy, **settings) as trainer:
            _train(trainer, model)
            wrapped = trainer.runtime.setups.wrapped(model)
            scores = trainer.evaluate(model, _data(), loss_fn=MSE)
    return {
        "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "device_ids": getattr(wrapped, "device_ids", "not wrapped"),
        "loss": scores["loss"],
    }


def test_the_placed_path_trains_like_the_moved_one(run_on_ranks):
    """Fake: Placement.of reports a GPU beside the CPU (none exists here), so the placed
    path runs for real over 2 gloo ranks; it must give the moved model's weights."""
    placed = run_on_ranks(_train_as_placed, 4, world_size=2)
    moved = run_on_ranks(_cpu_model_trains_as_before, 4, world_size=2)[0]
    for result in placed:
        assert result["device_ids"] is None  # DDP wrapped it without device_ids
        for key, value in moved.items():
            assert torch.equal(result["state"][key], value), key
    assert placed[0]["loss"] == placed[1]["loss"] > 0.0


@needs("horovod")
def test_horovod_keeps_a_placed_model_and_trains_like_the_moved_one(tmp_path):
    """Fake: Placement.of reports a GPU beside the CPU (none exists here); horovodrun -np 2
    over Gloo, Horovod's broadcast and all-reduce are real."""
    calls = [
        ("tests.strategies.test_placement", "_train_as_placed", (4, "horovod"), {}),
        ("tests.strategies.test_placement", "_cpu_model_trains_as_before", (4, "horovod"), {}),
    ]
    results = run_with_horovodrun(calls, tmp_path, np=2, timeout=170)
    for placed, moved in results:
        assert not isinstance(placed, RankError), placed
        assert not isinstance(moved, RankError), moved
        for key, value in moved.items():
            assert torch.equal(placed["state"][key], value), key
    assert results[0][0]["loss"] == results[1][0]["loss"] > 0.0


# ---------------------------------------------------------------- two GPUs (seed 003)
class ToyMpModel(nn.Module):
    """Seed 003's model: ``net1`` on one device, ``net2`` on another; forward moves between."""

    def __init__(self, dev0: torch.device, dev1: torch.device) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dev0, self.dev1 = dev0, dev1
        self.net1 = nn.Linear(4, 10).to(dev0)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 2).to(dev1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x.to(self.dev0))).to(self.dev1))


def _seed3_on_two_gpus(backend: str, checkpoint_dir: str) -> dict[str, object]:
    """Runs on every rank: seed 003's placement (rank r: cuda:2r % n and cuda:2r+1 % n),
    two epochs, a checkpoint, then a resume into a fresh placed model."""
    n = torch.cuda.device_count()
    rank = int(os.environ["RANK"])
    dev0, dev1 = torch.device("cuda", 2 * rank % n), torch.device("cuda", (2 * rank + 1) % n)
    model = ToyMpModel(dev0, dev1)
    settings = {"max_epochs": 2, "checkpoint_dir": checkpoint_dir}
    strategy = distkit.DDPStrategy(backend=backend)
    with distkit.Trainer(strategy, batch_size=4, progress=False, **settings) as trainer:
        _train(trainer, model)
        scores = trainer.evaluate(model, _data(), loss_fn=MSE)
        stored = trainer.full_state_dict()
    fresh = ToyMpModel(dev0, dev1)  # the checkpoint goes back onto dev0 and dev1
    _fit(distkit.DDPStrategy(backend=backend), fresh, **settings, resume="auto")
    return {
        "devices": [str(p.device) for p in model.parameters()],
        "fresh devices": [str(p.device) for p in fresh.parameters()],
        "state": {k: v.cpu() for k, v in model.state_dict().items()},
        "fresh": {k: v.cpu() for k, v in fresh.state_dict().items()},
        "stored on": sorted({str(v.device) for v in stored.values()}),
        "loss": scores["loss"],
    }


def _reference_on_cpu() -> dict[str, torch.Tensor]:
    model = ToyMpModel(CPU, CPU)
    _fit("ddp", model, max_epochs=2)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@needs("2 gpus", because="seed 003 puts net1 and net2 on different GPUs")
@pytest.mark.parametrize("backend", ["gloo", "nccl"])
def test_seed3_model_split_over_two_gpus_trains_under_ddp(backend, run_on_ranks, tmp_path):
    if backend == "nccl" and torch.cuda.device_count() < 4:
        pytest.skip("needs 4 CUDA GPUs: NCCL refuses two ranks on one GPU (2 ranks x 2 GPUs)")
    results = run_on_ranks(
        functools.partial(_seed3_on_two_gpus, backend, str(tmp_path)), world_size=2
    )
    reference = run_on_ranks(_reference_on_cpu, world_size=2)[0]
    for result in results:
        assert result["devices"][:2] != result["devices"][2:]  # net1 and net2 stayed apart
        assert result["fresh devices"] == result["devices"]  # restored onto the placement
        assert result["stored on"] == ["cpu"]
        for key, value in reference.items():
            assert torch.allclose(result["state"][key], value, atol=1e-5), key
            assert torch.equal(result["fresh"][key], result["state"][key]), key


def test_optimizer_state_follows_its_parameters_to_their_device():
    """torch's load_state_dict puts optimizer state where each parameter is at load time, and
    model.to() moves parameters but not optimizer state: a checkpoint loaded before the set-up
    moved the model to a GPU left the state on the CPU, and the first step failed (found on
    an H200). The set-up now moves the state after the parameters; here the parameters' other
    device is ``meta``, the only one besides the CPU on a machine without a GPU."""
    from distkit.strategies._placement import state_follows_parameters

    param = torch.nn.Parameter(torch.empty(3, device="meta"))
    fused = torch.nn.Parameter(torch.empty(2, device="meta"))
    optimizer = torch.optim.Adam([{"params": [param]}, {"params": [fused], "capturable": True}])
    for p in (param, fused):
        optimizer.state[p] = {"step": torch.tensor(4.0), "exp_avg": torch.zeros(p.shape)}
    state_follows_parameters(optimizer)
    assert optimizer.state[param]["exp_avg"].device.type == "meta"
    assert optimizer.state[param]["step"].device.type == "cpu"  # torch keeps it on the host
    assert optimizer.state[fused]["step"].device.type == "meta"  # capturable: with the param
    assert optimizer.state[fused]["exp_avg"].device.type == "meta"
