"""A plan is arithmetic over config.json and the safetensors headers: `convert-gqa --dry-run` and `gqakit uptrain
--plan` print it without importing torch or transformers (in a fresh process, whose modules are then read), and
print the same text as when torch and transformers are already loaded."""
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EMBEDDED = str(REPO / "gqakit" / "assets" / "austen-mha-8h")
RECIPE = str(REPO / "recipes" / "uptrain_embedded.yaml")
HEAVY = ("torch", "transformers")

_RUN = """import sys
{preload}from gqakit.cli import convert_main, main
rc = (convert_main if sys.argv[1] == "convert-gqa" else main)(sys.argv[2:])
print("LOADED", *[m for m in {heavy!r} if m in sys.modules], file=sys.stderr)
sys.exit(rc)
"""


def _run(argv: list[str], preload: bool, cwd: Path) -> tuple[str, list[str]]:
    code = _RUN.format(preload="import torch, transformers\n" if preload else "", heavy=HEAVY)
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, cwd=cwd, timeout=300)
    assert done.returncode == 0, done.stderr
    loaded = [line for line in done.stderr.splitlines() if line.startswith("LOADED")][-1].split()[1:]
    return done.stdout, loaded


PLANS = {
    "convert mean": ["convert-gqa", "--groups", "2", EMBEDDED, "--dry-run"],
    "convert fit": ["convert-gqa", "--groups", "2", EMBEDDED, "--dry-run", "--method", "fit"],
    "convert transfer": ["convert-gqa", "--groups", "1", EMBEDDED, "--dry-run", "--method", "transfer"],
    "uptrain": ["gqakit", "uptrain", RECIPE, "--plan", f"model={EMBEDDED}", "teacher=null", "batch_size=100000000",
                "--device-memory", "80GB"],
    "uptrain teacher fsdp": ["gqakit", "uptrain", RECIPE, "--plan", f"model={EMBEDDED}", f"teacher={EMBEDDED}",
                             "sharding=fsdp", "--processes", "4", "--device-memory", "1GB"],
}


@pytest.mark.parametrize("name", sorted(PLANS))
def test_plan_loads_neither_torch_nor_transformers_and_prints_the_same(name, tmp_path):
    light, loaded = _run(PLANS[name], preload=False, cwd=tmp_path)
    assert loaded == [], f"{name}: the plan imported {loaded}"
    heavy, loaded = _run(PLANS[name], preload=True, cwd=tmp_path)
    assert loaded == list(HEAVY)
    assert light == heavy and light.strip()
    assert list(tmp_path.iterdir()) == []  # nothing written
