"""Pipeline parallel inside FSDP (issue 48): ``FSDPStrategy(pipeline_parallel=P,
pipeline_split=[...], microbatches=M, schedule=...)`` on the mesh ``(pipeline, replicate,
shard, tensor)``. Every layout against one process at the same global batch (accumulation,
an uneven last step, clipping over every stage's gradients), through the Trainer, in
float64."""

from __future__ import annotations

import os
from functools import partial
from typing import Any

import pytest
import torch
from torch import nn

import distkit
from tests.support.exactness import (
    DTYPE,
    TOL,
    assert_same_epochs,
)  # the runs compared train in float64
from tests.support.gates import needs
from tests.support.workloads import make_dataset, make_stack, max_abs_diff

pytestmark = pytest.mark.timeout(400)

N = 21  # global batches of 8 with 2 accumulated: 16 + 5 (an uneven last step)
SPLIT = ["layers.1"]
PLAN_TP = {
    "layers.*.inner": "colwise",
    "layers.*.outer": "rowwise",
}  # stage 0: inp, layers.0; stage 1: layers.1, layers.2, out


def fit(
    name: str,
    batch: int,
    pipeline: int = 1,
    tensor: int = 1,
    clip: float | None = None,
    checkpoint_kind: str = "full",
    schedule: str = "1F1B",
    microbatches: int | None = 2,
    split: Any = None,
    depth: int = 3,
    replicate: int = 1,
    **settings: Any,
) -> dict[str, Any]:
    torch.manual_seed(0)
    if name == "fsdp":
        layout: dict[str, Any] = {}
        if pipeline > 1:
            layout = {"pipeline_parallel": pipeline, "pipeline_split": split or SPLIT,
                      "microbatches": microbatches, "schedule": schedule}  # fmt: skip
        if tensor > 1:
            layout |= {
                "tensor_parallel": tensor,
                "tensor_plan": {"layers.*.inner": "colwise", "layers.*.outer": "rowwise"},
            }
        strategy: Any = distkit.FSDPStrategy(checkpoint=checkpoint_kind, replicate=replicate,
                                             **layout)  # fmt: skip
    else:
        strategy = name
    trainer = distkit.Trainer(strategy, batch_size=batch, grad_accum_steps=2, seed=3,
                              max_epochs=2, progress=False, gradient_clip_norm=clip,
                              **settings)  # fmt: skip
    model = make_stack(dtype=DTYPE, depth=depth)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    taken = []
    optimizer.register_step_post_hook(lambda *_: taken.append(1))
    data = make_dataset(N, dtype=DTYPE)
    result = trainer.fit(model, optimizer, data, val_data=data, loss_fn=nn.functional.cross_entropy)
    out = {
        "state": trainer.full_state_dict(),
        "steps": trainer.global_step,
        "taken": len(taken),
        "history": result.history,
        "data": (trainer.runtime.data_rank, trainer.runtime.data_world_size),
    }
    trainer.close()
    return out


def test_pp2_equals_one_process(run_on_ranks):
    one = run_on_ranks(partial(fit, clip=0.05), "ddp", 4, world_size=1)[0]
    ranks = run_on_ranks(partial(fit, pipeline=2, clip=0.05), "fsdp", 4, world_size=2)
    for result in ranks:
        print(max_abs_diff(result["state"], one["state"]))
        assert result["data"] == (0, 1)
        assert result["steps"] == one["steps"]
        assert max_abs_diff(result["state"], one["state"]) <= TOL
        assert_same_epochs(result["history"], one["history"])


@pytest.mark.parametrize(
    ("schedule", "split", "microbatches"),
    [("gpipe", None, 2), ("interleaved1F1B", ["layers.0", "layers.1", "layers.2"], 2)],
    ids=["gpipe", "interleaved"],
)
def test_other_schedules_equal_one_process(run_on_ranks, schedule, split, microbatches):
    one = run_on_ranks(partial(fit, clip=0.05), "ddp", 4, world_size=1)[0]
    ranks = run_on_ranks(
        partial(fit, pipeline=2, clip=0.05, schedule=schedule, split=split,
                microbatches=microbatches),
        "fsdp", 4, world_size=2,
    )  # fmt: skip
    for result in ranks:
        print(schedule, max_abs_diff(result["state"], one["state"]))
        assert max_abs_diff(result["state"], one["state"]) <= TOL
        assert_same_epochs(result["history"], one["history"])


@pytest.mark.parametrize(
    ("tensor", "replicate"), [(1, 1), (2, 1), (1, 2)], ids=["pp2xfsdp2", "pp2xtp2", "pp2xhsdp2x1"]
)
def test_pp2_with_fsdp2_tp2_or_hsdp_on_4_ranks_equals_one_process(run_on_ranks, tensor, replicate):
    shares = 2 if tensor == 1 else 1  # data-parallel ranks
    one = run_on_ranks(partial(fit, clip=0.05), "ddp", 4 * shares, world_size=1)[0]
    ranks = run_on_ranks(partial(fit, pipeline=2, tensor=tensor, replicate=replicate,
                                 clip=0.05), "fsdp", 4, world_size=4)  # fmt: skip
    for result in ranks:
        print(tensor, max_abs_diff(result["state"], one["state"]))
        assert result["data"][1] == shares
        assert max_abs_diff(result["state"], one["state"]) <= TOL
        assert_same_epochs(result["history"], one["history"])


def _layout_fit(layout: str, batch: int, **settings: Any) -> dict[str, Any]:
    """A fit under ``layout``: "pp2", "pp2xfsdp2", "fsdp" (x2) or "one" (fsdp, a world of one)."""
    if layout.startswith("pp2"):
        return fit("fsdp", batch, pipeline=2, **settings)
    return fit("fsdp", batch, **settings)


@pytest.mark.parametrize("checkpoint", ["sharded", "full"])
def test_a_checkpoint_from_pp2_resumes_exactly_at_other_layouts(run_on_ranks, tmp_path, checkpoint):
    """Written at pp2 (2 ranks, one data-parallel rank: batch 4) after 3 of 6 steps, resumed
    at fsdp x2, in one process and at pp2 x fsdp2 (global batch 4 each time); and written at
    fsdp x2, resumed at pp2: each ends where the uninterrupted run ends."""
    import shutil

    whole = run_on_ranks(fit, "ddp", 4, world_size=1)[0]
    kinds = {"checkpoint_kind": checkpoint}
    for source, batch, world, targets in (
        ("pp2", 4, 2, (("fsdp", 2, 2), ("one", 4, 1), ("pp2xfsdp2", 2, 4))),
        ("fsdp", 2, 2, (("pp2", 4, 2),)),
    ):
        folder = tmp_path / source
        written = {"checkpoint_dir": str(folder), "max_steps": 3, **kinds}
        run_on_ranks(partial(_layout_fit, **written), source, batch, world_size=world)
        for layout, size, ranks in targets:
            mine = shutil.copytree(folder, tmp_path / f"{source}-to-{layout}")
            again = {"checkpoint_dir": str(mine), "resume": "auto", **kinds}
            resumed = run_on_ranks(partial(_layout_fit, **again), layout, size, world_size=ranks)
            for result in resumed:
                print(source, layout, max_abs_diff(result["state"], whole["state"]))
                assert result["steps"] == whole["steps"], layout
                assert result["taken"] == whole["steps"] - 3, layout  # it did resume
                assert max_abs_diff(result["state"], whole["state"]) <= TOL, (source, layout)


def test_a_rank_raising_inside_a_stage_stops_every_rank_fast_naming_the_stage(tmp_path):
    from tests.faults.test_faults import TORCHRUN, _assert_stopped_fast, _job

    proc, seconds = _job(TORCHRUN, tmp_path, "pp2", "--raise-at", "3", timeout=120)
    _assert_stopped_fast(proc, seconds)
    output = proc.stdout + proc.stderr
    assert "rank 1 (pipeline stage 1 (of stages 0-1)) failed" in output, output[-3000:]


class _Skip(nn.Module):
    """A forward that is no chain of its children: a residual around the last one."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h + x)


class _Unsaved(nn.Module):
    """A unit with a buffer outside the state dict (persistent=False), as rotary tables are."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.b = nn.Linear(6, 3)
        self.b.register_buffer("scale", torch.full((3,), 2.0), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x)) * self.b.scale


class _Tied(nn.Module):
    """An input layer and an output layer sharing one weight (as a language model's)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Linear(6, 6, bias=False)
        self.mid = nn.Linear(6, 6)
        self.head = nn.Linear(6, 6, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.mid(self.emb(x)))


def _attempt(model: nn.Module, split: Any, *, batch: int = 4, step_fn: Any = False,
             **strategy: Any) -> str:  # fmt: skip
    from distkit.errors import DistkitError

    try:
        made = distkit.FSDPStrategy(pipeline_parallel=2, pipeline_split=split, **strategy)
        trainer = distkit.Trainer(made, batch_size=batch, progress=False, max_steps=1)
    except DistkitError as exc:
        return f"{type(exc).__name__}: {exc}"
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    how: dict[str, Any] = {"loss_fn": nn.functional.cross_entropy}
    if step_fn is True:
        how = {"step_fn": lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1])}
    elif step_fn:
        how = {"step_fn": step_fn}
    try:
        trainer.fit(model, optimizer, make_dataset(16), **how)
    except DistkitError as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        trainer.close()
    return "trained"


def _in_own_loop(batches: list[Any]) -> str:
    """rt.forward_backward at pp2 on ``batches`` of (inputs, target): "trained", or the error."""
    from distkit.errors import DistkitError

    strategy = distkit.FSDPStrategy(pipeline_parallel=2, pipeline_split=SPLIT, microbatches=2)
    with distkit.Runtime(strategy=strategy) as rt:
        model = make_stack()
        net, _ = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
        try:
            for x, y in batches:
                rt.forward_backward(net, x, y, nn.functional.cross_entropy)
        except DistkitError as exc:
            return f"{type(exc).__name__}: {exc}"
    return "trained"


def _trainer_refusal(**options: Any) -> str:
    from distkit.errors import DistkitError

    strategy = distkit.FSDPStrategy(pipeline_parallel=2, pipeline_split=SPLIT)
    model = make_stack()
    if options.pop("meta", False):
        with distkit.init_empty():
            model = make_stack()
    try:
        with distkit.Trainer(strategy, batch_size=4, progress=False, max_steps=1,
                             **options) as trainer:  # fmt: skip
            trainer.fit(model, torch.optim.SGD(model.parameters(), lr=0.1), make_dataset(16),
                        loss_fn=nn.functional.cross_entropy)  # fmt: skip
    except DistkitError as exc:
        return f"{type(exc).__name__}: {exc}"
    return "trained"


def _refusals() -> dict[str, str]:
    bn = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    return {
        "skip": _attempt(_Skip(), ["b"]),
        "unused": _attempt(make_stack(), ["out"], microbatches=2),  # layers, a ModuleList
        "name": _attempt(make_stack(), ["layers.9"]),
        "order": _attempt(make_stack(), ["inp"]),
        "tied": _attempt(_Tied(), ["head"]),
        "batchnorm": _attempt(bn, ["2"]),
        "micro": _attempt(make_stack(), ["layers.1"], microbatches=3),
        "step_fn": _attempt(make_stack(), ["layers.1"], step_fn=True),
        "step_fn keywords": _attempt(
            make_stack(),
            ["layers.1"],
            step_fn=lambda m, b: nn.functional.cross_entropy(m(x=b[0]), b[1]),
        ),
        "step_fn without the model": _attempt(
            make_stack(), ["layers.1"], step_fn=lambda m, b: b[0].sum() * 0
        ),
        "world": _attempt(make_stack(), ["layers.1"], tensor_parallel=2, tensor_plan=PLAN_TP),
        "fine": _attempt(make_stack(), ["layers.1"]),
        "unsaved buffer": _attempt(nn.Sequential(nn.Linear(6, 6), _Unsaved()), ["1"]),
        "disagree": _attempt(make_stack(), [f"layers.{1 + int(os.environ['RANK'])}"]),
        "longer": _in_own_loop(
            [
                (torch.randn(4, 6), torch.zeros(4, dtype=torch.long)),
                (torch.randn(6, 6), torch.zeros(6, dtype=torch.long)),
            ]
        ),
        "dict inputs": _in_own_loop([({"x": torch.randn(4, 6)}, torch.zeros(4, dtype=torch.long))]),
        "shorter": _in_own_loop(
            [
                (torch.randn(4, 6), torch.zeros(4, dtype=torch.long)),
                (torch.randn(1, 6), torch.zeros(1, dtype=torch.long)),
            ]
        ),
        "compile": _trainer_refusal(compile=True),
        "fp16": _trainer_refusal(precision="fp16"),
        "meta": _trainer_refusal(meta=True),
    }


def test_a_model_or_options_that_cannot_pipeline_are_refused_on_every_rank_before_training(
    run_on_ranks,
):
    for found in run_on_ranks(_refusals, world_size=2):
        assert "could not cut the model by names at 'b'" in found["skip"], found["skip"]
        assert "pipeline_split=fn" in found["skip"]
        assert "ran the units ['inp', 'out']" in found["unused"], found["unused"]
        assert "'layers.9', which is no module" in found["name"], found["name"]
        assert "layers.0.inner" in found["name"] or "layers.0" in found["name"]
        assert "after the first unit" in found["order"], found["order"]
        assert "'emb.weight' (tied with ['head.weight'])" in found["tied"], found["tied"]
        assert "'1' is a BatchNorm1d" in found["batchnorm"], found["batchnorm"]
        assert "microbatches=3" in found["micro"] and "4 rows" in found["micro"], found["micro"]
        assert found["step_fn"] == "trained", found["step_fn"]
        keywords = found["step_fn keywords"]
        assert "step_fn called the model with [] and keywords ['x']" in keywords, keywords
        assert "returned without calling the model" in found["step_fn without the model"]
        world = found["world"]
        assert "pipeline_parallel=2" in world and "= 4" in world and "2 ranks" in world, world
        assert found["fine"] == "trained"
        assert found["unsaved buffer"] == "trained", found["unsaved buffer"]
        assert "RankDisagreementError" in found["disagree"], found["disagree"]
        assert "pipeline_split" in found["disagree"]
        assert "shape (6, 6), the first batch's (4, 6)" in found["longer"], found["longer"]
        assert "must be one tensor" in found["dict inputs"] and "dict" in found["dict inputs"]
        assert found["shorter"] == "trained"  # padded to the first batch's micro-batches
        assert "compile under pipeline_parallel" in found["compile"], found["compile"]
        assert "precision='fp16'" in found["fp16"] and "bf16" in found["fp16"], found["fp16"]
        assert "meta device" in found["meta"], found["meta"]


@pytest.mark.parametrize(
    ("kwargs", "words"),
    [
        ({"pipeline_parallel": 0}, "pipeline_parallel=0"),
        ({"pipeline_parallel": True}, "pipeline_parallel=True"),
        ({"pipeline_parallel": 2}, "needs pipeline_split"),
        ({"pipeline_parallel": 2, "pipeline_split": "layers.1"}, "pipeline_split=['layers.1']"),
        ({"pipeline_parallel": 2, "pipeline_split": ["a", "b"]}, "2 cut(s)"),
        ({"pipeline_parallel": 2, "pipeline_split": [3]}, "module names (str)"),
        ({"pipeline_parallel": 2, "pipeline_split": ["a"], "schedule": "zb"}, "'gpipe'"),
        ({"pipeline_parallel": 2, "pipeline_split": ["a"], "microbatches": 0}, "microbatches=0"),
        ({"pipeline_parallel": 2, "pipeline_split": ["a"], "stages_per_rank": 2},
         "schedule='interleaved1F1B'"),
        ({"pipeline_parallel": 2, "pipeline_split": ["a"], "schedule": "interleaved1F1B",
          "stages_per_rank": 1}, "at least 2 stages per rank"),
        ({"pipeline_parallel": 2, "pipeline_split": ["a", "b", "c"],
          "schedule": "interleaved1F1B", "microbatches": 3}, "a multiple of pipeline_parallel"),
        ({"pipeline_parallel": 2, "pipeline_split": ["a"], "microbatches": 1},
         "microbatches >= 2"),
        ({"microbatches": 4}, "without pipeline_parallel"),
        ({"pipeline_split": ["a"]}, "without pipeline_parallel"),
    ],
)  # fmt: skip
def test_pipeline_options_are_checked_when_the_strategy_is_made(kwargs, words):
    from distkit.errors import ConfigurationError

    with pytest.raises(ConfigurationError) as caught:
        distkit.FSDPStrategy(**kwargs)
    assert words in str(caught.value)


@pytest.mark.parametrize(
    "name", ["DDPStrategy", "HorovodStrategy", "DeepSpeedStrategy", "DataParallelStrategy",
             "ApexStrategy"],
)  # fmt: skip
@pytest.mark.parametrize("option", ["pipeline_parallel", "pipeline_split", "microbatches"])
def test_pipeline_parallel_under_another_backend_is_refused_naming_fsdp(name, option):
    from distkit.errors import UnsupportedFeatureError

    with pytest.raises(UnsupportedFeatureError) as caught:
        getattr(distkit, name)(**{option: 2})
    assert f"{name}({option}=...)" in str(caught.value)
    assert "no pipeline parallelism" in str(caught.value)
    assert f"distkit.FSDPStrategy({option}=...)" in str(caught.value)


def own_loop(pipeline: int, batch: int, save: str | None = None, load: str | None = None,
             plain: bool = False) -> Any:  # fmt: skip
    """A user's loop on the Runtime: rt.loader, rt.forward_backward, clipping, accumulation,
    predict; with ``save``, rt.save after 3 steps and stop; with ``load``, rt.load first;
    ``plain``: the model called, then rt.backward (refused under a pipeline)."""
    strategy = (
        distkit.FSDPStrategy(pipeline_parallel=2, pipeline_split=SPLIT, microbatches=2)
        if pipeline > 1
        else distkit.FSDPStrategy()
    )
    with distkit.Runtime(strategy=strategy, grad_accum_steps=2, seed=3) as rt:
        torch.manual_seed(0)
        net = make_stack(dtype=DTYPE)
        net, opt = rt.setup(net, torch.optim.AdamW(net.parameters(), lr=1e-2))
        loader = rt.loader(make_dataset(N, dtype=DTYPE), batch_size=batch, shuffle=True)
        state = {"model": net, "optimizer": opt, "loader": loader}
        first = rt.load(load, state)["epoch"] if load is not None else 0
        steps, losses = 0, []
        for epoch in range(first, 2):
            state["epoch"] = epoch
            for x, y in loader:
                if plain:
                    try:
                        rt.backward(nn.functional.cross_entropy(net(x), y))
                    except distkit.errors.UnsupportedFeatureError as exc:
                        return {"refused": str(exc)}
                loss = rt.forward_backward(net, x, y, nn.functional.cross_entropy)
                losses.append(float(loss))
                rt.clip_gradients(net, opt, max_norm=0.05)
                opt.step()
                opt.zero_grad()
                steps += rt.sync_gradients
                if save is not None and steps == 3:
                    rt.save(save, state)
                    return {"stopped": True}
        preds = rt.predict(net, make_dataset(N, dtype=DTYPE), batch_size=batch)
        return {
            "state": rt.full_state_dict(net),
            "steps": steps,
            "losses": losses,
            "preds": torch.stack(list(preds)) if preds else None,
        }


def test_a_users_loop_with_forward_backward_equals_one_process_and_resumes(run_on_ranks, tmp_path):
    """rt.forward_backward runs the schedule in a user's loop: the loop, its clipping,
    accumulation and predict equal one process's at pp2; an rt.save at pp2 resumes in one
    process and ends where the whole run ends; the model called in training is refused,
    naming rt.forward_backward."""
    one = run_on_ranks(partial(own_loop, 1), 4, world_size=1)[0]
    for result in run_on_ranks(partial(own_loop, 2), 4, world_size=2):
        assert result["steps"] == one["steps"]
        assert max_abs_diff(result["state"], one["state"]) <= TOL
        assert max(abs(a - b) for a, b in zip(result["losses"], one["losses"], strict=True)) <= TOL
        assert result["preds"].shape[0] == N
        assert torch.allclose(result["preds"], one["preds"], atol=TOL, rtol=0)
    path = str(tmp_path / "loop.pt")
    run_on_ranks(partial(own_loop, 2, save=path), 4, world_size=2)
    resumed = run_on_ranks(partial(own_loop, 1, load=path), 4, world_size=1)[0]
    assert resumed["steps"] == one["steps"] - 3  # the steps after the save, only
    assert max_abs_diff(resumed["state"], one["state"]) <= TOL
    for found in run_on_ranks(partial(own_loop, 2, plain=True), 4, world_size=2):
        assert "rt.forward_backward(model, inputs, target, loss_fn)" in found["refused"]


V, L = 11, 5  # a token model's vocabulary and sequence length


class Tokens(nn.Module):
    """A token model whose forward runs its children in order (a cut by names)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, 16)
        self.layers = nn.Sequential(
            *(nn.Sequential(nn.Linear(16, 16), nn.Tanh()) for _ in range(3))
        )
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(self.layers(self.emb(ids))))


def _token_data() -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, V, (N, L), generator=g)
    labels = ids.roll(-1, dims=1)
    labels[torch.rand(N, L, generator=g) < 0.3] = -100  # padding: rows of unequal counts
    return torch.utils.data.TensorDataset(ids, labels)


def _token_loss(logits: torch.Tensor, labels: torch.Tensor) -> distkit.Loss:
    total = nn.functional.cross_entropy(
        logits.reshape(-1, V), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    return distkit.Loss(total, (labels != -100).sum())


def _by_hand(model: Tokens) -> list[nn.Module]:
    """pipeline_split=fn: the stages as the user cuts them (the model's own modules)."""
    return [nn.Sequential(model.emb, model.layers[0]),
            nn.Sequential(model.layers[1], model.layers[2], model.norm, model.head)]  # fmt: skip


class _Named(torch.utils.data.Dataset):
    """The token data as dict batches, for a step_fn."""

    def __init__(self) -> None:
        self.ids, self.labels = _token_data().tensors

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"ids": self.ids[i], "labels": self.labels[i]}


def _token_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> distkit.Loss:
    return _token_loss(model(batch["ids"]), batch["labels"])


def _token_fit(pipeline: int, batch: int, weights: str, split: Any = None,
               step: bool = False) -> Any:  # fmt: skip
    torch.manual_seed(0)
    model = Tokens().to(DTYPE)
    strategy: Any = "ddp"
    if pipeline > 1:
        strategy = distkit.FSDPStrategy(pipeline_parallel=2, microbatches=2,
                                        pipeline_split=split or ["layers.1"])  # fmt: skip
    trainer = distkit.Trainer(strategy, batch_size=batch, grad_accum_steps=2, seed=3,
                              max_epochs=2, progress=False, gradient_clip_norm=0.05)  # fmt: skip
    how: dict[str, Any] = {"loss_fn": _token_loss}
    data: Any = _token_data()
    if step:  # dict batches, the loss from step_fn (evaluation's too)
        how, data = {"step_fn": _token_step}, _Named()
    result = trainer.fit(model, torch.optim.AdamW(model.parameters(), lr=1e-2), data,
                         val_data=data, **how)  # fmt: skip
    trainer.save_weights(weights)
    out = {"state": trainer.full_state_dict(), "history": result.history}
    trainer.close()
    return out


def test_token_exact_losses_and_save_weights_under_pp2_equal_one_process(run_on_ranks, tmp_path):
    """distkit.Loss(total, count) from loss_fn on the last stage: the step divides by every
    micro-batch's count; the weights saved gather both stages into the model's names; a
    cut by a callable trains the same, and so does a step_fn on dict batches (the model it
    calls stands in for the pipeline)."""
    from safetensors.torch import load_file

    one = run_on_ranks(partial(_token_fit, 1, weights=str(tmp_path / "one.safetensors")), 4,
                       world_size=1)[0]  # fmt: skip
    for split, name, step in ((None, "names", False), (_by_hand, "callable", False),
                              (None, "step_fn", True)):  # fmt: skip
        path = tmp_path / f"{name}.safetensors"
        ranks = run_on_ranks(partial(_token_fit, 2, weights=str(path), split=split, step=step),
                             4, world_size=2)  # fmt: skip
        for result in ranks:
            print(name, max_abs_diff(result["state"], one["state"]))
            assert max_abs_diff(result["state"], one["state"]) <= TOL, name
            assert_same_epochs(result["history"], one["history"])
        saved, reference = load_file(path), load_file(tmp_path / "one.safetensors")
        assert max_abs_diff(saved, reference) <= TOL, name


@pytest.mark.parametrize("checkpoint", ["sharded"])
def test_sigterm_to_one_stage_stops_both_and_resumes_exactly(tmp_path, checkpoint):
    """torchrun, pp2 (dropout in the first stage): SIGTERM to rank 1 (the last stage) at a
    step stops both ranks after the same step with a checkpoint; the rerun resumes and ends
    where the uninterrupted job ends. Sharded only (each stage's ranks write their part; the
    full checkpoint's gather is the checkpoint test's, and this job takes 20 s)."""

    from tests.faults.test_preemption import sigterm_stops_and_resumes_exactly

    sigterm_stops_and_resumes_exactly("pp2", tmp_path, sharded=checkpoint == "sharded")


# ---------------------------------------------------------------- the GPU path (NCCL)
def _on_gpu(pipeline: int, batch: int) -> dict[str, Any]:
    result = fit("fsdp", batch, pipeline=pipeline, clip=0.05)
    result["device"] = torch.cuda.current_device() if torch.cuda.is_available() else None
    return result


@needs("2 gpus", because="one GPU per rank: the stages' activations sent between GPUs (NCCL)")
def test_pp2_over_nccl_on_two_gpus_equals_one_gpu(run_on_ranks):
    """Written for a machine with 2+ CUDA GPUs (none here, none in CI; docs/gpu.md lists it):
    pp2 across two GPUs (the P2P sends, the loss broadcast, the relay's object sends staged on
    the GPU) against one GPU at the same batch, float64."""
    one = run_on_ranks(partial(_on_gpu, 1), 4, world_size=1)[0]
    for rank, result in enumerate(run_on_ranks(partial(_on_gpu, 2), 4, world_size=2)):
        assert result["device"] == rank
        assert max_abs_diff(result["state"], one["state"]) <= TOL
