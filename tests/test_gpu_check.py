"""The GPU device check (benchmarks/gpu/run.sh) end to end on CPU, so that its code cannot rot between the rare runs
on a lent GPU: DRY_RUN=1 runs the decode and training benchmarks' dry runs (tiny shapes, CPU) and the cuda tests
(which skip here), and the summary must report every part and pass."""
from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_device_check_runs_dry_on_cpu(tmp_path):
    env = dict(os.environ, OUT=str(tmp_path / "out"), DRY_RUN="1", WHEELS=str(tmp_path / "no-wheels"),
               TMPDIR=str(tmp_path), CUDA_VISIBLE_DEVICES="")
    run = subprocess.run(["bash", str(REPO / "benchmarks" / "gpu" / "run.sh")], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert [p["part"] for p in report["parts"]] == ["pytest", "decode", "train"]
    assert report["failed"] == [] and report["pytest"]["failed"] == 0 and report["pytest"]["skipped"] > 0
    assert {"MHA", "GQA-2", "MQA"} <= set(report["decode"]["variants"])
    assert report["train"]["uptrain"]["ddp"]["vs_bare"] > 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["decode.png", "image-packages.txt", "pytest.log",
                                                                    "report.json", "report.md", "run.log"]
    own = (tmp_path / "out" / "image-packages.txt").read_text().split()
    assert any(line.startswith("torch==") for line in own), own[:5]  # the environment's own packages


def _summary(work: Path, out: Path) -> tuple[int, dict]:
    run = subprocess.run(["python", str(REPO / "benchmarks" / "gpu" / "summary.py"), str(work), str(out)],
                         capture_output=True, text=True, timeout=120)
    return run.returncode, json.loads((out / "report.json").read_text())


def test_tests_skipped_at_the_deadline_are_not_a_pass(tmp_path):
    """A run whose tests were skipped past GQAKIT_TEST_DEADLINE exited 0 and said "Every check held" (a review):
    not run is not passed. The reason the conftest skips with is the one the summary counts."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("cuda_conftest", REPO / "tests" / "cuda" / "conftest.py")
    conftest = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(conftest)
    summary = (REPO / "benchmarks" / "gpu" / "summary.py").read_text()
    assert f'DEADLINE_SKIP = "{conftest.DEADLINE_SKIP}"' in summary
    work = tmp_path / "work"
    work.mkdir()
    (work / "parts.tsv").write_text("pytest\t150\t140\t0\n")
    cases = "".join(f'<testcase classname="c" name="t{i}" time="1"/>' for i in range(3))
    skips = "".join(f'<testcase classname="c" name="s{i}" time="0"><skipped message="{why}"/></testcase>'
                    for i, why in enumerate([conftest.DEADLINE_SKIP, conftest.DEADLINE_SKIP, "no CUDA"]))
    (work / "pytest.xml").write_text(f'<testsuite tests="6" failures="0" errors="0" skipped="3">{cases}{skips}'
                                     "</testsuite>")
    rc, report = _summary(work, tmp_path / "out")
    assert rc == 1 and report["pytest"]["unrun"] == 2
    assert report["failed"] == ["pytest: 2 tests did not run (the time budget for the tests ran out)"]


def test_an_interrupted_benchmark_still_writes_what_finished(tmp_path):
    """run.sh's timeout now interrupts (SIGINT, not SIGTERM, which left no junit report and no JSON): decode.py
    reports the variants that finished and fails its check. The second variant waits for the signal (a dry run's
    variants take milliseconds: a signal sent on its log line could land after the script had ended)."""
    import signal
    import sys

    out = tmp_path / "decode.json"
    driver = (f"import sys, time; sys.path[:0] = [{str(REPO / 'benchmarks' / 'gpu')!r}, {str(REPO / 'benchmarks')!r}]\n"
              "import decode\n"
              "real = decode.run_variant\n"
              "def waiting(name, *args, **kwargs):\n"
              "    if name != 'MHA':\n"
              "        print('waiting for the signal', file=sys.stderr, flush=True)\n"
              "        time.sleep(120)\n"
              "    return real(name, *args, **kwargs)\n"
              "decode.run_variant = waiting\n"
              f"sys.exit(decode.main(['--dry-run', '--json', {str(out)!r}]))\n")
    proc = subprocess.Popen([sys.executable, "-c", driver], cwd=REPO, env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for line in proc.stderr:
        if "waiting for the signal" in line:  # the first variant (MHA) has finished
            break
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=120)
    assert proc.returncode == 1
    report = json.loads(out.read_text())
    assert "MHA" in report["variants"]
    assert any(c.startswith("interrupted at the time limit after") for c in report["failed_checks"])
