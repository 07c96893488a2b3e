"""`gqakit demo` end to end on the embedded model (a short slice of the held-out text)."""
import json

from gqakit.cli import main


def test_demo_converts_and_ranks(tmp_path, capsys):
    out = tmp_path / "demo"
    assert main(["demo", "--eval-tokens", "1024", "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "| original (MHA) | 8 |" in printed and "| MQA | 1 | random |" in printed
    rows = json.loads((out / "results.json").read_text())["results"]["rows"]
    assert [(r["kv_heads"], r["method"]) for r in rows] == [(8, "-")] + [
        (g, m) for g in (4, 2, 1) for m in ("mean", "first", "random")]
    # At the dtype the cache is held in while scoring (fp32), the same count `gqakit eval` reports.
    assert "| KV-cache bytes/token (float32) |" in printed
    assert [r["kv_bytes_per_token"] for r in rows[::3]] == [16384, 8192, 4096, 2048]
    ppl = {(r["kv_heads"], r["method"]): r["perplexity"] for r in rows}
    # A real model loses something to pooling, and the mean loses least (GQA paper, alpha = 0).
    assert ppl[(8, "-")] < ppl[(4, "mean")] < ppl[(4, "first")] < ppl[(4, "random")]
    assert (out / "results.csv").is_file()
    assert main(["demo", "--eval-tokens", "1024", "-o", str(out)]) == 2  # refuses to overwrite


def test_keep_and_force_without_an_output_folder_are_refused(capsys):
    """--keep and --force act on -o's folder; without one they would be ignored (the models deleted unseen)."""
    for flag in ("--keep", "--force"):
        assert main(["demo", flag]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1 and f"{flag} acts on the --output-dir folder, and none is given" in err
