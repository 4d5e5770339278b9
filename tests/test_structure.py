"""The package's shape, held where a design review left it (issue 45) and ratcheted down.

``tests/test_layers.py`` holds the direction of every import; this file holds their breadth:
which private modules a package reaches into in another package (each pair on an allow-list
with the reason), the Trainer coming into the runtime by its door, the size of ``Runtime``'s
public face, the top-level files, the longest functions and the package circles. Each figure
may only go down: a change that lowers one lowers its bound here too (the tests say so when a
bound is looser than the package). ``python -m tests.support.structure`` prints the figures.
"""

from __future__ import annotations

import ast

from tests.support import structure

#: (importing package, imported package) -> (why, the private modules it may import there).
#: A package's private module is its own business; another package reaches into one only
#: where the name it needs is not worth a public promise yet, and says why here.
PRIVATE_IMPORTS: dict[tuple[str, str], tuple[str, set[str]]] = {
    ("distkit", "distkit.checkpoint"): (
        "distkit.load_weights is the user's; the checkpoint package exports its format only",
        {"_load_weights"},
    ),
    ("distkit", "distkit.launch"): (
        "distkit.spawn is the user's; the launch package's face is the launchers' table",
        {"_spawn"},
    ),
    ("distkit.data", "distkit.faults"): (
        "a stream's reader polls the preemption flag between items",
        {"_preempt"},
    ),
    ("distkit.data", "distkit.strategies"): (
        "a stream's shard sizes are agreed with the strategy's object collectives",
        {"_collectives"},
    ),
    ("distkit.doctor", "distkit.launch"): (
        "the doctor reads the launcher's environment as the launch package parses it",
        {"_env"},
    ),
    ("distkit.faults", "distkit.launch"): (
        "a preempted job requeues itself with the scheduler the launch package found",
        {"_requeue"},
    ),
    ("distkit.registry", "distkit.launch"): (
        "the registry reads the launcher's environment for strategy='auto'",
        {"_env"},
    ),
    ("distkit.runtime", "distkit.checkpoint"): (
        "the Runtime writes and reads the checkpoint format's files, shards and weights, "
        "locally and on object stores (weights to a URL are staged, then uploaded)",
        {"_fits", "_layout", "_pretrained", "_safetensors", "_shard_files", "_storage"},
    ),
    ("distkit.runtime", "distkit.data"): (
        "rt.loader builds the sharded sampler, the batch plan and the stream feeds",
        {"_batch_plan", "_feed", "_rank_view", "_sample_order", "_stream_feed", "_stream_spec"},
    ),
    ("distkit.runtime", "distkit.faults"): (
        "the Runtime's guard: watchdog progress, the failure channel, preemption, last resort",
        {"_channel", "_faults", "_last_resort", "_preempt", "_progress"},
    ),
    ("distkit.runtime", "distkit.strategies"): (
        "the Runtime drives a strategy's steps, placement, collectives and meta init, which "
        "the Strategy interface exposes only to the layer above it",
        {
            "_collectives",
            "_graph",
            "_group_lease",
            "_legacy_hooks",
            "_meta_init",
            "_placement",
            "_steps",
            "_tied_weights",
        },
    ),
    ("distkit.strategies", "distkit.checkpoint"): (
        "a strategy writes and reads its own shards in the checkpoint format",
        {"_digest", "_pending_weights", "_shard_files"},
    ),
    ("distkit.strategies", "distkit.faults"): (
        "a strategy's collectives report a failing peer on the failure channel",
        {"_channel", "_last_resort"},
    ),
    ("distkit.strategies", "distkit.launch"): (
        "strategies read the launcher's environment to join their process group",
        {"_env"},
    ),
    ("distkit.testing", "distkit.launch"): (
        "the test helpers start real processes as distkit.spawn does",
        {"_env", "_spawn"},
    ),
    ("distkit.trainer", "distkit.callbacks"): (
        "the Trainer calls its callbacks as one list",
        {"_list"},
    ),
    ("distkit.trainer", "distkit.checkpoint"): (
        "resume discovery checks a checkpoint's files and that it fits the model",
        {"_fits", "_shard_files"},
    ),
    ("distkit.trainer", "distkit.data"): (
        "fit plans its batches and builds its feed as rt.loader does",
        {"_batch_plan", "_feed", "_stream_spec"},
    ),
    ("distkit.trainer", "distkit.faults"): (
        "fit's loop polls preemption and reports progress to the watchdog",
        {"_preempt", "_progress"},
    ),
    ("distkit.trainer", "distkit.loggers"): (
        "the Trainer's log sink calls the loggers' base",
        {"_base"},
    ),
    ("distkit.trainer", "distkit.strategies"): (
        "fit's step calls the strategy's steps and placement as the Runtime does",
        {"_legacy_hooks", "_placement", "_steps"},
    ),
}

#: the Trainer may import at most this many runtime private modules, each named with a reason
#: (issue 45: at most 3); today none, all through ``distkit.runtime``'s door
TRAINER_RUNTIME_PRIVATE: dict[str, str] = {}

#: the bounds the figures may not exceed (issue 45's before: 36, 13; its goal for the face: 30;
#: issue 47 added data_rank and data_world_size: the data-parallel place a user's own sampler
#: shards by under tensor parallelism, where rank and world_size would feed a group's ranks
#: different samples; issue 48 added forward_backward: a pipeline's forward and backward are
#: one schedule step, which a user's loop cannot write as model(x) then rt.backward(loss))
RUNTIME_PUBLIC_NAMES = 33
TOP_LEVEL_FILES = 12

#: functions over 80 lines, each at most as long as it is now (issue 45, item 5, shortens them)
LONG_FUNCTIONS: dict[str, int] = {}

#: circles between packages, counting type-only imports: callbacks <-> trainer is annotations
#: only (a callback's hooks take the Trainer, as in Lightning); faults <-> strategies went
#: when the fail-fast guard named what it reads of a strategy (faults._faults.Watched)
CIRCLES: set[frozenset[str]] = {
    frozenset({"distkit.callbacks", "distkit.trainer"}),
}


def _private_by_pair() -> dict[tuple[str, str], set[str]]:
    found: dict[tuple[str, str], set[str]] = {}
    for importer, imported in structure.private_imports():
        pair = (structure.package_of(importer), structure.package_of(imported))
        found.setdefault(pair, set()).add(imported.split(".", 2)[2])
    return found


def test_structure_private_imports_across_packages_are_allow_listed():
    found = _private_by_pair()
    unlisted = [
        f"  {a} -> {b}: {sorted(mods - PRIVATE_IMPORTS.get((a, b), ('', set()))[1])}"
        for (a, b), mods in sorted(found.items())
        if mods - PRIVATE_IMPORTS.get((a, b), ("", set()))[1]
    ]
    assert not unlisted, (
        "private modules of another package imported without an allow-list entry "
        "(import the package's public name, or add the pair and why to PRIVATE_IMPORTS):\n"
        + "\n".join(unlisted)
    )
    stale = [
        f"  {a} -> {b}: {sorted(mods - found.get((a, b), set()))}"
        for (a, b), (_, mods) in sorted(PRIVATE_IMPORTS.items())
        if mods - found.get((a, b), set())
    ]
    assert not stale, "allow-listed imports no module makes any more (ratchet down):\n" + (
        "\n".join(stale)
    )
    assert all(reason.strip() for reason, _ in PRIVATE_IMPORTS.values())


def _names_imported_from(module: str, source: str) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(structure.tree_of(module)):
        if isinstance(node, ast.ImportFrom) and node.module == source and not node.level:
            names.update(alias.name for alias in node.names)
    return names


def test_structure_trainer_comes_in_by_the_runtime_door():
    from distkit import runtime

    private = structure.private_modules_imported("distkit.trainer", "distkit.runtime")
    assert {m.split(".", 2)[2] for m in private} == set(TRAINER_RUNTIME_PRIVATE), (
        "trainer/ imports runtime private modules; import them from distkit.runtime, "
        "adding the name and why to its PORT"
    )
    assert len(TRAINER_RUNTIME_PRIVATE) <= 3
    trainer = [m for m in structure.modules() if m.startswith("distkit.trainer")]
    used = set().union(*(_names_imported_from(m, "distkit.runtime") for m in trainer))
    user = {
        "Runtime",
        "RuntimeOptions",
        "Profiler",
        "RuntimeLoader",
        "SetUpModel",
        "SetUpOptimizer",
    }
    outside = sorted(used - user - set(runtime.PORT))
    assert not outside, f"the Trainer imports runtime names its port does not list: {outside}"
    unused = sorted(set(runtime.PORT) - used)
    assert not unused, f"port names the Trainer no longer imports (drop them): {unused}"
    assert all(reason.strip() for reason in runtime.PORT.values())
    assert set(runtime.PORT) <= set(runtime.__all__)


def _own_doc(name: str) -> bool:
    import inspect

    from distkit import Runtime

    member = inspect.getattr_static(Runtime, name)
    member = member.fget if isinstance(member, property) else member
    member = getattr(member, "__wrapped__", member)
    return bool((getattr(member, "__doc__", None) or "").strip())


def test_structure_runtime_face_and_top_level_stay_within_bounds():
    face = structure.public_names("distkit.runtime._runtime", "Runtime")
    assert len(face) <= RUNTIME_PUBLIC_NAMES, f"Runtime's public names grew: {face}"
    missing = [name for name in face if not _own_doc(name)]
    assert not missing, f"Runtime's public names without a docstring: {missing}"
    files = structure.top_level_files()
    assert len(files) <= TOP_LEVEL_FILES, f"top-level files grew: {files}"


#: the step loop reads like the user's loop: each at most this long (issue 45, item 5)
LOOP_FUNCTIONS = {
    "distkit.trainer._fit:train": 60,
    "distkit.trainer._step_loop:StepLoop.run_epoch": 60,
}


def test_structure_the_fit_and_step_loops_stay_short():
    lengths = {f"{m}:{name}": n for m, name, n in structure.functions()}
    long = {k: lengths[k] for k, bound in LOOP_FUNCTIONS.items() if lengths[k] > bound}
    assert not long, f"the loops grew past {LOOP_FUNCTIONS}: {long}"


def test_structure_long_functions_only_shrink():
    long = {f"{m}:{name}": n for m, name, n in structure.functions() if n > 80}
    grown = {
        k: (n, LONG_FUNCTIONS.get(k)) for k, n in long.items() if n > LONG_FUNCTIONS.get(k, 80)
    }
    assert not grown, f"functions over 80 lines, or longer than allowed (lines, bound): {grown}"
    shrunk = sorted(set(LONG_FUNCTIONS) - set(long))
    assert not shrunk, f"no longer over 80 lines: drop them from LONG_FUNCTIONS: {shrunk}"


def test_structure_package_circles_only_go():
    circles = {frozenset(c) for c in structure.package_cycles()}
    assert circles <= CIRCLES, f"new package circles: {[sorted(c) for c in circles - CIRCLES]}"
    assert circles >= CIRCLES, f"circles gone (drop them): {[sorted(c) for c in CIRCLES - circles]}"
