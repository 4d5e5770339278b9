"""The five posts of ``shared/seeds`` kept as their own loops over the Runtime (issue 44, item
7): each seed's loop shape with the distkit lines ``docs/hand-written.md`` shows, on small
synthetic data in float64, at two ranks against one process with the same global batch.

- 000 (apex, DeepLab on ADE20K): sync BatchNorm, SGD with momentum and weight decay, a
  DataLoader with its own collate_fn handed to ``rt.loader``, mean IoU over the whole
  validation set, a save every epoch with the loader's place. Its apex lines (amp, apex DDP)
  need CUDA: on CPU they run against the fake apex in ``test_user_loop_apex.py``; here the
  loop runs on ddp, the backend the same lines choose without apex.
- 001 (DDP, multi-task segmentation): a head the forward never uses
  (``find_unused_parameters=True``), sync BatchNorm, a BiSeNet-style warm-up + poly LR written
  into ``param_groups`` and ``defaults``, logging on ``rt.is_main``, ``torch.load(file)["model"]``
  with the module's own keys, and a resume that continues exactly.
- 002 (Horovod, MNIST): tqdm on rank 0, a per-epoch running loss and accuracy, evaluation over
  every test sample once; on horovod (horovodrun) and on torchrun's ddp.
- 003 (the DDP tutorial): ToyModel, MSE, a checkpoint saved and loaded on every rank between
  two phases, a collective timeout.
- 004 (AMP, DataParallel, DDP): the same script with ``--strategy dp`` in one process and
  ``--strategy ddp`` at two ranks, ``loader.batch_size`` read to size its logging.

The losses are batch means of per-sample means (cross-entropy over equal-size images, MSE),
the condition under which N ranks equal one process (``docs/runtime.md``).
Real gloo processes.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import distkit
from tests.support import exactness
from tests.support.gates import needs
from tests.support.horovod_runner import run_with_horovodrun
from tests.support.workloads import max_abs_diff

pytestmark = pytest.mark.timeout(300)
DT = exactness.DTYPE


def _images(n: int, classes: int, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 3, 6, 6, generator=g, dtype=DT)
    y = torch.randint(0, classes, (n, 6, 6), generator=g)
    return TensorDataset(x, y)


def _segmenter(classes: int, extra_head: bool = False) -> nn.Module:
    class Seg(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
            self.head = nn.Conv2d(8, classes, 1)
            if extra_head:  # a task head this run does not train: DDP must be told
                self.edge = nn.Conv2d(8, 1, 1)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.head(self.body(x))

    return Seg().to(DT)


def _collate(batch: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    images, masks = zip(*batch, strict=True)  # the post's dataset.collate_fn
    return torch.stack(images), torch.stack(masks)


# ---------------------------------------------------------------- seed 000
def seed_000(folder: str, global_batch: int) -> dict[str, Any]:
    train_dataset, valid_dataset = _images(27, 4, 0), _images(11, 4, 1)
    rt = distkit.Runtime("ddp", sync_batchnorm=True, seed=3)
    with rt:
        model = _segmenter(4)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-4)
        model, optimizer = rt.setup(model, optimizer)
        per_rank = global_batch // rt.world_size
        train_loader = rt.loader(
            DataLoader(train_dataset, batch_size=per_rank, shuffle=True, collate_fn=_collate)
        )
        loss_fn = nn.CrossEntropyLoss()
        ious = []
        for i in range(2):
            model.train()
            for image, gt in train_loader:
                optimizer.zero_grad()
                loss = loss_fn(model(image), gt)
                rt.backward(loss)
                optimizer.step()
            scores = rt.evaluate(
                model, valid_dataset, loss_fn=loss_fn, metrics={"seg": distkit.MeanIoU(4)},
                batch_size=per_rank,
            )  # fmt: skip
            ious.append(scores["seg_miou"])
            state = {"model": model, "optimizer": optimizer, "loader": train_loader, "epoch": i}
            rt.save(os.path.join(folder, "seg.pt"), state)
        return {"state": rt.full_state_dict(model), "ious": ious}


# ---------------------------------------------------------------- seed 001
def _warmup_poly(optimizer: torch.optim.Optimizer, step: int, lr0: float, total: int) -> None:
    """BiSeNet's WarmupPolyLrScheduler, as the post writes it into the optimizer."""
    warm = 2
    lr = lr0 * (step + 1) / warm if step < warm else lr0 * (1 - (step - warm) / total) ** 0.9
    optimizer.defaults["lr"] = lr
    for group in optimizer.param_groups:
        group["lr"] = lr


def seed_001(folder: str, global_batch: int, epochs: tuple[int, int]) -> dict[str, Any]:
    """Epochs ``epochs[0]`` up to ``epochs[1]``; resumed from ``folder``'s file after 0."""
    dataset = _images(25, 3, 2)
    path = os.path.join(folder, "multitask.pt")
    logged: list[str] = []
    with distkit.Runtime("ddp", sync_batchnorm=True, find_unused_parameters=True, seed=5) as rt:
        model = _segmenter(3, extra_head=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model, optimizer = rt.setup(model, optimizer)
        loader = rt.loader(dataset, batch_size=global_batch // rt.world_size)
        step = 0
        if epochs[0] > 0:
            step = rt.load(path, {"model": model, "optimizer": optimizer, "loader": loader})["step"]
        for epoch in range(*epochs):
            loader.sampler.set_epoch(epoch)
            for x, y in loader:
                _warmup_poly(optimizer, step, 0.05, total=20)
                loss = nn.functional.cross_entropy(model(x), y)
                optimizer.zero_grad()
                rt.backward(loss)
                optimizer.step()
                step += 1
                if rt.is_main:  # the post logs rank 0's own loss: its share, not the batch's
                    logged.append(f"{epoch} {step} {optimizer.param_groups[0]['lr']:.6f}")
            rt.save(path, {"model": model, "optimizer": optimizer, "loader": loader, "step": step})
        weights = torch.load(path, weights_only=True)["model"]  # the post's model.module keys
        return {"state": rt.full_state_dict(model), "file": weights, "logged": logged,
                "lr": optimizer.defaults["lr"]}  # fmt: skip


# ---------------------------------------------------------------- seed 002
def seed_002(strategy: str, global_batch: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(7)
    train_dataset = TensorDataset(torch.randn(30, 1, 4, 4, generator=g, dtype=DT),
                                  torch.randint(0, 5, (30,), generator=g))  # fmt: skip
    test_dataset = TensorDataset(torch.randn(13, 1, 4, 4, generator=g, dtype=DT),
                                 torch.randint(0, 5, (13,), generator=g))  # fmt: skip
    import tqdm

    with distkit.Runtime(strategy, seed=1) as rt:
        train_loader = rt.loader(train_dataset, batch_size=global_batch // rt.world_size)
        model = nn.Sequential(nn.Flatten(), nn.Linear(16, 12), nn.ReLU(), nn.Linear(12, 5)).to(DT)
        optimizer = torch.optim.Adam(params=model.parameters(), lr=1e-2)
        model, optimizer = rt.setup(model, optimizer)
        criterion = nn.CrossEntropyLoss()
        epochs = []
        for _epoch in range(2):
            loss, acc = 0.0, 0.0
            model.train()
            for data, target in tqdm.tqdm(train_loader, disable=not rt.is_main):
                optimizer.zero_grad()
                logits = model(data)
                step_loss = criterion(logits, target)
                rt.backward(step_loss)
                optimizer.step()
                pred = torch.argmax(logits, axis=1)
                acc += pred.eq(target).sum().item() / data.shape[0]
                loss += step_loss.item()
            scores = rt.evaluate(model, test_dataset, loss_fn=criterion,
                                 metrics={"acc": distkit.Accuracy()})  # fmt: skip
            epochs.append(scores)
        return {"state": rt.full_state_dict(model), "scores": epochs, "steps": len(train_loader)}


# ---------------------------------------------------------------- seed 003
class ToyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


def seed_003(folder: str, global_batch: int) -> dict[str, Any]:
    g = torch.Generator().manual_seed(9)
    data = TensorDataset(torch.randn(20, 10, generator=g, dtype=DT),
                         torch.randn(20, 5, generator=g, dtype=DT))  # fmt: skip
    path = os.path.join(folder, "toy.pt")
    with distkit.Runtime("ddp", collective_timeout=120, seed=2) as rt:
        model = ToyModel().to(DT)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
        model, optimizer = rt.setup(model, optimizer)
        loader = rt.loader(data, batch_size=global_batch // rt.world_size)
        loss_fn = nn.MSELoss()

        def epoch() -> None:
            for x, y in loader:
                optimizer.zero_grad()
                rt.backward(loss_fn(model(x), y))
                optimizer.step()

        epoch()
        rt.save(path, {"model": model, "optimizer": optimizer})  # rank 0 writes; all wait
        saved = rt.full_state_dict(model)
        epoch()  # trained on past the save, then rewound to it, as the tutorial loads
        rt.load(path, {"model": model, "optimizer": optimizer})
        rewound = rt.full_state_dict(model)
        epoch()
        return {"state": rt.full_state_dict(model), "rewound": max_abs_diff(saved, rewound)}


# ---------------------------------------------------------------- seed 004
def seed_004(strategy: str, global_batch: int) -> dict[str, Any]:
    """``python train.py --strategy dp`` or ``torchrun ... train.py --strategy ddp``."""
    dataset = _images(22, 3, 4)
    with distkit.Runtime(strategy, sync_batchnorm=True, find_unused_parameters=True,
                         seed=8) as rt:  # fmt: skip
        model = _segmenter(3, extra_head=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = rt.setup(model, optimizer)
        loader = rt.loader(dataset, batch_size=global_batch // rt.world_size, drop_last=False)
        log_every = max(1, len(loader.dataset) // (loader.batch_size * rt.world_size) // 2)
        lines = []
        for epoch in range(2):
            for i, (x, y) in enumerate(loader):
                optimizer.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                rt.backward(loss)
                optimizer.step()
                if i % log_every == 0:
                    lines.append((epoch, i))
        return {"state": rt.full_state_dict(model), "lines": lines}


# ---------------------------------------------------------------- the tests
def _agree(one: dict[str, Any], ranks: list[dict[str, Any]]) -> None:
    for rank in ranks:
        assert max_abs_diff(rank["state"], one["state"]) <= exactness.TOL


def test_seed_000_segmentation_loop_at_two_ranks_equals_one_process(run_on_ranks, tmp_path):
    one = run_on_ranks(seed_000, str(tmp_path / "one"), 6, world_size=1)[0]
    two = run_on_ranks(seed_000, str(tmp_path / "two"), 6, world_size=2)
    _agree(one, two)
    for rank in two:  # one confusion matrix over every validation image, not a per-rank mean
        assert rank["ious"] == pytest.approx(one["ious"], abs=1e-12)


def test_seed_001_multitask_loop_with_warmup_and_resume_equals_one_process(run_on_ranks, tmp_path):
    whole = run_on_ranks(seed_001, str(tmp_path / "whole"), 6, (0, 3), world_size=1)[0]
    folder = str(tmp_path / "two")
    run_on_ranks(seed_001, folder, 6, (0, 1), world_size=2)
    resumed = run_on_ranks(seed_001, folder, 6, (1, 3), world_size=2)
    _agree(whole, resumed)
    for rank in resumed:
        assert rank["lr"] == whole["lr"]
        assert set(rank["file"]) == set(whole["state"])  # no "module." prefix
        assert max_abs_diff(rank["file"], whole["state"]) <= exactness.TOL
    assert resumed[0]["logged"] == whole["logged"][-len(resumed[0]["logged"]) :]
    assert resumed[1]["logged"] == []  # logging on rank 0 only


@pytest.mark.parametrize("strategy", ["ddp", pytest.param("horovod", marks=[
    pytest.mark.horovod, needs("horovod")])])  # fmt: skip
def test_seed_002_mnist_loop_equals_one_process(run_on_ranks, tmp_path, strategy):
    one = run_on_ranks(seed_002, "ddp", 8, world_size=1)[0]
    if strategy == "horovod":
        calls = [("tests.runtime.test_seed_ports", "seed_002", ("horovod", 8), {})]
        two = [results[0] for results in run_with_horovodrun(calls, tmp_path)]
    else:
        two = run_on_ranks(seed_002, strategy, 8, world_size=2)
    _agree(one, two)
    for rank in two:  # the test set once, over both ranks
        for got, want in zip(rank["scores"], one["scores"], strict=True):
            assert got == pytest.approx(want, abs=1e-12)
        assert rank["steps"] == one["steps"] == 4


def test_seed_003_tutorial_save_and_load_on_every_rank_equals_one_process(run_on_ranks, tmp_path):
    one = run_on_ranks(seed_003, str(tmp_path / "one"), 4, world_size=1)[0]
    two = run_on_ranks(seed_003, str(tmp_path / "two"), 4, world_size=2)
    _agree(one, two)
    assert one["rewound"] == 0.0 and all(rank["rewound"] == 0.0 for rank in two)


def test_seed_004_same_script_dp_in_one_process_and_ddp_at_two_ranks_agree(run_on_ranks):
    one = run_on_ranks(seed_004, "dp", 6, world_size=1)[0]
    two = run_on_ranks(seed_004, "ddp", 6, world_size=2)
    _agree(one, two)
    for rank in two:  # loader.batch_size is the rank's 3, so it logs at the same steps
        assert rank["lines"] == one["lines"]
