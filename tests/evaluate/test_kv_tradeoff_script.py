"""benchmarks/kv_tradeoff.py --reports: the equal-bytes table from reports already made, given as report folders
or as the results.json files kept under docs/results/ (the form its documented command uses)."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
KEPT = REPO / "docs" / "results" / "kv-bytes"


def tradeoff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / "benchmarks" / "kv_tradeoff.py"), *args], capture_output=True,
                          text=True)


def table_rows(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.startswith("| smollm2")]


def test_a_results_file_reads_as_its_folder(tmp_path):
    files = [KEPT / "smollm2-original-wholetest.json", KEPT / "smollm2-original-int4-wholetest.json"]
    folders = []
    for i, f in enumerate(files):
        (tmp_path / str(i)).mkdir()
        folders.append(shutil.copy(f, tmp_path / str(i) / "results.json"))
    by_file = tradeoff("--reports", *map(str, files))
    by_folder = tradeoff("--reports", *(str(Path(f).parent) for f in folders))
    assert by_file.returncode == 0 and by_folder.returncode == 0, by_file.stderr + by_folder.stderr
    assert table_rows(by_file.stdout) == table_rows(by_folder.stdout)
    original = json.loads(files[0].read_text())["results"]["rows"][0]
    dense = [r for r in table_rows(by_file.stdout) if "| dense |" in r]
    assert len(table_rows(by_file.stdout)) == 2 and len(dense) == 1
    assert f"| {original['perplexity']:.2f} |" in dense[0] and "1.0x fewer" in dense[0]


def test_a_report_of_another_kind_is_refused(tmp_path):
    other = tmp_path / "stream.json"
    other.write_text(json.dumps({"kind": "stream", "results": {}}))
    done = tradeoff("--reports", str(other))
    assert done.returncode != 0 and "is not a `gqakit eval ppl` report" in done.stderr


def test_a_missing_or_broken_report_is_one_line(tmp_path):
    for given, said in ((tmp_path / "typo.json", "not found"), (tmp_path, "not found")):
        done = tradeoff("--reports", str(given))
        assert done.returncode != 0 and said in done.stderr and "Traceback" not in done.stderr
        assert len(done.stderr.strip().splitlines()) == 1
    broken = tmp_path / "results.json"
    broken.write_text("{not json")
    done = tradeoff("--reports", str(broken))
    assert done.returncode != 0 and "is not JSON" in done.stderr and "Traceback" not in done.stderr


def test_each_row_is_set_against_the_best_row_at_no_more_bytes():
    """"better" (this row's interval wholly below the best cheaper row's: it buys its bytes), "worse" (wholly above)
    and "overlaps" (cannot be told apart) are three verdicts; a single "no" read as both better and worse."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from kv_tradeoff import table

    def row(model, held, ppl, low, high):
        return {"model": model, "kv_heads": 1, "cache": "dense", "kv_bytes_held_per_token": held, "perplexity": ppl,
                "ppl_ci_low": low, "ppl_ci_high": high, "first": model == "a"}

    rows = [row("a", 100, 50.0, 48.0, 52.0), row("b", 200, 30.0, 29.0, 31.0), row("c", 300, 60.0, 58.0, 62.0),
            row("d", 400, 30.5, 29.5, 31.5)]
    verdicts = {line.split(" | ")[0][2:]: line.rsplit("|", 2)[1].strip() for line in table(rows).splitlines()[2:]}
    assert verdicts == {"a": "", "b": "better", "c": "worse", "d": "overlaps b dense"}


def test_the_table_names_the_compute_dtype_its_bytes_are_counted_at():
    """One dtype: the heading says it; reports of several: each row's cache column says its own (a bf16 cache holds
    half an fp32 one's bytes for the same model)."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from kv_tradeoff import table

    def row(model, dtype, held):
        return {"model": model, "kv_heads": 1, "cache": "dense", "kv_bytes_held_per_token": held, "perplexity": 2.0,
                "ppl_ci_low": 1.9, "ppl_ci_high": 2.1, "first": model == "a", "dtype": dtype}

    same = table([row("a", "float32", 200), row("b", "float32", 100)]).splitlines()
    assert "| bytes/token held (float32 compute) |" in same[0] and "| dense |" in same[2]
    mixed = table([row("a", "float32", 200), row("a", "bfloat16", 100)]).splitlines()
    assert "| bytes/token held |" in mixed[0]
    assert "| dense (bfloat16 compute) | 100 |" in mixed[2] and "| dense (float32 compute) | 200 |" in mixed[3]


def test_the_decoding_column_is_measured_or_says_it_was_not():
    """A plain report (one forward per window) holds the same while decoding; a cached row shows its measured mean;
    a quantized row from a report made before the decoding figure existed says "not measured"."""
    sys.path.insert(0, str(REPO / "benchmarks"))
    from kv_tradeoff import table

    def row(model, cache, held, **more):
        return {"model": model, "kv_heads": 1, "cache": cache, "kv_bytes_held_per_token": held, "perplexity": 2.0,
                "ppl_ci_low": 1.9, "ppl_ci_high": 2.1, "first": model == "a", **more}

    lines = table([row("a", "dense", 400, kv_cache="none", kv_bytes_per_token=400),
                   row("b", "int4", 100, kv_cache="int4", kv_bytes_held_decoding_mean=130.4),
                   row("c", "int2", 50, kv_cache="int2")]).splitlines()
    decoding = {line.split(" | ")[0][2:]: line.split(" | ")[4] for line in lines[2:]}
    assert decoding == {"a": "400", "b": "130", "c": "not measured"}
