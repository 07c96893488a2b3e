"""The floor rule of docs/architecture.md, read from the source with `ast` (every import, also the ones inside
functions): a package of gqakit imports only from its own package and from floors below it, never a sibling on
its floor; and no two modules import each other, directly or round a loop."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gqakit"
# Floors from the ground up. The root module `gqakit` (its __init__: __version__ and the hook that registers
# gqakit's own model classes once transformers is imported) sits below them all: it may import that hook only.
ROOT_MAY_IMPORT = {"gqakit.hf.models.registry"}
FLOORS = [
    {"common"},
    {"hf"},
    {"decode"},
    {"attention"},
    {"convert", "evaluate", "uptrain"},
    {"experiments", "reference"},
    {"demo", "demo_options", "generate"},
    {"cli"},
]
FLOOR = {name: level for level, names in enumerate(FLOORS) for name in names}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The gqakit modules (or packages) `path` imports, relative imports resolved."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if target == "gqakit" or target.startswith("gqakit."):
                found.add(target)
                found.update(f"{target}.{a.name}" for a in node.names)  # `from pkg import module`
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name == "gqakit" or a.name.startswith("gqakit."))
    return found


MODULES = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
GRAPH = {m: {t for t in _imports(p) if t in MODULES and t != m} for m, p in MODULES.items()}


def _room(module: str) -> str | None:
    """The top-level package or module of gqakit that `module` belongs to (None for the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def test_every_room_is_on_a_floor():
    rooms = {_room(m) for m in MODULES} - {None}
    assert rooms <= set(FLOOR), f"put {sorted(rooms - set(FLOOR))} on a floor in this test and docs/architecture.md"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down_or_within(module):
    own = _room(module)
    for target in sorted(GRAPH[module]):
        room = _room(target)
        if room is None or room == own:
            continue
        if own is None:  # the root
            assert target in ROOT_MAY_IMPORT, f"gqakit/__init__.py imports {target}; it may import {ROOT_MAY_IMPORT}"
            continue
        assert own is not None and FLOOR[room] < FLOOR[own], (
            f"{module} imports {target}: {room} is not on a floor below {own}; move the shared code down "
            "(common/, hf/, decode/) or the caller up")


def test_no_import_cycles():
    """Tarjan's strongly connected components over module imports (packages' __init__ imports included)."""
    index, low, stack, on, cycles = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in GRAPH:
        if v not in index:
            visit(v)
    # A package's __init__ that re-exports its own modules is not a loop a reader gets lost in: drop those edges.
    real = [c for c in cycles if not all(any(m == _init or m.startswith(_init + ".") for _init in c if
                                             MODULES[_init].name == "__init__.py") for m in c)]
    assert not real, f"modules that import each other: {real}"


def test_the_rule_sees_a_violation(tmp_path):
    """The checker itself: an upward import is caught."""
    bad = tmp_path / "gqakit" / "common" / "x.py"
    bad.parent.mkdir(parents=True)
    bad.write_text("from gqakit.convert.run import convert\n")
    assert "gqakit.convert.run" in {t for t in _imports_for_test(bad, tmp_path)}


def _imports_for_test(path: Path, root: Path) -> set[str]:
    global PACKAGE
    saved, PACKAGE = PACKAGE, root / "gqakit"
    try:
        return _imports(path)
    finally:
        PACKAGE = saved
