"""rt.predict / trainer.predict: every sample's output once, in the data's order, on real gloo
processes (ddp at 3 ranks with an uneven tail, fsdp and horovod at 2), the files mode and its
reader, streams, and the refusals.

Model and data are float64 (``tests/support/exactness.py``): a rank's batch of 2 against one
batch of all the samples is the same arithmetic blocked otherwise, within 1e-9 on any CPU."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, IterableDataset

import distkit
from distkit.errors import ConfigurationError, RankDisagreementError
from tests.support.exactness import DTYPE, TOL
from tests.support.gates import needs
from tests.support.horovod_runner import run_with_horovodrun
from tests.support.workloads import make_dataset, make_mlp

pytestmark = pytest.mark.timeout(180)

N = 10  # on 3 ranks with batch 2: 4, 3 and 3 samples, each rank's last batch short
#: the model and the data every test here predicts with: float64
mlp = partial(make_mlp, dtype=DTYPE)
dataset = partial(make_dataset, dtype=DTYPE)


def _reference(n: int = N) -> torch.Tensor:
    """One process, the whole data in one batch."""
    with torch.no_grad():
        return mlp()(dataset(n).tensors[0])


class Output(collections.OrderedDict):
    """A model output like transformers' ModelOutput: an OrderedDict subclass."""


class DictModel(nn.Module):
    """Takes keyword inputs (a dict batch) and returns an :class:`Output`."""

    def __init__(self) -> None:
        super().__init__()
        self.net = mlp()

    def forward(self, x: torch.Tensor) -> Output:
        logits = self.net(x)
        return Output(logits=logits, best=logits.argmax(1))


class DictSet(Dataset):
    def __init__(self, n: int) -> None:
        self.x = dataset(n).tensors[0]

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index]}


class SampleStream(IterableDataset):
    """The data's samples, one by one, as (x, y)."""

    def __init__(self, n: int) -> None:
        self.data = dataset(n)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.data)


class BatchStream:
    """An iterable of batches of uneven sizes (3, 1, 2, 4): batch i goes to rank i % 3."""

    def __iter__(self) -> Iterator[Any]:
        x, y = dataset(N).tensors
        start = 0
        for size in (3, 1, 2, 4):
            yield x[start : start + size], y[start : start + size]
            start += size


class RankShare(IterableDataset):
    """This rank's own share of the data (4, 3, 3 samples at 3 ranks), in a ShardedStream."""

    def __init__(self, rank: int) -> None:
        self.rank = rank

    def __iter__(self) -> Iterator[Any]:
        bounds = [0, 4, 7, 10]
        x = dataset(N).tensors[0]
        return iter(x[bounds[self.rank] : bounds[self.rank + 1]])


def _stacked(outputs: list[Any]) -> torch.Tensor | None:
    return torch.stack(outputs) if outputs else None


def ddp_checks(folder: str) -> dict[str, Any]:
    """Several promises in one 3-rank run (a run starts in ~1 s; each predict in ms)."""
    out: dict[str, Any] = {}
    # (its one training step takes the whole data on every rank, meant so)
    with distkit.Runtime("ddp", same_data_on_every_rank=True) as rt:
        model, data = mlp(), dataset(N)
        out["all"] = _stacked(rt.predict(model, data, batch_size=2))
        out["training after"] = model.training
        out["main"] = _stacked(rt.predict(model, data, gather="main", batch_size=2))
        written = rt.predict(model, data, gather=None, write_to=folder, batch_size=2)
        out["written"] = written
        out["files"] = sorted(p.name for p in Path(folder).iterdir())
        dicts = rt.predict(DictModel(), DictSet(N), batch_size=2)
        out["dict types"] = {type(d).__name__ for d in dicts}
        out["dict logits"] = torch.stack([d["logits"] for d in dicts])
        out["dict best"] = [int(d["best"]) for d in dicts]
        out["stream"] = _stacked(rt.predict(model, SampleStream(N), batch_size=2))
        out["batch stream"] = _stacked(rt.predict(model, BatchStream()))
        sharded = distkit.ShardedStream(RankShare(rt.rank))
        out["sharded stream"] = _stacked(rt.predict(model, sharded, batch_size=2))
        # a set-up model (its .module is the user's), after a training step
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        set_up, optimizer = rt.setup(model, optimizer)
        x, y = data.tensors
        rt.backward(nn.functional.cross_entropy(set_up(x), y))
        optimizer.step()
        out["set up"] = _stacked(rt.predict(set_up, data, batch_size=2))
        out["trained state"] = rt.full_state_dict(model)

        # an output that is not per sample on rank 1 only: every rank raises, none hangs
        def rank_one_sums(module: nn.Module, batch: Any) -> Any:
            logits = module(batch[0])
            return logits.sum(0) if rt.rank == 1 else logits

        try:
            rt.predict(model, data, predict_fn=rank_one_sums, batch_size=2)
        except ConfigurationError as exc:
            out["refused"] = str(exc)
        out["after refusal"] = _stacked(rt.predict(model, data, batch_size=2))
        # predict on some ranks only fails on every rank, naming the calls
        try:
            if rt.rank == 0:
                rt.predict(model, data, batch_size=2)
            else:
                rt.barrier()
        except RankDisagreementError as exc:
            out["some ranks"] = str(exc)
    return out


def test_predict_on_three_ddp_ranks_returns_every_sample_once_in_order(run_on_ranks, tmp_path):
    ranks = run_on_ranks(ddp_checks, str(tmp_path), world_size=3)
    expected = _reference()
    for rank, got in enumerate(ranks):
        assert got["all"].shape == (N, 3)
        torch.testing.assert_close(got["all"], expected, atol=TOL, rtol=0)
        assert got["training after"] is True  # the model's mode restored
        if rank == 0:
            torch.testing.assert_close(got["main"], expected, atol=TOL, rtol=0)
        else:
            assert got["main"] is None  # the others return an empty list
        assert got["written"] == []
        assert got["files"] == [f"predictions.rank{r:05d}-of-00003.pt" for r in range(3)]
        assert got["dict types"] == {"Output"}  # the output's type, per sample
        torch.testing.assert_close(got["dict logits"], expected, atol=TOL, rtol=0)
        assert got["dict best"] == expected.argmax(1).tolist()
        for stream in ("stream", "batch stream", "sharded stream"):
            torch.testing.assert_close(got[stream], expected, atol=TOL, rtol=0, msg=stream)
        assert "rank 1" in got["refused"] and "shape (3,)" in got["refused"]
        assert "different calls" in got["some ranks"] and "predict" in got["some ranks"]
    # the set-up model predicts with its trained weights
    trained = mlp()
    trained.load_state_dict(ranks[0]["trained state"])
    with torch.no_grad():
        after = trained(dataset(N).tensors[0])
    assert (after - expected).abs().max() > 1e-3  # the step changed the outputs
    for got in ranks:
        torch.testing.assert_close(got["set up"], after, atol=TOL, rtol=0)
        # a refused output left no collective behind: the next predict works
        torch.testing.assert_close(got["after refusal"], after, atol=TOL, rtol=0)
    # the files mode: the reader merges the three ranks' files in the data's order
    read = distkit.read_predictions(tmp_path)
    torch.testing.assert_close(torch.stack(read), expected, atol=TOL, rtol=0)


def fsdp_predict(n: int) -> dict[str, Any]:
    """5 samples, batch 2 at 2 ranks: rank 0 has 2 batches, rank 1 one and a spare pass."""
    with distkit.Runtime("fsdp") as rt:
        model = mlp()
        set_up, _ = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        data = dataset(n)
        return {
            "all": torch.stack(rt.predict(set_up, data, batch_size=2)),
            "main": rt.predict(set_up, data, gather="main", batch_size=2),
            "stream": torch.stack(rt.predict(set_up, SampleStream(n), batch_size=2)),
        }


def test_predict_on_fsdp_runs_every_forward_pass_and_returns_every_sample(run_on_ranks):
    ranks = run_on_ranks(fsdp_predict, 5, world_size=2)
    expected = _reference(5)
    for rank, got in enumerate(ranks):
        torch.testing.assert_close(got["all"], expected, atol=TOL, rtol=0)
        torch.testing.assert_close(got["stream"], expected, atol=TOL, rtol=0)
        assert (len(got["main"]) == 5) if rank == 0 else got["main"] == []
    torch.testing.assert_close(torch.stack(ranks[0]["main"]), expected, atol=TOL, rtol=0)


def horovod_predict(n: int) -> dict[str, Any]:
    with distkit.Runtime("horovod") as rt:
        model = mlp()
        return {"all": torch.stack(rt.predict(model, dataset(n), batch_size=2))}


@needs("horovod")
def test_predict_on_horovod_returns_every_sample_in_order(tmp_path):
    calls = [("tests.runtime.test_predict", "horovod_predict", (5,), {})]
    for (result,) in run_with_horovodrun(calls, tmp_path):
        assert not isinstance(result, Exception), result
        torch.testing.assert_close(result["all"], _reference(5), atol=TOL, rtol=0)


def _loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out, y)


def trainer_predict() -> dict[str, Any]:
    trainer = distkit.Trainer("ddp", batch_size=3, max_epochs=1, progress=False)
    model = mlp()
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.5), dataset(12), _loss)
    outputs = trainer.predict(model, dataset(7))  # the trainer's batch_size: 3
    state = trainer.full_state_dict()
    trainer.close()
    return {"outputs": torch.stack(outputs), "state": state}


def test_trainer_predict_after_fit_uses_the_trained_weights(run_on_ranks):
    ranks = run_on_ranks(trainer_predict, world_size=2)
    trained = mlp()
    trained.load_state_dict(ranks[0]["state"])
    with torch.no_grad():
        expected = trained(dataset(7).tensors[0])
    assert (expected - _reference(7)).abs().max() > 1e-3  # the fit changed the outputs
    for got in ranks:
        torch.testing.assert_close(got["outputs"], expected, atol=TOL, rtol=0)


# ---------------------------------------------------------------- one process (dp)
def test_predict_on_dp_in_one_process_with_custom_predict_fn_and_namedtuples(tmp_path):
    pair = collections.namedtuple("pair", "logits probs")
    with distkit.Runtime("dp") as rt:
        model = mlp()

        def both(module: nn.Module, batch: Any) -> Any:
            logits = module(batch[0])
            return pair(logits, logits.softmax(1)), [f"s{int(t)}" for t in batch[1]]

        outputs = rt.predict(model, dataset(N), both, batch_size=4)
        rt.predict(model, dataset(N), both, None, batch_size=4, write_to=tmp_path)
    expected = _reference()
    assert len(outputs) == N and all(isinstance(o[0], pair) for o in outputs)
    torch.testing.assert_close(torch.stack([o[0].logits for o in outputs]), expected)
    torch.testing.assert_close(torch.stack([o[0].probs for o in outputs]), expected.softmax(1))
    assert [o[1] for o in outputs] == [f"s{int(t)}" for t in dataset(N).tensors[1]]
    # a file holds plain containers: the namedtuple is a tuple
    read = distkit.read_predictions(tmp_path)
    assert [type(r[0]) for r in read] == [tuple] * N
    torch.testing.assert_close(torch.stack([r[0][0] for r in read]), expected)
    assert [r[1] for r in read] == [o[1] for o in outputs]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"gather": "everyone"}, "allowed: 'all'"),
        ({"gather": 0}, "is not a gather mode"),
        ({"gather": None}, "pass write_to=folder"),
        ({"write_to": "somewhere"}, "pass gather=None"),
        ({"predict_fn": "model"}, "predict_fn must be callable"),
        ({"predict_fn": lambda m, b: m(b[0]).mean()}, "shape ()"),
        ({"predict_fn": lambda m, b: m(b[0]).T}, "shape (3, 4)"),
        ({"predict_fn": lambda m, b: {"x": m(b[0]), "step": 3}}, "output['step'] is a int"),
        ({"predict_fn": lambda m, b: (m(b[0]), ["a"])}, "a list of 1 items"),
        ({"predict_fn": lambda m, b: None}, "returned None"),
        ({"predict_fn": lambda m, b: {}}, "holds no value per sample"),
    ],
)
def test_predict_refuses_hostile_arguments_and_outputs(kwargs, message):
    with distkit.Runtime("dp") as rt, pytest.raises(ConfigurationError) as caught:
        rt.predict(mlp(), dataset(N), batch_size=4, **kwargs)
    assert message in str(caught.value)


def test_predict_refuses_batches_the_default_predict_fn_cannot_read(tmp_path):
    triples = torch.utils.data.TensorDataset(*dataset(4).tensors, torch.zeros(4))
    (tmp_path / "file").write_text("")
    with distkit.Runtime("dp") as rt:
        with pytest.raises(ConfigurationError, match="of length 3"):
            rt.predict(mlp(), triples)
        with pytest.raises(ConfigurationError, match="is a file"):
            rt.predict(mlp(), dataset(4), gather=None, write_to=tmp_path / "file")
        with pytest.raises(ConfigurationError, match="cannot hold"):
            rt.predict(
                mlp(),
                dataset(4),
                lambda m, b: [object() for _ in b[0]],
                None,
                write_to=tmp_path / "objects",
            )


def test_read_predictions_refuses_a_folder_without_every_ranks_file(tmp_path):
    with pytest.raises(ConfigurationError, match="no prediction files"):
        distkit.read_predictions(tmp_path)
    with distkit.Runtime("dp") as rt:
        rt.predict(mlp(), dataset(4), gather=None, write_to=tmp_path)
    (tmp_path / "predictions.rank00000-of-00001.pt").rename(
        tmp_path / "predictions.rank00000-of-00002.pt"
    )
    with pytest.raises(ConfigurationError, match=r"lacks the file\(s\) of rank\(s\) \[1\] of 2"):
        distkit.read_predictions(tmp_path)
