"""One checkpoint layout: every entry's state at the top level under its name, distkit's
records under "distkit", for the Trainer's files and rt.save's alike, so
``torch.load(path)["model"]`` is the model's weights whoever wrote the file. rt.load reads a
Trainer's checkpoint; files of the first layout still load, saying so once."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import distkit
from distkit import checkpoint as ckpt
from distkit.errors import CheckpointError, ConfigurationError
from tests.support.workloads import make_dataset, make_mlp


def _loop_file(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    with distkit.Runtime("dp", seed=0) as rt:
        model = make_mlp()
        model, optimizer = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))
        loader = rt.loader(make_dataset(12), batch_size=4)
        for x, y in loader:
            rt.backward(nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            break
        rt.save(path, {"model": model, "optimizer": optimizer, "loader": loader, "step": 1})
        return model.state_dict(), optimizer.state_dict()


def test_rt_saves_entries_sit_at_the_top_with_distkits_records_apart(tmp_path):
    path = tmp_path / "loop.pt"
    weights, optim = _loop_file(path)
    raw = torch.load(path, weights_only=True)
    assert sorted(raw) == ["distkit", "loader", "model", "optimizer", "step"]
    for name, tensor in weights.items():
        assert torch.equal(raw["model"][name], tensor)
    fresh = make_mlp()
    fresh.load_state_dict(raw["model"])  # the weights without distkit
    assert raw["optimizer"]["param_groups"][0]["lr"] == optim["param_groups"][0]["lr"]
    assert raw["loader"] == {"epoch": 0, "position": 4} and raw["step"] == 1
    records = raw["distkit"]
    assert records["format"] == ckpt.FORMAT and records["version"] == ckpt.VERSION == 2
    assert records["kinds"] == {"model": "model", "optimizer": "optimizer",
                                "loader": "loader", "step": "value"}  # fmt: skip
    assert {"producer", "scaler", "ranks", "integrity"} <= set(records)


def test_a_trainers_checkpoint_has_the_same_layout_and_rt_load_reads_it(tmp_path):
    trainer = distkit.Trainer("dp", max_epochs=1, batch_size=4, progress=False,
                              checkpoint_dir=tmp_path, seed=0)  # fmt: skip
    model = make_mlp()
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), make_dataset(12),
                nn.functional.cross_entropy)  # fmt: skip
    trainer.close()
    (path,) = sorted(tmp_path.glob("step-*.pt"))
    raw = torch.load(path, weights_only=True)
    assert {"model", "optimizer", "scheduler", "progress", "distkit"} <= set(raw)
    assert not {"format", "producer", "scaler", "ranks"} & set(raw)  # records only apart
    assert raw["distkit"]["format"] == ckpt.FORMAT and "kinds" not in raw["distkit"]
    for name, tensor in model.state_dict().items():
        assert torch.equal(raw["model"][name], tensor)
    with distkit.Runtime("dp", seed=0) as rt:
        other = make_mlp(seed=5)
        other, optimizer = rt.setup(other, torch.optim.SGD(other.parameters(), lr=0.1))
        rest = rt.load(path, {"model": other, "optimizer": optimizer})
        assert rest["progress"]["global_step"] == 3
        for name, tensor in model.state_dict().items():
            assert torch.equal(other.state_dict()[name], tensor)


def test_the_first_layouts_files_still_load_saying_so_once(tmp_path):
    path = tmp_path / "loop.pt"
    _loop_file(path)
    raw = torch.load(path, weights_only=True)
    records = raw.pop("distkit")
    records.pop("integrity")
    kinds, ranks = records.pop("kinds"), records.pop("ranks")
    old = {**records, "version": 1, "runtime": {"kinds": kinds, "entries": raw, "ranks": ranks}}
    old_path = tmp_path / "old.pt"
    torch.save(old, old_path)  # what an earlier rt.save wrote (no digest either)
    with distkit.Runtime("dp", seed=0) as rt:
        model = make_mlp(seed=9)
        model, optimizer = rt.setup(model, torch.optim.AdamW(model.parameters(), lr=0.01))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            rest = rt.load(old_path, {"model": model, "optimizer": optimizer})
            rt.load(old_path, {"model": model})
        notes = [str(w.message) for w in caught if "first layout" in str(w.message)]
        assert len(notes) == 1 and "next save writes the current layout" in notes[0]
        assert rest == {"step": 1}
        for name, tensor in raw["model"].items():
            assert torch.equal(model.state_dict()[name], tensor)


def test_the_reserved_name_is_refused_and_a_sharded_trainer_file_names_its_reader(tmp_path):
    with distkit.Runtime("dp", seed=0) as rt, pytest.raises(ConfigurationError, match="reserved"):
        rt.save(tmp_path / "x.pt", {"distkit": 1})
    records = {"format": ckpt.FORMAT, "version": 2, "shards": "shards-x"}
    (tmp_path / "shards-x").mkdir()
    torch.save({"model": {}, "distkit": records}, tmp_path / "sharded.pt")
    with distkit.Runtime("dp", seed=0) as rt:
        model = rt.setup(make_mlp())
        with pytest.raises(CheckpointError, match=r"trainer\.load_checkpoint"):
            rt.load(tmp_path / "sharded.pt", {"model": model})
