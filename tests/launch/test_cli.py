"""The ``distkit`` command: command building (pure), ``run`` for real, and ``doctor``."""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from distkit import cli, doctor
from distkit import horovod_build as hb
from distkit.errors import ConfigurationError, MissingDependencyError
from distkit.launch import LaunchRequest, build_command, describe, thread_env, with_strategy_arg
from distkit.launch._env import LaunchEnv
from distkit.launch.diagnosis import MachineFacts, StrategyReport
from distkit.registry import (
    DEFAULT_CHOICES,
    StrategyRegistry,
    available_strategies,
    resolve_strategy_class,
)
from distkit.strategies.apex import _doctor as apex_doctor
from distkit.strategies.ddp import DDPStrategy
from distkit.strategies.dp import DataParallelStrategy
from distkit.strategies.horovod import _doctor as _horovod_doctor
from tests.support.fakes import FAKE_APEX_DIRS
from tests.support.gates import needs
from tests.support.paths import ROOT

pytestmark = pytest.mark.timeout(120)

PY = "/py/bin/python"
TORCHRUN = [PY, "-m", "torch.distributed.run"]
TINY = """\
import argparse
import distkit

parser = argparse.ArgumentParser()
parser.add_argument("--strategy", default="auto")
parser.add_argument("--tag", default="")
args = parser.parse_args()
trainer = distkit.Trainer(strategy=args.strategy, progress=False)
print(f"STRATEGY={trainer.strategy.name} RANK={trainer.rank} WORLD={trainer.world_size} "
      f"TAG={args.tag}", flush=True)
trainer.close()
"""


def _horovodrun() -> str | None:
    try:
        return hb.horovodrun_path()
    except MissingDependencyError:
        return None


def _cmd(strategy: str, *args: str, **fields: Any) -> list[str]:
    request = LaunchRequest(strategy, "train.py", tuple(args), choices=DEFAULT_CHOICES, **fields)
    tools = {"horovodrun": "hvdrun", "controller": "gloo"}
    return build_command(request, resolve_strategy_class(strategy), python=PY, tools=tools)


def _distkit(*args: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 100):
    full_env = {**os.environ, "PYTHONPATH": str(ROOT), **(env or {})}
    # OMP_NUM_THREADS too: the nox session sets it, and distkit run only adds it when unset
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        full_env.pop(key, None)
    if env is None or "OMP_NUM_THREADS" not in env:
        full_env.pop("OMP_NUM_THREADS", None)
    return subprocess.run(
        [sys.executable, "-m", "distkit.cli", *args],
        capture_output=True, text=True, env=full_env, cwd=cwd, timeout=timeout,
    )  # fmt: skip


# ---------------------------------------------------------------- pure command building
def test_command_ddp_and_apex_use_torchrun_standalone():
    for strategy in ("ddp", "apex"):
        assert _cmd(strategy, "--lr", "0.1", nproc_per_node=2) == [
            *TORCHRUN, "--standalone", "--nproc_per_node", "2",
            "train.py", "--lr", "0.1", "--strategy", strategy,
        ]  # fmt: skip


def test_command_ddp_multi_node_passes_rendezvous_flags():
    argv = _cmd(
        "ddp", nproc_per_node=4, nnodes=2, node_rank=1, master_addr="n1", master_port=29_600
    )
    assert argv == [
        *TORCHRUN, "--nnodes", "2", "--node_rank", "1", "--master_addr", "n1",
        "--master_port", "29600", "--nproc_per_node", "4", "train.py", "--strategy", "ddp",
    ]  # fmt: skip


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"nnodes": 2}, "needs --master-addr"),
        ({"nnodes": 2, "master_addr": "n1", "node_rank": 2}, "outside 0..1"),
        ({"hosts": "a,b"}, "-H is horovodrun's host list"),
        ({"node_rank": 1}, "needs a multi-node run"),
    ],
)
def test_command_torchrun_refuses_inconsistent_multi_node_flags(fields, message):
    with pytest.raises(ConfigurationError, match=message):
        _cmd("ddp", **fields)


def test_command_horovod_one_node_is_localhost_with_total_np():
    assert _cmd("horovod", "--x", nproc_per_node=3) == [
        "hvdrun", "-np", "3", "-H", "localhost:3", "--gloo", PY, "train.py", "--x",
        "--strategy", "horovod",
    ]  # fmt: skip


def test_command_horovod_hosts_get_n_slots_each_unless_given_and_np_is_their_sum():
    argv = _cmd("horovod", nproc_per_node=2, hosts="a,b:4", nnodes=2)
    assert argv[:6] == ["hvdrun", "-np", "6", "-H", "a:2,b:4", "--gloo"]


def test_command_horovod_user_controller_wins_and_torchrun_flags_are_refused():
    argv = _cmd("horovod", launcher_args=("--mpi",))
    assert "--gloo" not in argv and argv[5] == "--mpi"
    with pytest.raises(ConfigurationError, match="torchrun options"):
        _cmd("horovod", master_addr="n1")
    with pytest.raises(ConfigurationError, match="needs the host list"):
        _cmd("horovod", nnodes=2)
    with pytest.raises(ConfigurationError, match="not 'host' or 'host:slots'"):
        _cmd("horovod", hosts="a:0")


def test_command_dp_is_plain_python_and_refuses_several_processes():
    assert _cmd("dp", "a") == [PY, "train.py", "a", "--strategy", "dp"]
    with pytest.raises(ConfigurationError, match=r"single process.*--strategy ddp"):
        _cmd("dp", nproc_per_node=2)


def test_strategy_arg_is_appended_once_and_before_a_double_dash():
    assert with_strategy_arg(["--strategy", "x"], "ddp") == ["--strategy", "x"]
    assert with_strategy_arg(["--strategy=x"], "ddp") == ["--strategy=x"]
    assert with_strategy_arg(["a", "--", "b"], "dp") == ["a", "--strategy", "dp", "--", "b"]


def test_thread_env_only_for_multi_process_runs_the_user_left_unset():
    two = LaunchRequest("ddp", "t.py", nproc_per_node=2)
    ddp, dp = DDPStrategy, DataParallelStrategy
    assert thread_env(two, ddp, {}) == {"OMP_NUM_THREADS": "1"}
    assert thread_env(two, ddp, {"OMP_NUM_THREADS": "4"}) == {}
    assert thread_env(LaunchRequest("dp", "t.py"), dp, {}) == {}
    line = describe(["python", "my script.py"], {"OMP_NUM_THREADS": "1"})
    assert line == "OMP_NUM_THREADS=1 python 'my script.py'"


def test_cli_keeps_the_scripts_arguments_exactly(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("")
    args = ["run", "--strategy", "dp", "--dry-run", "t.py", "--", "-n", "2", "-h"]
    assert cli.main(args) == 0
    line = capsys.readouterr().err.strip()
    argv = shlex.split(line.split(": ", 2)[2])
    assert argv[1:] == ["t.py", "--strategy", "dp", "--", "-n", "2", "-h"]


def test_cli_missing_horovodrun_exits_2_with_the_build_command(tmp_path, capsys, monkeypatch):
    def missing() -> str:
        raise MissingDependencyError("horovodrun is neither in /x nor on PATH")

    monkeypatch.setattr(hb, "horovodrun_path", missing)
    (tmp_path / "t.py").write_text("")
    assert cli.main(["run", "--strategy", "horovod", "--dry-run", str(tmp_path / "t.py")]) == 2
    assert "-m distkit.horovod_build" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "phrase"),
    [
        (
            ["-n", "2", "--torchrun-args=--nproc_per_node 3"],
            "--torchrun-args sets --nproc_per_node",
        ),
        (["--torchrun-args=--nnodes=2"], "use distkit run's --nnodes instead"),
        (["--master-port", "99999"], "--master-port 99999 is not a TCP port"),
        (["--master-port", "0"], "give one from 1 to 65535"),
    ],
)
def test_cli_run_refuses_options_torchrun_would_take_otherwise(
    tmp_path, capsys, monkeypatch, extra, phrase
):
    """Before, -n 2 with --torchrun-args='--nproc_per_node 3' started 3 ranks (torchrun takes
    the last), and a port of 99999 reached torchrun."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "t.py").write_text("")
    assert cli.main(["run", "--strategy", "ddp", "--dry-run", *extra, "t.py"]) == 2
    err = capsys.readouterr().err
    assert phrase in err and "would run" not in err


def test_cli_run_refuses_a_folder_as_the_script(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "project").mkdir()
    assert cli.main(["run", "--strategy", "ddp", "--dry-run", "project"]) == 2
    assert "script 'project' is a folder: give the training script's file" in (
        capsys.readouterr().err
    )


def test_cli_run_usage_says_the_scripts_arguments_are_optional(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    assert "the script's own arguments, if any" in capsys.readouterr().out


# ---------------------------------------------------------------- distkit run, as a command
@pytest.mark.parametrize(
    "strategy", ["ddp", "apex", pytest.param("horovod", marks=needs("horovod")), "dp"]
)
def test_run_dry_run_prints_the_command_and_starts_nothing(tmp_path, strategy):
    (tmp_path / "t.py").write_text("raise SystemExit('must not run')")
    n = "1" if strategy == "dp" else "2"
    proc = _distkit(
        "run", "--strategy", strategy, "-n", n, "--dry-run", "t.py", "--a", cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    prefix, _, line = proc.stderr.strip().partition(": would run: ")
    assert prefix == "distkit" and proc.stdout == ""
    argv = shlex.split(line)
    assert argv[-3:] == ["--a", "--strategy", strategy]
    expected = {"ddp": "torch.distributed.run", "apex": "torch.distributed.run",
                "horovod": "-H", "dp": "t.py"}  # fmt: skip
    assert expected[strategy] in argv
    assert (argv[0] == "OMP_NUM_THREADS=1") == (n == "2")
    assert sys.executable in argv  # the same interpreter runs every rank


def test_run_refuses_dp_with_two_processes(tmp_path):
    (tmp_path / "t.py").write_text("")
    proc = _distkit("run", "--strategy", "dp", "-n", "2", "t.py", cwd=tmp_path)
    assert proc.returncode == 2 and "--strategy ddp" in proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a CPU machine")
def test_run_refuses_apex_without_cuda_before_starting_anything(tmp_path):
    """Before: torchrun started two ranks, each printed ApexNeedsCudaError's traceback, and
    torchrun's summary ended it (exit 1, 70 lines, 9 s here). Now one line, before any rank."""
    (tmp_path / "tiny.py").write_text("open('started', 'w').close()\n" + TINY)
    proc = _distkit("run", "--strategy", "apex", "-n", "2", "tiny.py", cwd=tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert not (tmp_path / "started").exists()  # no rank ran
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("distkit: error: strategy='apex' cannot train on this machine: no "
                           "CUDA device (NVIDIA apex is CUDA-only)")  # fmt: skip
    assert "on CPU: distkit run --strategy ddp, precision='bf16'" in line
    assert "Nothing was started" in line and "running:" not in proc.stderr
    dry = _distkit("run", "--strategy", "apex", "-n", "2", "--dry-run", "tiny.py", cwd=tmp_path)
    assert dry.returncode == 0 and "would run" in dry.stderr  # the command, still printed


def test_run_ddp_starts_two_ranks(tmp_path):
    (tmp_path / "tiny.py").write_text(TINY)
    proc = _distkit("run", "--strategy", "ddp", "-n", "2", "tiny.py", "--tag", "x y", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        assert f"STRATEGY=ddp RANK={rank} WORLD=2 TAG=x y" in proc.stdout
    assert "distkit: running: OMP_NUM_THREADS=1 " in proc.stderr


@pytest.mark.horovod
@needs("horovod")
def test_run_horovod_starts_two_ranks_under_horovodrun(tmp_path):
    (tmp_path / "tiny.py").write_text(TINY)
    proc = _distkit("run", "--strategy", "horovod", "-n", "2", "tiny.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for rank in (0, 1):
        assert f"STRATEGY=horovod RANK={rank} WORLD=2" in proc.stdout


def test_run_dp_is_one_plain_process(tmp_path):
    (tmp_path / "tiny.py").write_text(TINY)
    proc = _distkit("run", "--strategy", "dp", "-n", "1", "tiny.py", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "STRATEGY=dp RANK=0 WORLD=1" in proc.stdout
    assert "OMP_NUM_THREADS" not in proc.stderr


def test_run_exits_with_the_scripts_exit_code(tmp_path):
    (tmp_path / "fail.py").write_text("import sys\nsys.exit(3)\n")
    assert _distkit("run", "--strategy", "dp", "fail.py", cwd=tmp_path).returncode == 3


# ---------------------------------------------------------------- distkit doctor
@pytest.fixture(scope="module")
def doctor_outputs(tmp_path_factory):
    """``distkit doctor`` and ``distkit doctor --json``, run side by side (each ~8 s)."""
    cwd = tmp_path_factory.mktemp("doctor")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    procs = [
        subprocess.Popen([sys.executable, "-m", "distkit.cli", "doctor", *extra], cwd=cwd, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for extra in ([], ["--json"])
    ]  # fmt: skip
    outs = [p.communicate(timeout=100) for p in procs]
    for proc, (out, err) in zip(procs, outs, strict=True):
        assert proc.returncode == 0, out + err
    return outs[0][0], json.loads(outs[1][0])


def _block(text: str, strategy: str) -> list[str]:
    """The strategy's line in the text report and its indented why-not / fix lines."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"{strategy} "))
    end = start + 1
    while end < len(lines) and lines[end].startswith(" " * 21):
        end += 1
    return lines[start:end]


def test_doctor_reports_ddp_dp_usable_here(doctor_outputs):
    text, data = doctor_outputs
    assert set(data["strategies"]) == set(available_strategies())
    assert data["plugin_problems"] == []
    assert data["strategies"]["ddp"]["usable"] and data["strategies"]["dp"]["usable"]
    assert data["torch_version"] == str(torch.__version__)
    assert data["gloo"] is True and data["auto"] == "dp"
    # what the doctor's own process sees (on a one-GPU machine the tests hide the GPU from
    # child processes: tests/conftest.py)
    gpus = data["cuda_devices"]
    backend = "nccl" if gpus else "gloo"
    assert "usable" in _block(text, "ddp")[0] and backend in _block(text, "ddp")[0]
    replicas = max(1, gpus)
    assert f"{replicas} replica" in _block(text, "dp")[0]


def test_doctor_reports_horovod_with_pytorch_and_gloo(doctor_outputs):
    text, data = doctor_outputs
    report = data["strategies"]["horovod"]
    if _horovodrun() is None:
        assert not report["usable"] and "distkit.horovod_build" in report["fix"]
        return
    assert report["usable"], report
    assert report["details"]["check_build"]["frameworks"]["PyTorch"]
    assert report["details"]["check_build"]["controllers"]["Gloo"]
    assert "frameworks PyTorch, controllers Gloo" in _block(text, "horovod")[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-machine verdict")
def test_doctor_reports_apex_not_usable_with_reason_and_fix(doctor_outputs):
    text, data = doctor_outputs
    report = data["strategies"]["apex"]
    assert not report["usable"]
    assert any("no CUDA" in why or "not installed" in why for why in report["why_not"])
    assert report["fix"]
    block = "\n".join(_block(text, "apex"))
    assert "NOT usable" in block and "why not: no CUDA device" in block and "fix: " in block


@pytest.mark.parametrize(
    ("kind", "summary"),
    [("impostor", "impostor: PyPI's unrelated 'apex'"), ("legacy", "legacy NVIDIA apex"),
     ("modern", "modern NVIDIA apex")],
)  # fmt: skip
def test_doctor_classifies_fake_apex_installs(tmp_path, kind, summary):
    """tests/support/fakes holds fake apex packages (test doubles, not NVIDIA's or PyPI's code)."""
    env = {"PYTHONPATH": os.pathsep.join([str(FAKE_APEX_DIRS[kind]), str(ROOT)])}
    proc = _distkit("doctor", "--json", "--strategy", "apex", cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert set(data["strategies"]) == {"apex"}
    report = data["strategies"]["apex"]
    assert report["details"]["kind"] == kind
    assert report["summary"].startswith(summary)
    if kind == "impostor":
        assert "pip uninstall -y apex" in report["fix"]
    assert report["usable"] == (data["cuda_devices"] > 0 and kind != "impostor")


def _machine(**changes: Any) -> MachineFacts:
    base = MachineFacts(python="py", torch_version="2.13.0+cpu", cuda_devices=0, distributed=True,
                        nccl=False, gloo=True, launcher=LaunchEnv())  # fmt: skip
    return dataclasses.replace(base, **changes)


def test_horovod_verdict_missing_or_broken_points_at_the_build_module():
    missing = _horovod_doctor.verdict("horovod", _machine(), _horovod_doctor.HorovodFacts())
    assert not missing.usable and missing.fix == "py -m distkit.horovod_build"
    no_torch = _horovod_doctor.HorovodFacts(
        version="0.28.1", horovodrun="hvdrun", build_key="k-old", expected_key="k",
        check_build={"frameworks": {"PyTorch": False}, "controllers": {"Gloo": True}},
    )  # fmt: skip
    broken = _horovod_doctor.verdict("horovod", _machine(), no_torch)
    assert not broken.usable and broken.fix == "py -m distkit.horovod_build --force"
    assert "PyTorch extension" in broken.why_not[0] and "k-old" in broken.summary


def test_verdicts_for_apex_with_cuda_and_gpus_for_ddp_and_dp():
    gpus = _machine(cuda_devices=4, nccl=True)
    legacy = apex_doctor.verdict("apex", gpus, apex_doctor.ApexFacts("legacy", "25.04", "/x"))
    assert legacy.usable and legacy.fix is None
    assert DDPStrategy.diagnose(gpus).summary == "backend nccl, 4 GPU(s)"
    assert DataParallelStrategy.diagnose(gpus).summary.startswith("4 replicas")
    absent = apex_doctor.verdict("apex", _machine(cuda_devices=1), apex_doctor.ApexFacts("none"))
    assert not absent.usable and "nvidia-apex" in (absent.fix or "")


# ---------------------------------------------------------------- derived from the classes
class SerialStrategy(DataParallelStrategy):
    """A registered single-process strategy: help, choices and doctor rows must show it."""

    name = "serial"
    auto_select = False


class FailingCheckStrategy(DataParallelStrategy):
    name = "failing"
    auto_select = False

    @classmethod
    def diagnose(cls, machine: MachineFacts) -> StrategyReport:
        raise RuntimeError("probe exploded")


def _registry(*classes: type) -> StrategyRegistry:
    registry = StrategyRegistry(entry_point_group=None)
    for cls in classes:
        registry.register(cls.name, cls)
    return registry


def test_parser_choices_and_help_list_every_registered_strategy(capsys):
    registry = _registry(SerialStrategy)
    parser = cli.build_parser(registry)
    names = registry.names()
    assert "serial" in names and parser.parse_args(["run", "--strategy", "serial", "t.py"])
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "--strategy", "nope", "t.py"])
    assert f"--strategy {{{','.join(names)}}}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parser.parse_args(["run", "--help"])
    help_text = capsys.readouterr().out

    launchers = help_text.split("the launcher per strategy:")[1].split("examples:")[0]
    for name in names:
        assert f" {name}," in launchers or f" {name}:" in launchers, name
    for cls in registry.load_all().values():
        assert cls.launcher.help_lines(["x"])[1] in help_text
        if cls.launcher.args_option:
            assert cls.launcher.args_option in help_text


def test_doctor_row_for_a_strategy_whose_check_raises_and_the_others_still_report():
    machine = _machine()
    # only the rows this test reads: Horovod's check (horovodrun --check-build) takes ~9 s
    checkup = doctor.examine(["failing", "serial", "ddp"],
                             registry=_registry(SerialStrategy, FailingCheckStrategy),
                             machine=machine)  # fmt: skip
    failing = checkup.reports["failing"]
    assert not failing.usable and "probe exploded" in failing.summary
    assert checkup.reports["serial"].usable and checkup.reports["serial"].origin != "built-in"
    assert checkup.reports["ddp"].usable and checkup.auto == "dp"
    text = doctor.render_text(checkup)
    assert "[register_strategy()]" in _block(text, "serial")[0]


def test_cli_refuses_the_other_launchers_arguments(tmp_path, capsys):
    (tmp_path / "t.py").write_text("")
    args = ["run", "--strategy", "ddp", "--horovod-args=-x", "--dry-run", str(tmp_path / "t.py")]
    assert cli.main(args) == 2
    assert "--horovod-args is for horovodrun, but strategy='ddp' runs under torchrun" in (
        capsys.readouterr().err
    )


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("environ", "line"),
    [
        ({"SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "9",
          "SLURM_NODELIST": "n[1-2]"},
         "launcher  srun (rank 1 of 4)  ->  strategy='auto' picks ddp"),
        ({"SLURM_JOB_ID": "9", "SLURM_NTASKS": "4"},
         "launcher  none (rank 0 of 1)  ->  strategy='auto' picks dp"),
    ],
)  # fmt: skip
def test_doctor_names_the_cluster_launcher_and_what_auto_picks(environ, line):
    """A SLURM step is named as such; an allocation shell (no SLURM_PROCID) is one process.
    (The launcher line and auto's pick come before any strategy's row: one row is enough.)"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OMPI_", "PMI"))}
    done = subprocess.run([sys.executable, "-m", "distkit.cli", "doctor", "--strategy", "ddp"],
                          env={**env, **environ}, capture_output=True, text=True,
                          timeout=100)  # fmt: skip
    assert line in done.stdout, done.stdout + done.stderr


def test_doctor_types_import_from_the_public_path_and_the_old_one():
    import distkit.diagnosis as old  # its path until launch/ took it in (plugins import it)

    from distkit import launchers

    assert launchers.StrategyReport is StrategyReport is old.StrategyReport
    assert launchers.MachineFacts is MachineFacts is old.MachineFacts
