"""Unit tests of distkit.horovod_build (the real ~6 minute build is not run here)."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import tarfile
import urllib.error
import urllib.request
import zipfile
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest

from distkit import horovod_build as hb
from distkit.errors import DistkitError, MissingDependencyError
from distkit.horovod_build import suite
from tests.support.gates import needs
from tests.support.paths import ROOT

CPU = hb.Flavour(cuda=False, mpi=False)
CUDA_MPI = hb.Flavour(cuda=True, mpi=True)

CHECK_BUILD_OK = """\
Horovod v0.28.1:

Available Frameworks:
    [ ] TensorFlow
    [X] PyTorch
    [ ] MXNet

Available Controllers:
    [ ] MPI
    [X] Gloo

Available Tensor Operations:
    [ ] NCCL
    [ ] DDL
    [ ] CCL
    [ ] MPI
    [X] Gloo
"""
CHECK_BUILD_NO_TORCH = CHECK_BUILD_OK.replace("[X] PyTorch", "[ ] PyTorch")


def _source_tree(root: Path, top: str, torch: str) -> Path:
    src = root / "horovod-0.28.1"
    (src / "horovod" / "torch").mkdir(parents=True)
    (src / "CMakeLists.txt").write_text(top)
    (src / "horovod" / "torch" / "CMakeLists.txt").write_text(torch)
    return src


TOP = "cmake_minimum_required(VERSION 3.13)\nset(CMAKE_CXX_STANDARD 14)\nproject(horovod)\n"
TORCH = "if(HAVE_PYTORCH)\n    set(CMAKE_CXX_STANDARD 14)\nendif()\n"


@pytest.mark.timeout(30)
def test_patch_cxx17_patches_both_files_and_keeps_the_rest(tmp_path: Path) -> None:
    src = _source_tree(tmp_path, TOP, TORCH)
    changed = hb.patch_cxx17(src)
    assert sorted(changed) == sorted([src / "CMakeLists.txt", src / "horovod/torch/CMakeLists.txt"])
    assert (src / "CMakeLists.txt").read_text() == TOP.replace("STANDARD 14", "STANDARD 17")
    assert (src / "horovod/torch/CMakeLists.txt").read_text() == TORCH.replace("14", "17")


@pytest.mark.timeout(30)
def test_patch_cxx17_is_idempotent(tmp_path: Path) -> None:
    src = _source_tree(tmp_path, TOP, TORCH)
    hb.patch_cxx17(src)
    before = [p.read_text() for p in (src / "CMakeLists.txt", src / "horovod/torch/CMakeLists.txt")]
    assert hb.patch_cxx17(src) == []
    after = [p.read_text() for p in (src / "CMakeLists.txt", src / "horovod/torch/CMakeLists.txt")]
    assert after == before


@pytest.mark.timeout(30)
def test_patch_cxx17_patches_a_half_patched_tree_and_never_downgrades(tmp_path: Path) -> None:
    src = _source_tree(tmp_path, TOP.replace("14", "20"), TORCH)
    assert hb.patch_cxx17(src) == [src / "horovod/torch/CMakeLists.txt"]
    assert "set(CMAKE_CXX_STANDARD 20)" in (src / "CMakeLists.txt").read_text()


@pytest.mark.timeout(30)
def test_patch_cxx17_fails_loudly_without_the_line(tmp_path: Path) -> None:
    src = _source_tree(tmp_path, TOP, "if(HAVE_PYTORCH)\nendif()\n")
    with pytest.raises(DistkitError, match=r"horovod/torch/CMakeLists.txt has no"):
        hb.patch_cxx17(src)


@pytest.mark.timeout(30)
def test_patch_cxx17_fails_on_a_missing_file(tmp_path: Path) -> None:
    with pytest.raises(DistkitError, match="not found"):
        hb.patch_cxx17(tmp_path)


@pytest.mark.timeout(30)
def test_cache_key_contains_every_input() -> None:
    key = hb.cache_key("0.28.1", "2.13.0+cpu", "cp311", CPU)
    for part in ("0.28.1", "2.13.0+cpu", "cp311", "cpu-gloo", f"p{hb.PATCH_LEVEL}"):
        assert part in key
    assert "/" not in key and " " not in key


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "change",
    [
        {"horovod_version": "0.28.0"},
        {"torch_version": "2.13.0+cu126"},
        {"torch_version": "2.12.0+cpu"},
        {"py_tag": "cp312"},
        {"flavour": hb.Flavour(cuda=False, mpi=True)},
        {"flavour": hb.Flavour(cuda=True, mpi=False)},
        {"patch": hb.PATCH_LEVEL + 1},
    ],
)
def test_cache_key_changes_when_an_input_changes(change: dict[str, object]) -> None:
    base: dict[str, object] = dict(
        horovod_version="0.28.1", torch_version="2.13.0+cpu", py_tag="cp311", flavour=CPU
    )
    assert hb.cache_key(**{**base, **change}) != hb.cache_key(**base)  # type: ignore[arg-type]


@pytest.mark.timeout(30)
def test_python_tag_matches_this_interpreter() -> None:
    assert hb.python_tag().endswith(f"{sys.version_info[0]}{sys.version_info[1]}")


@pytest.mark.timeout(30)
def test_build_env_cpu() -> None:
    env = hb.build_env(CPU, jobs=2)
    assert env["HOROVOD_CPU_OPERATIONS"] == "GLOO"
    assert env["HOROVOD_WITHOUT_MPI"] == "1" and "HOROVOD_WITH_MPI" not in env
    assert "HOROVOD_GPU_OPERATIONS" not in env
    assert env["HOROVOD_WITH_PYTORCH"] == env["HOROVOD_WITH_GLOO"] == "1"
    assert env["HOROVOD_WITHOUT_TENSORFLOW"] == env["HOROVOD_WITHOUT_MXNET"] == "1"
    assert env["MAKEFLAGS"] == "-j2"
    assert env["CMAKE_POLICY_VERSION_MINIMUM"] == "3.5"
    assert all(isinstance(v, str) for v in env.values())


@pytest.mark.timeout(30)
def test_build_env_cuda_mpi() -> None:
    env = hb.build_env(CUDA_MPI, jobs=16)
    assert env["HOROVOD_GPU_OPERATIONS"] == "NCCL"
    assert env["HOROVOD_WITH_MPI"] == "1" and "HOROVOD_WITHOUT_MPI" not in env
    assert "HOROVOD_CPU_OPERATIONS" not in env
    assert env["HOROVOD_WITH_GLOO"] == env["HOROVOD_WITH_PYTORCH"] == "1"
    assert env["MAKEFLAGS"] == "-j16"
    assert CUDA_MPI.tag == "cuda-nccl-gloo-mpi" and CPU.tag == "cpu-gloo"


@pytest.mark.timeout(30)
def test_parse_check_build() -> None:
    parsed = hb.parse_check_build(CHECK_BUILD_OK)
    assert parsed["frameworks"] == {"TensorFlow": False, "PyTorch": True, "MXNet": False}
    assert parsed["controllers"] == {"MPI": False, "Gloo": True}
    assert parsed["tensor operations"]["Gloo"] is True
    assert parsed["tensor operations"]["NCCL"] is False


@pytest.mark.timeout(30)
def test_check_build_problems_pass_and_fail() -> None:
    assert hb.check_build_problems(CHECK_BUILD_OK, CPU) == []
    problems = hb.check_build_problems(CHECK_BUILD_NO_TORCH, CPU)
    assert len(problems) == 1 and "PyTorch" in problems[0]
    no_gloo = CHECK_BUILD_OK.replace(
        "    [X] Gloo\n\nAvailable Tensor", "    [ ] Gloo\n\nAvailable Tensor"
    )
    assert ["Gloo" in p for p in hb.check_build_problems(no_gloo, CPU)] == [True]
    assert {p.split()[0] for p in hb.check_build_problems(CHECK_BUILD_OK, CUDA_MPI)} == {
        "MPI",
        "NCCL",
    }
    assert len(hb.check_build_problems("Traceback: ImportError: no horovod", CPU)) == 2
    assert hb.check_build_problems("", CPU) != []


@pytest.mark.timeout(30)
def test_finalize_wheel_adds_marker_and_keeps_record_valid(tmp_path: Path) -> None:
    wheel = tmp_path / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("horovod/__init__.py", "x = 1\n")
        zf.writestr("horovod/torch/mpi_lib_v2.so", b"not an ELF file")  # strip fails -> unchanged
        zf.writestr("horovod-0.28.1.dist-info/RECORD", "stale\n")
    hb.finalize_wheel(wheel, {"key": "K"})
    with zipfile.ZipFile(wheel) as zf:
        assert json.loads(zf.read(hb.MARKER)) == {"key": "K"}
        assert zf.read("horovod/torch/mpi_lib_v2.so") == b"not an ELF file"
        rows = zf.read("horovod-0.28.1.dist-info/RECORD").decode().splitlines()
        recorded = {r.split(",")[0]: r.split(",")[1:] for r in rows}
        assert set(recorded) == set(zf.namelist())
        for name, (digest, size) in recorded.items():
            if name.endswith("RECORD"):
                continue
            data = zf.read(name)
            expected = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            assert digest == "sha256=" + expected.decode() and int(size) == len(data)


@pytest.mark.timeout(30)
def test_torch_missing_gives_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` raise ImportError
    with pytest.raises(MissingDependencyError, match="Install torch first, pinned"):
        hb.torch_info()


def _fake_environment(
    monkeypatch: pytest.MonkeyPatch, calls: list[str], installed: str | None
) -> None:
    monkeypatch.setattr(hb, "torch_info", lambda: ("2.13.0+cpu", False))
    monkeypatch.setattr(hb, "detect_flavour", lambda cuda: CPU)
    monkeypatch.setattr(hb, "installed_key", lambda version: installed)

    def fake_build(
        version: str, key: str, flavour: object, tv: str, out_dir: Path, jobs: int, session: object
    ) -> Path:
        calls.append("build")
        out_dir.mkdir(parents=True, exist_ok=True)
        wheel = out_dir / f"horovod-{version}-cp311-cp311-linux_x86_64.whl"
        wheel.write_bytes(b"new")
        return wheel

    monkeypatch.setattr(hb, "build_wheel", fake_build)
    monkeypatch.setattr(hb._Session, "run", lambda self, cmd, what, env=None: calls.append(what))
    monkeypatch.setattr(hb, "verify_install", lambda flavour, session: calls.append("verify"))


@pytest.mark.timeout(30)
def test_ensure_horovod_builds_then_hits_the_cache(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[str] = []
    _fake_environment(monkeypatch, calls, installed=None)
    wheel = hb.ensure_horovod(cache_dir=tmp_path)
    assert wheel is not None and wheel.read_bytes() == b"new"
    assert wheel.parent.name == hb.cache_key("0.28.1", "2.13.0+cpu", hb.python_tag(), CPU)
    assert calls[0] == "build" and calls[-1] == "verify"
    calls.clear()
    assert hb.ensure_horovod(cache_dir=tmp_path) == wheel
    assert "build" not in calls and calls[-1] == "verify"
    calls.clear()
    hb.ensure_horovod(cache_dir=tmp_path, force=True, install=False)
    assert calls == ["build"]


@pytest.mark.timeout(30)
def test_ensure_horovod_skips_a_matching_install(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[str] = []
    key = hb.cache_key("0.28.1", "2.13.0+cpu", hb.python_tag(), CPU)
    _fake_environment(monkeypatch, calls, installed=key)
    assert hb.ensure_horovod(cache_dir=tmp_path) is None
    assert calls == ["verify"]


@pytest.mark.timeout(60)
def test_cli_help_exits_0() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-m", "distkit.horovod_build", "--help"],
        capture_output=True,
        text=True,
        env=env,
        timeout=50,
    )
    assert done.returncode == 0, done.stderr
    for option in ("--version", "--cache-dir", "--force", "--no-install", "--no-verify", "--jobs"):
        assert option in done.stdout


@pytest.mark.timeout(60)
def test_failed_step_reports_log_tail_and_path(tmp_path: Path) -> None:
    session = hb._Session(tmp_path / "sub" / "build.log")
    script = "import sys\nfor i in range(100): print('line', i)\nsys.exit(3)"
    with pytest.raises(DistkitError) as info:
        session.run([sys.executable, "-c", script], "the fake build")
    message = str(info.value)
    assert "exit code 3" in message and str(tmp_path / "sub" / "build.log") in message
    assert "line 99" in message and "line 60" in message and "line 59\n" not in message
    assert "line 0\n" in (tmp_path / "sub" / "build.log").read_text()


@pytest.mark.timeout(30)
def test_ensure_horovod_without_mpi_ignores_an_mpicc_on_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """`--without-mpi` (nox's tests session: Open MPI's mpirun is installed for the mpirun
    tests, Horovod stays Gloo-only): the cache key and the build say no MPI."""
    calls: list[str] = []
    _fake_environment(monkeypatch, calls, installed=None)
    with_mpi = hb.Flavour(cuda=False, mpi=True)
    monkeypatch.setattr(hb, "detect_flavour", lambda cuda: with_mpi)
    wheel = hb.ensure_horovod(cache_dir=tmp_path, mpi=False)
    assert wheel is not None
    assert wheel.parent.name == hb.cache_key("0.28.1", "2.13.0+cpu", hb.python_tag(), CPU)
    parsed = []
    monkeypatch.setattr(hb, "ensure_horovod", lambda *a, **k: parsed.append(k["mpi"]))
    assert hb.main(["--without-mpi", "--cache-dir", str(tmp_path)]) == 0
    assert hb.main(["--cache-dir", str(tmp_path)]) == 0
    assert parsed == [False, None]


# ---------------------------------------------------------------- the rendezvous server patch
# Horovod 0.28.1's RendezvousHandler.do_DELETE, fixed-scope branch, as released. Used only when
# no cached sdist is at hand; the tests then check the patch against these lines.
RENDEZVOUS_FIXTURE = """\
class RendezvousHandler(KVStoreHandler):
    # Override DELETE handler
    def do_DELETE(self):
        paths = self.path.split('/')
        _, scope, key = paths

        if scope in self.server.scope_size:
            # scope defined by host_alloc_plan at server initialization
            with self.server.finished_list_lock:
                self.server.finished_list[scope].append(key)
                if self.server.scope_size[scope] == len(self.server.finished_list[scope]):
                    with self.server.cache_lock:
                        self.server.cache.get(scope, {}).clear()
                        self.server.finished_list.clear()
                        if self.server.verbose:
                            logging.info(f'Cleared scope {scope}')
"""


_FIX = ("self.server.finished_list.clear()", "del self.server.finished_list[scope]")


def _released_rendezvous_text() -> tuple[str, str]:
    """(where from, text) of 0.28.1's http_server.py: the cached sdist's, else the fixture."""
    sdist = hb.sdist_path(hb.DEFAULT_VERSION)
    if sdist.is_file():
        with tarfile.open(sdist) as tar:
            member = tar.extractfile(f"horovod-{hb.DEFAULT_VERSION}/{hb.RENDEZVOUS_FILE}")
            assert member is not None
            return str(sdist), member.read().decode()
    return "fixture", RENDEZVOUS_FIXTURE


def _rendezvous_tree(root: Path, text: str) -> Path:
    src = _source_tree(root, TOP, TORCH)
    server = src / hb.RENDEZVOUS_FILE
    server.parent.mkdir(parents=True)
    server.write_text(text)
    return src


@pytest.mark.timeout(30)
def test_patch_rendezvous_changes_the_one_statement_that_forgot_every_scope(tmp_path: Path) -> None:
    origin, released = _released_rendezvous_text()
    src = _rendezvous_tree(tmp_path, released)
    assert hb.rendezvous_is_fixed(released) is False, origin
    assert hb.patch_rendezvous(src) == [src / hb.RENDEZVOUS_FILE]
    patched = (src / hb.RENDEZVOUS_FILE).read_text()
    changed = [
        (old, new)
        for old, new in zip(released.splitlines(), patched.splitlines(), strict=True)
        if old != new
    ]
    assert changed == [
        (
            "                        self.server.finished_list.clear()",
            "                        del self.server.finished_list[scope]",
        )
    ], origin
    assert hb.rendezvous_is_fixed(patched) is True
    compile(patched, hb.RENDEZVOUS_FILE, "exec")  # still Python


@pytest.mark.timeout(30)
def test_patch_rendezvous_is_idempotent(tmp_path: Path) -> None:
    src = _rendezvous_tree(tmp_path, _released_rendezvous_text()[1])
    hb.patch_rendezvous(src)
    once = (src / hb.RENDEZVOUS_FILE).read_text()
    assert hb.patch_rendezvous(src) == []
    assert (src / hb.RENDEZVOUS_FILE).read_text() == once


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("class RendezvousHandler:\n    pass\n", "0 copies"),
        (RENDEZVOUS_FIXTURE + RENDEZVOUS_FIXTURE, "2 copies"),
    ],
    ids=["another-version", "twice"],
)
def test_patch_rendezvous_fails_loudly_on_a_server_it_does_not_know(
    tmp_path: Path, text: str, error: str
) -> None:
    src = _rendezvous_tree(tmp_path, text)
    with pytest.raises(DistkitError, match=f"{error}.*needs a new recipe"):
        hb.patch_rendezvous(src)
    assert (src / hb.RENDEZVOUS_FILE).read_text() == text
    with pytest.raises(DistkitError, match="not found"):
        hb.patch_rendezvous(tmp_path / "nothing")


@pytest.mark.timeout(30)
def test_patch_source_applies_every_patch(tmp_path: Path) -> None:
    src = _rendezvous_tree(tmp_path, _released_rendezvous_text()[1])
    assert len(hb.patch_source(src)) == 3
    assert hb.rendezvous_is_fixed((src / hb.RENDEZVOUS_FILE).read_text()) is True
    assert "set(CMAKE_CXX_STANDARD 17)" in (src / "CMakeLists.txt").read_text()
    assert hb.patch_source(src) == []
    assert hb.PATCHES == ("cxx17", "rendezvous-finished-scope")


def _load_server(text: str, tmp_path: Path) -> ModuleType:
    tmp_path.mkdir()
    path = tmp_path / "http_server.py"
    path.write_text(text)
    spec = importlib.util.spec_from_file_location("distkit_test_http_server", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _request(port: int, method: str, path: str, body: bytes | None = None) -> int:
    url = f"http://127.0.0.1:{port}/{path}"
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, data=body, method=method), timeout=10
        ) as response:
            return int(response.status)
    except urllib.error.HTTPError as exc:
        return exc.code


# Two ranks on one host: the scopes of Horovod's gloo init, each rank's rank in them, and the
# order in which the ranks met and left them in a real job ("put": a rank's address and host
# keys, "leave": its DELETE once the scope's barrier passed). Rank 0 is done with cross_0 (size
# 1) before rank 1 leaves local_localhost.
RANK_IN = {
    "global": {0: 0, 1: 1},
    "local_localhost": {0: 0, 1: 1},
    "cross_0": {0: 0},
    "cross_1": {1: 0},
}
ONE_INIT = [
    ("put", 0, "global"),
    ("put", 1, "global"),
    ("leave", 0, "global"),
    ("put", 0, "local_localhost"),
    ("leave", 1, "global"),
    ("put", 1, "local_localhost"),
    ("leave", 0, "local_localhost"),
    ("put", 0, "cross_0"),
    ("leave", 0, "cross_0"),
    ("leave", 1, "local_localhost"),
    ("put", 1, "cross_1"),
    ("leave", 1, "cross_1"),
]


def _keys_left_after_one_init(server_module: ModuleType) -> list[str]:
    """The keys the rendezvous server still holds after :data:`ONE_INIT`."""
    from horovod.runner.common.util.hosts import SlotInfo

    plan = [SlotInfo("localhost", r, r, 0, size=2, local_size=2, cross_size=1) for r in (0, 1)]
    server = server_module.RendezvousServer()
    port = server.start()
    try:
        server.init(plan)
        for action, rank, scope in ONE_INIT:
            key = RANK_IN[scope][rank]
            if action == "put":
                for name in (f"rank_{key}", str(key)):
                    assert _request(port, "PUT", f"{scope}/{name}", b"127.0.0.1:1") == 200
            else:
                assert _request(port, "DELETE", f"{scope}/{key}") == 200
        return [
            f"{scope}/{name}"
            for scope in sorted(RANK_IN)
            for name in ("0", "1", "rank_0", "rank_1")
            if _request(port, "GET", f"{scope}/{name}") == 200
        ]
    finally:
        server.stop()
        server._httpd.server_close()


@pytest.mark.timeout(60)
@needs("horovod runner")
def test_patched_rendezvous_server_forgets_a_finished_init(tmp_path: Path) -> None:
    """The released server keeps local_localhost's keys after this init; the patched one
    keeps none, so the next hvd.init() cannot read a dead rank's address."""
    origin, released = _released_rendezvous_text()
    if origin == "fixture":
        pytest.skip("the fixture is an excerpt; the server runs from the cached sdist only")
    src = _rendezvous_tree(tmp_path, released)
    hb.patch_rendezvous(src)
    before = _keys_left_after_one_init(_load_server(released, tmp_path / "a"))
    patched = (src / hb.RENDEZVOUS_FILE).read_text()
    after = _keys_left_after_one_init(_load_server(patched, tmp_path / "b"))
    assert before == [f"local_localhost/{name}" for name in ("0", "1", "rank_0", "rank_1")]
    assert after == []


@pytest.mark.timeout(30)
def test_a_wheel_cached_before_the_rendezvous_fix_is_rebuilt(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    calls: list[str] = []
    _fake_environment(monkeypatch, calls, installed=None)
    old_key = hb.cache_key("0.28.1", "2.13.0+cpu", hb.python_tag(), CPU, patch=1)
    old = tmp_path / old_key / "horovod-0.28.1-cp311-cp311-linux_x86_64.whl"
    old.parent.mkdir()
    old.write_bytes(b"old")
    wheel = hb.ensure_horovod(cache_dir=tmp_path)
    assert calls[0] == "build" and wheel is not None and wheel.read_bytes() == b"new"
    assert wheel.parent.name.endswith(f"_p{hb.PATCH_LEVEL}") and hb.PATCH_LEVEL >= 2


@pytest.mark.timeout(30)
def test_the_installed_build_has_the_patches_its_marker_names() -> None:
    """Whatever `python -m distkit.horovod_build` installed here carries the rendezvous fix."""
    key = hb.installed_key(hb.DEFAULT_VERSION)
    if key is None or not key.endswith(f"_p{hb.PATCH_LEVEL}"):
        pytest.skip(f"no horovod built by this patch level is installed (found {key})")
    assert hb.installed_rendezvous_fixed() is True


@pytest.mark.timeout(30)
def test_doctor_warns_about_a_rendezvous_server_that_keeps_keys() -> None:
    from distkit.launch._env import LaunchEnv
    from distkit.launch.diagnosis import MachineFacts
    from distkit.strategies.horovod import _doctor as doctor

    machine = MachineFacts("py", "2.13.0+cpu", 0, True, False, True, LaunchEnv())
    key = hb.cache_key("0.28.1", "2.13.0+cpu", "cp311", CPU)
    check_build = {"frameworks": {"PyTorch": True}, "controllers": {"Gloo": True}}
    facts = doctor.HorovodFacts(
        "0.28.1", "hvdrun", check_build, build_key=key, expected_key=key, rendezvous_fixed=True
    )
    fixed = doctor.verdict("horovod", machine, facts)
    assert fixed.usable and fixed.fix is None and "keeps" not in fixed.summary
    foreign = dataclasses.replace(facts, build_key=None, rendezvous_fixed=False)
    warned = doctor.verdict("horovod", machine, foreign)
    assert warned.usable and warned.fix == "py -m distkit.horovod_build"
    assert "hvd.init() after hvd.shutdown()" in warned.summary
    old = dataclasses.replace(facts, build_key=key.replace("_p2", "_p1"), rendezvous_fixed=False)
    assert doctor.verdict("horovod", machine, old).fix == "py -m distkit.horovod_build --force"


@pytest.mark.timeout(60)
def test_installed_rendezvous_fixed_reads_the_installed_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    package = tmp_path / "horovod"
    server = tmp_path / hb.RENDEZVOUS_FILE
    server.parent.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('must not be imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "horovod", raising=False)
    server.write_text(RENDEZVOUS_FIXTURE)
    assert hb.installed_rendezvous_fixed() is False
    server.write_text(RENDEZVOUS_FIXTURE.replace(*_FIX))
    assert hb.installed_rendezvous_fixed() is True
    server.write_text("class RendezvousHandler:\n    pass\n")
    assert hb.installed_rendezvous_fixed() is None
    server.unlink()
    assert hb.installed_rendezvous_fixed() is None


# ---------------------------------------------------------------- Horovod's own suite (nox)
@pytest.mark.timeout(60)
def test_suite_fetch_checks_every_file_against_the_release_digest(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    data = b"def test_one():\n    pass\n"
    monkeypatch.setattr(suite, "FILES", {"test/t.py": hashlib.sha256(data).hexdigest()})
    checkout = tmp_path / "checkout"
    (checkout / "test").mkdir(parents=True)
    (checkout / "test" / "t.py").write_bytes(data)
    suite.fetch(tmp_path / "a", checkout)
    assert (tmp_path / "a" / "test" / "t.py").read_bytes() == data
    (checkout / "test" / "t.py").write_bytes(data + b"# changed\n")
    with pytest.raises(DistkitError, match=r"test/t.py from .* has sha256 .*--source"):
        suite.fetch(tmp_path / "b", checkout)


@pytest.mark.timeout(60)
def test_suite_fetch_reads_the_tag_from_a_git_clone(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    data = b"def test_one():\n    pass\n"
    monkeypatch.setattr(suite, "FILES", {"test/t.py": hashlib.sha256(data).hexdigest()})
    repo = tmp_path / "repo"
    (repo / "test").mkdir(parents=True)
    (repo / "test" / "t.py").write_bytes(data)
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    for args in (["init", "-q"], ["add", "."], ["commit", "-qm", "c"], ["tag", "v9"]):
        subprocess.run([*git, *args], check=True, capture_output=True)
    (repo / "test" / "t.py").write_bytes(b"changed after the tag\n")
    (repo / "test" / "t.py").rename(repo / "moved.py")  # the work tree no longer has the file
    suite.fetch(tmp_path / "out", repo, tag="v9")
    assert (tmp_path / "out" / "test" / "t.py").read_bytes() == data
    with pytest.raises(DistkitError, match="not a git clone with tag v8"):
        suite.fetch(tmp_path / "out2", repo, tag="v8")


@pytest.mark.timeout(120)
def test_suite_reads_what_pytest_reports_and_fails_on_anything_unexplained(tmp_path: Path) -> None:
    tests = tmp_path / "test_x.py"
    tests.write_text(
        "import pytest\n"
        "def test_ok():\n    pass\n"
        "def test_bad():\n    assert 1 == 2, 'one is not two'\n"
        "def test_skips():\n    pytest.skip('No GPUs available')\n"
    )
    junit = tmp_path / "rank0.xml"
    args = [str(tests), "-q", "-p", "no:cacheprovider", f"--junitxml={junit}"]
    subprocess.run([sys.executable, "-m", "pytest", *args], capture_output=True, cwd=tmp_path)
    outcome = suite.read_junit(junit)
    assert outcome.results["test_ok"] == "passed"
    assert outcome.results["test_bad"].startswith("failed: AssertionError: one is not two")
    assert outcome.results["test_skips"] == "skipped: No GPUs available"
    assert outcome.counts() == {"passed": 1, "failed": 1, "skipped": 1}
    found = suite.problems([outcome], {"test_ok", "test_bad", "test_skips", *suite.NOT_APPLICABLE})
    assert [line.split(":")[1].split()[0] for line in found] == ["test_bad", "test_skips"]
    stale = suite.problems([suite.Outcome({"test_ok": "passed"})], {"test_ok"})
    assert len(stale) == len(suite.NOT_APPLICABLE)
    assert all("deselected but" in line for line in stale)


@pytest.mark.timeout(30)
def test_suite_deselects_each_not_applicable_test_and_hides_only_the_excluded_optimizers(
    tmp_path: Path,
) -> None:
    tests = tmp_path / "test_torch.py"
    tests.write_text("class TorchTests:\n    def test_a(self):\n        def test_inner(): ...\n")
    assert suite.defined_tests(tests) == {"test_a"}
    args = suite.pytest_args(Path("rank0.xml"), 300)
    deselected = [args[i + 1] for i, arg in enumerate(args) if arg == "--deselect"]
    assert deselected == [f"{suite.TEST_FILE}::TorchTests::{n}" for n in suite.NOT_APPLICABLE]
    assert all(why.strip() for why in [*suite.NOT_APPLICABLE.values(), *suite.SWEEP_EXCLUDED])

    class Optimizer:
        pass

    Muon = type("Muon", (Optimizer,), {"__module__": "torch.optim._muon"})
    SGD = type("SGD", (Optimizer,), {"__module__": "torch.optim.sgd"})
    optim = SimpleNamespace(Muon=Muon, SGD=SGD)
    assert suite.exclude_from_sweep(optim) == ["Muon"]
    swept = [
        c.__name__ for c in Optimizer.__subclasses__() if c.__module__.startswith("torch.optim")
    ]
    assert swept == ["SGD"]
