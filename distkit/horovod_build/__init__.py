"""Build, cache and install a working Horovod for the torch in this interpreter.

PyPI only has the horovod 0.28.1 sdist, which does not build against torch >= 2.1 as shipped.
This module applies the known fixes (C++17 in both CMakeLists, ``CMAKE_POLICY_VERSION_MINIMUM``,
cffi installed first, and horovodrun's rendezvous server forgetting a finished init's keys so a
second ``hvd.init()`` in one job does not abort), builds a wheel once per (horovod, torch,
python, flavour, patch level), caches it, installs it with ``--no-deps`` (torch is never
installed or upgraded) and checks the result with ``horovodrun --check-build``::

    python -m distkit.horovod_build [--version 0.28.1] [--cache-dir DIR] [--force]

``python -m distkit.horovod_build.suite`` (``nox -s horovod_suite``) runs Horovod's own PyTorch
tests against the installed build.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from distkit.errors import DistkitError
from distkit.horovod_build._install import (
    _PREFIX,
    _expose_horovodrun,
    _pip,
    _Session,
    build_wheel,
    check_build_problems,
    finalize_wheel,
    horovodrun_path,
    installed_key,
    installed_rendezvous_fixed,
    parse_check_build,
    verify_install,
)
from distkit.horovod_build._recipe import (
    BUILD_REQUIREMENTS,
    CMAKE_FILES,
    DEFAULT_VERSION,
    MARKER,
    PATCH_LEVEL,
    PATCHES,
    RENDEZVOUS_FILE,
    RUNTIME_REQUIREMENTS,
    Flavour,
    _cpu_count,
    build_env,
    cache_key,
    default_cache_dir,
    detect_flavour,
    patch_cxx17,
    patch_rendezvous,
    patch_source,
    python_tag,
    rendezvous_is_fixed,
    sdist_path,
    torch_info,
)

__all__ = [
    "BUILD_REQUIREMENTS",
    "CMAKE_FILES",
    "DEFAULT_VERSION",
    "MARKER",
    "PATCHES",
    "PATCH_LEVEL",
    "RENDEZVOUS_FILE",
    "RUNTIME_REQUIREMENTS",
    "Flavour",
    "build_env",
    "build_wheel",
    "cache_key",
    "check_build_problems",
    "default_cache_dir",
    "detect_flavour",
    "ensure_horovod",
    "finalize_wheel",
    "horovodrun_path",
    "installed_key",
    "installed_rendezvous_fixed",
    "main",
    "parse_check_build",
    "patch_cxx17",
    "patch_rendezvous",
    "patch_source",
    "python_tag",
    "rendezvous_is_fixed",
    "sdist_path",
    "torch_info",
    "verify_install",
]


def ensure_horovod(
    version: str = DEFAULT_VERSION,
    cache_dir: Path | str | None = None,
    *,
    force: bool = False,
    install: bool = True,
    verify: bool = True,
    jobs: int | None = None,
    mpi: bool | None = None,
) -> Path | None:
    """Make ``horovod.torch`` work in this interpreter: reuse, install from cache, or build.

    Args:
        version: horovod release to build.
        cache_dir: where wheels and logs go; default :func:`default_cache_dir`.
        force: rebuild even when a cached wheel or a matching install exists.
        install: install the wheel (``pip install --no-deps``); False only builds/caches it.
        verify: run ``horovodrun --check-build`` after installing.
        jobs: compile jobs; default the CPUs available to this process.
        mpi: build with MPI (True), without (False), or when ``mpicc`` is on PATH (None).

    Returns:
        The cached wheel's path; None when a matching horovod was already installed and no
        cached wheel exists.

    Raises:
        MissingDependencyError: torch is not importable.
        DistkitError: a step failed (the message has the log's tail and path).
    """
    torch_version, cuda = torch_info()
    flavour = detect_flavour(cuda)
    if mpi is not None:
        flavour = dataclasses.replace(flavour, mpi=mpi)
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
    parser.add_argument(
        "--without-mpi",
        dest="mpi",
        action="store_const",
        const=False,
        default=None,
        help="build Gloo only, even where mpicc is found (default: MPI when mpicc is on PATH)",
    )
    args = parser.parse_args(argv)
    try:
        wheel = ensure_horovod(
            args.horovod_version,
            args.cache_dir,
            force=args.force,
            install=not args.no_install,
            verify=not args.no_verify,
            jobs=args.jobs,
            mpi=args.mpi,
        )
    except DistkitError as exc:
        print(f"{_PREFIX} ERROR: {exc}", file=sys.stderr, flush=True)
        return 1
    if wheel is not None:
        print(f"{_PREFIX} wheel: {wheel}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
