"""The GPU device check's report: one summary table from what run.sh's parts left in its work folder.

Reads WORK/parts.tsv (part, budget s, seconds, exit status: one line per part, written by run.sh),
WORK/versions.json, WORK/pytest.xml (junit), WORK/decode.json and WORK/train.json with their markdown
reports; writes OUT/report.md (the summary, the failed checks, each part's tables) and OUT/report.json,
and OUT/decode.png (decode tokens/s against context, batch 8) where matplotlib is there. Prints the summary;
exits 1 if any part failed or any check did not hold.

    python benchmarks/gpu/summary.py WORK OUT
"""
from __future__ import annotations

import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

# the reason tests/cuda/conftest.py skips a test that would start after the deadline (tests/test_gpu_check.py holds
# the two equal)
DEADLINE_SKIP = "the device check's time budget for the tests is spent"


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def pytest_counts(path: Path) -> dict:
    """passed / failed / skipped / errors of a junit file ({} when it is missing)."""
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError):
        return {}
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{c.get('classname')}::{c.get('name')}" for c in suite.iter("testcase")
              if c.find("failure") is not None or c.find("error") is not None]
    unrun = sum(DEADLINE_SKIP in (s.get("message") or "") for s in suite.iter("skipped"))
    return {"passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"], "failed": n["failures"],
            "errors": n["errors"], "skipped": n["skipped"], "unrun": unrun, "failed_tests": failed}


def parts(work: Path) -> list[dict]:
    rows = []
    for line in (work / "parts.tsv").read_text().splitlines() if (work / "parts.tsv").is_file() else []:
        name, budget, seconds, rc = line.split("\t")
        rows.append({"part": name, "budget_s": int(budget), "seconds": int(seconds), "rc": int(rc)})
    return rows


def what(part: str, data: dict) -> str:
    """One cell saying what a part found."""
    if part == "pytest":
        t = data.get("pytest", {})
        return (f"{t['passed']} passed, {t['failed']} failed, {t['errors']} errors, {t['skipped']} skipped"
                if t else "no junit report")
    if part == "decode":
        cells = [c for v in data.get("decode", {}).get("variants", {}).values() for c in v["cells"].values()]
        ran = [c for c in cells if "tokens_per_s" in c]
        kernels = sorted({c.get("decode_kernel") for c in ran} - {None})
        graph = sum("graph_tokens_per_s" in c for c in ran)
        return (f"{len(ran)} of {len(cells)} cells ran ({graph} also captured); decode kernels: "
                f"{', '.join(kernels) or '-'}")
    if part == "train":
        up = data.get("train", {}).get("uptrain", {})
        vs = [f"{k} {v['vs_bare']:.2f}x bare" for k, v in up.items() if isinstance(v, dict) and "vs_bare" in v]
        return "uptrain: " + (", ".join(vs) or "no ratio")
    return ""


def plot(decode: dict, out: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for name, res in decode.get("variants", {}).items():
        for key, style, suffix in (("tokens_per_s", "-", " eager"), ("graph_tokens_per_s", "--", " graph")):
            points = sorted((int(k.split("x")[1]), c[key]) for k, c in res["cells"].items()
                            if k.startswith("8x") and key in c)
            if points:
                ax.plot(*zip(*points), style, marker="o", label=name + suffix)
    ax.set(xscale="log", xlabel="context (tokens)", ylabel="decode tokens/s", title="batch 8, bf16")
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "decode.png", dpi=100)
    plt.close(fig)


def main(argv: list[str]) -> int:
    work, out = Path(argv[0]), Path(argv[1])
    data = {"versions": read_json(work / "versions.json"), "pytest": pytest_counts(work / "pytest.xml"),
            "decode": read_json(work / "decode.json"), "train": read_json(work / "train.json"), "parts": parts(work)}
    failed = [f"{p['part']}: exit {p['rc']}" + (" (its time budget ran out)" if p["rc"] in (124, 137) else "")
              for p in data["parts"] if p["rc"] != 0]
    failed += data["pytest"].get("failed_tests", [])
    if data["pytest"].get("unrun"):  # skipped at the deadline: not run is not passed
        failed.append(f"pytest: {data['pytest']['unrun']} tests did not run (the time budget for the tests ran out)")
    for part in ("decode", "train"):
        failed += [f"{part}: {line}" for line in data[part].get("failed_checks", [])]
    v = data["versions"]
    lines = [f"# GPU device check: {v.get('gpu', '?')}, driver {v.get('driver', '?')}, CUDA {v.get('cuda', '?')}, "
             f"torch {v.get('torch', '?')}, transformers {v.get('transformers', '?')}", "",
             "| part | budget s | seconds | exit | what it found | verdict |", "|---|---|---|---|---|---|"]
    for p in data["parts"]:
        lines.append(f"| {p['part']} | {p['budget_s']} | {p['seconds']} | {p['rc']} | {what(p['part'], data)} | "
                     f"{'PASS' if p['rc'] == 0 else 'FAIL'} |")
    lines += ["", "Failed checks:" if failed else "Every check held.", *[f"- {f}" for f in failed]]
    print("\n".join(lines))
    for name in ("decode.md", "train.md"):
        if (work / name).is_file():
            lines += ["", (work / name).read_text()]
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.md").write_text("\n".join(lines) + "\n")
    (out / "report.json").write_text(json.dumps({**data, "failed": failed}, indent=1) + "\n")
    plot(data["decode"], out)
    return 1 if failed or not data["parts"] else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
