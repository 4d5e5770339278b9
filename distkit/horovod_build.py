"""Build, cache and install a working Horovod for the torch in this interpreter.

PyPI only has the horovod 0.28.1 sdist, which does not build against torch >= 2.1 as shipped.
This module applies the known fixes (C++17 in both CMakeLists, ``CMAKE_POLICY_VERSION_MINIMUM``,
cffi installed first), builds a wheel once per (horovod, torch, python, flavour, patch level),
caches it, installs it with ``--no-deps`` (torch is never installed or upgraded) and checks the
result with ``horovodrun --check-build``::

    python -m distkit.horovod_build [--version 0.28.1] [--cache-dir DIR] [--force]
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distkit.errors import DistkitError, MissingDependencyError

DEFAULT_VERSION = "0.28.1"
PATCH_LEVEL = 1  # bump when the patches or build settings change: invalidates cached wheels
RUNTIME_REQUIREMENTS = ("cloudpickle", "psutil", "pyyaml", "packaging")
BUILD_REQUIREMENTS = ("numpy", "cmake", "wheel", "setuptools", "cffi", *RUNTIME_REQUIREMENTS)
CMAKE_FILES = ("CMakeLists.txt", "horovod/torch/CMakeLists.txt")
MARKER = "horovod/distkit_build.json"  # added to the wheel: the installed build knows its key
_CXX_RE = re.compile(r"set\(\s*CMAKE_CXX_STANDARD\s+(\d+)\s*\)")
_PREFIX = "[distkit.horovod_build]"


@dataclass(frozen=True)
class Flavour:
    """What the wheel is built with: CUDA (NCCL) or CPU, and MPI or not. Gloo is always on."""

    cuda: bool = False
    mpi: bool = False

    @property
    def parts(self) -> list[str]:
        """Short names, e.g. ``["cpu", "gloo"]`` or ``["cuda", "nccl", "gloo", "mpi"]``."""
        device = ["cuda", "nccl"] if self.cuda else ["cpu"]
        return [*device, "gloo", *(["mpi"] if self.mpi else [])]

    @property
    def tag(self) -> str:
        """The flavour as it appears in the cache key, e.g. ``"cpu-gloo"``."""
        return "-".join(self.parts)


def _cpu_count() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def _bin_path() -> str:
    """PATH with this interpreter's bin dir first (pip's cmake and mpicc land there)."""
    return os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])


def detect_flavour(cuda: bool) -> Flavour:
    """The flavour for this machine: MPI when an MPI compiler (``mpicc``) is on PATH.

    Args:
        cuda: whether torch sees a CUDA device and is a CUDA build (then NCCL is used).
    """
    return Flavour(cuda=cuda, mpi=shutil.which("mpicc", path=_bin_path()) is not None)


def python_tag() -> str:
    """The wheel python tag of this interpreter, e.g. ``"cp311"``."""
    impl = "cp" if sys.implementation.name == "cpython" else sys.implementation.name
    return f"{impl}{sys.version_info[0]}{sys.version_info[1]}"


def cache_key(
    horovod_version: str,
    torch_version: str,
    py_tag: str,
    flavour: Flavour,
    patch: int = PATCH_LEVEL,
) -> str:
    """The name under which a wheel is cached; any change of an input means a rebuild.

    Args:
        horovod_version: e.g. ``"0.28.1"``.
        torch_version: ``torch.__version__`` including its local tag, e.g. ``"2.13.0+cpu"``.
        py_tag: e.g. ``"cp311"``.
        flavour: the build flavour.
        patch: this module's patch level.

    Returns:
        e.g. ``"horovod-0.28.1_torch-2.13.0+cpu_cp311_cpu-gloo_p1"``.
    """
    return f"horovod-{horovod_version}_torch-{torch_version}_{py_tag}_{flavour.tag}_p{patch}"


def default_cache_dir() -> Path:
    """``$DISTKIT_CACHE_DIR/horovod``, or ``~/.cache/distkit/horovod``."""
    root = os.environ.get("DISTKIT_CACHE_DIR")
    return Path(root) / "horovod" if root else Path.home() / ".cache" / "distkit" / "horovod"


def patch_cxx17(source_dir: Path) -> list[Path]:
    """Switch both CMakeLists of a horovod source tree from C++14 to C++17 (torch >= 2.1 needs it).

    Args:
        source_dir: the extracted sdist, e.g. ``.../horovod-0.28.1``.

    Returns:
        The files changed; empty when the tree already uses C++17.

    Raises:
        DistkitError: a file is missing or sets no ``CMAKE_CXX_STANDARD``.
    """
    changed = []
    for rel in CMAKE_FILES:
        path = Path(source_dir) / rel
        if not path.is_file():
            raise DistkitError(f"{path} not found: is {source_dir} a horovod source tree?")
        text = path.read_text()
        levels = _CXX_RE.findall(text)
        if not levels:
            raise DistkitError(
                f"{path} has no 'set(CMAKE_CXX_STANDARD 14)' line to patch to 17; this horovod "
                "version needs a new recipe (bump PATCH_LEVEL in distkit/horovod_build.py)."
            )
        if any(int(level) < 17 for level in levels):
            path.write_text(_CXX_RE.sub(_to_cxx17, text))
            changed.append(path)
    return changed


def _to_cxx17(match: re.Match[str]) -> str:
    return "set(CMAKE_CXX_STANDARD 17)" if int(match[1]) < 17 else match[0]


def build_env(flavour: Flavour, jobs: int) -> dict[str, str]:
    """The environment variables that select what Horovod builds (merged over ``os.environ``).

    Args:
        flavour: CPU/CUDA and MPI choice.
        jobs: parallel compile jobs (``MAKEFLAGS=-j<jobs>``).
    """
    env = {
        "HOROVOD_WITH_PYTORCH": "1",
        "HOROVOD_WITHOUT_TENSORFLOW": "1",
        "HOROVOD_WITHOUT_MXNET": "1",
        "HOROVOD_WITH_GLOO": "1",
        "HOROVOD_WITH_MPI" if flavour.mpi else "HOROVOD_WITHOUT_MPI": "1",
        "CMAKE_POLICY_VERSION_MINIMUM": "3.5",  # pip's cmake 4.x rejects gloo's old minimum
        "MAKEFLAGS": f"-j{jobs}",
    }
    if flavour.cuda:
        env["HOROVOD_GPU_OPERATIONS"] = "NCCL"
    else:
        env["HOROVOD_CPU_OPERATIONS"] = "GLOO"
    return env


def parse_check_build(output: str) -> dict[str, dict[str, bool]]:
    """Parse ``horovodrun --check-build`` into ``{section: {name: enabled}}``.

    Sections are lower-cased without "Available", e.g. ``out["frameworks"]["PyTorch"]``.
    """
    sections: dict[str, dict[str, bool]] = {}
    current: dict[str, bool] | None = None
    for line in output.splitlines():
        item = re.match(r"\s*\[([ xX])\]\s+(\S.*?)\s*$", line)
        if item and current is not None:
            current[item[2]] = item[1] in "xX"
        elif (head := re.match(r"\s*Available (.+?):\s*$", line)) is not None:
            current = sections.setdefault(head[1].lower(), {})
    return sections


def check_build_problems(output: str, flavour: Flavour) -> list[str]:
    """What is missing from a ``--check-build`` output for ``flavour``; empty when all is there."""
    parsed = parse_check_build(output)
    need = [("frameworks", "PyTorch"), ("controllers", "Gloo")]
    need += [("controllers", "MPI")] * flavour.mpi + [("tensor operations", "NCCL")] * flavour.cuda
    return [
        f"{name} is not marked [X] under 'Available {section.title()}'"
        for section, name in need
        if not parsed.get(section, {}).get(name, False)
    ]


def torch_info() -> tuple[str, bool]:
    """``(torch.__version__, cuda usable)`` of this interpreter; never installs torch.

    Raises:
        MissingDependencyError: torch is not importable.
    """
    try:
        import torch
    except ImportError as exc:
        raise MissingDependencyError(
            f"building Horovod needs torch importable in {sys.executable} ({exc}). Install torch "
            f"first, pinned to the version you train with (e.g. `{sys.executable} -m pip install "
            "torch==2.13.0`): this tool never installs or upgrades torch."
        ) from exc
    return str(torch.__version__), bool(torch.cuda.is_available() and torch.version.cuda)


def installed_key(version: str) -> str | None:
    """The cache key of the installed horovod if it is ``version`` and was built by this module."""
    try:
        if importlib.metadata.version("horovod") != version:
            return None
        spec = importlib.util.find_spec("horovod")
    except (importlib.metadata.PackageNotFoundError, ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    marker = Path(next(iter(spec.submodule_search_locations))) / Path(MARKER).name
    try:
        return str(json.loads(marker.read_text())["key"])
    except (OSError, ValueError, KeyError):
        return None


def finalize_wheel(wheel: Path, marker: dict[str, Any], strip: bool = True) -> None:
    """Add the build marker to ``wheel`` in place, ``strip --strip-debug`` its .so, fix RECORD."""
    strip_bin = shutil.which("strip") if strip else None
    tmp = wheel.with_suffix(".tmp")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
        record = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        entries = [(zipfile.ZipInfo(MARKER, (2020, 1, 1, 0, 0, 0)), json.dumps(marker).encode())]
        entries[0][0].external_attr = 0o644 << 16
        entries += [(i, src.read(i)) for i in src.infolist() if i.filename != record]
        lines = []
        for info, data in entries:
            if strip_bin and info.filename.endswith(".so"):
                data = _strip(strip_bin, data)
            dst.writestr(info, data, zipfile.ZIP_DEFLATED)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            lines.append(f"{info.filename},sha256={digest},{len(data)}")
        dst.writestr(src.getinfo(record), "\n".join([*lines, f"{record},,", ""]))
    os.replace(tmp, wheel)


def _strip(strip_bin: str, data: bytes) -> bytes:
    """``data`` (a shared library) without debug info; unchanged if ``strip`` fails."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "lib.so"
        path.write_bytes(data)
        done = subprocess.run([strip_bin, "--strip-debug", str(path)], capture_output=True)
        return path.read_bytes() if done.returncode == 0 else data


class _Session:
    """Progress lines with elapsed time, and subprocesses whose output goes to one log file."""

    def __init__(self, log: Path) -> None:
        self.log, self.t0 = log, time.monotonic()

    def say(self, msg: str) -> None:
        print(f"{_PREFIX} [{time.monotonic() - self.t0:6.1f}s] {msg}", flush=True)

    def run(self, cmd: list[str], what: str, env: dict[str, str] | None = None) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with self.log.open("a") as fh:
            fh.write(f"\n### {time.strftime('%Y-%m-%d %H:%M:%S')} $ {shlex.join(cmd)}\n")
            fh.flush()
            rc = subprocess.run(
                cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
            ).returncode
        if rc != 0:
            tail = "\n".join(self.log.read_text(errors="replace").splitlines()[-40:])
            raise DistkitError(
                f"{what} failed (exit code {rc}). Last 40 lines of the log:\n"
                f"{tail}\n{what} failed; full log: {self.log}"
            )


def _pip(*args: str) -> list[str]:
    return [sys.executable, "-m", "pip", *args]


def build_wheel(
    version: str,
    key: str,
    flavour: Flavour,
    torch_version: str,
    out_dir: Path,
    jobs: int,
    session: _Session,
) -> Path:
    """Download, patch and build the horovod sdist; move the wheel into ``out_dir``."""
    session.log.unlink(missing_ok=True)  # the log holds the latest build (and later installs)
    session.say(f"installing build prerequisites: {' '.join(BUILD_REQUIREMENTS)}")
    session.run(_pip("install", *BUILD_REQUIREMENTS), "installing the build prerequisites")
    now = importlib.metadata.version("torch")
    if now.split("+")[0] != torch_version.split("+")[0]:
        raise DistkitError(
            f"torch changed from {torch_version} to {now} during setup; reinstall "
            f"torch=={torch_version} and rerun"
        )
    with tempfile.TemporaryDirectory(prefix="distkit-horovod-") as tmp_name:
        tmp = Path(tmp_name)
        session.say(f"downloading the horovod {version} sdist")
        sdist = _pip("download", "--no-deps", "--no-binary", ":all:", f"horovod=={version}")
        session.run([*sdist, "-d", str(tmp)], f"downloading horovod=={version}")
        archives = sorted(tmp.glob("horovod-*.tar.gz"))
        if not archives:
            raise DistkitError(f"pip download left no horovod-*.tar.gz; see {session.log}")
        with tarfile.open(archives[0]) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(tmp, filter="data")
            else:  # Python < 3.10.12 / 3.11.4
                tar.extractall(tmp)
        source = tmp / f"horovod-{version}"
        session.say(f"patched C++14 -> C++17 in {len(patch_cxx17(source))} CMakeLists.txt")
        session.say(
            f"building horovod {version} for torch {torch_version} / {python_tag()} "
            f"({', '.join(flavour.parts)}) ... "
            f"this takes ~{round(1 + 10 / jobs)} min or less on {jobs} cores; log: {session.log}"
        )
        env = {
            k: v for k, v in os.environ.items() if not re.match(r"HOROVOD_(WITH|.*_OPERATIONS$)", k)
        }
        env.update(build_env(flavour, jobs), PATH=_bin_path())
        dist = tmp / "dist"
        wheel_cmd = _pip("wheel", "-v", "--no-build-isolation", "--no-deps", "--no-cache-dir")
        session.run([*wheel_cmd, "-w", str(dist), str(source)], "the horovod build", env=env)
        built = next(dist.glob("horovod-*.whl"))
        marker = {"key": key, "torch": torch_version, "flavour": flavour.tag}
        finalize_wheel(built, marker)
        out_dir.mkdir(parents=True, exist_ok=True)
        partial = out_dir / (built.name + ".partial")
        shutil.move(built, partial)
        os.replace(partial, out_dir / built.name)  # atomic: a half-copied wheel is never cached
    session.say(f"built {out_dir / built.name} ({(out_dir / built.name).stat().st_size:,} bytes)")
    return out_dir / built.name


def horovodrun_path() -> str:
    """``horovodrun`` next to ``sys.executable``, else on PATH."""
    local = Path(sys.executable).parent / "horovodrun"
    found = str(local) if local.is_file() else shutil.which("horovodrun")
    if found is None:
        raise MissingDependencyError(f"horovodrun is neither in {local.parent} nor on PATH")
    return found


def _expose_horovodrun() -> None:
    """Give ``horovodrun`` a pyenv shim: ``python -m pip`` bypasses pyenv's automatic rehash."""
    root = os.environ.get("PYENV_ROOT")
    if not root or (Path(root) / "shims" / "horovodrun").exists() or not shutil.which("pyenv"):
        return
    if Path(sys.executable).resolve().is_relative_to(Path(root).resolve()):
        subprocess.run(["pyenv", "rehash"], capture_output=True)


def verify_install(flavour: Flavour, session: _Session) -> None:
    """Run ``horovodrun --check-build``, print it, and require PyTorch and Gloo (+ MPI/NCCL)."""
    session.say("verifying: horovodrun --check-build")
    done = subprocess.run([horovodrun_path(), "--check-build"], capture_output=True, text=True)
    output = (done.stdout + done.stderr).strip()
    print(output, flush=True)
    problems = check_build_problems(output, flavour)
    if done.returncode != 0 or problems:
        raise DistkitError(
            f"horovodrun --check-build (exit code {done.returncode}): "
            f"{'; '.join(problems) or 'failed'}. Rerun with --force to rebuild."
        )


def ensure_horovod(
    version: str = DEFAULT_VERSION,
    cache_dir: Path | str | None = None,
    *,
    force: bool = False,
    install: bool = True,
    verify: bool = True,
    jobs: int | None = None,
) -> Path | None:
    """Make ``horovod.torch`` work in this interpreter: reuse, install from cache, or build.

    Args:
        version: horovod release to build.
        cache_dir: where wheels and logs go; default :func:`default_cache_dir`.
        force: rebuild even when a cached wheel or a matching install exists.
        install: install the wheel (``pip install --no-deps``); False only builds/caches it.
        verify: run ``horovodrun --check-build`` after installing.
        jobs: compile jobs; default the CPUs available to this process.

    Returns:
        The cached wheel's path; None when a matching horovod was already installed and no
        cached wheel exists.

    Raises:
        MissingDependencyError: torch is not importable.
        DistkitError: a step failed (the message has the log's tail and path).
    """
    torch_version, cuda = torch_info()
    flavour = detect_flavour(cuda)
    key = cache_key(version, torch_version, python_tag(), flavour)
    out_dir = Path(cache_dir or default_cache_dir()).expanduser() / key
    session = _Session(out_dir / "build.log")
    cached = next(iter(sorted(out_dir.glob(f"horovod-{version}-*.whl"))), None)
    if install and not force and installed_key(version) == key:
        try:
            if verify:
                verify_install(flavour, session)
            else:
                session.run([sys.executable, "-c", "import horovod.torch"], "import horovod.torch")
            _expose_horovodrun()
            session.say(f"horovod {version} is already installed for {key}: nothing to do")
            return cached
        except DistkitError as exc:
            session.say(f"the installed horovod does not work ({exc}); reinstalling")
    if cached is None or force:
        cached = build_wheel(
            version, key, flavour, torch_version, out_dir, jobs or _cpu_count(), session
        )
    else:
        session.say(f"cache hit: {cached}")
    if install:
        session.say(f"installing {cached.name} (--no-deps) and {' '.join(RUNTIME_REQUIREMENTS)}")
        session.run(_pip("install", *RUNTIME_REQUIREMENTS), "installing horovod's runtime deps")
        session.run(
            _pip("install", "--no-deps", "--force-reinstall", str(cached)),
            f"installing {cached.name}",
        )
        _expose_horovodrun()
        if verify:
            verify_install(flavour, session)
    session.say("done")
    return cached


def main(argv: list[str] | None = None) -> int:
    """Command line entry point; returns the exit code (0 ok, 1 failure)."""
    parser = argparse.ArgumentParser(
        prog="python -m distkit.horovod_build",
        description="Build (once), cache and install a Horovod wheel that works with the torch "
        "installed in this interpreter (PyTorch + Gloo; MPI if mpicc is found; NCCL on CUDA). "
        "Never installs or upgrades torch.",
        epilog="Wheels are cached per horovod version, torch version, python tag, flavour and "
        "patch level (set DISTKIT_CACHE_DIR or --cache-dir to move the cache); a cache hit "
        "installs in seconds, a build takes ~6 min on 2 cores. The build log is written next to "
        "the wheel. Install torch first: this tool only ever installs horovod with --no-deps.",
    )
    parser.add_argument(
        "--version",
        dest="horovod_version",
        default=DEFAULT_VERSION,
        metavar="X.Y.Z",
        help="horovod release (default: %(default)s)",
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        metavar="DIR",
        help=f"wheel cache and build logs (default: {default_cache_dir()})",
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if cached/installed")
    parser.add_argument("--no-install", action="store_true", help="only build and cache the wheel")
    parser.add_argument("--no-verify", action="store_true", help="skip horovodrun --check-build")
    parser.add_argument("--jobs", type=int, metavar="N", help="compile jobs (default: all CPUs)")
    args = parser.parse_args(argv)
    try:
        wheel = ensure_horovod(
            args.horovod_version,
            args.cache_dir,
            force=args.force,
            install=not args.no_install,
            verify=not args.no_verify,
            jobs=args.jobs,
        )
    except DistkitError as exc:
        print(f"{_PREFIX} ERROR: {exc}", file=sys.stderr, flush=True)
        return 1
    if wheel is not None:
        print(f"{_PREFIX} wheel: {wheel}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
