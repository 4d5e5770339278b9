"""The package's structure in figures, read from the source with :mod:`ast` (nothing runs).

``python -m tests.support.structure`` prints them: the private modules a package imports from
another package, the longest functions, the top-level files, ``Runtime``'s and ``Strategy``'s
public names, and the import circles between packages counting type-only imports too.
``tests/test_layers.py`` holds the package to them.
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path

from tests.support.paths import ROOT

PACKAGE = ROOT / "distkit"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


@cache
def tree_of(name: str) -> ast.Module:
    path = modules()[name]
    return ast.parse(path.read_text(), str(path))


def _all_imports(tree: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import, those under ``if TYPE_CHECKING:`` too."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node


def imported_modules(name: str) -> set[str]:
    """The distkit modules ``name`` names in its imports (type-only ones included), each as
    written: ``from distkit.runtime._loop import LoopState`` names ``distkit.runtime._loop``."""
    known = modules()
    is_package = modules()[name].name == "__init__.py"
    found: set[str] = set()
    for node in _all_imports(tree_of(name)):
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
            if target.startswith("distkit.") and target != name:
                found.add(target)
    return found


def package_of(name: str) -> str:
    """``distkit.runtime._loop`` -> ``distkit.runtime``; a top-level module is its own."""
    parts = name.split(".")
    if len(parts) > 2 or modules()[name].name == "__init__.py":
        return ".".join(parts[:2])
    return name


def is_private(name: str) -> bool:
    return any(part.startswith("_") for part in name.split(".")[2:])


def private_imports() -> set[tuple[str, str]]:
    """(importer, private module of another package) for every such import."""
    pairs = set()
    for importer in modules():
        for imported in imported_modules(importer):
            if is_private(imported) and package_of(imported) != package_of(importer):
                pairs.add((importer, imported))
    return pairs


def private_modules_imported(by: str, of: str) -> set[str]:
    """The private modules of package ``of`` that modules of package ``by`` import."""
    return {b for a, b in private_imports() if package_of(a) == by and package_of(b) == of}


def package_cycles() -> list[list[str]]:
    """Circles between packages (and top-level modules), counting type-only imports."""
    edges: dict[str, set[str]] = {}
    for importer in modules():
        source = package_of(importer)
        for imported in imported_modules(importer):
            target = package_of(imported)
            if target != source and target != "distkit":
                edges.setdefault(source, set()).add(target)
    found, seen = [], set()
    for start in sorted(edges):
        for nxt in sorted(edges[start]):
            path = _path(edges, nxt, start)
            if path is not None:
                circle = frozenset([start, *path])
                if circle not in seen:
                    seen.add(circle)
                    found.append([start, *path])
    return found


def _path(edges: dict[str, set[str]], start: str, goal: str) -> list[str] | None:
    """The shortest chain of packages from ``start`` to ``goal`` (breadth first)."""
    queue, came = [start], {start: None}
    while queue:
        node = queue.pop(0)
        if node == goal:
            chain = []
            at: str | None = node
            while at is not None:
                chain.append(at)
                at = came[at]
            return chain[::-1][:-1]
        for nxt in sorted(edges.get(node, ())):
            if nxt not in came:
                came[nxt] = node
                queue.append(nxt)
    return None


def functions() -> Iterator[tuple[str, str, int]]:
    """(module, qualified name, lines) of every function and method."""
    for name in modules():
        stack: list[tuple[ast.AST, str]] = [(tree_of(name), "")]
        while stack:
            node, prefix = stack.pop()
            for child in ast.iter_child_nodes(node):
                if isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                    qualified = f"{prefix}{child.name}"
                    assert child.end_lineno is not None
                    yield name, qualified, child.end_lineno - child.lineno + 1
                    stack.append((child, qualified + "."))
                elif isinstance(child, ast.ClassDef):
                    stack.append((child, f"{prefix}{child.name}."))
                else:
                    stack.append((child, prefix))


def top_level_files() -> list[str]:
    return sorted(path.name for path in PACKAGE.glob("*.py"))


def public_names(module: str, cls: str) -> list[str]:
    """The public attributes a class defines in its body (methods, properties, fields)."""
    for node in ast.walk(tree_of(module)):
        if isinstance(node, ast.ClassDef) and node.name == cls:
            names = []
            for item in node.body:
                if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                    names.append(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    names.append(item.target.id)
                elif isinstance(item, ast.Assign):
                    names += [t.id for t in item.targets if isinstance(t, ast.Name)]
            return sorted({n for n in names if not n.startswith("_")})
    raise LookupError(f"no class {cls} in {module}")


def report() -> str:
    pairs = sorted(private_imports())
    longest = sorted(functions(), key=lambda f: -f[2])
    lines = [
        f"cross-package private imports: {len(pairs)} "
        f"({len({b for _, b in pairs})} private modules)",
        "trainer -> runtime private modules: "
        f"{len(private_modules_imported('distkit.trainer', 'distkit.runtime'))}",
        f"Runtime public names: {len(public_names('distkit.runtime._runtime', 'Runtime'))}",
        f"Strategy public names: {len(public_names('distkit.strategies.base', 'Strategy'))}",
        f"top-level files: {len(top_level_files())} ({', '.join(top_level_files())})",
        f"functions over 80 lines: {sum(1 for f in longest if f[2] > 80)}",
        *(f"  {lines} {module}:{name}" for module, name, lines in longest[:8]),
        "package circles (type-only imports counted): "
        + (", ".join(" <-> ".join(c) for c in package_cycles()) or "none"),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(report() + "\n")
