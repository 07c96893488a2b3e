"""The documented layout is the tree's: every module and package under gqakit/ is named in the module-by-module
layout of docs/architecture.md (under its top-level package), and every name there still exists; every recipe
in recipes/ is named there too (and in the README's tour, if that lists recipes at all); every benchmark script
is in benchmarks/README.md's table. A module that moves or is added fails here with the line to write."""
from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "gqakit"
ARCHITECTURE = REPO / "docs" / "architecture.md"


def code_block_after(text: str, heading: str) -> str:
    """The first ``` block after the markdown heading `heading`."""
    start = re.search(rf"^#+ {re.escape(heading)}\s*$", text, re.M)
    assert start, f"no '{heading}' heading"
    block = re.search(r"^```[^\n]*\n(.*?)^```", text[start.end():], re.M | re.S)
    assert block, f"no code block after '{heading}'"
    return block.group(1)


def layout_sections(block: str) -> dict[str, str]:
    """The layout block split by entry: 'common/', 'hf/', ... (the gqakit/ packages), '' for the top-level modules
    of gqakit/ (the `  cli.py, ...` line), and 'recipes/', 'benchmarks/', ... (the entries beside gqakit/). Each
    holds its first line and the indented lines that continue it."""
    sections: dict[str, str] = {}
    current = None
    for line in block.splitlines():
        top = re.match(r"^(\S+/)", line)  # gqakit/, recipes/, ...
        package = re.match(r"^  ([\w.-]+/)", line)  # a package of gqakit/
        modules = re.match(r"^  [\w.]+\.py\b", line)  # gqakit/'s own modules
        if top:
            current = "" if top.group(1) == "gqakit/" else top.group(1)
        elif package:
            current = package.group(1)
        elif modules:
            current = ""
        if current is not None:
            sections[current] = sections.get(current, "") + line + "\n"
    return sections


def named(text: str, name: str) -> bool:
    return re.search(rf"(?<![\w./-]){re.escape(name)}(?![\w-])", text) is not None


def layout_problems() -> list[str]:
    """What the Layout block of docs/architecture.md misses or names in vain, one line each."""
    sections = layout_sections(code_block_after(ARCHITECTURE.read_text(encoding="utf-8"), "Layout"))
    problems = []
    modules = sorted(p for p in PACKAGE.rglob("*.py") if p.name != "__init__.py" and "__pycache__" not in p.parts)
    packages = sorted(p.parent for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE)
    for path in modules + packages:
        rel = path.relative_to(PACKAGE)
        parts = rel.parts
        section = parts[0] + "/" if len(parts) > 1 or path.is_dir() else ""
        inside = "".join(p + "/" for p in parts[1:-1])
        where = (f"under `{section}`" + (f" (in its `{inside}`)" if inside else "") if section
                 else "on the `cli.py, demo.py, generate.py` line")
        text = sections.get(section)
        if text is None:
            problems.append(f"gqakit/{rel}: the layout has no `  {section}` entry; add one for its package")
            continue
        names = [p + "/" for p in parts[1:-1]] + [parts[-1] + ("/" if path.is_dir() else "")]
        missing = [n for n in names if not named(text, n)] if len(parts) > 1 else \
            [n for n in parts if not named(text, n)]
        if missing:
            problems.append(f"gqakit/{rel}{'/' if path.is_dir() else ''}: add {', '.join(f'`{n}`' for n in missing)} "
                            f"(with what it holds) {where} in the Layout block of docs/architecture.md")
    for section, text in sections.items():
        if section and not (PACKAGE / section).is_dir():
            continue  # recipes/, benchmarks/, ...: checked below or free text
        root = PACKAGE / section if section else PACKAGE
        for name in sorted(set(re.findall(r"(?<![\w./-])([\w]+\.py)\b", text))):
            found = [root / name] if not section else list(root.rglob(name))
            if not any(p.is_file() for p in found):
                problems.append(f"docs/architecture.md's Layout names `{name}` under `{section or 'gqakit/'}`, "
                                f"but no gqakit/{section}**/{name} exists: move or remove it")
    return problems


def recipe_problems() -> list[str]:
    recipes = sorted(p.stem for p in (REPO / "recipes").glob("*.yaml"))
    problems = []
    layout = layout_sections(code_block_after(ARCHITECTURE.read_text(encoding="utf-8"), "Layout")).get("recipes/", "")
    for stem in recipes:
        if not (named(layout, stem) or named(layout, stem + ".yaml")):
            problems.append(f"recipes/{stem}.yaml: name `{stem}` on the `recipes/` line of the Layout block "
                            "of docs/architecture.md")
    tour = layout_sections(code_block_after((REPO / "README.md").read_text(encoding="utf-8"),
                                            "A tour of the package")).get("recipes/", "")
    listed = [stem for stem in recipes if named(tour, stem) or named(tour, stem + ".yaml")]
    if listed and len(listed) < len(recipes):
        missing = sorted(set(recipes) - set(listed))
        problems.append(f"README.md's tour lists some recipes on its `recipes/` line but not {', '.join(missing)}: "
                        "name them all, or none and point to recipes/")
    return problems


def benchmark_problems() -> list[str]:
    readme = (REPO / "benchmarks" / "README.md").read_text(encoding="utf-8")
    table = set(re.findall(r"^\| `([\w/]+\.(?:py|sh))` \|", readme, re.M))
    folder = REPO / "benchmarks"  # its scripts and those of its folders (gpu/run.sh), by their relative path
    scripts = {p.relative_to(folder).as_posix() for pattern in ("*.py", "*.sh") for p in folder.rglob(pattern)
               if not p.name.startswith("_") and "__pycache__" not in p.parts}
    return [f"benchmarks/{name}: add a row to the table in benchmarks/README.md (what it measures, a quick "
            f"check and a full run)" for name in sorted(scripts - table)] + \
        [f"benchmarks/README.md has a row for {name}, which is not in benchmarks/: remove the row"
         for name in sorted(table - scripts)]


def test_the_layout_names_every_module_and_nothing_else():
    problems = layout_problems()
    assert not problems, "docs/architecture.md's Layout is not the tree's:\n  " + "\n  ".join(problems)


def test_every_recipe_is_documented():
    problems = recipe_problems()
    assert not problems, "\n  ".join(["recipes missing from the layout:", *problems])


def test_every_benchmark_script_is_in_its_readme():
    problems = benchmark_problems()
    assert not problems, "\n  ".join(["benchmarks/README.md is not the folder's:", *problems])


def test_the_checks_see_a_missing_module(tmp_path):
    block = ("gqakit/\n  common/       errors.py, gone.py\n                more.py\n  hf/           models/ (a.py)\n"
             "  cli.py, demo.py\nrecipes/        YAML recipes (x, y)\n")
    sections = layout_sections(block)
    assert set(sections) == {"common/", "hf/", "", "recipes/"}
    assert named(sections["common/"], "more.py") and not named(sections["common/"], "ore.py")
    assert named(sections["hf/"], "models/") and named(sections["recipes/"], "y")
    assert not named(sections["common/"], "error.py") and not named(sections["recipes/"], "x_t5")
