"""The package's layout rules, checked on its source: no module over 400 lines, no import circle,
no private name imported from another package.

An import circle counts whether its imports sit at the top of a module or inside a function: a
function-level import that only dodges a circle still ties the two modules together.
"""

from __future__ import annotations

import ast
from pathlib import Path

import remat

ROOT = Path(remat.__file__).parent
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = path.relative_to(ROOT.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def _package(name: str, modules: dict[str, Path]) -> str:
    """The package a module belongs to: itself for a package's ``__init__``, else its parent."""
    return name if modules[name].name == "__init__.py" else name.rpartition(".")[0]


def _imports(name: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, str, int]]:
    """(module imported, name imported or "", line) for every import of a remat module."""
    package = _package(name, modules)
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(a.name, "", node.lineno) for a in node.names if a.name in modules]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + [base])
                base = base.rstrip(".")
            for alias in node.names:
                full = f"{base}.{alias.name}"
                if full in modules:  # ``from remat import aten``: the submodule itself
                    found.append((full, "", node.lineno))
                elif base in modules:
                    found.append((base, alias.name, node.lineno))
    return found


def test_no_module_passes_400_lines() -> None:
    long = {
        str(path.relative_to(ROOT.parent)): n
        for path in _modules().values()
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, long


def test_no_private_name_is_imported_from_another_package() -> None:
    modules = _modules()
    crossing = []
    for name, path in modules.items():
        for module, imported, line in _imports(name, path, modules):
            if imported.startswith("_") and _package(module, modules) != _package(name, modules):
                crossing.append(f"{path.relative_to(ROOT.parent)}:{line} {module}.{imported}")
    assert not crossing, crossing


def test_no_import_circle() -> None:
    """Edges to a package's ``__init__`` count only where it is what the import names."""
    modules = _modules()
    edges = {
        name: {m for m, _, _ in _imports(name, path, modules) if m != name} for name, path in modules.items()
    }
    circles = []
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(name: str, path: list[str]) -> None:
        state[name] = 1
        for other in sorted(edges[name]):
            if state.get(other) == 1:
                circles.append(" -> ".join(path[path.index(other) :] + [other]))
            elif other not in state:
                visit(other, [*path, other])
        state[name] = 2

    for name in sorted(modules):
        if name not in state:
            visit(name, [name])
    assert not circles, circles
