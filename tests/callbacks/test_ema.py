"""``distkit.callbacks.EMA``: averages of the weights, validated on and carried by checkpoints.

One promise per test: the averages at ddp x2 and fsdp x2 equal one process's, and a
hand-computed EMA of the trained weights; validation runs on them and gives the trained
weights back; a resumed fit (at another world size) ends with the averages of an
uninterrupted one; skipped steps leave them alone. Multi-rank cases on real gloo processes.

The fits train in float64 (``tests/support/exactness.py``), so the averages are float64 too
and every comparison holds to 1e-9 on any CPU; the fp16 case is float32 by nature.
"""

from __future__ import annotations

from functools import partial

import pytest
import torch
from torch import nn

import distkit
from distkit.callbacks import EMA, Callback
from tests.support.exactness import DTYPE, TOL
from tests.support.workloads import make_bn_model, make_dataset, make_mlp, max_abs_diff

pytestmark = pytest.mark.timeout(300)

#: fp16 (float32 model and averages) against the float64 hand EMA: the float32 rounding of
#: 5 updates, measured 3.1e-8 (2026-12-03; the float64 "32" case: 1.1e-16)
FP16_TOL = 1e-6
DECAY = 0.8  # far from 1, so that a few steps move the averages well away from the start


class WeightLog(Callback):
    """The trained weights after each step (full CPU tensors), and whether it stepped."""

    stops_training = False

    def __init__(self) -> None:
        self.steps: list[tuple[bool, dict[str, torch.Tensor]]] = []

    def on_train_step_end(self, trainer, logs):
        self.steps.append((not logs["skipped"], _params(trainer.model)))


def _params(model: nn.Module) -> dict[str, torch.Tensor]:
    out = {}
    for name, p in model.named_parameters():
        whole = p.full_tensor() if hasattr(p, "full_tensor") else p  # fsdp: a collective
        out[name] = whole.detach().cpu().clone()
    return out


def _hand_ema(start: dict[str, torch.Tensor], log: WeightLog, decay: float) -> dict:
    ema = {k: v.double() for k, v in start.items()}
    for stepped, weights in log.steps:
        if stepped:
            ema = {k: decay * ema[k] + (1 - decay) * weights[k].double() for k in ema}
    return ema


def _fit_ema(strategy, batch_size: int, *, n: int = 48, epochs: int = 1, ema=None,
             model=None, **settings) -> dict:  # fmt: skip
    ema = EMA(decay=DECAY) if ema is None else ema
    log = WeightLog()
    trainer = distkit.Trainer(strategy, batch_size=batch_size, max_epochs=epochs,
                              progress=False, callbacks=[ema, log], **settings)  # fmt: skip
    model = make_mlp(dtype=DTYPE) if model is None else model
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2, momentum=0.9)
    data = make_dataset(n, dtype=DTYPE)
    trainer.fit(model, optimizer, data, loss_fn=nn.functional.cross_entropy)
    averaged = ema.averaged_state_dict()
    out = {
        "averaged": averaged,
        "state": ema.state_dict(),
        "hand": _hand_ema(start, log, DECAY),
        "trained": _params(model),
        "stepped": [stepped for stepped, _ in log.steps],
        "updates": ema.updates,
    }
    trainer.close()
    return out


def test_ema_averages_equal_a_hand_computed_ema_of_the_trained_weights():
    run = _fit_ema("dp", 8)
    assert run["updates"] == len(run["stepped"]) == 6
    # a float64 model is averaged in float64 (float32 averages would be off by ~3e-8)
    assert {v.dtype for v in run["averaged"].values()} == {torch.float64}
    assert max_abs_diff(run["averaged"], run["hand"]) <= TOL
    assert max_abs_diff(run["averaged"], run["trained"]) > 1e-3  # it is not the weights


def test_ema_averages_at_ddp_x2_equal_one_process(run_on_ranks):
    ranks = run_on_ranks(_fit_ema, "ddp", 4, world_size=2)
    one = _fit_ema("dp", 8)
    for rank in ranks:
        assert max_abs_diff(rank["averaged"], one["averaged"]) <= TOL
        assert max_abs_diff(rank["state"]["averages"], one["state"]["averages"]) <= TOL


def test_ema_averages_at_fsdp_x2_are_sharded_and_equal_one_process(run_on_ranks):
    ranks = run_on_ranks(_fit_ema, "fsdp", 4, world_size=2)
    one = _fit_ema("dp", 8)
    for rank in ranks:
        assert max_abs_diff(rank["averaged"], one["averaged"]) <= TOL
        assert max_abs_diff(rank["state"]["averages"], one["state"]["averages"]) <= TOL
        assert max_abs_diff(rank["averaged"], rank["hand"]) <= TOL


class ValidationProbe(Callback):
    """Around each validation (after EMA's swap), what the model held."""

    stops_training = False

    def __init__(self) -> None:
        self.during: list[dict[str, torch.Tensor]] = []
        self.after: list[dict[str, torch.Tensor]] = []

    def on_validation_start(self, trainer):
        self.during.append(_params(trainer.model))

    def on_validation_end(self, trainer, metrics):
        pass


class RootBiased(nn.Module):
    """make_bn_model with a parameter of the root's own (fsdp keeps a root unit's parameters
    gathered after an evaluation forward: the swap back must still reach them)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = make_bn_model()
        self.shift = nn.Parameter(torch.zeros(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x) + self.shift


def _validated(strategy: str, batch_size: int, *, with_ema: bool = True) -> dict:
    ema, probe, log = EMA(decay=DECAY), ValidationProbe(), WeightLog()
    callbacks = [ema, probe, log] if with_ema else [log]
    trainer = distkit.Trainer(strategy, batch_size=batch_size, max_epochs=2, progress=False,
                              val_every_n_steps=2, callbacks=callbacks)  # fmt: skip
    model = RootBiased()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    val = make_dataset(20, seed=4)
    result = trainer.fit(model, optimizer, make_dataset(32), loss_fn=nn.functional.cross_entropy,
                         val_data=val, metrics={"acc": distkit.Accuracy()})  # fmt: skip
    out = {"last": result.validations[-1], "trained": _params(model)}
    if with_ema:
        # the last validation (the end of epoch 2) ran on the final averages
        averaged_model = RootBiased()
        averaged_model.load_state_dict(ema.averaged_state_dict())
        scores = trainer.evaluate(averaged_model, val, loss_fn=nn.functional.cross_entropy,
                                  metrics={"acc": distkit.Accuracy()})  # fmt: skip
        out.update(scores=scores, last_trained=log.steps[-1][1], during=probe.during[-1],
                   averaged=ema.averaged_state_dict())  # fmt: skip
    trainer.close()
    return out


def test_ema_validation_runs_on_the_averages_and_gives_the_trained_weights_back():
    run = _validated("dp", 8)
    plain = _validated("dp", 8, with_ema=False)
    assert run["last"]["val_loss"] == pytest.approx(run["scores"]["loss"], rel=1e-6)
    assert run["last"]["val_acc"] == pytest.approx(run["scores"]["acc"])
    assert run["last"]["val_loss"] != pytest.approx(plain["last"]["val_loss"], rel=1e-4)
    during = {k: run["averaged"][k] for k in run["during"]}
    assert max_abs_diff(run["during"], during) == 0.0
    # the training in between validations ran on the trained weights: as without EMA
    assert max_abs_diff(run["trained"], plain["trained"]) == 0.0


def test_ema_validation_at_fsdp_x2_runs_on_the_averages(run_on_ranks):
    ranks = run_on_ranks(_validated, "fsdp", 4, world_size=2)
    plain = run_on_ranks(partial(_validated, with_ema=False), "fsdp", 4, world_size=2)
    for rank, without in zip(ranks, plain, strict=True):
        assert rank["last"]["val_loss"] == pytest.approx(rank["scores"]["loss"], rel=1e-6)
        assert max_abs_diff(rank["trained"], without["trained"]) == 0.0


def _resumed(strategy: str, batch_size: int, folder: str, epochs: int) -> dict:
    return _fit_ema(strategy, batch_size, epochs=epochs, checkpoint_dir=folder, resume="auto")


def test_ema_resumed_at_another_world_size_ends_with_the_uninterrupted_averages(
    run_on_ranks, tmp_path
):
    whole = _fit_ema("dp", 8, epochs=2)
    run_on_ranks(partial(_resumed, epochs=1), "ddp", 4, str(tmp_path), world_size=2)
    resumed = _resumed("dp", 8, str(tmp_path), epochs=2)  # one process, from the checkpoint
    assert resumed["updates"] == whole["updates"] == 12
    assert max_abs_diff(resumed["averaged"], whole["averaged"]) <= TOL


def test_ema_resumed_from_fsdp_x2_on_one_process_equals_the_uninterrupted_fit(
    run_on_ranks, tmp_path
):
    whole = _fit_ema("dp", 8, epochs=2)
    run_on_ranks(partial(_resumed, epochs=1), "fsdp", 4, str(tmp_path), world_size=2)
    resumed = _resumed("dp", 8, str(tmp_path), epochs=2)
    assert max_abs_diff(resumed["averaged"], whole["averaged"]) <= TOL


class PoisonStep(Callback):
    """NaN gradients at step 2 (a skipped step under nonfinite="skip")."""

    stops_training = False

    def on_before_optimizer_step(self, trainer, optimizer):
        if trainer.global_step == 1:  # the step about to run is the second
            for group in optimizer.param_groups:
                for p in group["params"]:
                    p.grad.fill_(float("nan"))


def _overflowing_loss() -> object:
    """Cross-entropy, but the second call's scaled gradients overflow (an fp16 skip)."""
    calls = []

    def loss_fn(output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        calls.append(1)
        loss = nn.functional.cross_entropy(output, target)
        return loss * 1e38 if len(calls) == 2 else loss

    return loss_fn


def _skipping(precision: str) -> dict:
    ema, log = EMA(decay=DECAY), WeightLog()
    fp16 = precision == "fp16"
    callbacks = [ema, log] if fp16 else [ema, log, PoisonStep()]
    trainer = distkit.Trainer("dp", batch_size=8, max_epochs=1, progress=False,
                              nonfinite="skip", precision=precision,
                              callbacks=callbacks)  # fmt: skip
    dtype = torch.float32 if fp16 else DTYPE  # fp16 autocast lowers float32 operations only
    model = make_mlp(dtype=dtype)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    loss_fn = _overflowing_loss() if fp16 else nn.functional.cross_entropy
    trainer.fit(model, optimizer, make_dataset(48, dtype=dtype), loss_fn=loss_fn)
    return {"averaged": ema.averaged_state_dict(), "hand": _hand_ema(start, log, DECAY),
            "stepped": [s for s, _ in log.steps], "updates": ema.updates}  # fmt: skip


@pytest.mark.parametrize("precision", ["32", "fp16"], ids=["nonfinite-skip", "fp16-overflow"])
def test_ema_skipped_steps_leave_the_averages_alone(precision):
    run = _skipping(precision)
    skipped = run["stepped"].count(False)
    assert skipped == 1 and not run["stepped"][1]
    assert run["updates"] == run["stepped"].count(True)
    assert max_abs_diff(run["averaged"], run["hand"]) <= (FP16_TOL if precision == "fp16" else TOL)


@pytest.mark.parametrize("decay", [1.0, -0.1, 1.5, float("nan"), "0.9", True, None])
def test_ema_refuses_a_decay_outside_zero_to_one_naming_it(decay):
    with pytest.raises(distkit.ConfigurationError, match=r"EMA\(decay=.*\[0, 1\)"):
        EMA(decay=decay)


def test_ema_apply_at_end_leaves_the_averages_in_the_model():
    ema = EMA(decay=DECAY, apply_at_end=True)
    trainer = distkit.Trainer("dp", batch_size=8, max_epochs=1, progress=False,
                              callbacks=[ema])  # fmt: skip
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    trainer.fit(model, optimizer, make_dataset(48), loss_fn=nn.functional.cross_entropy)
    assert max_abs_diff(_params(model), dict(ema.state_dict()["averages"])) <= 1e-7


def test_ema_checkpoint_of_another_model_is_refused_naming_the_mismatch():
    ema = EMA()
    ema.load_state_dict({"updates": 3, "averages": {"0.weight": torch.zeros(2, 2)}})
    trainer = distkit.Trainer("dp", batch_size=8, max_epochs=1, progress=False,
                              callbacks=[ema])  # fmt: skip
    model = make_mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.2)
    with pytest.raises(distkit.errors.CheckpointError, match=r"0\.weight \(2, 2\)"):
        trainer.fit(model, optimizer, make_dataset(48), loss_fn=nn.functional.cross_entropy)


def test_resuming_without_the_ema_callback_says_its_averages_are_dropped(tmp_path):
    """Before: the saved averages were dropped without a word."""

    def fit(epochs: int, callbacks: list) -> None:
        model = make_mlp()
        trainer = distkit.Trainer("dp", batch_size=8, max_epochs=epochs, progress=False,
                                  checkpoint_dir=tmp_path, resume="auto",
                                  callbacks=callbacks)  # fmt: skip
        trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), make_dataset(16),
                    loss_fn=nn.functional.cross_entropy)  # fmt: skip
        trainer.close()

    fit(1, [EMA(decay=0.9)])
    with pytest.warns(UserWarning, match=r"does not have: EMA.*Pass the same callbacks"):
        fit(2, [])
