"""``rt.loader(...)`` returns a ``torch.utils.data.DataLoader`` whose ``batch_size``,
``dataset``, ``sampler`` (with ``set_epoch``), ``batch_sampler``, ``num_workers``,
``drop_last`` and ``len()`` are this rank's truth: the sampler's indices are the samples the
rank loads, the ranks' shares are disjoint and cover the data, and ``set_epoch`` moves the
loader as ``DistributedSampler.set_epoch`` moves a hand-written loop (a resumed epoch kept).
Real gloo processes."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

import distkit
from distkit.errors import ConfigurationError
from tests.support.workloads import make_dataset

pytestmark = pytest.mark.timeout(300)
N = 21  # global batches of 8: 8 + 8 + 5, the last split 3 + 2 over two ranks


class Indexed(Dataset[torch.Tensor]):
    """Sample i is the number i (so a batch says which samples it holds)."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(i)


def _loaded(loader: Any) -> list[list[int]]:
    return [batch.tolist() for batch in loader]


def what_each_rank_sees(batch: int, num_workers: int) -> dict[str, Any]:
    dataset = Indexed()
    with distkit.Runtime("ddp", seed=5) as rt:
        loader = rt.loader(dataset, batch_size=batch, num_workers=num_workers)
        facts = {
            "is_loader": isinstance(loader, DataLoader),
            "batch_size": loader.batch_size,
            "dataset": loader.dataset is dataset,
            "len": len(loader),
            "num_workers": loader.num_workers,
            "drop_last": loader.drop_last,
            "sampler_len": len(loader.sampler),
            "sampler": list(loader.sampler),
            "batch_sampler": list(loader.batch_sampler),
            "batch_sampler_len": len(loader.batch_sampler),
        }
        facts["epoch_0"] = _loaded(loader)
        facts["sampler_after"] = list(loader.sampler)  # the next epoch's: epoch 1
        facts["epoch_1"] = _loaded(loader)
        # a hand loop's set_epoch: the epoch it names, whatever the loader did before
        by_set_epoch = {}
        for epoch in (3, 3, 1):
            loader.sampler.set_epoch(epoch)
            by_set_epoch.setdefault(epoch, []).append(_loaded(loader))
        facts["by_set_epoch"] = by_set_epoch
        facts["epoch_3"] = _loaded(loader.epoch(3))
        return facts


def test_the_loader_is_a_dataloader_telling_each_ranks_truth(run_on_ranks):
    num_workers = 0  # (the ranks are daemonic processes: no workers; see the test below)
    ranks = run_on_ranks(what_each_rank_sees, 4, num_workers, world_size=2)
    for rank, facts in enumerate(ranks):
        assert facts["is_loader"] and facts["dataset"]
        assert facts["batch_size"] == 4 and facts["num_workers"] == num_workers
        assert facts["drop_last"] is False
        assert facts["len"] == 3 == facts["batch_sampler_len"] == len(facts["epoch_0"])
        # what the sampler says is what the rank loads
        assert facts["batch_sampler"] == facts["epoch_0"]
        assert facts["sampler"] == [i for b in facts["epoch_0"] for i in b]
        assert facts["sampler_len"] == [11, 10][rank]  # 4 + 4 + 3, 4 + 4 + 2
        assert facts["sampler_after"] == [i for b in facts["epoch_1"] for i in b]
        assert facts["epoch_0"] != facts["epoch_1"]  # each epoch in its own order
        three, again = facts["by_set_epoch"][3]
        assert three == again == facts["epoch_3"]  # set_epoch(3) twice: epoch 3 twice
        assert facts["by_set_epoch"][1] == [facts["epoch_1"]]
    # the two ranks' shares are disjoint and cover the data, every epoch
    for key in ("epoch_0", "epoch_1", "epoch_3"):
        shares = [sorted(i for b in facts[key] for i in b) for facts in ranks]
        assert not set(shares[0]) & set(shares[1])
        assert sorted(shares[0] + shares[1]) == list(range(N))


def resumed_with_set_epoch(path: str) -> dict[str, Any]:
    """A hand loop that calls set_epoch(ep) each epoch, saved after a batch of epoch 1 and
    resumed: set_epoch(1) keeps the loader where the save left it."""
    out: dict[str, Any] = {}
    with distkit.Runtime("ddp", seed=5) as rt:
        loader = rt.loader(Indexed(), batch_size=2)
        whole = []
        for epoch in range(2):
            loader.sampler.set_epoch(epoch)
            for i, batch in enumerate(loader):
                whole.append(batch.tolist())
                if epoch == 1 and i == 0:
                    rt.save(path, {"loader": loader})
        out["whole"] = whole
    with distkit.Runtime("ddp", seed=5) as rt:
        loader = rt.loader(Indexed(), batch_size=2)
        rt.load(path, {"loader": loader})
        start = loader.current_epoch
        rest = []
        for epoch in range(start, 2):
            loader.sampler.set_epoch(epoch)
            rest.extend(batch.tolist() for batch in loader)
        out["rest"] = rest
    return out


def test_set_epoch_of_the_epoch_a_resumed_loader_is_in_keeps_its_place(run_on_ranks, tmp_path):
    for rank in run_on_ranks(resumed_with_set_epoch, str(tmp_path / "ckpt.pt"), world_size=2):
        per_epoch = 6  # 21 samples, global batch 4: 6 micro-batches an epoch
        assert rank["rest"] == rank["whole"][per_epoch + 1 :]


def test_its_attributes_are_read_only_and_a_batch_sampler_has_no_batch_size():
    with distkit.Runtime("dp", seed=0) as rt:
        loader = rt.loader(make_dataset(10), batch_size=4, drop_last=True)
        assert loader.drop_last is True and len(loader) == 2
        for name in ("batch_size", "dataset", "sampler", "drop_last"):
            with pytest.raises(ValueError, match="should not be set"):
                setattr(loader, name, None)
        given = DataLoader(make_dataset(10), batch_sampler=[[0, 1, 2], [3], [4, 5]])
        by_batches = rt.loader(given)
        assert by_batches.batch_size is None and list(by_batches.batch_sampler) == [
            [0, 1, 2], [3], [4, 5]]  # fmt: skip
        with pytest.raises(ConfigurationError, match="while the loader is being iterated"):
            for _ in loader:
                loader.sampler.set_epoch(4)
        with pytest.raises(ConfigurationError, match="integer >= 0, got -1"):
            loader.sampler.set_epoch(-1)
        with_workers = rt.loader(Indexed(), batch_size=8, num_workers=1)
        assert with_workers.num_workers == 1
        planned = list(with_workers.batch_sampler)
        assert _loaded(with_workers) == planned and len(planned) == 3


class Counting(IterableDataset[torch.Tensor]):
    def __iter__(self) -> Any:
        return iter(torch.arange(6.0).unsqueeze(1))


def test_a_streams_loader_says_what_it_can_and_why_not_the_rest():
    with distkit.Runtime("dp", seed=0) as rt:
        loader = rt.loader(Counting(), batch_size=2)
        assert isinstance(loader, DataLoader) and loader.batch_size == 2
        assert isinstance(loader.dataset, Counting)
        with pytest.raises(TypeError, match="no sample indices ahead"):
            list(loader.sampler)
        with pytest.raises(TypeError, match="length is not known"):
            len(loader)
        assert [b.tolist() for b in loader] == [[[0.0], [1.0]], [[2.0], [3.0]], [[4.0], [5.0]]]


def test_a_loader_from_rt_loader_is_not_sharded_again():
    """Sharding a rank's share again would train each rank on a part of its part."""
    with distkit.Runtime("dp", seed=0) as rt:
        loader = rt.loader(make_dataset(12), batch_size=4)
        model = rt.setup(nn.Linear(6, 3))
        loss = nn.functional.cross_entropy
        for call in (
            lambda: rt.loader(loader),
            lambda: rt.evaluate(model, loader, loss_fn=loss),
            lambda: rt.loader(rt.loader(Counting(), batch_size=2)),
        ):
            with pytest.raises(ConfigurationError, match=r"loader that rt\.loader returned"):
                call()
    trainer = distkit.Trainer("dp", max_epochs=1, progress=False)
    with distkit.Runtime("dp", seed=0) as rt:
        loader = rt.loader(TensorDataset(torch.randn(8, 6), torch.zeros(8).long()))
    net = nn.Linear(6, 3)
    with pytest.raises(ConfigurationError, match=r"loader\.dataset"):
        trainer.fit(net, torch.optim.SGD(net.parameters(), lr=0.1), loader, loss)
    trainer.close()
