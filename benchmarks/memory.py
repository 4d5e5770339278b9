"""Per-rank memory of a ~50M-parameter model: ddp, fsdp, HSDP, tensor and pipeline parallel and
DeepSpeed ZeRO 1/2/3, by ranks.

Each configuration trains the same residual MLP (default: 6 blocks ``x + W2 gelu(W1 x)`` of
width 1024 and hidden width 4096, and a 10-way head: 50.4 M parameters) in fp32 with Adam for
3 steps of 512 rows per rank, once without and once with activation checkpointing of every
``Block``. Every rank measures:

- **state**, at each optimizer step (inside its post-step hook: the step's gradients and the
  updated optimizer state are both alive there), as the bytes of unique tensor storages:
  ``params`` (the module's parameters: a sharded parameter's local slice, ZeRO-3's
  ``param.ds_tensor``), ``master`` (the tensors the optimizer steps over that are not the
  module's parameters: ZeRO's fp32 partitions), ``grads`` (their ``.grad``) and ``optimizer``
  (Adam's state). ``live`` is every tensor storage the garbage collector can reach
  (``gc.get_objects()``, deduplicated by storage address; the dataset left out), and ``other``
  what ``live`` holds beyond the four: ZeRO's buckets, the batch, ... On CPU there is no
  device allocator to ask, so this walk stands in for "allocator statistics": it cannot see
  tensors held only by C++ (DDP's gradient buckets, autograd's graph), which RSS does count.
- **activations**: the bytes the forward saves for backward (unique storages packed by
  ``torch.autograd.graph.saved_tensors_hooks`` around the model's forward, parameters left
  out), the largest step's.
- **RSS**, above the RSS right before the model is built (after the imports, DeepSpeed's and
  those the first fit makes on first use included, the process group and the dataset):
  ``rss_setup`` is the peak while the model is built and set up (up to its first forward),
  ``rss_training`` the peak from there to the end of training (the peak, VmHWM, is reset at
  both points through ``/proc/self/clear_refs``; where that is refused, both are the peak
  since the process started). ``rss_peak`` is the process's absolute peak.
  Workers run with ``MALLOC_MMAP_THRESHOLD_=131072`` so that glibc returns freed tensors to
  the system at once, and RSS follows the live tensors rather than the allocator's cache.

Next to the measured state bytes per parameter stands the theory for fp32 Adam (4 bytes of
parameter, 4 of gradient, 8 of Adam's two moments): ddp 16; fsdp on N ranks 16/N; HSDP with
2 replica groups of S ranks 16/S; ZeRO-1 4 + 4 + 8/N, ZeRO-2 4 + 4/N + 8/N, ZeRO-3 16/N, each
plus the fp32 master partition (4/N) that DeepSpeed keeps beside the module's parameters even
when these are fp32. ``tp2`` is ``FSDPStrategy(tensor_parallel=2)`` with each block's ``up``
colwise and ``down`` rowwise (at 2 ranks tensor parallel alone, at 4 ranks fsdp2 x tp2): a
parameter the plan splits keeps 16/N bytes (split 2 ways, sharded over N/2), one it does not
(``down``'s bias, the head) 16/(N/2); the theory weighs the two by their counts. Its batch is
per data-parallel rank (a tensor-parallel group's 2 ranks share one). ``pp2`` is
``FSDPStrategy(pipeline_parallel=2)`` cut at the middle block (the head in the second stage;
2 micro-batches, 1F1B; at 4 ranks pp2 x fsdp2): a rank keeps its stage's parameters,
16 x (the stage's share) / (its data-parallel ranks) bytes per parameter of the model, the
theory for the larger stage. Its activations are not measured (the stages run their modules
outside the model's forward, which the measurement hooks): ``null``.

    python benchmarks/memory.py      # the tables in docs/large-models.md (~20 min on 2 cores)
    python benchmarks/memory.py --strategies ddp fsdp --procs 1 2 --width 64 --layers 2

Writes benchmarks/results/memory.json:

    {"meta": {"parameters", "width", "hidden", "layers", "batch_size", "steps", "torch",
              "deepspeed"},
     CONFIG: {RANKS: {"off" | "on": ENTRY}}}    # CONFIG: ddp, fsdp, hsdp, deepspeed1, ...
                                                # RANKS: "1", "2", "4"; "on": checkpointing
    ENTRY = {"skipped": why} | {"error": what} | {
        "params", "master", "grads", "optimizer", "state", "other", "live", "activations",
        "rss_setup", "rss_training", "rss_peak":  bytes, each the largest over the ranks,
        "parameters": the model's, "bytes_per_param": state / parameters,
        "theory": {"params", "master", "grads", "optimizer": bytes per parameter,
                   "textbook": without master, "total": with it},
        "vs_1": state / the same configuration's state on 1 rank (null: none measured)}
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn
from typing_extensions import override

import distkit

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 2**20
CONFIGS = ("ddp", "fsdp", "hsdp", "tp2", "pp2", "deepspeed1", "deepspeed2", "deepspeed3")
PIPELINE = 2
HSDP_REPLICAS = 2
TENSOR_PARALLEL = 2
#: tp2's plan: each block's two Linear layers (the blocks are the Sequential's children "0", ...)
TP_PLAN = {"*.up": "colwise", "*.down": "rowwise"}
CHECKPOINTING = {"off": (False,), "on": (True,), "both": (False, True)}
STATE_PARTS = ("params", "master", "grads", "optimizer")
RSS_FIELDS = ("rss_setup", "rss_training", "rss_peak")
FIELDS = (*STATE_PARTS, "state", "other", "live", "activations", *RSS_FIELDS)
CLASSES = 10
#: code the first fit imports on first use (torch's compiler stack under ddp and fsdp; what
#: deepspeed.initialize pulls in, as of DeepSpeed 0.19): imported before the baseline, so that
#: the training peak is memory, not modules. A name another version lacks is passed over.
LAZY_IMPORTS = {
    "torch": ("torch._dynamo",),
    "deepspeed": (
        "deepspeed",
        "deepspeed.runtime.engine",
        "deepspeed.ops.op_builder.all_ops",
        "deepspeed.module_inject.auto_ep_layer",
        "deepspeed.runtime.zero.muon.muon_optimizer",
        "deepspeed.ops.triton_ops",
        "functorch.compile",
    ),
}


# ---------------------------------------------------------------------------- the model
class Block(nn.Module):
    """A transformer's MLP with its residual: the unit fsdp shards and checkpointing wraps."""

    def __init__(self, width: int, hidden: int) -> None:
        super().__init__()
        self.up = nn.Linear(width, hidden)
        self.down = nn.Linear(hidden, width)

    @override
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(nn.functional.gelu(self.up(x)))


def make_model(width: int, hidden: int, layers: int) -> nn.Sequential:
    # blocks as top-level children: fsdp's default policy makes each one a unit of its own
    torch.manual_seed(0)
    return nn.Sequential(*(Block(width, hidden) for _ in range(layers)), nn.Linear(width, CLASSES))


# ---------------------------------------------------------------------------- configurations
def make_strategy(config: str, layers: int = 6) -> str | distkit.Strategy:
    # imported here: the launcher needs neither, and a worker one of them
    if config == "ddp":
        return "ddp"
    if config in ("fsdp", "hsdp", "tp2", "pp2"):
        from distkit.strategies.fsdp import FSDPStrategy

        if config == "pp2":  # the Sequential's children "0", ...: the second stage at the middle
            return FSDPStrategy(pipeline_parallel=PIPELINE, pipeline_split=[str(layers // 2)],
                                microbatches=2)  # fmt: skip
        if config == "tp2":
            return FSDPStrategy(tensor_parallel=TENSOR_PARALLEL, tensor_plan=TP_PLAN)
        return FSDPStrategy(replicate=HSDP_REPLICAS if config == "hsdp" else 1)
    from distkit.strategies.deepspeed import DeepSpeedStrategy

    return DeepSpeedStrategy(stage=zero_stage(config))


def zero_stage(config: str) -> int:
    return int(config.removeprefix("deepspeed"))


def skip_reason(config: str, procs: int) -> str | None:
    if config == "hsdp" and procs != 2 * HSDP_REPLICAS:
        # one rank per group would be ddp; one group would be fsdp
        return f"HSDP runs at {2 * HSDP_REPLICAS} ranks only ({HSDP_REPLICAS} groups x 2)"
    if config == "tp2" and procs % TENSOR_PARALLEL:
        return f"tensor parallel needs a multiple of {TENSOR_PARALLEL} ranks"
    if config == "pp2" and procs % PIPELINE:
        return f"pipeline parallel needs a multiple of {PIPELINE} ranks"
    if config.startswith("deepspeed") and importlib.util.find_spec("deepspeed") is None:
        return "DeepSpeed is not installed (pip install 'distkit[deepspeed]')"
    return None


def theory(config: str, procs: int, split: float = 0.0) -> dict[str, float]:
    """Bytes per parameter a rank keeps under fp32 Adam, by part (see the module docstring);
    ``split``: the share of the parameters tensor parallelism splits (tp2), or the larger
    stage's share of them (pp2)."""
    if config.startswith("deepspeed"):
        stage = zero_stage(config)
        parts = {
            "params": 4 / procs if stage == 3 else 4.0,
            "master": 4 / procs,  # the fp32 partition ZeRO steps over, a copy
            "grads": 4 / procs if stage >= 2 else 4.0,
            "optimizer": 8 / procs,
        }
    else:
        if config == "tp2":  # split: over every rank; whole: over the data-parallel ones
            data = procs // TENSOR_PARALLEL
            per_byte = split / procs + (1 - split) / data
        elif config == "pp2":  # the larger stage's parameters, over its data-parallel ranks
            per_byte = split / (procs // PIPELINE)
        else:
            per_byte = 1 / {"ddp": 1, "fsdp": procs, "hsdp": procs // HSDP_REPLICAS}[config]
        parts = {"params": 4 * per_byte, "master": 0.0, "grads": 4 * per_byte,
                 "optimizer": 8 * per_byte}  # fmt: skip
    total = sum(parts.values())
    return {**parts, "textbook": total - parts["master"], "total": total}


# ---------------------------------------------------------------------------- measuring
def storage_of(tensor: torch.Tensor) -> tuple[int, int] | None:
    """(address, bytes) of the memory behind ``tensor`` (a DTensor's local slice), or None."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    if local.is_sparse or local.device.type == "meta":
        return None
    storage = local.untyped_storage()
    address = storage.data_ptr()
    return (address, storage.nbytes()) if address else None


def storages(tensors: Iterable[torch.Tensor | None]) -> dict[int, int]:
    found = (storage_of(t) for t in tensors if t is not None)
    return dict(item for item in found if item is not None)


def live_storages() -> dict[int, int]:
    """Every tensor storage Python can reach: what a CPU rank holds, short of C++-only ones."""
    found: dict[int, int] = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and (item := storage_of(obj)) is not None:
                found[item[0]] = item[1]
        except (ReferenceError, RuntimeError, NotImplementedError, TypeError):
            continue  # a dead weak proxy, a tensor subclass without storage
    return found


class StateMeter:
    """The bytes of parameters, master copies, gradients and optimizer state, and all live
    tensors, at each optimizer step; keeps the step with the most live bytes."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, leave_out: set[int]):
        self.model = model
        self.leave_out = leave_out  # the dataset's storages: the same under every strategy
        self.largest: dict[str, int] = dict.fromkeys((*STATE_PARTS, "other", "live"), 0)
        # the user's optimizer steps under every strategy: fsdp re-points it in place, and
        # ZeRO's inner torch.optim *is* it, stepping over ZeRO's flat fp32 partitions
        optimizer.register_step_post_hook(self._measure)

    def _measure(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        module = [getattr(p, "ds_tensor", p) for p in self.model.parameters()]  # ZeRO-3 slice
        stepped = [p for group in optimizer.param_groups for p in group["params"]]
        state = (v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
        parts = {
            "params": storages(module),
            "master": storages(stepped),
            "grads": storages(p.grad for p in [*self.model.parameters(), *stepped]),
            "optimizer": storages(state),
        }
        counted: set[int] = set(self.leave_out)
        sizes = {}
        for name, found in parts.items():  # a storage counts once, in the first part it is in
            sizes[name] = sum(size for address, size in found.items() if address not in counted)
            counted.update(found)
        live = {**live_storages(), **{a: s for found in parts.values() for a, s in found.items()}}
        sizes["other"] = sum(size for address, size in live.items() if address not in counted)
        sizes["live"] = sum(size for a, size in live.items() if a not in self.leave_out)
        if sizes["live"] > self.largest["live"]:
            self.largest = sizes


class SavedForBackward:
    """The bytes the model's forward saves for backward, parameters left out (they are state),
    counted once per storage; keeps the largest step's."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.largest = 0
        self._step: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        model.register_forward_pre_hook(self._start)
        model.register_forward_hook(self._stop)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        # read at each pack: fsdp and ZeRO-3 swap in gathered parameters unit by unit
        parameters = storages(self.model.parameters())
        item = storage_of(tensor)
        if item is not None and item[0] not in parameters:
            self._step[item[0]] = item[1]
        return tensor

    def _start(self, *_: Any) -> None:
        self._step = {}
        self._hooks.__enter__()

    def _stop(self, *_: Any) -> None:
        self._hooks.__exit__(None, None, None)
        self.largest = max(self.largest, sum(self._step.values()))


class ResidentSet:
    """Peak RSS above a starting point in two phases: the set-up (the model built, the strategy
    wrapping it) up to the first forward, then training; and the process's absolute peak."""

    def __init__(self) -> None:
        gc.collect()
        self.peak_before = _max_rss()
        self.at_start = _rss()
        self.resets = _reset_peak()
        self.setup_peak: int | None = None

    def end_setup(self, *_: Any) -> None:
        """The first forward begins: the set-up's peak is known, the training's starts."""
        if self.setup_peak is None:
            self.setup_peak = self._peak()
            self.resets = self.resets and _reset_peak()

    def _peak(self) -> int:
        # without a reset, ru_maxrss: the peak since the process started, phases merged
        return _peak_since_reset() if self.resets else _max_rss()

    def report(self) -> dict[str, int]:
        training = self._peak()
        setup = training if self.setup_peak is None else self.setup_peak
        return {
            "rss_setup": setup - self.at_start,
            "rss_training": training - self.at_start,
            "rss_peak": max(setup, training, self.peak_before),
        }


def _rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _max_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def _reset_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as clear:
            clear.write("5")  # resets VmHWM, the peak RSS (Linux 4.0+)
    except OSError:
        return False
    return True


def _peak_since_reset() -> int:
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


# ---------------------------------------------------------------------------- one run
def worker(config: str, checkpointing: bool, args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    import_lazy_code(config)
    trainer = distkit.Trainer(
        make_strategy(config, args.layers),
        batch_size=args.batch_size,
        progress=False,
        activation_checkpointing=[Block] if checkpointing else None,
    )
    data = dataset(args.steps * args.batch_size * trainer.data_world_size, args.width)
    rss = ResidentSet()
    model = make_model(args.width, args.hidden, args.layers)
    count = sum(p.numel() for p in model.parameters())
    split = sum(p.numel() for name, p in model.named_parameters() if tensor_split(name))
    if config == "pp2":  # the larger stage's parameters: the blocks from the middle, the head
        half = args.layers // 2
        split = max(
            sum(p.numel() for n, p in model.named_parameters() if int(n.split(".")[0]) < half),
            sum(p.numel() for n, p in model.named_parameters() if int(n.split(".")[0]) >= half),
        )
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
    state = StateMeter(model, optimizer, leave_out=set(storages(data.tensors)))
    saved = SavedForBackward(model)
    for module in (model, *model.children()):  # a pipeline runs the children, not the model
        module.register_forward_pre_hook(rss.end_setup)
    trainer.fit(model, optimizer, data, loss_fn=nn.functional.cross_entropy)
    activations = None if config == "pp2" else saved.largest
    mine = {**state.largest, "activations": activations, **rss.report(), "parameters": count,
            "split": split}  # fmt: skip
    mine["state"] = sum(mine[part] for part in STATE_PARTS)
    ranks = trainer.strategy.all_gather_object(mine)
    if trainer.is_main:
        args.out.write_text(json.dumps({"ranks": ranks}))
    trainer.close()


def tensor_split(name: str) -> bool:
    """Whether TP_PLAN splits the parameter ``name``: a colwise layer's weight and bias, a
    rowwise layer's weight (its bias is added whole, after the sum over the ranks)."""
    return name.endswith((".up.weight", ".up.bias", ".down.weight"))


def import_lazy_code(config: str) -> None:
    names = list(LAZY_IMPORTS["torch"])
    if config.startswith("deepspeed"):
        os.environ.setdefault("DS_ACCELERATOR", "cpu")  # as the strategy sets it on CPU
        names += LAZY_IMPORTS["deepspeed"]
    for name in names:
        try:
            importlib.import_module(name)
        except ModuleNotFoundError:
            continue


def dataset(samples: int, width: int) -> torch.utils.data.TensorDataset:
    generator = torch.Generator().manual_seed(1)
    return torch.utils.data.TensorDataset(
        torch.randn(samples, width, generator=generator),
        torch.randint(0, CLASSES, (samples,), generator=generator),
    )


def launch(
    config: str, procs: int, checkpointing: bool, args: argparse.Namespace
) -> dict[str, Any]:
    """One configuration at one rank count: the largest rank's figures, or why there are none."""
    reason = skip_reason(config, procs)
    if reason:
        return {"skipped": reason}
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "ranks.json"
        script = [__file__, "--worker", config, "--out", str(out), *model_arguments(args)]
        if checkpointing:
            script.append("--checkpointed")
        # a world of one as plain `python` runs it (DeepSpeed's too: distkit sets LOCAL_RANK)
        torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"]
        cmd = [sys.executable, *(torchrun if procs > 1 else []), *script]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MALLOC_MMAP_THRESHOLD_": "131072"}
        # DeepSpeed and torchrun print pages: keep stderr's tail to say why a run failed
        proc = subprocess.run(
            cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        if proc.returncode != 0:
            return {"error": failure(proc.returncode, proc.stderr)}
        ranks = json.loads(out.read_text())["ranks"]
    return largest_rank(ranks, config, procs)


def failure(code: int, stderr: str) -> str:
    lines = [line for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return f"exited {code}: {(errors or lines or ['no output'])[-1].strip()[:300]}"


def model_arguments(args: argparse.Namespace) -> list[str]:
    names = ("width", "hidden", "layers", "batch_size", "steps")
    return [
        text for name in names for text in (f"--{name.replace('_', '-')}", str(vars(args)[name]))
    ]


def largest_rank(ranks: list[dict[str, int]], config: str, procs: int) -> dict[str, Any]:
    entry: dict[str, Any] = {
        field: max(rank[field] for rank in ranks) if ranks[0][field] is not None else None
        for field in FIELDS
    }
    entry["bytes_per_param"] = entry["state"] / ranks[0]["parameters"]
    entry["theory"] = theory(config, procs, ranks[0]["split"] / ranks[0]["parameters"])
    entry["parameters"] = ranks[0]["parameters"]
    return entry


# ---------------------------------------------------------------------------- the tables
def mib(value: float | None) -> str:
    return "not measured" if value is None else f"{value / MIB:.1f}"


def state_table(results: dict[str, Any]) -> Iterator[str]:
    """Per-rank state (the runs without checkpointing: the state does not depend on it)."""
    yield (
        "| configuration | ranks | params | ZeRO fp32 copy | grads | optimizer | state "
        "| B/param | theory B/param | other live |"
    )
    yield "|---|--:|--:|--:|--:|--:|--:|--:|--:|--:|"
    for config, procs, runs in rows(results):
        entry = runs.get("off") or next(iter(runs.values()))
        if "state" not in entry:
            yield f"| {config} | {procs} | {entry.get('skipped') or entry.get('error')} |||||||||"
            continue
        parts = " | ".join(mib(entry[part]) for part in (*STATE_PARTS, "state"))
        theory_text = f"{entry['theory']['textbook']:.1f}"
        if entry["theory"]["master"]:
            theory_text += f" + {entry['theory']['master']:.1f}"
        yield (
            f"| {config} | {procs} | {parts} | {entry['bytes_per_param']:.1f} | {theory_text} "
            f"| {mib(entry['other'])} |"
        )


def activation_table(results: dict[str, Any]) -> Iterator[str]:
    """Activations and RSS without and with checkpointing ("off / on")."""
    yield (
        "| configuration | ranks | activations | set-up peak RSS | training peak RSS "
        "| absolute peak RSS |"
    )
    yield "|---|--:|--:|--:|--:|--:|"
    for config, procs, runs in rows(results):
        if not any("state" in entry for entry in runs.values()):
            reason = " / ".join(sorted({e.get("skipped") or e["error"] for e in runs.values()}))
            yield f"| {config} | {procs} | {reason} ||||"
            continue
        cells = [pair(runs, field) for field in ("activations", *RSS_FIELDS)]
        yield f"| {config} | {procs} | " + " | ".join(cells) + " |"


def pair(runs: dict[str, dict[str, Any]], field: str) -> str:
    """ "off / on" (one figure where both read the same)."""

    def one(entry: dict[str, Any] | None) -> str:
        if entry is None:
            return "-"
        return mib(entry[field]) if field in entry else entry.get("skipped") or entry["error"]

    texts = [one(runs.get(key)) for key in ("off", "on")]
    return texts[0] if texts[0] == texts[1] else " / ".join(texts)


def rows(results: dict[str, Any]) -> Iterator[tuple[str, str, dict[str, Any]]]:
    for config, by_procs in results.items():
        if config != "meta":
            for procs, runs in by_procs.items():
                yield config, procs, runs


def add_vs_1(results: dict[str, Any]) -> None:
    for config, _, runs in rows(results):
        for key, entry in runs.items():
            base = results[config].get("1", {}).get(key, {}).get("state")
            if "state" in entry:
                entry["vs_1"] = entry["state"] / base if base else None


# ---------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--strategies", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--checkpointing", choices=tuple(CHECKPOINTING), default="both")
    parser.add_argument("--width", type=int, default=1024, help="features between blocks")
    parser.add_argument("--hidden", type=int, default=None, help="inside a block (4 x width)")
    parser.add_argument("--layers", type=int, default=6, help="blocks")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=512, help="rows per rank and step")
    parser.add_argument("--results", type=Path, default=RESULTS, help="where memory.json goes")
    parser.add_argument("--worker", choices=CONFIGS, help=argparse.SUPPRESS)
    parser.add_argument("--checkpointed", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.hidden = args.hidden or 4 * args.width
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker(args.worker, args.checkpointed, args)
        return 0
    results: dict[str, Any] = {"meta": meta(args)}
    for config in args.strategies:
        for procs in args.procs:
            for checkpointing in CHECKPOINTING[args.checkpointing]:
                entry = launch(config, procs, checkpointing, args)
                results.setdefault(config, {}).setdefault(str(procs), {})
                results[config][str(procs)]["on" if checkpointing else "off"] = entry
                print(progress(config, procs, checkpointing, entry), flush=True)
    add_vs_1(results)
    print_tables(results)
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "memory.json").write_text(json.dumps(results, indent=2))
    print(f"\nwrote {args.results / 'memory.json'}")
    return 0


def progress(config: str, procs: int, checkpointing: bool, entry: dict[str, Any]) -> str:
    outcome = entry.get("skipped") or entry.get("error") or "measured"
    return f"{config} x{procs}, checkpointing {'on' if checkpointing else 'off'}: {outcome}"


def meta(args: argparse.Namespace) -> dict[str, Any]:
    with torch.device("meta"):  # counted, not allocated
        model = make_model(args.width, args.hidden, args.layers)
    spec = importlib.util.find_spec("deepspeed")
    deepspeed = None
    if spec is not None:
        from importlib.metadata import version

        deepspeed = version("deepspeed")
    return {
        "parameters": sum(p.numel() for p in model.parameters()),
        "width": args.width,
        "hidden": args.hidden,
        "layers": args.layers,
        "batch_size": args.batch_size,
        "steps": args.steps,
        "torch": torch.__version__,
        "deepspeed": deepspeed,
    }


def print_tables(results: dict[str, Any]) -> None:
    info = results["meta"]
    print(
        f"\nper rank, the largest rank, MiB: {info['parameters'] / 1e6:.1f} M parameters, fp32 "
        f"Adam, {info['batch_size']} rows per rank\n"
    )
    print("\n".join(state_table(results)))
    print("\nwithout / with activation checkpointing, MiB\n")
    print("\n".join(activation_table(results)))


if __name__ == "__main__":
    sys.exit(main())
