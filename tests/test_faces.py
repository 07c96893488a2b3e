"""Package faces stay light: importing a package of gqakit (or the attention kinds) loads neither torch nor
transformers, and the command line parses without them. Each import runs in a fresh interpreter: the test process
has loaded torch long since."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "gqakit"
# the re-hosting registry holds its entries' builders, which compute derived tensors with torch
HOLDS_TORCH = {"gqakit.hf.architectures.rehost"}
PACKAGES = sorted(".".join(p.parent.relative_to(PACKAGE.parent).parts) for p in PACKAGE.rglob("__init__.py"))
LIGHT = """
import sys
heavy = sorted(m for m in ("torch", "transformers") if m in sys.modules)
assert not heavy, f"{name} imports {heavy}"
"""


def _run(code: str) -> None:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=PACKAGE.parent)
    assert out.returncode == 0, out.stderr


@pytest.mark.parametrize("name", [*(p for p in PACKAGES if p not in HOLDS_TORCH), "gqakit.attention.kinds"])
def test_importing_a_package_loads_no_torch(name):
    _run(f"import {name}\nname = {name!r}\n" + LIGHT)


@pytest.mark.parametrize("argv", [["--help"], ["eval", "ppl", "--help"], ["generate", "--help"],
                                  ["convert", "--help"], ["uptrain", "--help"]])
def test_the_command_line_parses_without_torch(argv):
    _run("import contextlib, io\nfrom gqakit.cli import main\n"
         f"with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):\n    main({argv!r})\n"
         f"name = 'gqakit {' '.join(argv)}'\n" + LIGHT)
