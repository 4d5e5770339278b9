"""Dict batches and models that return their own loss, end to end (issue 27, part 2):
validation with fit's step_fn (or eval_step_fn), token-exact validation loss counted once
over ranks, EarlyStopping and BestCheckpoint on it, metrics that get the step's output and
the batch."""

from __future__ import annotations

from functools import partial
from typing import Any

import pytest
import torch

import distkit
from distkit.errors import ConfigurationError
from tests.lm.test_token_inputs import OwnLoss
from tests.support.token_workloads import Sequences, V, make_lm, token_step, token_sum

pytestmark = pytest.mark.timeout(300)


class TokenAccuracy(distkit.Metric):
    """Next-token accuracy over the labelled tokens: gets the logits and the dict batch."""

    def batch_state(self, output: Any, batch: Any) -> torch.Tensor:
        labels = batch["labels"]
        valid = labels != -100
        hits = (output.argmax(-1) == labels) & valid
        return torch.stack([hits.sum(), valid.sum()]).double()

    def state_shape(self) -> tuple[int, ...]:
        return (2,)

    def compute(self, state: torch.Tensor) -> float:
        hits, total = state.tolist()
        return hits / total


def eval_step(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> distkit.Loss:
    logits = model(batch["input_ids"])
    labels = batch["labels"]
    total = torch.nn.functional.cross_entropy(
        logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    return distkit.Loss(total, (labels != -100).sum(), output=logits)


def by_hand(state: dict[str, torch.Tensor], data: Sequences) -> dict[str, float]:
    """The token mean and accuracy over every token of ``data``, in one process."""
    model = make_lm()
    model.load_state_dict(state)
    with torch.no_grad():
        batch = {"input_ids": data.ids, "labels": data.labels}
        total, n = token_sum(model, batch)
        logits = model(data.ids)
    valid = data.labels != -100
    hits = ((logits.argmax(-1) == data.labels) & valid).sum()
    return {"loss": float(total / n), "acc": float(hits / valid.sum())}


def fit_validated(strategy: str, batch: int, **fit_args: Any) -> dict[str, Any]:
    trainer = distkit.Trainer(strategy, batch_size=batch, max_epochs=2, progress=False,
                              seed=1)  # fmt: skip
    model = make_lm()
    result = trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.5), Sequences(),
                         step_fn=token_step, val_data=Sequences(n=13, seed=7),
                         **fit_args)  # fmt: skip
    scores = trainer.evaluate(model, Sequences(n=13, seed=7), step_fn=eval_step,
                              metrics={"acc": TokenAccuracy()})  # fmt: skip
    state = trainer.full_state_dict()
    trainer.close()
    return {"history": result.history, "scores": scores, "state": state}


def test_validation_runs_fits_step_fn_and_counts_every_token_once_over_ranks(run_on_ranks):
    """13 validation sequences over 2 ranks (an uneven shard): val_loss is the mean over
    every labelled token, as one process computes it by hand."""
    for rank in run_on_ranks(fit_validated, "ddp", 4, world_size=2):
        expected = by_hand(rank["state"], Sequences(n=13, seed=7))
        assert rank["history"][-1]["val_loss"] == pytest.approx(expected["loss"], rel=1e-5)
        assert rank["scores"]["loss"] == pytest.approx(expected["loss"], rel=1e-5)
        assert rank["scores"]["acc"] == pytest.approx(expected["acc"], rel=1e-6)


def test_early_stopping_and_best_checkpoint_watch_a_step_fn_fits_val_loss(tmp_path):
    stop = distkit.callbacks.EarlyStopping("val_loss", patience=1)
    best = distkit.callbacks.BestCheckpoint("val_loss")
    trainer = distkit.Trainer("dp", batch_size=4, max_epochs=30, progress=False,
                              checkpoint_dir=tmp_path, callbacks=[stop, best])  # fmt: skip
    model = make_lm()
    # a step so large that the validation loss soon stops improving
    result = trainer.fit(model, torch.optim.SGD(model.parameters(), lr=8.0), Sequences(),
                         step_fn=token_step, val_data=Sequences(n=13, seed=7))  # fmt: skip
    trainer.close()
    assert result.stopped_early
    assert len(result.history) < 30
    losses = [v["val_loss"] for v in result.validations]
    assert best.kept and best.kept[0][0] == pytest.approx(min(losses))


def test_eval_step_fn_differs_from_the_training_step():
    seen = []

    def validation(model, batch):
        seen.append(len(batch["input_ids"]))
        return eval_step(model, batch)

    trainer = distkit.Trainer("dp", batch_size=4, max_epochs=1, progress=False)
    model = make_lm()
    result = trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.5), Sequences(),
                         step_fn=token_step, val_data=Sequences(n=13, seed=7),
                         eval_step_fn=validation, metrics={"acc": TokenAccuracy()})  # fmt: skip
    trainer.close()
    assert sum(seen) == 13
    assert {"val_loss", "val_acc"} <= set(result.validations[-1])


@pytest.mark.parametrize("as_dict", [True, False])
def test_a_model_that_returns_its_own_loss_evaluates_from_its_output(as_dict):
    """model(**batch) returns {"loss", "logits"} / an object with .loss: the batch means,
    weighted by samples (a mean loss cannot be token-exact: say so with distkit.Loss)."""
    trainer = distkit.Trainer("dp", batch_size=5, progress=False)
    model = OwnLoss(as_dict)
    data = Sequences(n=13, seed=7)
    scores = trainer.evaluate(model, data, step_fn=lambda m, b: m(**b))
    means = []
    for start in range(0, 13, 5):
        batch = {k: v[start : start + 5] for k, v in (("input_ids", data.ids),
                                                        ("labels", data.labels))}  # fmt: skip
        with torch.no_grad():  # on the device the evaluation moved the model to (a GPU's)
            device = next(model.lm.parameters()).device
            total, n = token_sum(model.lm, {k: v.to(device) for k, v in batch.items()})
        means.append((float(total / n.clamp(min=1)), len(batch["labels"])))
    expected = sum(m * k for m, k in means) / 13
    assert scores["loss"] == pytest.approx(expected, rel=1e-5)
    trainer.close()


def test_evaluation_step_refusals_name_the_fix():
    trainer = distkit.Trainer("dp", batch_size=4, progress=False)
    model = make_lm()
    data = Sequences(n=8)
    only_loss = partial(token_step, count="int")
    with pytest.raises(ConfigurationError, match="need the model's output"):
        trainer.evaluate(model, data, step_fn=only_loss, metrics={"acc": TokenAccuracy()})
    with pytest.raises(ConfigurationError, match="not both"):
        trainer.evaluate(model, data, loss_fn=torch.nn.functional.cross_entropy,
                         step_fn=only_loss)  # fmt: skip
    with pytest.raises(ConfigurationError, match="must be callable"):
        trainer.evaluate(model, data, step_fn="loss")
    flip = iter(range(100))

    def mixed(m, b):
        total, n = token_sum(m, b)
        return distkit.Loss(total, n) if next(flip) % 2 else total / n

    with pytest.raises(ConfigurationError, match="for some batches and a mean loss"):
        trainer.evaluate(model, data, step_fn=mixed)
    trainer.close()
