"""Strategy plugins: pip-installed distributions with a ``distkit.strategies`` entry point.

tests/support/plugins holds five throw-away distributions. They are pip-installed into a temporary
folder put on PYTHONPATH (never into this environment), and real processes use them: a
torchrun job trains with the working one by name, ``distkit doctor`` shows its row, and each
broken one (an import error, a built-in's name, no Strategy, a name two plugins claim, an
import that parses the command line and exits) gets one line naming its distribution while
everything else keeps working.
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

import distkit
from distkit.registry import StrategyRegistry, _plugins
from tests.support.paths import ROOT
from tests.support.workloads import max_abs_diff

pytestmark = pytest.mark.timeout(240)

PLUGINS = ROOT / "tests" / "support" / "plugins"
DISTRIBUTIONS = (
    "distkit_plugin_example",
    "distkit_plugin_broken",
    "distkit_plugin_clash",
    "distkit_plugin_twin",
    "distkit_plugin_argv",
)

TRAIN = """\
import argparse, torch
from torch import nn
import distkit
from tests.support.workloads import make_dataset, make_mlp

parser = argparse.ArgumentParser()
parser.add_argument("--strategy")
args = parser.parse_args()
for name in (args.strategy, "ddp"):
    trainer = distkit.Trainer(name, batch_size=4, max_epochs=2, grad_accum_steps=2, seed=3,
                              progress=False)
    model = make_mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    trainer.fit(model, opt, make_dataset(60), loss_fn=nn.functional.cross_entropy)
    print(f"STRATEGY={trainer.strategy.name} RANK={trainer.rank} WORLD={trainer.world_size}",
          flush=True)
    if trainer.is_main:
        torch.save(model.state_dict(), f"{name}.pt")
    trainer.close()
"""

# In one process: what a user of an environment with all three plugins installed sees.
PROBE = """\
import contextlib, io, json
import distkit
from distkit import cli

out = {"available": distkit.available_strategies()}
try:
    distkit.Trainer("broken", progress=False)
except distkit.StrategyPluginError as exc:
    out["broken"] = str(exc)
with distkit.Trainer("dp", progress=False) as trainer:
    out["dp"] = trainer.strategy.name
err = io.StringIO()
with contextlib.redirect_stderr(err):
    out["run_broken"] = cli.main(["run", "--strategy", "broken", "--dry-run", "t.py"])
    out["run_ddp"] = cli.main(["run", "--strategy", "ddp", "--dry-run", "t.py"])
out["run_err"] = err.getvalue()
help_text = io.StringIO()
with contextlib.redirect_stdout(help_text), contextlib.suppress(SystemExit):
    cli.main(["run", "--help"])
out["help"] = help_text.getvalue()
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The plugin distributions, pip-installed (no dependencies, offline) into a folder."""
    sources = tmp_path_factory.mktemp("plugin-sources")
    target = tmp_path_factory.mktemp("site-packages")
    for name in DISTRIBUTIONS:  # build from copies: the build leaves files beside the sources
        shutil.copytree(PLUGINS / name, sources / name)
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
         "--no-build-isolation", "--target", str(target),
         *(str(sources / name) for name in DISTRIBUTIONS)],
        check=True, capture_output=True, timeout=180,
    )  # fmt: skip
    return target


def _env(site: Path) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}
    env["OMP_NUM_THREADS"] = "1"
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return env


def _run(args: list[str], site: Path, cwd: Path, code: int = 0) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        args, capture_output=True, text=True, env=_env(site), cwd=cwd, timeout=200
    )
    assert proc.returncode == code, proc.stdout + proc.stderr
    return proc


def test_plugin_trains_by_name_under_torchrun_like_ddp(site, tmp_path):
    (tmp_path / "train.py").write_text(TRAIN)
    cmd = [sys.executable, "-m", "distkit.cli", "run", "--strategy", "example", "-n", "2"]
    proc = _run([*cmd, "train.py"], site, tmp_path)

    assert "torch.distributed.run" in proc.stderr  # distkit run asked the class: torchrun
    for rank in (0, 1):
        assert f"STRATEGY=example RANK={rank} WORLD=2" in proc.stdout
        assert f"STRATEGY=ddp RANK={rank} WORLD=2" in proc.stdout
    example, ddp = (torch.load(tmp_path / f"{name}.pt") for name in ("example", "ddp"))
    # the plugin is ddp underneath: the same arithmetic, bitwise (measured 0.0)
    assert max_abs_diff(example, ddp) == 0.0


def test_doctor_shows_the_plugin_row_and_one_line_per_broken_plugin(site, tmp_path):
    cmd = [sys.executable, "-m", "distkit.cli", "doctor", "--strategy", "example"]
    text = _run([*cmd, "--strategy", "ddp"], site, tmp_path).stdout
    data = json.loads(_run([*cmd, "--json"], site, tmp_path).stdout)

    row = next(line for line in text.splitlines() if line.startswith("example "))
    assert "usable" in row and "NOT" not in row and "[plugin distkit-plugin-example 0.1.0]" in row
    ddp_row = next(line for line in text.splitlines() if line.startswith("ddp "))
    assert ddp_row.split()[1] == "usable"
    assert data["strategies"]["example"]["origin"] == "plugin distkit-plugin-example 0.1.0"
    problems = data["plugin_problems"]
    assert len(problems) == 5, problems
    for problem in problems:  # one line each in the text report too (argv's quotes its argv)
        start = f"  {problem.split(' after printing ')[0]}"
        assert len([line for line in text.splitlines() if line.startswith(start)]) == 1
    broken, clash, not_strategy = (
        next(p for p in problems if word in p) for word in ("'broken'", "'ddp'", "'notastrategy'")
    )
    assert "distkit-plugin-broken 0.1.0" in broken and "ModuleNotFoundError" in broken
    assert "pip uninstall distkit-plugin-broken" in broken
    assert "distkit-plugin-clash 0.1.0" in clash and "'ddp' is a built-in strategy" in clash
    assert "not a distkit.Strategy subclass" in not_strategy


def test_broken_plugins_leave_distkit_and_the_other_strategies_working(site, tmp_path):
    (tmp_path / "t.py").write_text("")
    proc = _run([sys.executable, "-c", PROBE], site, tmp_path)
    out = json.loads(proc.stdout.strip().splitlines()[-1])

    assert {"example", "broken", "notastrategy", "ddp"} <= set(out["available"])
    assert out["available"].count("ddp") == 1  # the clashing plugin did not replace it
    assert out["broken"].startswith("strategy plugin 'broken' from distkit-plugin-broken 0.1.0")
    assert "\n" not in out["broken"] and out["dp"] == "dp"
    assert out["run_broken"] == 2 and out["run_ddp"] == 0
    errors = [line for line in out["run_err"].splitlines() if "error" in line]
    assert errors == [f"distkit: error: {out['broken']}"]
    assert "example" in out["help"] and "--strategy {" in out["help"]


DISTKIT = [sys.executable, "-m", "distkit.cli"]


def test_a_plugin_that_parses_the_command_line_at_import_is_one_problem_line(site, tmp_path):
    """Its argparse meets `doctor` and exits 2. Before, that SystemExit escaped the plugin
    guard: `distkit doctor` and `distkit run` printed the plugin's usage and exited 2."""
    (tmp_path / "t.py").write_text("")
    doctor = _run([*DISTKIT, "doctor", "--strategy", "ddp"], site, tmp_path)
    run_ddp = _run([*DISTKIT, "run", "--strategy", "ddp", "--dry-run", "t.py"], site, tmp_path)
    run_argv = _run([*DISTKIT, "run", "--strategy", "argv", "t.py"], site, tmp_path, code=2)

    (line,) = [x.strip() for x in doctor.stdout.splitlines() if "'argv'" in x]
    assert line.startswith("strategy plugin 'argv' from distkit-plugin-argv 0.1.0 (argv = "
                           "distkit_plugin_argv:ArgvStrategy) is left out: importing it called "
                           "sys.exit(2) after printing ")  # fmt: skip
    assert "unrecognized arguments: doctor" in line and "__main__" in line
    assert "pip uninstall distkit-plugin-argv" in line
    assert "usage:" not in doctor.stderr + run_ddp.stderr  # the plugin's own text is held back
    assert "ddp " in doctor.stdout and "would run" in run_ddp.stderr
    assert run_argv.stderr.startswith("distkit: error: strategy plugin 'argv' from ")


def test_two_plugins_claiming_one_name_are_both_left_out_naming_each_other(site, tmp_path):
    """distkit-plugin-twin and distkit-plugin-clash both declare `twin`. Before, the one
    listed first (an accident of sys.path) won silently."""
    (tmp_path / "t.py").write_text("")
    probe = (
        "import distkit\n"
        "try:\n    distkit.Trainer('twin', progress=False)\n"
        "except distkit.StrategyPluginError as exc:\n    print('ERROR', exc)\n"
    )
    trainer = _run([sys.executable, "-c", probe], site, tmp_path).stdout
    run = _run([*DISTKIT, "run", "--strategy", "twin", "t.py"], site, tmp_path, code=2).stderr
    data = json.loads(
        _run([*DISTKIT, "doctor", "--json", "--strategy", "ddp"], site, tmp_path).stdout
    )

    (line,) = [p for p in data["plugin_problems"] if "'twin'" in p]
    assert line.startswith("strategy plugin 'twin' is left out: 2 plugins claim that name, ")
    for claim in ("distkit-plugin-twin 0.1.0 (twin = distkit_plugin_twin:TwinStrategy)",
                  "distkit-plugin-clash 0.1.0 (twin = distkit_plugin_clash:TwinStrategy)",
                  "pip uninstall distkit-plugin-twin", "pip uninstall distkit-plugin-clash",
                  "rename the entry point"):  # fmt: skip
        assert claim in line
    assert "twin" not in data["strategies"]  # neither class is used
    assert trainer.strip() == f"ERROR {line}"
    assert run.strip() == f"distkit: error: {line}"


def test_builtins_resolve_without_reading_entry_points(monkeypatch):
    def unreadable(group: str) -> tuple[list[_plugins.Plugin], list[str]]:
        raise AssertionError("a built-in name must not read the entry points")

    monkeypatch.setattr(_plugins, "discover", unreadable)
    registry = StrategyRegistry()
    assert registry.resolve("ddp").name == "ddp"
    monkeypatch.setattr(distkit.registry, "DEFAULT_REGISTRY", registry)
    with distkit.Trainer("dp", progress=False) as trainer:
        assert trainer.strategy.name == "dp"


def test_unreadable_entry_points_are_one_problem_line(monkeypatch):
    import importlib.metadata

    def corrupt(**kwargs: object) -> object:
        raise ValueError("bad METADATA")

    monkeypatch.setattr(importlib.metadata, "entry_points", corrupt)
    registry = StrategyRegistry()
    assert "ddp" in registry.names()
    message = "reading the 'distkit.strategies' entry points failed: ValueError: bad METADATA"
    assert registry.problems() == [message]
