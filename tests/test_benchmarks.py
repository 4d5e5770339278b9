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

import pytest
import torch

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parent.parent
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
    shutil.copy(BENCH / "overhead.py", tmp_path / "overhead.py")
    run_script(str(tmp_path / "overhead.py"), "--only", "single", "--steps", "20", "--rounds", "1")
    results = json.loads((tmp_path / "results" / "overhead.json").read_text())
    assert results
    for entry in results.values():
        assert entry["ratio"] > 0
        assert entry["steps_timed"] > 0


def test_memory_fsdp_halves_the_per_rank_bytes_at_2_processes(tmp_path: Path) -> None:
    shutil.copy(BENCH / "memory.py", tmp_path / "memory.py")  # writes beside itself
    proc = run_script(str(tmp_path / "memory.py"), "--width", "64", "--layers", "2")
    results = json.loads((tmp_path / "results" / "memory.json").read_text())
    assert results["ddp"]["2"]["vs_1"] == 1.0  # every rank keeps everything
    assert results["fsdp"]["2"]["vs_1"] == pytest.approx(0.5, abs=0.01)  # step counts stay whole
    assert results["fsdp"]["1"]["total"] == results["ddp"]["1"]["total"]
    assert "vs 1 proc" in proc.stdout


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
        assert block["frameworks"]["hand"]["ratio"] == 1.0
    assert "distkit" in proc.stdout and "vs hand" in proc.stdout


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
