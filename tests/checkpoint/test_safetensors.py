"""Weights as safetensors in one process: rt.save_weights / trainer.save_weights write one file
or a (sharded) Hugging Face folder with equal tensors and dtypes, tied weights once, no stale
shards; distkit.load_weights reads them back and refuses what does not match, saying why.
The multi-process saves (ddp, fsdp, a transformers model): test_safetensors_ranks.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

import distkit
from distkit.checkpoint import _safetensors as st
from distkit.errors import CheckpointError, ConfigurationError
from tests.support.workloads import make_dataset, make_mlp

safetensors_torch = pytest.importorskip("safetensors.torch")

pytestmark = pytest.mark.timeout(120)


class Mixed(nn.Module):
    """fp32 and bf16 parameters, an int64 buffer, and a tensor larger than the others."""

    def __init__(self, seed: int = 3) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 4).to(torch.bfloat16)
        self.table = nn.Embedding(32, 8)
        self.register_buffer("steps", torch.arange(5, dtype=torch.int64))


class TiedLM(nn.Module):
    """An embedding and an output layer that share one weight (as GPT-2's lm_head does)."""

    def __init__(self, tie: bool = True) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.embed = nn.Embedding(12, 6)
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 12, bias=False)
        if tie:
            self.head.weight = self.embed.weight


def _read(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a file, or of a folder's files (through its index when sharded)."""
    if path.is_file():
        return safetensors_torch.load_file(str(path))
    index = path / st.INDEX_NAME
    files = set(json.loads(index.read_text())["weight_map"].values()) if index.exists() else None
    out: dict[str, torch.Tensor] = {}
    for file in sorted(files) if files else [st.WEIGHTS_NAME]:
        out.update(safetensors_torch.load_file(str(path / file)))
    return out


def _assert_same(saved: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(saved) == sorted(expected)
    for name, tensor in expected.items():
        assert saved[name].dtype == tensor.dtype, name
        assert torch.equal(saved[name], tensor.detach().cpu()), name


# ---------------------------------------------------------------- saving
def test_save_weights_one_file_holds_the_state_dict_with_its_dtypes(tmp_path):
    model = Mixed()
    with distkit.Runtime("dp") as rt:
        set_up = rt.setup(model)
        written = rt.save_weights(set_up, tmp_path / "w.safetensors", max_shard_size=10)
    assert written == [tmp_path / "w.safetensors"]  # a file is one file, whatever the size
    saved = _read(tmp_path / "w.safetensors")
    _assert_same(saved, model.state_dict())
    assert saved["b.weight"].dtype == torch.bfloat16 and saved["steps"].dtype == torch.int64
    with safetensors_torch.safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        # transformers needs format=pt; the digest is of the file's tensors
        assert f.metadata() == {"format": "pt", st.DIGEST_KEY: st.tensors_digest(saved)}
    assert [p.name for p in tmp_path.iterdir()] == ["w.safetensors"], "a temp file was left"


def test_save_weights_folder_under_the_limit_is_one_model_safetensors(tmp_path):
    model = Mixed()
    with distkit.Runtime("dp") as rt:
        written = rt.save_weights(model, tmp_path / "out")  # the user's own module works too
    assert written == [tmp_path / "out" / "model.safetensors"]
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["model.safetensors"]
    _assert_same(_read(tmp_path / "out"), model.state_dict())


def test_save_weights_shards_a_folder_at_max_shard_size_with_a_hugging_face_index(tmp_path):
    model = Mixed()
    limit = 700  # bytes: a.weight is 512, table.weight 1024 (alone, over the limit)
    with distkit.Runtime("dp") as rt:
        written = rt.save_weights(model, tmp_path / "out", max_shard_size=limit)
    index = json.loads((tmp_path / "out" / st.INDEX_NAME).read_text())
    shards = sorted({*index["weight_map"].values()})
    count = len(shards)
    assert count >= 3
    assert shards == [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
    assert [p.name for p in written] == [*shards, st.INDEX_NAME]
    assert sorted(index["weight_map"]) == sorted(model.state_dict())
    nbytes = {k: v.numel() * v.element_size() for k, v in model.state_dict().items()}
    assert index["metadata"] == {"total_size": sum(nbytes.values())}
    for shard in shards:
        names = [k for k, file in index["weight_map"].items() if file == shard]
        size = sum(nbytes[k] for k in names)
        assert size <= limit or len(names) == 1, (shard, names, size)
        with safetensors_torch.safe_open(str(tmp_path / "out" / shard), framework="pt") as f:
            assert sorted(f.keys()) == sorted(names) and f.metadata()["format"] == "pt"
    _assert_same(_read(tmp_path / "out"), model.state_dict())


def test_save_weights_removes_the_stale_weight_files_of_an_earlier_save_only(tmp_path):
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "tokenizer.json").write_text("{}")  # the user's: left alone
    model = Mixed()
    with distkit.Runtime("dp") as rt:
        rt.save_weights(model, folder, max_shard_size=300)  # many shards
        many = len(list(folder.glob("model-*-of-*.safetensors")))
        rt.save_weights(model, folder, max_shard_size=1100)  # fewer shards
        fewer = sorted(p.name for p in folder.glob("model-*.safetensors"))
        rt.save_weights(model, folder)  # one file
    assert many > len(fewer) >= 2
    assert all(name.endswith(f"-of-{len(fewer):05d}.safetensors") for name in fewer)
    assert sorted(p.name for p in folder.iterdir()) == ["model.safetensors", "tokenizer.json"]
    _assert_same(_read(folder), model.state_dict())


def test_save_weights_saves_a_tied_weight_once_and_load_weights_restores_both_names(tmp_path):
    model = TiedLM()
    with distkit.Runtime("dp") as rt:
        rt.save_weights(model, tmp_path / "tied.safetensors")
    saved = _read(tmp_path / "tied.safetensors")
    assert sorted(saved) == ["body.bias", "body.weight", "embed.weight"]  # the first name
    fresh = TiedLM()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    result = distkit.load_weights(fresh, tmp_path / "tied.safetensors")
    assert result.missing_keys == [] and result.unexpected_keys == []
    assert "head.weight" in result.loaded
    assert fresh.head.weight is fresh.embed.weight  # still tied
    _assert_same(fresh.state_dict(), model.state_dict())
    untied = TiedLM(tie=False)  # the alias is its own weight here: the file lacks it
    with pytest.raises(CheckpointError, match=r"model's head\.weight are not in the files"):
        distkit.load_weights(untied, tmp_path / "tied.safetensors")


def test_trainer_save_weights_needs_a_fit_then_saves_its_model(tmp_path):
    trainer = distkit.Trainer("dp", batch_size=8, max_epochs=1, seed=2, progress=False)
    with pytest.raises(ConfigurationError, match=r"save_weights needs a model: call fit"):
        trainer.save_weights(tmp_path / "early.safetensors")
    assert not (tmp_path / "early.safetensors").exists()
    model = make_mlp()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.5), make_dataset(32),
                loss_fn=nn.functional.cross_entropy)  # fmt: skip
    written = trainer.save_weights(tmp_path / "after")
    assert written == [tmp_path / "after" / "model.safetensors"]
    saved = _read(tmp_path / "after")
    _assert_same(saved, trainer.full_state_dict())
    assert not torch.equal(saved["0.weight"], before["0.weight"]), "the fit changed nothing"


# ---------------------------------------------------------------- loading
def test_load_weights_reads_a_sharded_folder_into_a_fresh_model(tmp_path):
    model = Mixed()
    with distkit.Runtime("dp") as rt:
        rt.save_weights(model, tmp_path / "out", max_shard_size=600)
    fresh = Mixed(seed=9)
    fresh.steps.zero_()
    assert not torch.equal(fresh.a.weight, model.a.weight)
    result = distkit.load_weights(fresh, str(tmp_path / "out"))
    assert sorted(result.loaded) == sorted(model.state_dict())
    _assert_same(fresh.state_dict(), model.state_dict())


def test_load_weights_strict_false_reports_what_does_not_match(tmp_path):
    source = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    with distkit.Runtime("dp") as rt:
        rt.save_weights(source, tmp_path / "w.safetensors")
    other = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))  # 2.* instead of 1.*
    with pytest.raises(CheckpointError) as refused:
        distkit.load_weights(other, tmp_path / "w.safetensors")
    message = str(refused.value)
    assert "model's 2.weight, 2.bias are not in the files" in message
    assert "files' 1.bias, 1.weight are not in the model" in message
    assert "strict=False" in message
    result = distkit.load_weights(other, tmp_path / "w.safetensors", strict=False)
    assert result.loaded == ["0.weight", "0.bias"]
    assert result.missing_keys == ["2.weight", "2.bias"]
    assert result.unexpected_keys == ["1.bias", "1.weight"]  # the files list names sorted
    assert torch.equal(other[0].weight, source[0].weight)


def test_load_weights_refuses_other_shapes_and_leaves_the_model_unchanged(tmp_path):
    with distkit.Runtime("dp") as rt:
        rt.save_weights(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), tmp_path / "w")
    target = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 3))
    before = {k: v.clone() for k, v in target.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"1\.weight: file \[2, 8\], model \[3, 8\]"):
        distkit.load_weights(target, tmp_path / "w", strict=False)
    for name, value in target.state_dict().items():
        assert torch.equal(value, before[name]), f"{name} changed by a refused load"


def _flip_a_data_bit(file: Path) -> None:
    data = bytearray(file.read_bytes())
    data[-3] ^= 0x10  # in the tensors' bytes (after the header), not the header
    file.write_bytes(bytes(data))


@pytest.mark.parametrize("shards", [1, 3])
def test_load_weights_refuses_a_damaged_file_before_loading_any(tmp_path, shards):
    """save_weights records a digest of each file's tensors in its metadata; before, one
    flipped bit loaded without a word. Every file is verified before any tensor is copied."""
    model = Mixed()
    with distkit.Runtime("dp") as rt:
        written = rt.save_weights(
            model, tmp_path / "w", max_shard_size=600 if shards > 1 else "1GB"
        )
    files = sorted(p for p in written if p.suffix == ".safetensors")
    assert len(files) == shards
    _flip_a_data_bit(files[-1])  # the last shard: the earlier ones would load first
    fresh = Mixed(seed=9)
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(CheckpointError, match=r"is damaged: its tensors do not match the digest"):
        distkit.load_weights(fresh, tmp_path / "w")
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())


def test_load_weights_takes_a_file_other_tools_wrote_without_a_digest(tmp_path):
    model = nn.Linear(4, 2)
    safetensors_torch.save_file(model.state_dict(), str(tmp_path / "w.safetensors"))
    fresh = nn.Linear(4, 2)
    distkit.load_weights(fresh, tmp_path / "w.safetensors")
    assert torch.equal(fresh.weight, model.weight)


def test_load_weights_refuses_integer_tensors_for_float_weights(tmp_path):
    """torch's load_state_dict casts an int64 tensor into a float parameter without a word."""
    ids = {"weight": torch.arange(8).reshape(2, 4), "bias": torch.zeros(2)}
    safetensors_torch.save_file(ids, str(tmp_path / "w.safetensors"))
    fresh = nn.Linear(4, 2)
    with pytest.raises(CheckpointError, match=r"weight: file I64, model torch.float32"):
        distkit.load_weights(fresh, tmp_path / "w.safetensors")


def test_load_weights_refuses_paths_it_cannot_read_saying_what_is_allowed(tmp_path):
    model = make_mlp()
    with pytest.raises(CheckpointError, match=r"no such file: .*nothing\.safetensors"):
        distkit.load_weights(model, tmp_path / "nothing.safetensors")
    with pytest.raises(CheckpointError, match=r"no such file or folder: .*nowhere"):
        distkit.load_weights(model, tmp_path / "nowhere")
    torch.save(model.state_dict(), tmp_path / "w.pt")
    with pytest.raises(CheckpointError, match=r"reads safetensors files .*torch\.load"):
        distkit.load_weights(model, tmp_path / "w.pt")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"holds no model\.safetensors .*pytorch_model"):
        distkit.load_weights(model, tmp_path / "empty")
    (tmp_path / "junk.safetensors").write_bytes(b"not a safetensors file at all")
    with pytest.raises(CheckpointError, match=r"not a readable safetensors file"):
        distkit.load_weights(model, tmp_path / "junk.safetensors")
    with pytest.raises(ConfigurationError, match=r"takes a torch\.nn\.Module, got OrderedDict"):
        distkit.load_weights(model.state_dict(), tmp_path / "w.pt")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError, match=r"path must be a str or os\.PathLike"):
        distkit.load_weights(model, 3)  # type: ignore[arg-type]


def test_load_weights_refuses_a_folder_whose_index_names_missing_shards(tmp_path):
    with distkit.Runtime("dp") as rt:
        rt.save_weights(Mixed(), tmp_path / "out", max_shard_size=600)
    next(iter(sorted((tmp_path / "out").glob("model-00002-*")))).unlink()
    with pytest.raises(CheckpointError, match=r"names shard files that are not in .*00002"):
        distkit.load_weights(Mixed(), tmp_path / "out")


# ---------------------------------------------------------------- hostile inputs
@pytest.mark.parametrize(
    ("given", "size"),
    [(1234, 1234), ("500MB", 500 * 10**6), ("2GB", 2 * 10**9), ("1GiB", 2**30),
     ("1.5 kb", 1500), ("64", 64), (" 3 MiB ", 3 * 2**20)],
)  # fmt: skip
def test_max_shard_size_reads_bytes_and_units(given, size):
    assert st.parse_size(given) == size


@pytest.mark.parametrize("bad", [0, -5, True, 1.5, "5 parsecs", "GB", "", None, "0MB"])
def test_save_weights_refuses_a_bad_max_shard_size_before_writing(tmp_path, bad):
    refused = pytest.raises(ConfigurationError, match=r"max_shard_size=.*allowed: a positive int")
    with distkit.Runtime("dp") as rt, refused:
        rt.save_weights(make_mlp(), tmp_path / "out", max_shard_size=bad)
    assert not (tmp_path / "out").exists()


def test_save_weights_refuses_wrong_models_and_paths_saying_the_fix(tmp_path):
    model = make_mlp()
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "a_dir.safetensors").mkdir()
    with distkit.Runtime("dp") as rt:
        with pytest.raises(ConfigurationError, match=r"Module .*got OrderedDict"):
            rt.save_weights(model.state_dict(), tmp_path / "x.safetensors")  # type: ignore[arg-type]
        with pytest.raises(ConfigurationError, match=r"path must be a str or os\.PathLike"):
            rt.save_weights(model, None)  # type: ignore[arg-type]
        with pytest.raises(CheckpointError, match=r"a file of another format.*w\.safetensors"):
            rt.save_weights(model, tmp_path / "w.pt")
        with pytest.raises(CheckpointError, match=r"is a file, and a path without"):
            rt.save_weights(model, tmp_path / "a_file")
        with pytest.raises(CheckpointError, match=r"is a folder, and a path ending in"):
            rt.save_weights(model, tmp_path / "a_dir.safetensors")
        with pytest.raises(CheckpointError, match=r"cannot write the weights file"):
            rt.save_weights(model, tmp_path / "a_file" / "under.safetensors")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_dir.safetensors", "a_file"]
    closed = distkit.Runtime("dp")
    closed.close()
    with pytest.raises(distkit.errors.TrainerClosedError, match=r"save_weights\(\) on a closed"):
        closed.save_weights(model, tmp_path / "x.safetensors")
