"""The large-model paths (issue 28) on one CUDA GPU, in one process (issue 30).

DeepSpeed ZeRO stages 1-3 on the GPU (NCCL, a world of one) against ddp on the same GPU,
its bf16 and fp16 (DeepSpeed's own loss scaler; a step it skips must be counted), a resume
onto the GPU, a meta-device model at stage 3, and no host read of distkit's own in its
steady steps under ``torch.cuda.set_sync_debug_mode``; FSDP2 with ``CPUOffloadPolicy``
(parameters and optimizer on the CPU, compute on the GPU) and with a ``MixedPrecisionPolicy``
in a world of one (which shards nothing, so the policy says it cannot act); activation
checkpointing on the GPU (the same weights, and a lower CUDA
memory peak in the epoch record); a meta-device model under fsdp materialised on the GPU.

Every test needs a CUDA GPU and skips without one (CI has none; ``scripts/gpu_check.sh`` runs
them in its focus step, with DeepSpeed installed from ``.gpu/deepspeed/`` when that folder is
there). What needs two GPUs (a policy on sharded units, HSDP's replicas, NCCL between ranks)
is the multi-rank tests on such a machine: docs/gpu.md.
"""

from __future__ import annotations

import traceback
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn

import distkit
from tests.runtime.test_activation_checkpointing import Block, Net
from tests.support.gates import needs
from tests.support.host_syncs import steady_syncs
from tests.support.meta_models import build
from tests.support.workloads import make_dataset, make_mlp, max_abs_diff

pytestmark = [needs("cuda"), pytest.mark.timeout(300)]

#: the same fp32 arithmetic on the same GPU through two backends
TIGHT = 1e-5
#: reduced precision against the fp32 run (a lost loss scaling or a wrong batch weighting moves
#: these weights by 5e-2 to 1e-1: ../shared/notes/deepspeed.md)
LOOSE = 5e-2
N = 21  # 8 per step, 2 accumulated: 16 + 5, an uneven last step
#: every parameter of the small models partitioned at stage 3
SMALL = {"zero_optimization": {"stage3_param_persistence_threshold": 0}}


def _deepspeed(stage: int) -> distkit.DeepSpeedStrategy:
    return distkit.DeepSpeedStrategy(stage=stage, config=SMALL)


def _fit(strategy: Any, *, model: nn.Module | None = None, epochs: int = 2, samples: int = N,
         **settings: Any) -> dict[str, Any]:  # fmt: skip
    """Two epochs of the MLP (SGD with momentum, accumulation 2, an uneven end), with the
    device every forward's output was on."""
    devices: set[str] = set()

    def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        devices.add(out.device.type)
        return nn.functional.cross_entropy(out, y)

    torch.manual_seed(0)
    options: dict[str, Any] = {"batch_size": 8, "grad_accum_steps": 2}
    options.update(settings)
    trainer = distkit.Trainer(strategy, seed=3, max_epochs=epochs, progress=False, **options)
    net = model if model is not None else make_mlp()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    try:
        result = trainer.fit(net, optimizer, make_dataset(samples), loss_fn=loss_fn,
                             val_data=make_dataset(13),
                             metrics={"acc": distkit.Accuracy()})  # fmt: skip
        state = trainer.full_state_dict()
        steps = trainer.global_step
    finally:
        trainer.close()
    return {"state": state, "history": result.history, "devices": devices, "steps": steps}


def _finite(history: list[dict[str, Any]]) -> bool:
    return all(row["train_loss"] == row["train_loss"] for row in history)


# ------------------------------------------------------------------------------- DeepSpeed
@needs("deepspeed")
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_cuda_deepspeed_fit_equals_ddp_on_the_gpu(stage):
    ddp = _fit("ddp")
    got = _fit(_deepspeed(stage))
    assert got["devices"] == ddp["devices"] == {"cuda"}
    assert got["steps"] == ddp["steps"]
    assert max_abs_diff(got["state"], ddp["state"]) <= TIGHT
    # evaluation counts every sample once, on the GPU as on the CPU
    assert got["history"][-1]["val_acc"] == ddp["history"][-1]["val_acc"]
    assert got["history"][-1]["val_loss"] == pytest.approx(ddp["history"][-1]["val_loss"], abs=1e-5)


@needs("deepspeed")
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_cuda_deepspeed_half_precision_stays_with_fp32(precision):
    """bf16: DeepSpeed's bf16 optimizer; fp16: its dynamic loss scaler (CUDA only). A step the
    scaler skips still counts in ``global_step`` (as a GradScaler's does) and is reported in
    the epoch's ``skipped_steps``; then the weights may differ by one step's update, and the
    validation loss must still agree."""
    full = _fit("ddp")
    got = _fit(_deepspeed(2), precision=precision)
    assert _finite(got["history"]), got["history"]
    assert got["steps"] == full["steps"]
    skipped = sum(int(row.get("skipped_steps", 0)) for row in got["history"])
    if precision == "bf16":
        assert skipped == 0  # no loss scaler: nothing to skip
    if skipped == 0:
        assert max_abs_diff(got["state"], full["state"]) <= LOOSE
    else:  # each skipped step of SGD with momentum moves these weights by about 0.1
        assert got["history"][-1]["val_loss"] == pytest.approx(
            full["history"][-1]["val_loss"], rel=0.05
        )


@needs("deepspeed")
@pytest.mark.parametrize("stage", [2, 3])
def test_cuda_deepspeed_resumes_onto_the_gpu_as_if_uninterrupted(stage, tmp_path):
    """The checkpoint (torch's form: full weights and SGD's momentum) is loaded before the
    engine exists and must reach DeepSpeed's partitions on the GPU."""
    whole = _fit(_deepspeed(stage))
    folder = str(tmp_path / "ckpt")
    _fit(_deepspeed(stage), checkpoint_dir=folder, max_steps=3)
    resumed = _fit(_deepspeed(stage), checkpoint_dir=folder, resume="auto")
    assert resumed["steps"] == whole["steps"]
    assert max_abs_diff(resumed["state"], whole["state"]) <= TIGHT


@needs("deepspeed")
def test_cuda_deepspeed_stage_3_meta_model_trains_like_the_normally_built_one():
    normal = _fit(_deepspeed(3), model=build("normal"))
    built = _fit(_deepspeed(3), model=build("init_empty"))
    assert built["devices"] == {"cuda"}
    assert max_abs_diff(built["state"], normal["state"]) <= 1e-6


@contextmanager
def _synchronisations(seen: list[str]) -> Iterator[None]:
    """Under ``set_sync_debug_mode("warn")``, append to ``seen`` the caller of every
    synchronising CUDA call: the innermost frame of the Python stack outside torch's files
    (and the warnings module, which calls this from the warning torch raises there)."""
    shown = warnings.showwarning

    def note(message: Any, category: Any, filename: str, lineno: int, *args: Any) -> None:
        if "synchroniz" not in str(message):
            shown(message, category, filename, lineno, *args)
            return
        frames = [
            f
            for f in traceback.extract_stack()[:-1]  # less this function
            if "/torch/" not in f.filename and f.filename != warnings.__file__
        ]
        seen.append(f"{frames[-1].filename}:{frames[-1].lineno}" if frames else "?")

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)


@needs("deepspeed")
@pytest.mark.parametrize("stage", [2, 3])
def test_cuda_deepspeed_steady_steps_add_no_synchronisation_of_distkits_own(stage):
    """DeepSpeed's engine synchronises in its own step (its gradient-norm and overflow
    checks): those are DeepSpeed's. What must not be there, between log points, is a
    synchronising call whose nearest caller is distkit's (the CPU test counts explicit reads;
    this one sees every synchronisation the GPU makes, implicit ones included)."""
    log_every = 4
    seen: list[str] = []
    spans: list[list[str]] = [[]]

    class Watch(distkit.Callback):
        stops_training = False

        def on_train_step_end(self, trainer, logs):
            spans[-1].extend(seen)
            seen.clear()
            spans.append([])

    trainer = distkit.Trainer(_deepspeed(stage), batch_size=4, max_epochs=1, progress=False,
                              log_every_n_steps=log_every, gradient_clip_norm=1.0,
                              callbacks=[Watch()])  # fmt: skip
    model = make_mlp()
    try:
        with _synchronisations(seen):
            trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.05), make_dataset(64),
                        loss_fn=nn.functional.cross_entropy)  # fmt: skip
    finally:
        trainer.close()
    assert len(spans) == 17, len(spans)  # 16 steps
    steady = steady_syncs(spans, log_every)
    assert any("/deepspeed/" in call for calls in steady.values() for call in calls), steady
    ours = {k: [c for c in calls if "/distkit/" in c] for k, calls in steady.items()}
    assert not any(ours.values()), ours


# ------------------------------------------------------------------------------------ FSDP
def _policy_bf16() -> Any:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, output_dtype=torch.float32
    )


def test_cuda_fsdp_in_a_world_of_one_says_its_policy_cannot_apply_and_autocasts_bf16():
    """One GPU is a world of one, where fsdp shards nothing and a ``MixedPrecisionPolicy``
    (it applies to sharded units) cannot act: it says so and trains in fp32, exactly as plain
    fsdp. ``precision="bf16"`` autocasts instead: near fp32, not equal to it. (The policy
    itself at two ranks: ``test_fsdp_policies.py``, on a machine with 2 GPUs.)"""
    full = _fit("fsdp")
    with pytest.warns(UserWarning, match="shards nothing"):
        policy = _fit(distkit.FSDPStrategy(mp_policy=_policy_bf16()))
    assert policy["devices"] == {"cuda"}
    assert max_abs_diff(policy["state"], full["state"]) <= TIGHT
    derived = _fit("fsdp", precision="bf16")
    assert _finite(derived["history"])
    assert 0 < max_abs_diff(derived["state"], full["state"]) <= LOOSE


def test_cuda_fsdp_cpu_offload_equals_fsdp_on_the_gpu(tmp_path):
    """``CPUOffloadPolicy`` keeps parameters, gradients and the optimizer's step on the CPU
    (pinned) and computes on the GPU: the batches go to the GPU all the same, and it ends
    where plain fsdp on the GPU ends; a checkpoint taken with it resumes exactly."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    def offloaded() -> distkit.FSDPStrategy:
        return distkit.FSDPStrategy(offload_policy=CPUOffloadPolicy())

    plain = _fit("fsdp")
    got = _fit(offloaded())
    assert got["devices"] == {"cuda"}
    assert max_abs_diff(got["state"], plain["state"]) <= TIGHT
    folder = str(tmp_path / "ckpt")
    _fit(offloaded(), checkpoint_dir=folder, max_steps=3)
    resumed = _fit(offloaded(), checkpoint_dir=folder, resume="auto")
    assert resumed["steps"] == plain["steps"]
    assert max_abs_diff(resumed["state"], plain["state"]) <= TIGHT


def test_cuda_fsdp_meta_model_is_materialised_on_the_gpu_like_the_normal_build():
    normal = _fit("fsdp", model=build("normal"))
    built = _fit("fsdp", model=build("init_empty"))
    assert built["devices"] == {"cuda"}
    assert max_abs_diff(built["state"], normal["state"]) <= 1e-6


# --------------------------------------------------------------- activation checkpointing
#: micro-batch of the wide net: its forward keeps 400 MiB for backward without checkpointing
#: (50 MiB a block: its input, tanh's output, dropout's mask and output) and 144 MiB with it
#: (each block's input), measured on the CPU with saved_tensors_hooks (unique storages,
#: parameters left out) at batch 256, times 8
WIDE_BATCH = 2048


def _wide_fit(strategy: Any, checkpointing: Any) -> dict[str, Any]:
    """A wide residual net whose saved activations outweigh a step's transients (8 blocks of
    2048x2048, dropout in each), one epoch of two steps."""
    torch.manual_seed(0)
    model = Net(width=2048, depth=8)
    return _fit(strategy, model=model, epochs=1, samples=2 * WIDE_BATCH, batch_size=WIDE_BATCH,
                grad_accum_steps=1, activation_checkpointing=checkpointing)  # fmt: skip


@pytest.mark.parametrize(
    "strategy", ["ddp", "fsdp", pytest.param("deepspeed3", marks=needs("deepspeed"))]
)
def test_cuda_activation_checkpointing_same_weights_and_a_lower_memory_peak(strategy):
    """Recomputed blocks draw the same dropout masks on the GPU (torch stashes the CUDA random
    state): the same weights. And the CUDA peak the epoch record reports (``peak_mem_mib``,
    from ``max_memory_allocated``) drops: by the 256 MiB of activations no longer kept, less
    one block's recomputation (50 MiB); asserted at 60 MiB."""

    def strategy_of() -> Any:
        return _deepspeed(3) if strategy == "deepspeed3" else strategy

    without = _wide_fit(strategy_of(), None)
    with_ = _wide_fit(strategy_of(), [Block])
    assert with_["devices"] == {"cuda"}
    assert max_abs_diff(with_["state"], without["state"]) <= 1e-6
    last_without, last_with = without["history"][-1], with_["history"][-1]
    assert "peak_reserved_mib" in last_with  # CUDA's allocator reports it
    assert last_without["peak_mem_mib"] - last_with["peak_mem_mib"] >= 60, (
        last_without["peak_mem_mib"],
        last_with["peak_mem_mib"],
    )
