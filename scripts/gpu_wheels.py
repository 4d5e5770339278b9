"""DeepSpeed for the GPU machine, which has no package index: brought as files in ``.gpu/``.

    python3 scripts/gpu_wheels.py fetch [DIR]            # here, with an index: fill DIR
    python3 scripts/gpu_wheels.py install DIR TARGET     # there: install what is missing

``fetch`` (default DIR ``.gpu/deepspeed``) builds DeepSpeed's wheel from its sdist (pure
Python: ``py3-none-any``; the ops it would compile are JIT-built at first use, and distkit's
tests use none) and downloads the wheels of its requirements for the GPU machine's Python
(3.12, manylinux x86_64; ``--python-version`` to change). numpy and torch are not brought:
the GPU machine has its own CUDA build of torch and the numpy it was built against.

``install`` puts into ``TARGET`` (a folder for ``PYTHONPATH``, ``pip install --target``) each
wheel of ``DIR`` whose distribution is absent from the running Python or older there, without
dependencies, so nothing the machine has is replaced in place. It prints what it installed and
what it left to the machine, and ``import deepspeed`` from ``TARGET`` at the end.

A wheel built here records ``accelerator_name='cpu'`` and no prebuilt ops; DeepSpeed reads both
only to load prebuilt ops, and picks its accelerator (CUDA there) when it is imported.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

DEEPSPEED = "deepspeed==0.19.8"  # as pyproject.toml's test extra
#: DeepSpeed 0.19.8's requirements, less numpy and torch (see the module's docstring); pip
#: adds theirs (pydantic's core, annotated-types, typing-extensions, typing-inspection)
REQUIREMENTS = ("einops", "hjson", "msgpack", "ninja", "packaging", "psutil", "py-cpuinfo",
                "pydantic>=2", "tqdm")  # fmt: skip
WHEEL = re.compile(r"^(?P<name>[^-]+)-(?P<version>[^-]+)-.*\.whl$")


def fetch(folder: Path, python_version: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip"]
    subprocess.run([*pip, "wheel", "--no-deps", "-q", "-w", str(folder), DEEPSPEED], check=True)
    subprocess.run(
        [*pip, "download", "-q", "-d", str(folder), "--only-binary=:all:",
         "--python-version", python_version, "--implementation", "cp",
         "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
         "--platform", "manylinux_2_28_x86_64", *REQUIREMENTS],
        check=True,
    )  # fmt: skip
    for wheel in sorted(folder.glob("*.whl")):
        print(wheel.name)


def _key(version: str) -> tuple[tuple[int, str], ...]:
    """A version as comparable parts (enough for release numbers like 2.12.5 or 0.19.8)."""
    parts = re.split(r"[.+-]", version)
    return tuple((int(p), "") if p.isdigit() else (-1, p) for p in parts)


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wanted(wheels: list[str], installed: dict[str, str]) -> tuple[list[str], list[str]]:
    """Which of ``wheels`` (file names) to install, given ``installed`` (canonical name ->
    version): those absent or older; and a line for each one left to the machine."""
    take, leave = [], []
    for wheel in wheels:
        match = WHEEL.match(wheel)
        if match is None:
            continue
        name, version = _canonical(match["name"]), match["version"]
        have = installed.get(name)
        if have is not None and _key(have) >= _key(version):
            leave.append(f"{name}: the machine's {have} (brought {version})")
        else:
            take.append(wheel)
    return take, leave


def install(folder: Path, target: Path) -> None:
    wheels = sorted(p.name for p in folder.glob("*.whl"))
    if not any(w.startswith("deepspeed-") for w in wheels):
        raise SystemExit(f"no deepspeed wheel in {folder}: run `gpu_wheels.py fetch` first")
    installed = {
        _canonical(d.metadata["Name"]): d.version
        for d in metadata.distributions()
        if d.metadata["Name"]
    }
    take, leave = wanted(wheels, installed)
    for line in leave:
        print("kept", line)
    if take:
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
             "--target", str(target), *(str(folder / w) for w in take)],
            check=True,
        )  # fmt: skip
    print("installed", " ".join(take) or "nothing")
    probe = "import deepspeed; print('deepspeed', deepspeed.__version__, 'at', deepspeed.__file__)"
    path = os.pathsep.join(filter(None, [str(target), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path}
    subprocess.run([sys.executable, "-c", probe], check=True, env=env)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    get = commands.add_parser("fetch")
    get.add_argument("folder", nargs="?", default=".gpu/deepspeed", type=Path)
    get.add_argument("--python-version", default="3.12")
    put = commands.add_parser("install")
    put.add_argument("folder", type=Path)
    put.add_argument("target", type=Path)
    args = parser.parse_args()
    if args.command == "fetch":
        fetch(args.folder, args.python_version)
    else:
        install(args.folder, args.target)


if __name__ == "__main__":
    main()
