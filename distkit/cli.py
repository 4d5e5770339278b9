"""The ``distkit`` command: ``distkit run`` starts a script under its strategy's launcher,
``distkit doctor`` says which strategies work on this machine.

Exit codes: ``run`` ends with the launched command's exit code (on POSIX distkit replaces
itself with the launcher, so signals reach it directly); 2 for a usage error or a missing
launcher; 1 for an internal error.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path

from distkit.errors import DistkitError, MissingDependencyError

PREFIX = "distkit:"
USAGE_ERROR = 2

RUN_EPILOG = """\
-n is processes per node (torchrun's --nproc_per_node); the launcher per strategy:
  ddp, apex  python -m torch.distributed.run --standalone --nproc_per_node N script.py ...
             (several nodes: run the same command on each, with --nnodes K --node-rank R
             --master-addr HOST [--master-port P])
  horovod    horovodrun -np N*hosts -H localhost:N [--gloo] python script.py ...
             (several nodes: run once, on one node, with -H node1,node2 or -H node1:4,node2:4;
             -np is the sum of the slots; --gloo unless MPI is built and mpirun is on PATH)
  dp         python script.py ...  (one process; -n must be 1)

distkit's options go before SCRIPT: everything after SCRIPT is the script's, untouched.
"--strategy S" is appended to the script's arguments unless they already hold --strategy.
OMP_NUM_THREADS=1 is set for multi-process runs unless you set it. The exact command is
printed to stderr first. Exit code: the launcher's (torchrun and horovodrun exit 1 when a rank
fails and print that rank's code); 2 when the launcher is missing or the options do not fit.

examples:
  distkit run --strategy ddp -n 2 train.py --epochs 3
  distkit run --strategy horovod -n 4 train.py
  distkit run --strategy horovod -n 4 -H node1,node2 train.py
  distkit run --strategy ddp -n 8 --nnodes 2 --node-rank 0 --master-addr node1 train.py
  distkit run --strategy horovod -n 2 --horovod-args="--verbose --mpi" train.py
  distkit run --strategy ddp -n 2 --torchrun-args="--max-restarts 3" train.py
  distkit run --strategy dp --dry-run train.py
"""

DOCTOR_EPILOG = """\
Checks torch, CUDA, NCCL and Gloo, Horovod (via `horovodrun --check-build`, a few seconds) and
the installed apex (without importing it), then prints for ddp, dp, horovod and apex whether it
is usable here, why not, and the command that fixes it. Always exits 0 unless it crashes.

examples:
  distkit doctor
  distkit doctor --json | python -m json.tool
  distkit doctor --strategy apex
"""


def build_parser() -> argparse.ArgumentParser:
    """The ``distkit`` argument parser with its ``run`` and ``doctor`` subcommands."""
    from distkit.doctor import STRATEGIES
    from distkit.launch import LAUNCHERS

    parser = argparse.ArgumentParser(
        prog="distkit",
        description="Run one PyTorch training script on any data-parallel backend (ddp, horovod,\n"
        "apex, dp), and check which backends work on this machine.",
        epilog="examples:\n  distkit doctor\n  distkit run --strategy ddp -n 2 train.py\n\n"
        "`distkit run --help` and `distkit doctor --help` say more.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{run,doctor}")
    fmt = argparse.RawDescriptionHelpFormatter
    run = sub.add_parser(
        "run",
        help="start a training script under the launcher its strategy needs",
        description="Start SCRIPT with torchrun, horovodrun or plain python, as --strategy needs,\n"
        "and pass --strategy on to the script.",
        epilog=RUN_EPILOG,
        formatter_class=fmt,
    )
    run.add_argument(
        "--strategy",
        required=True,
        choices=sorted(LAUNCHERS),
        type=str.lower,
        help="the backend; it picks the launcher (see below) and is passed to the script",
    )
    run.add_argument(
        "-n", "--nproc-per-node", type=int, default=1, metavar="N", help="processes per node"
    )
    run.add_argument("--nnodes", type=int, default=1, metavar="K", help="nodes (default 1)")
    run.add_argument("--node-rank", type=int, metavar="R", help="this node's rank (ddp, apex)")
    run.add_argument("--master-addr", metavar="HOST", help="node 0's address (ddp, apex)")
    run.add_argument("--master-port", type=int, metavar="PORT", help="rendezvous port (ddp, apex)")
    run.add_argument("-H", "--hosts", metavar="HOSTS", help="horovod: host1[:slots],host2...")
    run.add_argument(
        "--torchrun-args",
        default="",
        metavar="ARGS",
        help="more torchrun options, as one string (see the examples)",
    )
    run.add_argument(
        "--horovod-args",
        default="",
        metavar="ARGS",
        help="more horovodrun options, as one string (see the examples)",
    )
    run.add_argument("--dry-run", action="store_true", help="print the command, do not run it")
    run.add_argument("script", help="the training script")
    run.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    doctor = sub.add_parser(
        "doctor",
        help="say which strategies work on this machine and how to fix the others",
        description="Report, per strategy, whether it is usable here, why not, and the fix.",
        epilog=DOCTOR_EPILOG,
        formatter_class=fmt,
    )
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument(
        "--strategy",
        action="append",
        choices=STRATEGIES,
        type=str.lower,
        help="check only this strategy (repeatable); skipping horovod saves its check-build",
    )
    return parser


def _fail(message: str, code: int = USAGE_ERROR) -> int:
    print(f"{PREFIX} error: {message}", file=sys.stderr, flush=True)
    return code


def exact_script_args(argv: Sequence[str], script: str, parsed: Sequence[str]) -> list[str]:
    """The script's arguments exactly as typed: argparse drops a ``--`` right after the script."""
    for i, arg in enumerate(argv):
        if arg == script and list(argv[i + 1 :]) in (list(parsed), ["--", *parsed]):
            return list(argv[i + 1 :])
    return list(parsed)


def cmd_run(args: argparse.Namespace) -> int:
    """``distkit run``: build the command, print it, and replace this process with it."""
    from distkit import launch

    launcher_args = {"torchrun": args.torchrun_args, "horovodrun": args.horovod_args}
    used = launch.LAUNCHERS[args.strategy]
    for name, value in launcher_args.items():
        if value and name != used:
            flag = "--torchrun-args" if name == "torchrun" else "--horovod-args"
            return _fail(f"{flag} is for {name}, but strategy={args.strategy!r} runs under {used}")
    try:
        extra = tuple(shlex.split(launcher_args.get(used, "")))
    except ValueError as exc:  # unbalanced quotes
        return _fail(f"cannot split the {used} arguments {launcher_args[used]!r}: {exc}")
    request = launch.LaunchRequest(
        strategy=args.strategy,
        script=args.script,
        script_args=tuple(args.script_args),  # see exact_script_args
        nproc_per_node=args.nproc_per_node,
        nnodes=args.nnodes,
        node_rank=args.node_rank,
        master_addr=args.master_addr,
        master_port=args.master_port,
        hosts=args.hosts,
        launcher_args=extra,
    )
    horovodrun, controller = "horovodrun", None
    try:
        launch.build_command(request, python=sys.executable)  # validate before any probing
        if used == "horovodrun":
            from distkit.horovod_build import horovodrun_path

            horovodrun = horovodrun_path()
            controller = launch.horovod_controller(request.launcher_args, horovodrun)
        argv = launch.build_command(
            request, python=sys.executable, horovodrun=horovodrun, controller=controller
        )
    except MissingDependencyError as exc:
        return _fail(
            f"strategy='horovod' needs horovodrun, which is missing ({exc}). Build and install "
            f"Horovod for this torch: {sys.executable} -m distkit.horovod_build",
        )
    except DistkitError as exc:
        return _fail(str(exc))
    if not Path(args.script).exists():
        return _fail(f"script {args.script!r} not found (from {os.getcwd()})")
    env = launch.thread_env(request, os.environ)
    verb = "would run" if args.dry_run else "running"
    print(f"{PREFIX} {verb}: {launch.describe(argv, env)}", file=sys.stderr, flush=True)
    if args.dry_run:
        return 0
    return _exec(argv, {**os.environ, **env})


def _exec(argv: list[str], env: dict[str, str]) -> int:
    sys.stdout.flush()
    try:
        if os.name == "posix":
            os.execve(argv[0], argv, env)  # only returns by raising
        import subprocess

        return subprocess.run(argv, env=env).returncode
    except OSError as exc:
        return _fail(f"could not start {argv[0]}: {exc}")


def cmd_doctor(args: argparse.Namespace) -> int:
    """``distkit doctor``: print the report (text or ``--json``); 0 unless it crashes."""
    from distkit import doctor

    selected = tuple(args.strategy or doctor.STRATEGIES)
    facts = doctor.collect_facts(selected)
    reports = {k: v for k, v in doctor.assess(facts).items() if k in selected}
    if args.json:
        print(json.dumps(doctor.to_json(facts, reports), indent=2))
    else:
        print(doctor.render_text(facts, reports))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``distkit`` console script; returns the exit code."""
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser().parse_args(argv)
    if args.command == "run":
        args.script_args = exact_script_args(argv, args.script, args.script_args)
    handler = cmd_run if args.command == "run" else cmd_doctor
    try:
        return handler(args)
    except KeyboardInterrupt:
        return 130
    except Exception as exc:  # a bug: show where, then say so in one line
        import traceback

        traceback.print_exc()
        print(f"{PREFIX} internal error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
