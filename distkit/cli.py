"""The ``distkit`` command: ``distkit run`` starts a script under its strategy's launcher,
``distkit doctor`` says which strategies work on this machine.

Exit codes: ``run`` ends with the launched command's exit code (on POSIX distkit replaces
itself with the launcher, so signals reach it directly); 2 for a usage error, a missing
launcher or a strategy that cannot run on this machine; 1 for an internal error.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from distkit.errors import DistkitError

if TYPE_CHECKING:
    from distkit.launch.families import LauncherFamily
    from distkit.registry import StrategyRegistry
    from distkit.strategies.base import Strategy

PREFIX = "distkit:"
USAGE_ERROR = 2

RUN_NOTES = """\
distkit's options go before SCRIPT: everything after SCRIPT is the script's, untouched.
"--strategy S" is appended to the script's arguments unless they already hold --strategy.
OMP_NUM_THREADS=1 is set for multi-process runs unless you set it. The exact command is
printed to stderr first. Before anything starts, the strategy's `distkit doctor` check runs:
a strategy that cannot train here (apex without CUDA) is refused at once (--dry-run skips the
check). Exit code: the launcher's (torchrun and horovodrun exit 1 when a rank fails and print
that rank's code); 2 when the launcher is missing, the options do not fit, or the check fails.
"""


def _families(
    classes: dict[str, type[Strategy]], registry: StrategyRegistry
) -> dict[LauncherFamily, list[str]]:
    """Each launcher family in use, with its strategies' names ("auto"'s choice first)."""
    preferred = [name for name, _ in registry.auto_candidates()]
    ordered = sorted(classes, key=lambda n: (n not in preferred, n))
    families: dict[LauncherFamily, list[str]] = {}
    for name in ordered:
        families.setdefault(classes[name].launcher, []).append(name)
    return families


def _run_epilog(families: dict[LauncherFamily, list[str]]) -> str:
    lines = ["-n is processes per node (torchrun's --nproc_per_node); the launcher per strategy:"]
    for family, names in families.items():
        lines += family.help_lines(sorted(names))
    lines += ["", RUN_NOTES, "examples:"]
    lines += [f"  {ex}" for family, names in families.items() for ex in family.examples(names[0])]
    return "\n".join(lines) + "\n"


def _doctor_epilog(names: Sequence[str]) -> str:
    example = next((n for n in reversed(names)), "NAME")
    listed = textwrap.fill(", ".join(names), width=76, initial_indent="  ", subsequent_indent="  ")
    return (
        "Checks torch, CUDA, NCCL and Gloo, then asks every registered strategy, plugins\n"
        "included, whether it is usable here, why not, and the command that fixes it:\n"
        f"{listed}\n"
        "Some checks take seconds (horovodrun --check-build); --strategy skips the others.\n"
        "Plugins that cannot be loaded get one line each. Always exits 0 unless it crashes.\n\n"
        "examples:\n  distkit doctor\n  distkit doctor --json | python -m json.tool\n"
        f"  distkit doctor --strategy {example}\n"
    )


def build_parser(registry: StrategyRegistry | None = None) -> argparse.ArgumentParser:
    """The ``distkit`` argument parser; its strategy choices and help come from ``registry``."""
    from distkit.registry import DEFAULT_REGISTRY

    registry = DEFAULT_REGISTRY if registry is None else registry
    names = registry.names()
    families = _families(registry.load_all(), registry)
    first = next(iter(families.values()), ["NAME"])[0]
    parser = argparse.ArgumentParser(
        prog="distkit",
        description=textwrap.fill(
            f"Run one PyTorch training script on any data-parallel backend ({', '.join(names)}), "
            "and check which backends work on this machine.",
            width=90,
        ),
        epilog=f"examples:\n  distkit doctor\n  distkit run --strategy {first} -n 2 train.py\n\n"
        "`distkit run --help` and `distkit doctor --help` say more.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{run,doctor}")
    fmt = argparse.RawDescriptionHelpFormatter
    launchers = ", ".join(family.launcher for family in families)
    run = sub.add_parser(
        "run",
        help="start a training script under the launcher its strategy needs",
        description=f"Start SCRIPT under the launcher --strategy runs under ({launchers}),\n"
        "and pass --strategy on to the script.",
        epilog=_run_epilog(families),
        formatter_class=fmt,
    )
    run.add_argument(
        "--strategy",
        required=True,
        choices=names,
        type=str.lower,
        help="the backend; it picks the launcher (see below) and is passed to the script",
    )
    run.add_argument(
        "-n", "--nproc-per-node", type=int, default=1, metavar="N", help="processes per node"
    )
    run.add_argument("--nnodes", type=int, default=1, metavar="K", help="nodes (default 1)")
    run.add_argument("--node-rank", type=int, metavar="R", help="this node's rank (torchrun)")
    run.add_argument("--master-addr", metavar="HOST", help="node 0's address (torchrun)")
    run.add_argument("--master-port", type=int, metavar="PORT", help="rendezvous port (torchrun)")
    run.add_argument("-H", "--hosts", metavar="HOSTS", help="horovodrun: host1[:slots],host2...")
    options = []
    for family in families:
        if family.args_option is not None:
            action = run.add_argument(
                family.args_option,
                default="",
                metavar="ARGS",
                help=f"more {family.launcher} options, as one string (see the examples)",
            )
            options.append((family.args_option, action.dest, family.launcher))
    run.set_defaults(launcher_options=options)
    run.add_argument("--dry-run", action="store_true", help="print the command, do not run it")
    run.add_argument("script", help="the training script")
    run.add_argument(
        "script_args",
        nargs=argparse.REMAINDER,
        help="the script's own arguments, if any (everything after SCRIPT)",
    )
    doctor = sub.add_parser(
        "doctor",
        help="say which strategies work on this machine and how to fix the others",
        description="Report, per strategy, whether it is usable here, why not, and the fix.",
        epilog=_doctor_epilog(names),
        formatter_class=fmt,
    )
    doctor.add_argument("--json", action="store_true", help="machine-readable output")
    doctor.add_argument(
        "--strategy",
        action="append",
        choices=names,
        type=str.lower,
        help="check only this strategy (repeatable); the others' checks are skipped",
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
    from distkit.registry import DEFAULT_CHOICES, resolve_strategy_class

    try:
        strategy = resolve_strategy_class(args.strategy)
    except DistkitError as exc:  # a plugin that cannot be loaded
        return _fail(str(exc))
    family = strategy.launcher
    for option, dest, launcher in args.launcher_options:
        if getattr(args, dest) and option != family.args_option:
            return _fail(
                f"{option} is for {launcher}, but strategy={args.strategy!r} runs under "
                f"{family.launcher}"
            )
    dest = next((d for o, d, _ in args.launcher_options if o == family.args_option), None)
    raw = getattr(args, dest) if dest is not None else ""
    try:
        extra = tuple(shlex.split(raw))
    except ValueError as exc:  # unbalanced quotes
        return _fail(f"cannot split the {family.launcher} arguments {raw!r}: {exc}")
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
        choices=DEFAULT_CHOICES,
    )
    try:
        launch.build_command(request, strategy, python=sys.executable)  # validate first
        tools = family.find_tools(request)
        argv = launch.build_command(request, strategy, python=sys.executable, tools=tools)
    except DistkitError as exc:
        return _fail(str(exc))
    if not Path(args.script).exists():
        return _fail(f"script {args.script!r} not found (from {os.getcwd()})")
    if Path(args.script).is_dir():
        return _fail(
            f"script {args.script!r} is a folder: give the training script's file (e.g. "
            f"{Path(args.script) / 'train.py'}); a folder with a __main__.py runs as "
            "`python -m`, which distkit run does not start"
        )
    env = launch.thread_env(request, strategy, os.environ)
    refusal = None if args.dry_run else _cannot_run_here(strategy, args.strategy)
    if refusal is not None:
        return _fail(refusal)
    verb = "would run" if args.dry_run else "running"
    print(f"{PREFIX} {verb}: {launch.describe(argv, env)}", file=sys.stderr, flush=True)
    if args.dry_run:
        return 0
    return _exec(argv, {**os.environ, **env})


def _cannot_run_here(strategy: type[Strategy], name: str) -> str | None:
    """Why ``strategy`` cannot train on this machine, from its ``distkit doctor`` verdict, or
    None: checked before any process starts, so that N ranks do not each start and fail."""
    from distkit.launch.diagnosis import collect_machine
    from distkit.registry import DEFAULT_CHOICES

    try:
        report = strategy.diagnose(collect_machine(DEFAULT_CHOICES))
    except Exception:  # a broken check must not block a run: the ranks say what is wrong
        return None
    if report.usable:
        return None
    why = "; ".join(report.why_not) or report.summary
    fix = f" Fix: {report.fix}." if report.fix else ""
    return (
        f"strategy={name!r} cannot train on this machine: {why}.{fix} Nothing was started "
        f"(`distkit doctor --strategy {name}` shows the check; --dry-run prints the command)"
    )


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

    checkup = doctor.examine(args.strategy)
    if args.json:
        print(json.dumps(doctor.to_json(checkup), indent=2))
    else:
        print(doctor.render_text(checkup))
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
