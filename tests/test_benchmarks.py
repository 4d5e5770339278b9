"""Smoke tests of benchmarks/: the scripts run and write what the docs and charts read.

No timing assertions: performance claims live in the benchmarks' own output, not in tests.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.gates import needs
from tests.support.multiprocess import children_see_cuda
from tests.support.paths import ROOT

pytestmark = pytest.mark.timeout(180)

BENCH = ROOT / "benchmarks"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def run_script(*args: str) -> subprocess.CompletedProcess[str]:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
    }
    proc = subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, env=env, timeout=170, cwd=ROOT
    )
    assert proc.returncode == 0, f"{args} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}"
    return proc


def test_overhead_single_writes_a_positive_ratio(tmp_path: Path) -> None:
    # run a copy: it writes next to itself (tmp_path/results), never over the real results
    for name in ("overhead.py", "models.py"):
        shutil.copy(BENCH / name, tmp_path / name)
    run_script(str(tmp_path / "overhead.py"), "--only", "single", "--steps", "20", "--rounds", "1")
    results = json.loads((tmp_path / "results" / "overhead.json").read_text())
    assert results
    for entry in results.values():
        assert entry["ratio"] > 0
        assert entry["steps_timed"] > 0


def memory_table(tmp_path: Path, *args: str) -> tuple[dict[str, Any], str]:
    """benchmarks/memory.py on a tiny model (2 blocks of width 64), with ``args``."""
    tiny = ["--width", "64", "--layers", "2", "--batch-size", "64"]
    proc = run_script(str(BENCH / "memory.py"), *tiny, "--results", str(tmp_path), *args)
    return json.loads((tmp_path / "memory.json").read_text()), proc.stdout


def test_memory_fsdp_halves_the_per_rank_state_and_checkpointing_the_activations(
    tmp_path: Path,
) -> None:
    results, stdout = memory_table(
        tmp_path, "--strategies", "ddp", "fsdp", "hsdp", "--procs", "2", "--checkpointing", "both"
    )
    parameters = results["meta"]["parameters"]
    ddp, fsdp = results["ddp"]["2"], results["fsdp"]["2"]
    # fp32 Adam: every rank keeps everything (and Adam's step count per tensor)
    assert ddp["off"]["state"] == pytest.approx(16 * parameters, rel=0.01)
    assert fsdp["off"]["state"] == pytest.approx(ddp["off"]["state"] / 2, rel=0.01)
    for runs in (ddp, fsdp):
        assert runs["on"]["state"] == runs["off"]["state"]  # checkpointing keeps the same state
        assert runs["on"]["activations"] < runs["off"]["activations"] / 3
        for entry in runs.values():
            assert entry["bytes_per_param"] == pytest.approx(entry["theory"]["total"], rel=0.01)
            assert entry["rss_peak"] >= max(entry["rss_setup"], entry["rss_training"]) > 0
    assert fsdp["off"]["activations"] == ddp["off"]["activations"]  # gathered weights left out
    assert "4 ranks only" in results["hsdp"]["2"]["off"]["skipped"]
    assert "| fsdp | 2 |" in stdout and "4 ranks only" in stdout


def test_memory_pp2_keeps_each_stages_state_on_its_ranks(tmp_path: Path) -> None:
    results, _ = memory_table(tmp_path, "--strategies", "pp2", "--procs", "2",
                              "--checkpointing", "off")  # fmt: skip
    entry = results["pp2"]["2"]["off"]
    # two blocks and the head: the larger stage (a block and the head) over its one rank
    assert entry["bytes_per_param"] == pytest.approx(entry["theory"]["total"], rel=0.01)
    assert 0.5 < entry["theory"]["total"] / 16 < 0.6
    assert entry["activations"] is None  # the stages run outside the model's forward


def test_pipeline_times_each_schedule_beside_the_hand_written_one(tmp_path: Path) -> None:
    # 1F1B and interleaved (which has no hand-written twin): 4 launches
    tiny = ["--width", "32", "--hidden", "64", "--layers", "4", "--batch", "16", "--steps", "2",
            "--warmup", "1", "--microbatches", "4", "--schedules", "1F1B", "interleaved1F1B",
            "--results", str(tmp_path)]  # fmt: skip
    proc = run_script(str(BENCH / "pipeline.py"), *tiny)
    results = json.loads((tmp_path / "pipeline.json").read_text())
    assert results["one_ms"] > 0
    kinds = {row["schedule"]: row for row in results["rows"]}
    assert set(kinds) == {"1F1B", "interleaved1F1B"}
    assert kinds["1F1B"]["hand_ms"] > 0 and kinds["interleaved1F1B"]["hand_ms"] is None
    assert kinds["1F1B"]["theory"] == pytest.approx(1 / 5)
    assert kinds["interleaved1F1B"]["step_ms"] > 0
    assert "| 1F1B | 1 | 4 |" in proc.stdout


def test_checkpoints_times_blocking_and_background_saves_locally_and_on_s3(tmp_path: Path) -> None:
    pytest.importorskip("moto.server", reason="moto[server] is in the test extra")
    proc = run_script(str(BENCH / "checkpoints.py"), "--sizes", "25", "--ranks", "1",
                      "--saves", "1", "--results", str(tmp_path))  # fmt: skip
    rows = json.loads((tmp_path / "checkpoints.json").read_text())["rows"]
    assert [(row["store"], row["size_mb"]) for row in rows] == [("local", 25), ("s3", 25)]
    for row in rows:
        assert 0 < row["async_blocked_s"] <= row["async_persist_s"]
        assert row["ratio"] == pytest.approx(row["async_blocked_s"] / row["sync_blocked_s"])
    assert "| 25 MB | 1 | s3 |" in proc.stdout


@needs("deepspeed")
def test_memory_zero3_shards_the_state_and_counts_its_fp32_copy(tmp_path: Path) -> None:
    results, _ = memory_table(
        tmp_path, "--strategies", "deepspeed3", "--procs", "2", "--checkpointing", "off"
    )
    parameters = results["meta"]["parameters"]
    entry = results["deepspeed3"]["2"]["off"]
    assert entry["theory"]["textbook"] == 8 and entry["theory"]["master"] == 2
    # ZeRO's partitions of parameters (param.ds_tensor), their fp32 copy, gradients, Adam
    for part, per_param in (("params", 2), ("master", 2), ("grads", 2), ("optimizer", 4)):
        assert entry[part] == pytest.approx(per_param * parameters, rel=0.01), part
    assert entry["state"] - entry["master"] == pytest.approx(16 * parameters / 2, rel=0.01)


def test_peers_runs_distkit_and_the_hand_loop_on_1_and_2_processes(tmp_path: Path) -> None:
    out = tmp_path / "peers.json"
    proc = run_script(
        str(BENCH / "peers.py"), "--only", "distkit,hand", "--steps", "6", "--rounds", "1",
        "--nprocs", "1,2", "--out", str(out),
    )  # fmt: skip
    report = json.loads(out.read_text())
    assert report["meta"]["threads_per_process"] == 1
    for key, processes in (("single", 1), ("x2", 2)):
        block = report[key]
        assert block["processes"] == processes
        assert list(block["frameworks"]) == ["hand", "distkit"]  # only what was asked for
        for entry in block["frameworks"].values():
            assert entry["status"] == "ok", entry
            assert entry["ratio"] > 0 and entry["samples_per_s"] > 0
            assert entry["steps_timed"] == 5  # 6 steps: 5 forward-to-forward intervals
            assert entry["calls_per_step"] > 10  # counted in one more epoch
            # the same FLOPs per sample for every loop: MFU ranks them as samples/s does
            mfu = (
                block["flops_per_sample"]
                * entry["samples_per_s"]
                / (processes * block["peak_flops"])
            )
            assert entry["mfu"] == pytest.approx(mfu, rel=1e-12) and 0 < entry["mfu"] < 1
        assert block["peak_source"].startswith("measured: CPU fp32 matmul, 1 thread")
        assert block["frameworks"]["hand"]["ratio"] == 1.0
    assert "distkit" in proc.stdout and "vs hand" in proc.stdout
    # one model, counted once per block: the same count at every world size
    assert report["single"]["flops_per_sample"] == report["x2"]["flops_per_sample"] > 1e6


def test_compile_blocks_times_each_mode_on_gpt2_and_compares_it_with_eager(tmp_path):
    pytest.importorskip(
        "transformers", reason="the GPT-2 example's model (pip install transformers)"
    )
    out = tmp_path / "compile_blocks.json"
    proc = run_script(
        str(BENCH / "compile_blocks.py"), "--layers", "3", "--steps", "6", "--warmup", "2",
        "--backend", "aot_eager", "--out", str(out),
    )  # fmt: skip
    results = json.loads(out.read_text())["layers_3"]
    assert list(results) == ["eager", "model", "blocks"]
    for mode, entry in results.items():
        assert entry["status"] == "ok", entry
        assert entry["steps"] == 6 and entry["first_step_s"] > 0 and entry["step_ms"] > 0
        assert entry["max_weight_diff"] == 0.0, mode  # aot_eager runs eager's kernels
    assert results["eager"]["graphs"] == 0
    assert results["blocks"]["graphs"] == 1  # three GPT2Blocks, one graph
    assert "GPT-2, 3 blocks" in proc.stdout


def test_growth_notes_the_first_step_and_every_distkit_check_on_2_ranks(tmp_path: Path) -> None:
    out = tmp_path / "growth.json"
    run_script(
        str(BENCH / "growth.py"), "--ranks", "2", "--only", "hand,trainer,runtime",
        "--out", str(out),
    )  # fmt: skip
    results = json.loads(out.read_text())["results"]
    for loop in ("hand", "trainer", "runtime"):
        summary = results[loop]["2"]
        assert summary["status"] == "ok", summary
        assert summary["first_step_s"] >= summary["first_step_rank0_s"] > 0
    assert results["hand"]["2"]["checks"] == {}  # the hand loop has no checks of distkit's
    fit = results["trainer"]["2"]["checks"]
    # the start-of-fit agreement: a tagged sum of 4 x 2 + 3 float64, then the messages
    assert fit["exchange[fit] all_reduce_async"]["bytes_per_rank"] == (4 * 2 + 3) * 8
    assert fit["exchange[fit] all_gather"]["calls"] == 1
    assert fit["tagged_sum[log] all_reduce_async (in loop)"]["calls"] == 4  # a log point a step
    loop = results["runtime"]["2"]["checks"]
    assert {"exchange[setup] all_gather", "exchange[loader] all_gather"} <= set(loop)
    for entry in [*fit.values(), *loop.values()]:
        assert 0 <= entry["min_s"] <= entry["max_s"]


def test_peers_reports_a_missing_framework_instead_of_crashing(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import peers

    monkeypatch.setitem(peers.NEEDS, "accelerate", ("no_such_module_xyz", "pip install accelerate"))
    args = peers.parse_args(["--only", "accelerate", "--steps", "4", "--rounds", "1"])
    assert args.only == ["hand", "accelerate"]  # the baseline always runs
    threads = torch.get_num_threads()
    try:
        results = peers.measure(peers.context(1, 0, 1, args), args.only, args.rounds)
    finally:
        torch.set_num_threads(threads)
    assert results["hand"]["status"] == "ok"
    assert results["accelerate"] == {
        "status": "not installed",
        "detail": "not installed (pip install accelerate)",
    }


def test_peers_rejects_an_unknown_framework(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(BENCH))
    import peers

    with pytest.raises(SystemExit):
        peers.parse_args(["--only", "distkit,deepspeed"])
    assert "unknown framework(s) deepspeed" in capsys.readouterr().err


def write_results(folder: Path, *, scaling: bool) -> None:
    folder.mkdir()
    run = {"world_size": 1, "batch_size_per_process": 32, "steps_timed": 100}
    overhead = {
        "single": {**run, "hand_ms": 6.6, "distkit_ms": 6.5, "ratio": 0.985},
        "ddp x2": {**run, "world_size": 2, "hand_ms": 9.1, "distkit_ms": 9.3, "ratio": 1.02},
    }
    (folder / "overhead.json").write_text(json.dumps(overhead))
    if scaling:
        rates = {"dp": {"1": 6000.0}, "ddp": {"1": 5500.0, "2": 7000.0}}
        data = {s: {n: {"samples_per_s": v} for n, v in by_n.items()} for s, by_n in rates.items()}
        (folder / "scaling.json").write_text(json.dumps(data))

    def ok(ms: float, ratio: float) -> dict[str, object]:
        return {"status": "ok", "ms_per_step": ms, "ratio": ratio, "samples_per_s": 32e3 / ms}

    peers = {
        "meta": {"date": "2025-01-02T03:04:05+00:00", "machine": "2-core CPU machine"},
        "single": {
            "processes": 1,
            "frameworks": {
                "hand": ok(6.0, 1.0),
                "distkit": ok(6.1, 1.017),
                "fabric": ok(6.5, 1.083),
                "lightning": {"status": "failed", "detail": "boom"},
                "accelerate": {"status": "not installed", "detail": "pip install accelerate"},
            },
        },
        "x2": {"processes": 2, "frameworks": {"hand": ok(9.0, 1.0), "distkit": ok(9.2, 1.022)}},
    }
    (folder / "peers.json").write_text(json.dumps(peers))


@pytest.mark.parametrize("scaling", [True, False], ids=["with-scaling", "without-scaling"])
def test_plot_writes_both_charts(tmp_path: Path, scaling: bool) -> None:
    pytest.importorskip("matplotlib", reason="plot.py needs matplotlib (pip install matplotlib)")
    write_results(tmp_path / "results", scaling=scaling)
    out = tmp_path / "img"
    proc = run_script(
        str(BENCH / "plot.py"), "--results", str(tmp_path / "results"), "--out", str(out)
    )
    for name in ("overhead.png", "throughput.png"):
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, name
    assert ("scaling.json: its panel is left out" in proc.stdout) is not scaling


def test_streams_benchmark_prints_each_kind_against_map_style(tmp_path: Path) -> None:
    shutil.copy(BENCH / "streams.py", tmp_path / "streams.py")
    proc = run_script(str(tmp_path / "streams.py"), "--rounds", "1")
    for line in ("ddp x2: ms per step", "dp x1: ms per step", "one table sum alone"):
        assert line in proc.stdout
    table = json.loads((tmp_path / "results" / "streams.json").read_text())
    assert set(table) == {"ddp x2", "dp x1"}
    assert all(value > 0 for row in table.values() for value in row.values())


# ---------------------------------------------------------------------------- GPU benchmarks
# `nox -s bench -- --device cuda` runs benchmarks/gpu.py. Here (no GPU) the tests check that it
# skips cleanly, what it would run, the table it prints, and the CUDA timing by construction.
needs_cuda = needs("cuda")


def bench_module(monkeypatch: pytest.MonkeyPatch, name: str):  # type: ignore[no-untyped-def]
    monkeypatch.syspath_prepend(str(BENCH))
    return __import__(name)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a CUDA machine gpu.py runs instead")
def test_gpu_script_without_cuda_prints_one_line_and_exits_0() -> None:
    proc = run_script(str(BENCH / "gpu.py"))
    assert proc.stdout.strip() == (
        f"no CUDA device here (torch {torch.__version__}, cuda available: False): the GPU "
        "benchmarks skip; run this on a machine with NVIDIA GPUs and a CUDA build of torch"
    )


@pytest.mark.parametrize(
    ("argv", "device", "rest"),
    [
        ([], "cpu", []),
        (["--only", "single"], "cpu", ["--only", "single"]),
        (["--device", "cuda"], "cuda", []),
        (["--device=cuda", "--gpus", "1,2"], "cuda", ["--gpus", "1,2"]),
        (["--steps", "9", "--device", "cpu"], "cpu", ["--steps", "9"]),
    ],
)
def test_gpu_split_device_reads_the_bench_sessions_arguments(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], device: str, rest: list[str]
) -> None:
    gpu = bench_module(monkeypatch, "gpu")
    assert gpu.split_device(argv) == (device, rest)


@pytest.mark.parametrize("argv", [["--device"], ["--device", "tpu"], ["--device=gpu"]])
def test_gpu_split_device_rejects_other_devices(
    monkeypatch: pytest.MonkeyPatch, argv: list[str]
) -> None:
    gpu = bench_module(monkeypatch, "gpu")
    with pytest.raises(ValueError, match=r"cpu .*cuda"):
        gpu.split_device(argv)


class FakeSession:
    """What the bench session asks nox for: installs, runs, an error."""

    def __init__(self, posargs: list[str]) -> None:
        self.posargs = posargs
        self.installs: list[tuple[str, ...]] = []
        self.runs: list[tuple[str, ...]] = []

    def install(self, *args: str) -> None:
        self.installs.append(args)

    def run(self, *args: str, **kwargs: object) -> None:
        self.runs.append(args)

    def error(self, message: str) -> None:
        raise SystemExit(message)


@pytest.fixture
def noxfile(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    """noxfile.py imported with a stand-in for nox (not installed in the test environment)."""
    import importlib.util
    import types

    fake = types.ModuleType("nox")
    fake.options = types.SimpleNamespace()  # type: ignore[attr-defined]
    fake.session = lambda **_: lambda function: function  # type: ignore[attr-defined]
    fake.Session = FakeSession  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "nox", fake)
    spec = importlib.util.spec_from_file_location("noxfile_under_test", ROOT / "noxfile.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_session_with_device_cuda_installs_the_chosen_torch_and_runs_gpu_py(
    noxfile, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DISTKIT_BENCH_TORCH", raising=False)
    session = FakeSession(["--device", "cuda", "--gpus", "1,2"])
    noxfile.bench(session)
    assert session.installs[0] == ("torch==2.13.0",)
    assert all(args[0] == "torch==2.13.0" for args in session.installs if "lightning" in args)
    assert session.runs == [("python", "benchmarks/gpu.py", "--gpus", "1,2")]

    monkeypatch.setenv("DISTKIT_BENCH_TORCH", "torch==2.13.0+cu126")
    session = FakeSession(["--device=cuda"])
    noxfile.bench(session)
    assert session.installs[0] == ("torch==2.13.0+cu126",)
    assert session.runs == [("python", "benchmarks/gpu.py")]


def test_bench_session_on_cpu_runs_every_cpu_script_with_the_arguments_for_overhead(
    noxfile,
) -> None:
    session = FakeSession(["--only", "single"])
    noxfile.bench(session)
    scripts = [args[1] for args in session.runs if args[1].startswith("benchmarks/")]
    assert scripts == [
        f"benchmarks/{name}.py"
        for name in (
            "overhead",
            "scaling",
            "memory",
            "streams",
            "peers",
            "startup",
            "compile_blocks",
            "plot",
        )
    ]
    assert session.runs[1] == ("python", "benchmarks/overhead.py", "--only", "single")
    assert not any("gpu.py" in " ".join(args) for args in session.runs)


def test_bench_session_rejects_an_unknown_device(noxfile) -> None:
    with pytest.raises(SystemExit, match="'tpu'"):
        noxfile.bench(FakeSession(["--device", "tpu"]))


def test_gpu_plan_runs_every_benchmark_on_one_gpu_per_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu = bench_module(monkeypatch, "gpu")
    args = gpu.parse_args(["--models", "resnet", "--precisions", "fp32,bf16", "--steps", "5"])
    jobs = gpu.plan(args, [1, 2, 4])
    by = {(job.benchmark, job.precision, tuple(job.gpus)): job.cmd for job in jobs}
    assert len(jobs) == 2 * (3 + 1 + 1)  # per precision: overhead x3 counts, scaling, peers
    for cmd in by.values():
        assert cmd[cmd.index("--device") + 1] == "cuda"
        assert cmd[cmd.index("--model") + 1] == "resnet"
        assert cmd[cmd.index("--batch-size") + 1] == "128"
    single = by[("overhead", "32", (1,))]
    assert single[single.index("--only") + 1] == "single"  # one process, cuda:0
    four = by[("overhead", "bf16", (4,))]
    assert four[four.index("--only") + 1 :][:3] == ["ddp", "--nprocs", "4"]  # torchrun, NCCL
    scaling = by[("scaling", "32", (1, 2, 4))]
    assert scaling[scaling.index("--procs") + 1 :][:3] == ["1", "2", "4"]
    peers = by[("peers", "bf16", (1, 4))]
    assert peers[peers.index("--nprocs") + 1] == "1,4"


def test_gpu_dry_run_prints_the_commands_without_a_gpu() -> None:
    proc = run_script(str(BENCH / "gpu.py"), "--dry-run", "--gpus", "1,2", "--models", "cnn")
    lines = proc.stdout.strip().splitlines()
    assert len(lines) == 3 * 4  # 3 precisions x (overhead x2, scaling, peers)
    assert all("--device cuda" in line for line in lines)


GPU_REPORT = {
    "meta": {
        "machine": "2x NVIDIA H100 80GB HBM3",
        "date": "2026-01-02T03:04:05+00:00",
        "torch": "2.13.0+cu126",
        "cuda": "12.6",
    },
    "runs": {
        "resnet/bf16": {
            "model": "resnet",
            "precision": "bf16",
            "batch_size_per_process": 128,
            "overhead": {
                "1": {"world_size": 1, "hand_ms": 20.0, "distkit_ms": 20.2, "ratio": 1.01},
                "2": {"error": "exited 1: boom"},
            },
            "scaling": {
                "1": {"samples_per_s": 6400.0, "step_ms": 20.0, "efficiency": 1.0},
                "2": {"samples_per_s": 12160.0, "step_ms": 21.0, "efficiency": 0.95},
            },
            "peers": {
                "1": {
                    "hand": {"status": "ok", "ratio": 1.0},
                    "distkit": {
                        "status": "ok",
                        "ratio": 1.01,
                        "mfu": 0.4123,
                        "peak_source": "published: NVIDIA H100 80GB HBM3, bf16",
                    },
                    "fabric": {"status": "ok", "ratio": 1.034},
                    "lightning": {"status": "failed", "detail": "boom"},
                    "accelerate": {"status": "not installed", "detail": "pip install accelerate"},
                },
            },
        },
        "cnn/32": {
            "model": "cnn",
            "precision": "32",
            "batch_size_per_process": 256,
            "scaling": {"1": {"error": "did not finish in 10 s"}},
        },
    },
}


def test_gpu_markdown_table_has_one_row_per_model_precision_and_gpu_count(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gpu = bench_module(monkeypatch, "gpu")
    lines = gpu.markdown_table(GPU_REPORT).splitlines()
    assert lines[0].startswith("2x NVIDIA H100 80GB HBM3, 2026-01-02T03:04:05+00:00; torch ")
    header = "| model | precision | batch/GPU | GPUs | hand ms/step | distkit ms/step | vs hand "
    assert lines[2] == header + (
        "| samples/s | efficiency | MFU | Fabric | Lightning | Accelerate |"
    )
    # distkit's MFU from peers.py, and the peak it divides by named above the table
    assert "over the GPUs' peak: published: NVIDIA H100 80GB HBM3, bf16)" in lines[0]
    assert lines[4:] == [
        "| resnet | bf16 | 128 | 1 | 20.00 | 20.20 | 1.010 | 6,400 | 1.00 | 41.2% | 1.03 "
        "| failed | not installed |",
        "| resnet | bf16 | 128 | 2 | failed | failed | failed | 12,160 | 0.95 | - | - | - | - |",
        "| cnn | fp32 | 256 | 1 | - | - | - | failed | failed | - | - | - | - |",
    ]


def test_gpu_table_flag_prints_the_table_of_a_json_file(tmp_path: Path) -> None:
    (tmp_path / "gpu.json").write_text(json.dumps(GPU_REPORT))
    proc = run_script(str(BENCH / "gpu.py"), "--table", str(tmp_path / "gpu.json"))
    assert "| resnet | bf16 | 128 | 1 | 20.00 | 20.20 | 1.010 |" in proc.stdout


def test_resnet_trains_a_step_on_cpu_under_bf16_autocast(monkeypatch: pytest.MonkeyPatch) -> None:
    models = bench_module(monkeypatch, "models")
    model = models.make_model("resnet")
    assert 11.0e6 < sum(p.numel() for p in model.parameters()) < 11.4e6  # ResNet-18's size
    x, y = models.make_data(4, "resnet").tensors
    assert x.shape == (4, 3, 32, 32)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits, y)
    assert logits.dtype == torch.bfloat16 and logits.shape == (4, 10)
    loss.backward()
    optimizer.step()
    assert torch.isfinite(loss)
    changed = sum(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert changed == len(before)  # every parameter got a gradient and moved


class FakeEvent:
    """torch.cuda.Event on a machine without CUDA: records the host time."""

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.at: float | None = None

    def record(self) -> None:
        import time

        self.at = time.perf_counter()

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.at is not None and end.at is not None
        return (end.at - self.at) * 1e3


def test_step_clock_on_cuda_waits_for_the_gpu_once_per_epoch_not_per_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    overhead = bench_module(monkeypatch, "overhead")
    waits = []
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: waits.append(a))
    clock = overhead.StepClock(torch.device("cuda", 0))
    for _ in range(6):
        clock.stamp()
    assert waits == []  # recording a step's start never waits for the GPU
    steps = clock.steps_ms()
    assert len(waits) == 1 and len(steps) == 5 and all(ms >= 0 for ms in steps)
    assert clock.steps_ms() == []  # the next epoch starts afresh


def test_overhead_trains_both_loops_under_bf16_autocast(tmp_path: Path) -> None:
    proc = run_script(
        str(BENCH / "overhead.py"), "--only", "single", "--steps", "6", "--rounds", "1",
        "--precision", "bf16", "--results", str(tmp_path),
    )  # fmt: skip
    result = json.loads((tmp_path / "overhead.json").read_text())["single"]
    assert result["steps_timed"] == 5 and result["ratio"] > 0
    assert "single" in proc.stdout


@needs_cuda
def test_gpu_script_runs_every_benchmark_on_one_gpu(tmp_path: Path) -> None:
    if not children_see_cuda():
        pytest.skip("the GPU is hidden from child processes (DISTKIT_TESTS_HIDE_LONE_GPU)")
    out = tmp_path / "gpu.json"
    proc = run_script(
        str(BENCH / "gpu.py"), "--gpus", "1", "--models", "cnn", "--precisions", "fp32,bf16",
        "--steps", "5", "--rounds", "1", "--results", str(tmp_path / "runs"), "--out", str(out),
    )  # fmt: skip
    report = json.loads(out.read_text())
    for run in report["runs"].values():
        assert run["overhead"]["1"]["ratio"] > 0
        assert run["scaling"]["1"]["samples_per_s"] > 0
        assert run["peers"]["1"]["distkit"]["status"] == "ok"
    assert "| cnn | bf16 | 256 | 1 |" in proc.stdout


@needs_cuda
def test_step_clock_adds_no_host_sync_to_the_steps_it_times() -> None:
    sys.path.insert(0, str(BENCH))
    import overhead

    clock = overhead.StepClock(torch.device("cuda", 0))
    x = torch.randn(256, 256, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(4):
            clock.stamp()
            x = x @ x
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len(clock.steps_ms()) == 3


# ---------------------------------------------------------------------------- start-up
def test_startup_launch_reports_rank_0_stages_up_to_the_first_optimizer_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    startup = bench_module(monkeypatch, "startup")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    stages = startup.launch("distkit")
    order = ["interpreter up", "import torch", "import distkit", "Trainer(...)",
             "first step starts", "first optimizer step", "torchrun exited"]  # fmt: skip
    at = [stages[name] for name in order]
    assert at == sorted(at) and at[0] > 0


def test_startup_import_breakdown_lists_what_import_distkit_adds_to_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    startup = bench_module(monkeypatch, "startup")
    rows = startup.import_breakdown()
    names = [name for name, _, _ in rows]
    assert names[0] == "distkit"  # the whole tree is distkit's own cumulative time
    assert "torch" not in names
    assert all(cumulative >= 5 for _, _, cumulative in rows)


def test_token_exact_writes_a_ratio_per_mode(tmp_path: Path) -> None:
    proc = run_script(str(BENCH / "token_exact.py"), "--nprocs", "1", "--steps", "8",
                      "--rounds", "1", "--results", str(tmp_path))  # fmt: skip
    results = json.loads((tmp_path / "token_exact.json").read_text())
    assert set(results["1"]) == {"plain", "tensor", "int"}
    assert results["1"]["plain"]["ratio"] == 1.0
    assert all(entry["ratio"] > 0 and entry["steps"] > 0 for entry in results["1"].values())
    assert "tensor" in proc.stdout
