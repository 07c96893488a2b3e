"""Every benchmark script imports: benchmarks/transfer_layer.py imported `prepare` from where a refactor had moved it,
and its documented commands failed before doing anything (a review). Most scripts run in the suite only through a
few of their functions, so their imports are checked here, all in one child process (a few seconds)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = """
import importlib.util, json, pathlib, sys
failed = {}
for path in sorted(pathlib.Path("benchmarks").rglob("*.py")):
    sys.path.insert(0, str(path.parent))  # a script's siblings (_measure, _gpu) import as it does
    name = "bench_" + "_".join(path.with_suffix("").parts[1:])
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses look their module up
    try:
        spec.loader.exec_module(module)
    except BaseException as e:
        failed[str(path)] = repr(e)
    sys.path.pop(0)
print(json.dumps(failed))
"""


def test_every_benchmark_script_imports():
    result = subprocess.run([sys.executable, "-c", _CHILD], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    failed = json.loads(result.stdout.strip().splitlines()[-1])
    assert len(list((ROOT / "benchmarks").rglob("*.py"))) > 20
    assert failed == {}
