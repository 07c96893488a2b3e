"""The floor rule of docs/architecture.md, read from the source with `ast` (every import, also the ones inside
functions): a package of gqakit imports only from its own package and from floors below it, never a sibling on
its floor; and no two modules import each other, directly or round a loop, a package's `__init__` included.

An import is an edge to the module it names: `import a.b.c` to a.b.c; `from pkg import name` to pkg.name when that
is a module, else to pkg (its `__init__`, which then holds or re-exports `name`); relative imports resolved."""
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


def modules(package: Path) -> dict[str, Path]:
    """{dotted name: file} of every module under the folder `package` (a package is named by its __init__)."""
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = path.relative_to(package.parent).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def imports(module: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The modules of `known` that `module` (the file `path`) imports: one edge per imported name."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            found.update(f"{source}.{a.name}" if f"{source}.{a.name}" in known else source for a in node.names)
    return {t for t in found if t in known and t != module}


def graph(package: Path) -> dict[str, set[str]]:
    """{module: the modules it imports} for the package in the folder `package`."""
    known = modules(package)
    return {m: imports(m, p, known) for m, p in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The modules that import each other, directly or round a loop: Tarjan's strongly connected components of
    more than one module, each sorted. No loop is exempt, not one through a package's __init__."""
    index, low, stack, on, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
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
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return sorted(found)


def room(module: str) -> str | None:
    """The top-level package or module of gqakit that `module` belongs to (None for the root)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else None


def misplaced(module: str, targets: set[str]) -> list[str]:
    """What breaks the floor rule among `module`'s imports, one message each naming the fix."""
    own, problems = room(module), []
    for target in sorted(targets):
        theirs = room(target)
        if theirs is None or theirs == own:
            continue
        if own is None:  # the root
            if target not in ROOT_MAY_IMPORT:
                problems.append(f"gqakit/__init__.py imports {target}; it may import {ROOT_MAY_IMPORT}")
        elif not FLOOR[theirs] < FLOOR[own]:
            problems.append(f"{module} imports {target}: {theirs} is not on a floor below {own}; move the shared "
                            "code down (common/, hf/, decode/) or the caller up")
    return problems


MODULES = modules(PACKAGE)
GRAPH = graph(PACKAGE)


def test_every_room_is_on_a_floor():
    rooms = {room(m) for m in MODULES} - {None}
    assert rooms <= set(FLOOR), f"put {sorted(rooms - set(FLOOR))} on a floor in this test and docs/architecture.md"


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_point_down_or_within(module):
    problems = misplaced(module, GRAPH[module])
    assert not problems, "; ".join(problems)


def test_no_import_cycles():
    loops = cycles(GRAPH)
    assert not loops, f"modules that import each other (move what both need into a module below them): {loops}"


def _tree(root: Path, files: dict[str, str]) -> Path:
    """A package `gqakit` under `root` holding `files` ({path inside gqakit/: source}); returns its folder."""
    for name, source in {"__init__.py": "", **files}.items():
        path = root / "gqakit" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(source)
    return root / "gqakit"


def test_the_guard_sees_an_upward_import(tmp_path):
    package = _tree(tmp_path, {"common/__init__.py": "", "common/x.py": "from gqakit.convert.run import convert\n",
                               "convert/__init__.py": "", "convert/run.py": "def convert(): pass\n"})
    edges = graph(package)
    assert edges["gqakit.common.x"] == {"gqakit.convert.run"}
    assert misplaced("gqakit.common.x", edges["gqakit.common.x"]) == [
        "gqakit.common.x imports gqakit.convert.run: convert is not on a floor below common; move the shared code "
        "down (common/, hf/, decode/) or the caller up"]
    assert misplaced("gqakit", {"gqakit.convert.run"}) and not misplaced("gqakit", ROOT_MAY_IMPORT)


def test_the_guard_sees_a_loop_through_a_reexporting_init(tmp_path):
    package = _tree(tmp_path, {
        "pkg/__init__.py": "from .a import x\n",
        "pkg/a.py": "def x():\n    from gqakit.pkg.b import y  # inside a function: still an edge\n",
        "pkg/b.py": "from gqakit.pkg import x\ny = 1\n",
        "pkg/c.py": "from gqakit.pkg import b\nimport gqakit.pkg.a\n",  # a module, not the __init__
    })
    edges = graph(package)
    assert edges["gqakit.pkg"] == {"gqakit.pkg.a"} and edges["gqakit.pkg.b"] == {"gqakit.pkg"}
    assert edges["gqakit.pkg.c"] == {"gqakit.pkg.b", "gqakit.pkg.a"}
    assert cycles(edges) == [["gqakit.pkg", "gqakit.pkg.a", "gqakit.pkg.b"]]
