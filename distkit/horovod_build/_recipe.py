"""What to build: the flavour, the cache key, the patches to the sdist and the build environment."""

from __future__ import annotations

import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

from distkit.errors import DistkitError, MissingDependencyError

DEFAULT_VERSION = "0.28.1"
PATCH_LEVEL = 2  # bump when the patches or build settings change: invalidates cached wheels
#: what the sdist gets, as recorded in the wheel's marker: 1 = C++17, 2 = + the rendezvous fix
PATCHES = ("cxx17", "rendezvous-finished-scope")
RUNTIME_REQUIREMENTS = ("cloudpickle", "psutil", "pyyaml", "packaging")
BUILD_REQUIREMENTS = ("numpy", "cmake", "wheel", "setuptools", "cffi", *RUNTIME_REQUIREMENTS)
CMAKE_FILES = ("CMakeLists.txt", "horovod/torch/CMakeLists.txt")
RENDEZVOUS_FILE = "horovod/runner/http/http_server.py"  # horovodrun's rendezvous server
# When the last rank of one scope (global, local_<host>, cross_<n>) leaves the rendezvous,
# 0.28.1 forgets the finished ranks of *every* scope. A scope whose ranks were half counted then
# never completes, its keys stay, and the next hvd.init() in the job can read a dead address.
_RENDEZVOUS_BUG = "self.server.finished_list.clear()"
_RENDEZVOUS_FIX = "del self.server.finished_list[scope]"
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


def sdist_path(version: str, cache_dir: Path | str | None = None) -> Path:
    """Where the build keeps the horovod ``version`` sdist it patched (kept for rebuilds).

    Args:
        version: e.g. ``"0.28.1"``.
        cache_dir: the wheel cache; default :func:`default_cache_dir`.
    """
    root = Path(cache_dir or default_cache_dir()).expanduser()
    return root / "sdist" / f"horovod-{version}.tar.gz"


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
                "version needs a new recipe (bump PATCH_LEVEL in distkit/horovod_build/_recipe.py)."
            )
        if any(int(level) < 17 for level in levels):
            path.write_text(_CXX_RE.sub(_to_cxx17, text))
            changed.append(path)
    return changed


def _to_cxx17(match: re.Match[str]) -> str:
    return "set(CMAKE_CXX_STANDARD 17)" if int(match[1]) < 17 else match[0]


def rendezvous_is_fixed(text: str) -> bool | None:
    """Whether the text of ``horovod/runner/http/http_server.py`` forgets only its own scope.

    Returns:
        True with the fix (ours, or one that removed the old statement and has ours), False with
        Horovod 0.28.1's statement, None when the file has neither (another version's server:
        nothing is known about it).
    """
    if _RENDEZVOUS_BUG in text:
        return False
    return True if _RENDEZVOUS_FIX in text else None


def patch_rendezvous(source_dir: Path) -> list[Path]:
    """Make horovodrun's rendezvous server forget a finished scope's ranks, not every scope's.

    In Horovod 0.28.1 (``RendezvousHandler.do_DELETE``), the last rank leaving one scope clears
    the finished lists of all scopes, so a scope whose ranks were half counted never completes
    and keeps its keys; a second ``hvd.init()`` in the same ``horovodrun`` job then reads the
    previous init's addresses and gloo aborts ("Connection refused", "Connect timeout"). The
    patch deletes only that scope's list, the one statement changed.

    Args:
        source_dir: the extracted sdist, e.g. ``.../horovod-0.28.1``.

    Returns:
        The file changed; empty when the tree is already patched.

    Raises:
        DistkitError: the file is missing, or holds neither the old statement (exactly once)
            nor the fix: this Horovod version needs a new recipe.
    """
    path = Path(source_dir) / RENDEZVOUS_FILE
    if not path.is_file():
        raise DistkitError(f"{path} not found: is {source_dir} a horovod source tree?")
    text = path.read_text()
    count = text.count(_RENDEZVOUS_BUG)
    if count == 0 and rendezvous_is_fixed(text):
        return []
    if count != 1:
        raise DistkitError(
            f"{path} has {count} copies of {_RENDEZVOUS_BUG!r} (expected one, in "
            "RendezvousHandler.do_DELETE); this horovod version needs a new recipe (look at "
            "patch_rendezvous and bump PATCH_LEVEL in distkit/horovod_build/_recipe.py)."
        )
    path.write_text(text.replace(_RENDEZVOUS_BUG, _RENDEZVOUS_FIX))
    return [path]


def patch_source(source_dir: Path) -> list[Path]:
    """Apply every patch in :data:`PATCHES` to an extracted sdist; the files changed.

    Raises:
        DistkitError: a patch does not apply (see :func:`patch_cxx17`, :func:`patch_rendezvous`).
    """
    return [*patch_cxx17(source_dir), *patch_rendezvous(source_dir)]


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
