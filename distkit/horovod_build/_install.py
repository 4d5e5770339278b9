"""Building, marking, installing and checking the wheel."""

from __future__ import annotations

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
from pathlib import Path
from typing import Any

from distkit.errors import DistkitError, MissingDependencyError
from distkit.horovod_build._recipe import (
    _PREFIX,
    BUILD_REQUIREMENTS,
    MARKER,
    PATCHES,
    RENDEZVOUS_FILE,
    Flavour,
    _bin_path,
    build_env,
    patch_source,
    python_tag,
    rendezvous_is_fixed,
    sdist_path,
)


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


def installed_rendezvous_fixed() -> bool | None:
    """Whether the installed horovod's rendezvous server forgets a finished init's keys.

    Reads ``horovod/runner/http/http_server.py`` without importing horovod: True when it has
    the fix, False for Horovod 0.28.1's server, None when horovod is not installed or the file is
    another version's (see :func:`~distkit.horovod_build.rendezvous_is_fixed`).
    """
    try:
        spec = importlib.util.find_spec("horovod")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(next(iter(spec.submodule_search_locations))).parent
    try:
        return rendezvous_is_fixed((root / RENDEZVOUS_FILE).read_text())
    except OSError:
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
        archive = _fetch_sdist(version, out_dir.parent, session)
        with tarfile.open(archive) as tar:
            if hasattr(tarfile, "data_filter"):
                tar.extractall(tmp, filter="data")
            else:  # Python < 3.10.12 / 3.11.4
                tar.extractall(tmp)
        source = tmp / f"horovod-{version}"
        changed = [str(path.relative_to(source)) for path in patch_source(source)]
        session.say(f"patches {' + '.join(PATCHES)}: changed {', '.join(changed) or 'nothing'}")
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
        marker = {"key": key, "torch": torch_version, "flavour": flavour.tag, "patches": PATCHES}
        finalize_wheel(built, marker)
        out_dir.mkdir(parents=True, exist_ok=True)
        partial = out_dir / (built.name + ".partial")
        shutil.move(built, partial)
        os.replace(partial, out_dir / built.name)  # atomic: a half-copied wheel is never cached
    session.say(f"built {out_dir / built.name} ({(out_dir / built.name).stat().st_size:,} bytes)")
    return out_dir / built.name


def _fetch_sdist(version: str, cache_dir: Path, session: _Session) -> Path:
    """The horovod ``version`` sdist, downloaded once into the cache (the patches read it)."""
    cached = sdist_path(version, cache_dir)
    if cached.is_file():
        session.say(f"using the cached sdist {cached}")
        return cached
    session.say(f"downloading the horovod {version} sdist")
    cached.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cached.parent) as tmp:
        sdist = _pip("download", "--no-deps", "--no-binary", ":all:", f"horovod=={version}")
        session.run([*sdist, "-d", tmp], f"downloading horovod=={version}")
        archives = sorted(Path(tmp).glob("horovod-*.tar.gz"))
        if not archives:
            raise DistkitError(f"pip download left no horovod-*.tar.gz; see {session.log}")
        os.replace(archives[0], cached)  # atomic: a half-downloaded sdist is never cached
    return cached


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
