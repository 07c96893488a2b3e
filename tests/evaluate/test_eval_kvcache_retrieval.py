"""`gqakit eval passkey | niah --kv-cache`: the prompt prefilled through the cache in chunks, then decoded greedily
from it. A dense cache gives the replies of the plain path; int4 through the console script reports fewer bytes
held than dense; the shared refusals are one line for both commands."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from cli_contract import run_cli, run_refused
from eval_tiny import checkpoint, run_eval, tokenizer
from gqakit.common import report
from gqakit.common.errors import GqakitError
from gqakit.evaluate.generation import greedy_generator
from gqakit.evaluate.passkey import build_cases
from gqakit.hf.loading import kv_bytes_per_token, load_model

EMBEDDED = Path(__file__).resolve().parents[2] / "gqakit" / "assets" / "austen-mha-8h"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("kvgen") / "model", tokenizer(), max_positions=512)


@pytest.fixture(scope="module")
def loaded(tiny):
    return load_model(str(tiny), "float32", None, "cpu")


@pytest.mark.parametrize("chunk", [None, 32, 100])
def test_dense_replies_equal_the_plain_path(loaded, chunk):
    model, tok = loaded
    cases = build_cases(tok, [256], [0.0, 0.5, 1.0], trials=2, seed=3)
    plain = greedy_generator(model, tok, new_tokens=8)
    dense = greedy_generator(model, tok, new_tokens=8, kv_cache="dense", kv_chunk=chunk)
    assert [dense(c.prompt) for c in cases] == [plain(c.prompt) for c in cases]
    assert plain.held_per_token is None  # nothing measured without --kv-cache
    assert dense.held_per_token == kv_bytes_per_token(model.config, torch.float32)  # K and V of every layer


def test_dense_prefill_reads_the_cache(loaded):
    """Chunks after the first attend to the cached past: the logits equal one forward over the prompt."""
    from gqakit.evaluate.kvcache import make_cache

    model, tok = loaded
    ids = tok(build_cases(tok, [256], [0.5], trials=1, seed=0)[0].prompt, return_tensors="pt").input_ids
    cache = make_cache("dense", model.config)
    with torch.no_grad():
        whole = model(input_ids=ids).logits[0, -1]
        for start in range(0, ids.shape[1], 64):
            last = model(input_ids=ids[:, start:start + 64], cache=cache, use_cache=True).logits[0, -1]
    assert torch.allclose(last, whole, atol=1e-5) and cache.get_seq_length() == ids.shape[1]


def test_quanto_groups_that_do_not_fill_are_one_line(loaded):
    pytest.importorskip("optimum.quanto")
    model, tok = loaded
    decode = greedy_generator(model, tok, new_tokens=2, kv_cache="int4")
    prompt = tok.decode(list(range(40, 71)))  # a prompt shorter than --kv-chunk: one chunk of an odd length
    n = len(tok(prompt).input_ids)
    assert (2 * n) % 64  # 2 K/V heads x n tokens: not whole groups of 64
    with pytest.raises(GqakitError, match=r"^kv_cache=int4 quantizes a window's first tokens at once, in groups of "
                                          r"64 tokens, and this window or prompt holds \d+"):
        decode(prompt)


def test_int4_passkey_through_the_console_script(tmp_path):
    pytest.importorskip("optimum.quanto")
    out_dir = tmp_path / "r"
    done = run_cli("gqakit", "eval", "passkey", str(EMBEDDED), "--lengths", "300", "--depths", "0,1", "--trials", "1",
                   "--new-tokens", "4", "--kv-cache", "int4", "-o", str(out_dir), "-q", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    record = report.read_report(out_dir)["results"]
    dense = record["model"]["kv_bytes_per_token"]
    assert record["kv_cache"] == "int4" and record["kv_chunk"] == 128
    assert record["kv_cache_settings"]["backend"] == "quanto" and record["kv_cache_settings"]["nbits"] == 4
    assert 0 < record["kv_bytes_held_per_token"] < dense / 2
    assert all(0 < c["kv_bytes_held_per_token"] < dense / 2 for c in record["cases"] + record["cells"])
    assert "kv_bytes_held_per_token" in (out_dir / "results.csv").read_text().splitlines()[0].split(",")
    row = [line for line in done.stdout.splitlines() if line.startswith("| KV-cache bytes/token held")]
    held = record["cells"][0]["kv_bytes_held_per_token"]
    assert row == [f"| KV-cache bytes/token held (int4 cache, measured) | {held:,.1f} |"]
    assert "prefilled into a fresh int4 cache, 128 tokens per forward" in done.stdout


def test_dense_niah_reports_the_bytes_held(tiny, tmp_path):
    code, out, err = run_eval("niah", tiny, "--tasks", "niah_single", "--lengths", "512", "--depths", "0.5",
                              "--samples", "1", "--kv-cache", "dense", "--kv-chunk", "64", "-o", tmp_path / "r", "-q")
    assert code == 0, err
    record = report.read_report(tmp_path / "r")["results"]
    model = record["models"][0]
    assert record["kv_cache"] == "dense" and record["kv_chunk"] == 64
    assert model["kv_bytes_held_per_token"] == model["kv_bytes_per_token"] == record["cells"][0][
        "kv_bytes_held_per_token"]
    assert f"| KV-cache bytes/token held (dense cache, measured) | | | {model['kv_bytes_per_token']:,.1f} |" in out


REFUSED = [
    (["--kv-cache", "dense", "--kv-chunk", "0"], ("--kv-chunk must be a positive number of tokens, got 0",)),
    (["--kv-chunk", "16"], ("--kv-chunk only applies with --kv-cache",)),
    (["--kv-cache", "fp8", "--attention", "sinks"], ("--kv-cache fp8", "--attention sinks", "drop one")),
]


@pytest.mark.parametrize("command", ["passkey", "niah"])
@pytest.mark.parametrize("argv, needles", REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_refusals_are_one_line(tiny, tmp_path, command, argv, needles):
    run_refused([tiny, tmp_path], "gqakit", "eval", command, str(tiny), "--lengths", "256", "-q",
                "-o", str(tmp_path / "r"), *argv, cwd=tmp_path, needles=needles)


@pytest.mark.parametrize("command", ["passkey", "niah"])
def test_missing_backend_names_the_extra(tiny, tmp_path, command):
    """A regular package `optimum` first on the path hides optimum.quanto, as if it were not installed."""
    import os

    shadow = tmp_path / "shadow"
    (shadow / "optimum").mkdir(parents=True)
    (shadow / "optimum" / "__init__.py").write_text("")
    path = os.pathsep.join(p for p in (str(shadow), os.environ.get("PYTHONPATH", "")) if p)
    run_refused([tiny], "gqakit", "eval", command, str(tiny), "--lengths", "256", "--kv-cache", "int4", "-q",
                "-o", str(tmp_path / "r"), cwd=tmp_path, env={"PYTHONPATH": path},
                needles=("--kv-cache int4 quantizes with optimum-quanto, which is not installed",
                         'pip install "gqakit[kvquant]"'))
    assert not (tmp_path / "r").exists()


def test_encoder_decoder_is_refused(tmp_path):
    from uptrain_tiny import make_t5_model

    t5 = make_t5_model(tmp_path / "t5", kv_heads=2)
    run_refused([tmp_path], "gqakit", "eval", "passkey", str(t5), "--lengths", "256", "--kv-cache", "dense", "-q",
                "-o", str(tmp_path / "r"), cwd=tmp_path, needles=("is an encoder-decoder",))
