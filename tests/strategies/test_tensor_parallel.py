"""Tensor parallel inside FSDP (issue 47): ``FSDPStrategy(tensor_parallel=T, tensor_plan=...)``
on the mesh ``(replicate, shard, tensor)``. Every layout that fits 4 gloo ranks with T=2
against one process at the same global batch (accumulation, an uneven last step, clipping
over the DTensor shards), through the Trainer, in float64."""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)
from torch.utils.data import IterableDataset

import distkit
from distkit.errors import ConfigurationError, UnsupportedFeatureError
from tests.support.exactness import (
    DTYPE,
    TOL,
    assert_same_epochs,
)  # the runs compared train in float64
from tests.support.gates import needs
from tests.support.workloads import Block, make_dataset, make_stack, max_abs_diff

pytestmark = pytest.mark.timeout(400)

N = 21  # global batches of 8 with 2 accumulated: 16 + 5 (an uneven last step)
PLAN = {"layers.*.inner": "colwise", "layers.*.outer": "rowwise"}


def fit(
    name: str,
    batch: int,
    replicate: int = 1,
    tensor: int = 1,
    clip: float | None = None,
    checkpoint_kind: str = "full",
    **settings: Any,
) -> dict[str, Any]:
    torch.manual_seed(0)
    if name == "fsdp":
        plan = PLAN if tensor > 1 else None
        strategy: Any = distkit.FSDPStrategy(
            replicate=replicate, tensor_parallel=tensor, tensor_plan=plan,
            checkpoint=checkpoint_kind,
        )  # fmt: skip
    else:
        strategy = name
    trainer = distkit.Trainer(strategy, batch_size=batch, grad_accum_steps=2, seed=3,
                              max_epochs=2, progress=False, gradient_clip_norm=clip,
                              **settings)  # fmt: skip
    model = make_stack(dtype=DTYPE)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    taken = []  # the optimizer steps this fit takes (a resumed one: the rest only)
    optimizer.register_step_post_hook(lambda *_: taken.append(1))
    data = make_dataset(N, dtype=DTYPE)
    result = trainer.fit(model, optimizer, data, val_data=data, loss_fn=nn.functional.cross_entropy)
    inner = model.layers[0].inner.weight
    out = {
        "state": trainer.full_state_dict(),
        "steps": trainer.global_step,
        "taken": len(taken),
        "history": result.history,
        "mesh": getattr(getattr(inner, "device_mesh", None), "mesh_dim_names", None),
        "local": tuple(inner.to_local().shape) if hasattr(inner, "to_local") else None,
        "data": (trainer.runtime.data_rank, trainer.runtime.data_world_size),
    }
    trainer.close()
    return out


@pytest.mark.parametrize(
    ("replicate", "world", "mesh"),
    [(1, 2, ("tensor",)), (1, 4, ("shard", "tensor")), (2, 4, ("replicate", "shard", "tensor"))],
    ids=["tp2", "fsdp2xtp2", "hsdp2x1xtp2"],
)
def test_tensor_parallel_equals_one_process_at_the_global_batch(
    run_on_ranks, replicate, world, mesh
):
    """T=2 at every layout of 2 and 4 ranks: the T ranks of a group see the same samples,
    so the global batch is 4 x (world / 2); clipping's norm is over every shard once."""
    shares = world // 2
    one = run_on_ranks(partial(fit, clip=0.05), "ddp", 4 * shares, world_size=1)[0]
    ranks = run_on_ranks(
        partial(fit, replicate=replicate, tensor=2, clip=0.05), "fsdp", 4, world_size=world
    )
    for rank, result in enumerate(ranks):
        assert result["data"] == (rank // 2, shares)
        assert result["steps"] == one["steps"]
        # the colwise layer's 16 rows: split over 2 by TP, then over the shard dimension
        assert result["local"][0] == 16 // 2 // (shares // replicate)
        assert max_abs_diff(result["state"], one["state"]) <= TOL
        assert_same_epochs(result["history"], one["history"])
    if mesh[0] == "tensor":
        assert ranks[0]["mesh"] == ("tensor",)
    else:  # FSDP over the data-parallel dimensions, TP inside: 2-D parameters
        assert ranks[0]["mesh"] is not None and "tensor" in ranks[0]["mesh"]


def _resume_fit(layout: str, batch: int, **settings: Any) -> dict[str, Any]:
    """A fit under ``layout``: "fsdp2xtp2", "fsdp", "tp2" or "one" (fsdp in a world of one)."""
    if layout == "fsdp2xtp2" or layout == "tp2":
        return fit("fsdp", batch, tensor=2, **settings)
    return fit("fsdp", batch, **settings)


@pytest.mark.parametrize("checkpoint", ["sharded", "full"])
def test_a_checkpoint_from_fsdp2_x_tp2_resumes_exactly_at_other_layouts(
    run_on_ranks, tmp_path, checkpoint
):
    """Written at fsdp2 x tp2 (4 ranks, 2 data-parallel), resumed at fsdp x2, in one process
    (global batch 8 each time) and at tp2 alone (2 ranks, one data-parallel rank: batch 8):
    each ends where the uninterrupted run ends."""
    whole = run_on_ranks(fit, "ddp", 8, world_size=1)[0]
    folder = str(tmp_path / "ckpt")
    strategy_kw = {"checkpoint_dir": folder, "max_steps": 3}
    run_on_ranks(partial(_resume_fit, checkpoint_kind=checkpoint, **strategy_kw), "fsdp2xtp2",
                 4, world_size=4)  # fmt: skip
    for layout, batch, world in (("fsdp", 4, 2), ("one", 8, 1), ("tp2", 8, 2)):
        # a copy each: a resumed fit writes checkpoints of its own into its folder
        mine = shutil.copytree(folder, tmp_path / layout)
        again = {"checkpoint_dir": str(mine), "resume": "auto", "checkpoint_kind": checkpoint}
        resumed = run_on_ranks(partial(_resume_fit, **again), layout, batch, world_size=world)
        for result in resumed:
            assert result["steps"] == whole["steps"], layout
            assert result["taken"] == whole["steps"] - 3, layout  # it did resume
            assert max_abs_diff(result["state"], whole["state"]) <= TOL, layout


def own_loop(tensor: int, batch: int, save: str | None = None, load: str | None = None) -> Any:
    """A user's loop on the Runtime: rt.loader, rt.backward, clipping, accumulation; with
    ``save``, rt.save after 3 steps and stop; with ``load``, rt.load first and finish."""
    strategy = (
        distkit.FSDPStrategy(tensor_parallel=2, tensor_plan=PLAN)
        if tensor > 1
        else distkit.FSDPStrategy()
    )
    with distkit.Runtime(strategy=strategy, grad_accum_steps=2, seed=3) as rt:
        torch.manual_seed(0)
        net = make_stack(dtype=DTYPE)
        net, opt = rt.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        loader = rt.loader(make_dataset(N, dtype=DTYPE), batch_size=batch, shuffle=True)
        state = {"model": net, "optimizer": opt, "loader": loader}
        first = rt.load(load, state)["epoch"] if load is not None else 0
        seen: list[list[float]] = []
        steps = norms = 0
        for epoch in range(first, 2):
            state["epoch"] = epoch
            for x, y in loader:
                seen.append(x[:, 0].tolist())
                rt.backward(nn.functional.cross_entropy(net(x), y))
                rt.clip_gradients(net, opt, max_norm=0.05)
                opt.step()
                opt.zero_grad()
                if rt.sync_gradients:
                    steps += 1
                    norms += opt.last_grad_norm is not None
                if save is not None and steps == 3:
                    rt.save(save, state)
                    return {"stopped": True}
        preds = rt.predict(net, make_dataset(N, dtype=DTYPE), batch_size=batch)
        return {
            "state": rt.full_state_dict(net),
            "steps": steps,
            "norms": norms,
            "seen": seen,
            "preds": torch.stack(list(preds)) if preds else None,
            "rank": rt.rank,
        }


def test_a_users_loop_on_the_runtime_equals_one_process_and_resumes_across_layouts(
    run_on_ranks, tmp_path
):
    """rt.loader gives a tensor-parallel group's ranks the same batches (and the data-parallel
    ranks different ones); the loop, its clipping and accumulation equal one process at the
    global batch, at fsdp2 x tp2 and at tp2; predict returns every sample once, in order; an
    rt.save at fsdp2 x tp2 resumes in one process and ends where the whole run ends."""
    one = run_on_ranks(partial(own_loop, 1), 8, world_size=1)[0]
    four = run_on_ranks(partial(own_loop, 2), 4, world_size=4)
    for result in four:
        assert result["steps"] == one["steps"] and result["norms"] == one["steps"]
        assert max_abs_diff(result["state"], one["state"]) <= TOL
        assert result["preds"].shape[0] == N
        assert torch.allclose(result["preds"], one["preds"], atol=TOL, rtol=0)
    assert four[0]["seen"] == four[1]["seen"] and four[2]["seen"] == four[3]["seen"]
    assert four[0]["seen"] != four[2]["seen"]
    one_share = run_on_ranks(partial(own_loop, 1), 4, world_size=1)[0]
    for result in run_on_ranks(partial(own_loop, 2), 4, world_size=2):  # tp2: one share
        assert max_abs_diff(result["state"], one_share["state"]) <= TOL
        assert torch.allclose(result["preds"], one_share["preds"], atol=TOL, rtol=0)
    path = str(tmp_path / "loop.pt")
    run_on_ranks(partial(own_loop, 2, save=path), 4, world_size=4)
    resumed = run_on_ranks(partial(own_loop, 1, load=path), 8, world_size=1)[0]
    assert resumed["steps"] == one["steps"] - 3  # the steps after the save, only
    assert max_abs_diff(resumed["state"], one["state"]) <= TOL


# ---------------------------------------------------------------- refusals and hostile cases
def _fit_with(plan: Any, model: nn.Module, **strategy: Any) -> str:
    try:
        trainer = distkit.Trainer(
            distkit.FSDPStrategy(tensor_parallel=2, tensor_plan=plan, **strategy),
            batch_size=4, progress=False, max_steps=1,
        )  # fmt: skip
    except ConfigurationError as exc:
        return f"ConfigurationError: {exc}"
    try:
        trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), make_dataset(16),
                    loss_fn=nn.functional.cross_entropy)  # fmt: skip
    except ConfigurationError as exc:
        return f"ConfigurationError: {exc}"
    finally:
        trainer.close()
    return "trained"


class Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(8, 6)
        self.head = nn.Linear(6, 8, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(x)


def _refusals() -> dict[str, str]:
    return {
        "no match": _fit_with({"blocks.*.up": "colwise"}, make_stack()),
        "not linear": _fit_with({"layers.0": "colwise"}, make_stack()),
        "uneven": _fit_with({"out": "colwise"}, make_stack()),  # 3 classes over 2
        "tied": _fit_with({"head": "colwise"}, Tied()),
        "both tied": _fit_with({"head": "colwise", "emb": "rowwise"}, Tied()),
        "world": _fit_with(PLAN, make_stack(), replicate=2),
    }


def test_a_plan_that_cannot_split_the_model_is_refused_on_every_rank_before_training(
    run_on_ranks,
):
    for found in run_on_ranks(_refusals, world_size=2):
        assert "'blocks.*.up' matches no module of Stack" in found["no match"], found
        assert "layers.0.inner" in found["no match"]  # what the names look like
        assert "'colwise' on Block" in found["not linear"] and "'layers.0.*'" in found["not linear"]
        assert "out_features=3" in found["uneven"] and "tensor_parallel=2" in found["uneven"]
        assert "weight (3, 16)" in found["uneven"]
        assert "tied weights" in found["tied"] and "'emb'" in found["tied"]
        assert "tied weights" in found["both tied"]
        world = found["world"]
        assert "replicate=2" in world and "tensor_parallel=2" in world and "2 ranks" in world


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"tensor_parallel": 0}, "tensor_parallel=0"),
        ({"tensor_parallel": 1.5}, "tensor_parallel=1.5"),
        ({"tensor_parallel": True}, "tensor_parallel=True"),
        ({"tensor_parallel": 2}, "needs tensor_plan="),
        ({"tensor_plan": {"a": "colwise"}}, "with tensor_parallel=1"),
        ({"tensor_parallel": 2, "tensor_plan": {"a": "diagonal"}}, "'diagonal'"),
        ({"tensor_parallel": 2, "tensor_plan": {}}, "non-empty dict"),
        ({"tensor_parallel": 2, "tensor_plan": {"a": 3}}, "(int)"),
    ],
)
def test_tensor_parallel_options_are_checked_when_the_strategy_is_made(kwargs, words):
    with pytest.raises(ConfigurationError) as caught:
        distkit.FSDPStrategy(**kwargs)
    assert words in str(caught.value)


def _own_sampler_loop(share_by: str) -> str:
    """A user's DataLoader sharded with a DistributedSampler, by rt.rank or rt.data_rank."""
    from torch.utils.data import DataLoader, DistributedSampler

    strategy = distkit.FSDPStrategy(tensor_parallel=2, tensor_plan=PLAN)
    with distkit.Runtime(strategy=strategy) as rt:
        net = make_stack()
        net, opt = rt.setup(net, torch.optim.SGD(net.parameters(), lr=0.1))
        data = make_dataset(16)
        ranks = (rt.world_size, rt.rank) if share_by == "rank" else (rt.data_world_size,
                                                                     rt.data_rank)  # fmt: skip
        sampler = DistributedSampler(data, num_replicas=ranks[0], rank=ranks[1], shuffle=False)
        try:
            for x, y in DataLoader(data, batch_size=4, sampler=sampler):
                rt.backward(nn.functional.cross_entropy(net(x), y))
                opt.step()
                opt.zero_grad()
        except ConfigurationError as exc:
            return str(exc)
    return "trained"


def test_a_tensor_parallel_group_fed_different_batches_by_the_users_sampler_is_stopped(
    run_on_ranks,
):
    """Sharding by rt.rank gives the 2 ranks of one tensor-parallel group other samples: the
    split layers would compute garbage; the first backward stops both, naming the fix."""
    for message in run_on_ranks(partial(_own_sampler_loop, "rank"), world_size=2):
        assert "ranks [0, 1] form one tensor-parallel group" in message, message
        assert "rt.data_rank" in message
    assert run_on_ranks(partial(_own_sampler_loop, "data_rank"), world_size=2) == ["trained"] * 2


def test_a_rank_raising_mid_step_stops_its_tensor_parallel_group_fast(tmp_path):
    from tests.faults.test_faults import TORCHRUN, _assert_stopped_fast, _job

    proc, seconds = _job(TORCHRUN, tmp_path, "tp2", "--raise-at", "3", timeout=120)
    _assert_stopped_fast(proc, seconds)


@pytest.mark.parametrize(
    "name", ["DDPStrategy", "HorovodStrategy", "DeepSpeedStrategy", "DataParallelStrategy",
             "ApexStrategy"],
)  # fmt: skip
@pytest.mark.parametrize("option", ["tensor_parallel", "tensor_plan"])
def test_tensor_parallel_under_another_backend_is_refused_naming_fsdp(name, option):
    with pytest.raises(UnsupportedFeatureError) as caught:
        getattr(distkit, name)(**{option: 2})
    assert f"{name}({option}=...)" in str(caught.value)
    assert f"distkit.FSDPStrategy({option}=...)" in str(caught.value)


def _meta_build(path: str) -> dict[str, Any]:
    """fsdp2 x tp2: a stack built on meta (init_empty) is split, sharded and materialised
    slice by slice; with no weights its values are the normal build's, with load_weights
    the file's. Then activation checkpointing trains exactly as without."""
    out: dict[str, Any] = {}
    for name in ("fresh", "loaded"):
        torch.manual_seed(0)  # where the block begins: its initial values replay from here
        with distkit.init_empty():  # float32: a meta model cast to float64 draws in float64
            model = make_stack()
        if name == "loaded":
            distkit.load_weights(model, path)
        trainer = distkit.Trainer(distkit.FSDPStrategy(tensor_parallel=2, tensor_plan=PLAN),
                                  batch_size=4, max_steps=1, progress=False)  # fmt: skip
        trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.0), make_dataset(N),
                    loss_fn=nn.functional.cross_entropy)  # fmt: skip
        out[name] = trainer.full_state_dict()
        trainer.close()
    for checkpointing in (None, [Block]):
        out[f"checkpointed={checkpointing is not None}"] = fit(
            "fsdp", 4, tensor=2, activation_checkpointing=checkpointing
        )["state"]
    return out


def test_meta_init_load_weights_and_activation_checkpointing_under_fsdp2_x_tp2(
    run_on_ranks, tmp_path
):
    from safetensors.torch import save_file

    stored = {k: v + 1.0 for k, v in make_stack(seed=5).state_dict().items()}
    path = str(tmp_path / "stack.safetensors")
    save_file(stored, path)
    built = make_stack().state_dict()
    for result in run_on_ranks(partial(_meta_build, path), world_size=4):
        assert max_abs_diff(result["fresh"], built) == 0
        assert max_abs_diff(result["loaded"], stored) == 0
        assert max_abs_diff(result["checkpointed=True"], result["checkpointed=False"]) == 0


def _mixed_and_compiled() -> dict[str, Any]:
    """fsdp2 x tp2: compile=True against eager (the same arithmetic: equal), and bf16 (FSDP's
    policy over the split layers) on a float32 stack."""
    out = {
        "eager": fit("fsdp", 4, tensor=2)["state"],
        "compiled": fit("fsdp", 4, tensor=2, compile=True)["state"],
    }
    trainer = distkit.Trainer(distkit.FSDPStrategy(tensor_parallel=2, tensor_plan=PLAN),
                              batch_size=4, precision="bf16", max_epochs=3, progress=False,
                              seed=3)  # fmt: skip
    model = make_stack()
    seen: list[torch.dtype] = []
    model.layers[0].inner.register_forward_hook(lambda m, i, o: seen.append(o.dtype))
    result = trainer.fit(model, torch.optim.AdamW(model.parameters(), lr=1e-2),
                         make_dataset(N), loss_fn=nn.functional.cross_entropy)  # fmt: skip
    out["bf16 losses"] = [h["train_loss"] for h in result.history]
    out["bf16 compute"] = seen[0]
    out["master"] = next(model.parameters()).dtype
    trainer.close()
    return out


def test_compile_and_bf16_under_fsdp2_x_tp2(run_on_ranks):
    for result in run_on_ranks(_mixed_and_compiled, world_size=4):
        assert max_abs_diff(result["compiled"], result["eager"]) <= TOL
        assert result["bf16 compute"] == torch.bfloat16 and result["master"] == torch.float32
        losses = result["bf16 losses"]
        assert all(loss == loss for loss in losses) and losses[-1] < losses[0], losses


# ---------------------------------------------------------------- the GPU path (NCCL)
def _on_gpu(tensor: int, batch: int) -> dict[str, Any]:
    result = fit("fsdp", batch, tensor=tensor, clip=0.05)
    result["device"] = torch.cuda.current_device() if torch.cuda.is_available() else None
    return result


@needs("2 gpus", because="one GPU per rank: the tensor-parallel group's NCCL collectives")
def test_tp2_over_nccl_on_two_gpus_equals_one_gpu(run_on_ranks):
    """Written for a machine with 2+ CUDA GPUs (none here, none in CI; docs/gpu.md lists it):
    tp2 across two GPUs against one GPU at the same batch, float64."""
    one = run_on_ranks(partial(_on_gpu, 1), 4, world_size=1)[0]
    for rank, result in enumerate(run_on_ranks(partial(_on_gpu, 2), 4, world_size=2)):
        assert result["device"] == rank
        assert max_abs_diff(result["state"], one["state"]) <= TOL


def _profiled(folder: str) -> list[str]:
    settings = distkit.Profiler(dir=folder, wait=0, warmup=1, active=1)
    fit("fsdp", 4, tensor=2, profiler=settings, max_steps=3)
    return sorted(str(p.relative_to(folder)) for p in Path(folder).rglob("*.pt.trace.json"))


def test_the_profiler_traces_each_rank_of_a_tensor_parallel_group(run_on_ranks, tmp_path):
    """tp2: each rank writes its trace, with distkit's phases and the group's all-reduce in
    the forward (the rowwise layers' sum of partial outputs)."""
    folder = str(tmp_path / "traces")
    traces = run_on_ranks(partial(_profiled, folder), world_size=2)[0]
    assert [t.split("/")[0] for t in traces] == ["rank0", "rank1"], traces
    for trace in traces:
        events = json.loads((Path(folder) / trace).read_text())["traceEvents"]
        names = {event.get("name", "") for event in events}
        assert {"distkit/forward", "distkit/backward", "distkit/optimizer"} <= names
        assert any("all_reduce" in name for name in names), sorted(names)[:40]


# ---------------------------------------------------------------- streams
class Samples(IterableDataset):
    """make_dataset's samples as a stream; ``shard_by``: a ShardedStream's own split, by the
    global rank ("rank") or by the data-parallel rank ("data")."""

    def __init__(self, shard_by: str | None = None) -> None:
        self.data = make_dataset(N, dtype=DTYPE)
        self.shard_by = shard_by

    def __iter__(self) -> Any:
        step, start = 1, 0
        if self.shard_by is not None:
            import torch.distributed as dist

            world, rank = dist.get_world_size(), dist.get_rank()
            step, start = (world, rank) if self.shard_by == "rank" else (world // 2, rank // 2)
        for i in range(start, len(self.data), step):
            yield self.data[i]


def _stream_fit(tensor: int, batch: int, shard_by: str | None = None) -> Any:
    source: Any = Samples(shard_by)
    if shard_by is not None:
        source = distkit.ShardedStream(source)
    strategy = distkit.FSDPStrategy(tensor_parallel=2, tensor_plan=PLAN) if tensor > 1 else "ddp"
    trainer = distkit.Trainer(strategy, batch_size=batch, grad_accum_steps=2, seed=3,
                              max_epochs=2, progress=False)  # fmt: skip
    model = make_stack(dtype=DTYPE)
    try:
        result = trainer.fit(model, torch.optim.AdamW(model.parameters(), lr=1e-2), source,
                             val_data=Samples(), loss_fn=nn.functional.cross_entropy)  # fmt: skip
    except ConfigurationError as exc:
        return str(exc)
    finally:
        state = trainer.full_state_dict() if trainer.global_step else None
        trainer.close()
    return {"state": state, "history": result.history}


def test_a_stream_under_fsdp2_x_tp2_equals_one_process_and_a_rank_split_one_is_refused(
    run_on_ranks,
):
    """A stream distkit shards gives a tensor-parallel group's ranks the same batches (the
    training and the validation loss equal one process at the global batch); a ShardedStream
    split by the global rank gives them other samples: refused on every rank before its
    batches train; split by the data-parallel rank it trains."""
    one = run_on_ranks(partial(_stream_fit, 1), 8, world_size=1)[0]
    for result in run_on_ranks(partial(_stream_fit, 2), 4, world_size=4):
        assert max_abs_diff(result["state"], one["state"]) <= TOL
        assert_same_epochs(result["history"], one["history"])
    for message in run_on_ranks(partial(_stream_fit, 2, shard_by="rank"), 4, world_size=4):
        assert "ranks [0, 1] form one tensor-parallel group" in message, message
        assert "ShardedStream must shard by the data-parallel rank" in message
    for result in run_on_ranks(partial(_stream_fit, 2, shard_by="data"), 4, world_size=4):
        assert isinstance(result, dict) and result["state"] is not None, result


# ---------------------------------------------------------------- sequence parallel
V, L = 12, 6  # vocabulary (2 divides it: the embedding and head split over it), sequence


class SeqBlock(nn.Module):
    """A pre-norm residual block over (batch, sequence, width): position by position."""

    def __init__(self, width: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.inner = nn.Linear(width, 2 * width)
        self.outer = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.outer(torch.tanh(self.inner(self.norm(x))))


class Tokens(nn.Module):
    def __init__(self, pool: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 16)
        self.layers = nn.ModuleList(SeqBlock() for _ in range(2))
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, V)
        self.pool = pool  # a classifier of the sequence's mean: what cannot run on a part of it

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.emb(ids)
        for layer in self.layers:
            x = layer(x)
        x = self.norm(x)
        return self.head(x.mean(dim=1) if self.pool else x)


SEQUENCE_PLAN = {
    "emb": "rowwise",
    "layers.*.norm": "sequence",
    "layers.*.inner": "colwise",
    "layers.*.outer": "rowwise",
    "norm": "sequence",
    "head": "colwise_gather",
}


def _token_data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (N, L), generator=g)
    return torch.utils.data.TensorDataset(ids, ids.roll(-1, dims=1))


def _sequence_fit(tensor: int, batch: int, pool: bool = False, clip: float | None = 0.05) -> Any:
    torch.manual_seed(0)
    model = Tokens(pool).to(DTYPE)
    # pooled: the head stays whole (unplanned), on each rank's mean of its part of the sequence
    plan = {k: v for k, v in SEQUENCE_PLAN.items() if not (pool and k == "head")}
    strategy: Any = (
        distkit.FSDPStrategy(tensor_parallel=2, tensor_plan=plan) if tensor > 1 else "ddp"
    )
    trainer = distkit.Trainer(strategy, batch_size=batch, grad_accum_steps=2, seed=3,
                              max_epochs=2, progress=False, gradient_clip_norm=clip)  # fmt: skip

    def loss_fn(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if logits.dim() == 2:  # pooled: the sequence's first next token
            return nn.functional.cross_entropy(logits, target[:, 0])
        return nn.functional.cross_entropy(logits.reshape(-1, V), target.reshape(-1))

    try:
        trainer.fit(model, torch.optim.AdamW(model.parameters(), lr=1e-2), _token_data(),
                    loss_fn=loss_fn)  # fmt: skip
    except ConfigurationError as exc:
        return str(exc)
    finally:
        state = trainer.full_state_dict() if trainer.global_step else None
        trainer.close()
    return state


def test_sequence_parallel_equals_one_process_and_a_plan_that_mixes_positions_is_stopped(
    run_on_ranks,
):
    """'sequence' norms between colwise/rowwise pairs: the stream between the split layers is
    split over the sequence; tp2 and fsdp2 x tp2 equal one process, clipping included (a
    norm's gradient is a partial sum over the group, summed before the norm is taken). A
    classifier of the sequence's mean left unplanned (each rank then pools its half) gives
    each rank its own loss: the first backward stops every rank, nothing trained."""
    for world in (2, 4):
        one = run_on_ranks(partial(_sequence_fit, 1), 4 * (world // 2), world_size=1)[0]
        for state in run_on_ranks(partial(_sequence_fit, 2), 4, world_size=world):
            assert not isinstance(state, str), state
            assert max_abs_diff(state, one) <= TOL
    for message in run_on_ranks(partial(_sequence_fit, 2, pool=True), 4, world_size=2):
        assert "computed different losses in their first backward" in message, message


@pytest.mark.parametrize("checkpoint", ["sharded"])  # the full one's resume: the checkpoint test
def test_sigterm_to_one_rank_of_a_tensor_parallel_group_stops_both_and_resumes_exactly(
    tmp_path, checkpoint
):
    """torchrun, tp2 (dropout between the split layers): SIGTERM to rank 1 at a step stops
    both ranks after the same step with a checkpoint; the rerun resumes and ends where the
    uninterrupted job ends (a group's random streams are one: kept once, given to both)."""
    from tests.faults.test_preemption import sigterm_stops_and_resumes_exactly

    sigterm_stops_and_resumes_exactly("tp2", tmp_path, sharded=checkpoint == "sharded")


class OwnColwise(ParallelStyle):
    """A user's own style (torch's colwise inside), with object's repr (its address)."""

    def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
        return ColwiseParallel()._apply(module, device_mesh)


def _split_by(kind: str) -> dict[str, torch.Tensor]:
    def by_hand(model: nn.Module, tp_mesh: Any) -> None:
        parallelize_module(model, tp_mesh, {"layers.*.inner": ColwiseParallel(),
                                            "layers.*.outer": RowwiseParallel()})  # fmt: skip

    plans: dict[str, Any] = {
        "strings": PLAN,
        "styles": {"layers.*.inner": OwnColwise(), "layers.*.outer": RowwiseParallel()},
        "callable": by_hand,
    }
    trainer = distkit.Trainer(
        distkit.FSDPStrategy(tensor_parallel=2, tensor_plan=plans[kind]), batch_size=4,
        grad_accum_steps=2, seed=3, max_epochs=1, progress=False,
    )  # fmt: skip
    model = make_stack(dtype=DTYPE)
    trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), make_dataset(N, dtype=DTYPE),
                loss_fn=nn.functional.cross_entropy)  # fmt: skip
    state = trainer.full_state_dict()
    trainer.close()
    return state


def test_a_plan_of_torch_styles_or_a_callable_splits_as_the_strings_do(run_on_ranks):
    """A style object of the user's (whose repr is its address: the ranks' agreement on the
    options must not read that as a disagreement) and a callable plan train alike."""
    strings = run_on_ranks(partial(_split_by, "strings"), world_size=2)[0]
    for kind in ("styles", "callable"):
        for state in run_on_ranks(partial(_split_by, kind), world_size=2):
            assert max_abs_diff(state, strings) == 0, kind


def test_tp4_splits_each_layer_four_ways_and_equals_one_process(run_on_ranks):
    """T=4 on 4 ranks: one group, one data-parallel rank (the batch of 4 is the global one)."""
    one = run_on_ranks(partial(fit, clip=0.05), "ddp", 4, world_size=1)[0]
    for result in run_on_ranks(partial(fit, tensor=4, clip=0.05), "fsdp", 4, world_size=4):
        assert result["data"] == (0, 1) and result["local"] == (4, 16)  # 16 rows over 4
        assert max_abs_diff(result["state"], one["state"]) <= TOL
