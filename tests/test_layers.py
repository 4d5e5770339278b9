"""The package's layers: every import in ``distkit/`` points down, and no import cycle exists.

The import graph is read from the source with :mod:`ast`: module-level and function-level
imports alike (a function-level import is still a dependency, only a later one). Imports under
``if TYPE_CHECKING:`` are left out: they never run, and serve annotations only. Importing
``distkit.a.b`` runs ``distkit/a/__init__.py`` first, so that counts as an import of the
package ``distkit.a`` too (not of ``distkit`` itself, which every module's import runs).

Nor does a lower layer get a higher one's answers by being handed them at import: no module
below the registry keeps a value a caller passes it in a module global (an install hook), and
no module assigns another distkit module's attributes. What a lower layer needs from a
higher one is passed down as a value (see ``distkit/launch/_choices.py``).

Each module belongs to the layer of the longest prefix in :data:`LAYERS` that names it; a
module may import its own layer and the layers below. A module no prefix names fails the test:
a new module is placed on purpose.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from functools import cache
from pathlib import Path

from tests.support.paths import ROOT

PACKAGE = ROOT / "distkit"

#: lowest first; a module sits in the layer of the longest prefix that names it
LAYERS: list[tuple[str, list[str]]] = [
    ("leaves", ["distkit.errors", "distkit._version", "distkit.batch", "distkit.metrics",
                "distkit.loss", "distkit._imports", "distkit._atomic", "distkit._validate",
                "distkit.horovod_build"]),
    ("launch", ["distkit.launch", "distkit.launchers"]),
    ("faults", ["distkit.faults"]),
    ("checkpoint", ["distkit.checkpoint"]),
    ("strategies", ["distkit.strategies"]),
    ("registry", ["distkit.registry"]),
    ("data", ["distkit.data"]),
    ("runtime", ["distkit.runtime"]),
    ("trainer", ["distkit.trainer", "distkit.callbacks", "distkit.loggers"]),
    ("top", ["distkit.cli", "distkit.doctor", "distkit.testing", "distkit"]),
]  # fmt: skip


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _runtime_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import that can run: all but those under ``if TYPE_CHECKING:``."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                yield from _runtime_imports(ast.Module(body=[child], type_ignores=[]))
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        yield from _runtime_imports(node)


def _with_packages(name: str, importer: str) -> list[str]:
    """``name`` and the packages whose ``__init__`` importing it runs: not ``distkit``, and
    not a package that holds the importer (its ``__init__`` has run, or is running)."""
    parts = name.split(".")
    packages = [".".join(parts[:i]) for i in range(2, len(parts))]
    inside = [p for p in packages if importer == p or importer.startswith(p + ".")]
    return [p for p in packages if p not in inside] + [name]


def imports_of(name: str) -> set[str]:
    """The distkit modules ``name`` imports (resolved to modules that exist)."""
    known = modules()
    path = known[name]
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in _runtime_imports(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                for alias in node.names
            ]
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target.startswith("distkit"):
                found.update(t for t in _with_packages(target, name) if t in known)
    found.discard(name)
    return found


def layer_of(name: str) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            named = name == prefix or name.startswith(prefix + ".")
            if named and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    return None if best is None else best[1]


def graph() -> dict[str, set[str]]:
    return {name: imports_of(name) for name in modules()}


def upward_imports() -> set[tuple[str, str]]:
    edges = graph()
    up = set()
    for importer, imported in ((a, b) for a, bs in edges.items() for b in bs):
        low, high = layer_of(importer), layer_of(imported)
        if low is not None and high is not None and high > low:
            up.add((importer, imported))
    return up


def cycles() -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    edges = graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(edges[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def install_hooks(tree: ast.AST) -> list[str]:
    """Functions that keep one of their own parameters in a module global (``global _view``
    then ``_view = view``): how a higher layer installs itself into a lower one."""
    found = []
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        params = {a.arg for a in [*fn.args.posonlyargs, *fn.args.args, *fn.args.kwonlyargs]}
        globals_ = {n for node in ast.walk(fn) if isinstance(node, ast.Global) for n in node.names}
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                value = node.value
                kept = isinstance(value, ast.Name) and value.id in params
                for target in targets:
                    if kept and isinstance(target, ast.Name) and target.id in globals_:
                        found.append(f"{fn.name}() keeps its parameter in global {target.id}")
    return found


def foreign_assignments(tree: ast.AST) -> list[str]:
    """``module.attr = ...`` where ``module`` names a distkit module this file imported."""
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {a.asname or a.name for a in node.names if a.name.startswith("distkit")}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("distkit"):
            known = modules()
            imported |= {
                a.asname or a.name for a in node.names if f"{node.module}.{a.name}" in known
            }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign | ast.AugAssign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for target in targets:
                if (
                    isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name)
                    and target.value.id in imported
                ):
                    found.append(f"assigns {target.value.id}.{target.attr}")
    return found


# ---------------------------------------------------------------- the tests
def test_layers_place_every_module():
    unplaced = sorted(name for name in modules() if layer_of(name) is None)
    assert not unplaced, f"modules in no layer (add them to LAYERS): {unplaced}"


def test_layers_have_no_import_cycle():
    assert cycles() == []


def test_layers_imports_point_down():
    names = [name for name, _ in LAYERS]
    up = [
        f"  {a} ({names[layer_of(a) or 0]}) -> {b} ({names[layer_of(b) or 0]})"
        for a, b in sorted(upward_imports())
    ]
    assert not up, "imports that point up a layer:\n" + "\n".join(up)


def test_layers_graph_reads_function_level_relative_and_type_checking_imports(tmp_path):
    """The reader itself: a function-level import counts, a relative one resolves, and one
    under TYPE_CHECKING does not count."""
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import metrics\n"
        "if TYPE_CHECKING:\n"
        "    from distkit.trainer import Trainer\n"
        "def f():\n"
        "    from distkit.strategies.ddp import DDPStrategy\n"
    )
    tree = ast.parse(source)
    seen = [node.module for node in _runtime_imports(tree)]
    assert seen == ["typing", None, "distkit.strategies.ddp"]
    assert "distkit.strategies" in imports_of("distkit.trainer")  # runs the package's init
    assert "distkit.strategies" not in imports_of("distkit.strategies.ddp")  # already running
    assert layer_of("distkit.strategies.apex.legacy") == layer_of("distkit.strategies")


def test_layers_nothing_is_installed_into_a_lower_layer():
    registry = [name for name, _ in LAYERS].index("registry")
    found = []
    for name, path in modules().items():
        tree = ast.parse(path.read_text(), str(path))
        below = (layer_of(name) or 0) < registry
        found += [f"  {name}: {hook}" for hook in install_hooks(tree) if below]
        found += [f"  {name}: {hook}" for hook in foreign_assignments(tree)]
    assert not found, (
        "a module keeps what a caller installs, or assigns another module's attributes (pass "
        "the value down instead):\n" + "\n".join(found)
    )


def test_layers_install_hook_reader_finds_the_old_registry_view():
    """The reader itself, on the pattern distkit had (launch/_registry_view.py's install, and
    the registry assigning a view)."""
    hook = "_view = None\ndef install(view):\n    global _view\n    _view = view\n"
    assert install_hooks(ast.parse(hook)) == ["install() keeps its parameter in global _view"]
    state = "_lease = None\ndef take(n):\n    global _lease\n    _lease = object()\n"
    assert install_hooks(ast.parse(state)) == []  # module state of its own is no hook
    poke = "from distkit.launch import families\nfamilies.TORCH_LAUNCHERS = None\n"
    assert foreign_assignments(ast.parse(poke)) == ["assigns families.TORCH_LAUNCHERS"]
