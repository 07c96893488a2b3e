"""`gqakit eval stream`: chunked streaming equals token-by-token streaming for every policy, the sink and
window policies equal the house SinkCache / WindowCache fed one token at a time, recompute equals a
from-scratch loop, and the command writes its report with a fluency verdict.

Tiny random fp32 Llama (2 layers, 4 heads, 2 K/V heads), W and S small so that eviction happens
early, chunk sizes that do not divide the stream, and rebasing of positions inside the stream.
"""
from __future__ import annotations

import csv

import pytest
import torch

from eval_tiny import checkpoint, one_line_error, run_eval, text, tiny_llama, tokenizer
from gqakit.hf.compat import cache_kwargs
from gqakit.decode.cache import SinkCache, WindowCache
from gqakit.common import report
from gqakit.evaluate.stream import POLICIES, bucketize, fluency, stream_nll
from gqakit.decode.stream_cache import ChunkedSinkCache

ATOL = 1e-5  # per-token NLL, nats
N, W, S = 61, 6, 2



@pytest.fixture(scope="module")
def model():
    return tiny_llama(vocab=64, max_positions=32)


@pytest.fixture(scope="module")
def stream():
    return torch.randint(3, 64, (N,), generator=torch.Generator().manual_seed(7))


def nll_of(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Per-token NLL of ids[1:] from logits (T, V) of ids[:-1] (or of all ids)."""
    logp = torch.log_softmax(logits[: ids.numel() - 1].double(), dim=-1)
    return -logp.gather(-1, ids[1:, None])[:, 0]


@torch.no_grad()
def house_cache_token_by_token(model, ids: torch.Tensor, sinks: int, window: int) -> torch.Tensor:
    cache = SinkCache(sinks, window, rope=model) if sinks else WindowCache(window)
    logits = torch.cat([model(input_ids=ids[None, t:t + 1], **cache_kwargs(model, cache), use_cache=True).logits[0]
                        for t in range(ids.numel() - 1)])
    return nll_of(logits, ids)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("chunk", [7, 13])
def test_chunked_equals_token_by_token(model, stream, policy, chunk):
    kw = dict(window=W, sinks=S, recompute_every=5)
    one = stream_nll(model, stream, policy, chunk=1, **kw)
    many = stream_nll(model, stream, policy, chunk=chunk, **kw)  # 61 tokens: chunks of 7 / 13 do not divide it
    assert many.nll.shape == (N - 1,)
    torch.testing.assert_close(many.nll, one.nll, atol=ATOL, rtol=0)


@pytest.mark.parametrize("sinks,window", [(S, W), (0, 7), (4, 3), (3, 1)])
@pytest.mark.parametrize("chunk,rebase_every", [(1, None), (7, None), (13, 2), (64, None)])
def test_sinks_and_window_equal_the_house_caches_token_by_token(model, stream, sinks, window, chunk, rebase_every):
    want = house_cache_token_by_token(model, stream, sinks, window)
    policy = "sinks" if sinks else "window"
    got = stream_nll(model, stream, policy, window=window, sinks=sinks, chunk=chunk, rebase_every=rebase_every)
    torch.testing.assert_close(got.nll, want, atol=ATOL, rtol=0)


@torch.no_grad()
def test_house_cache_in_chunks_is_a_different_policy(model, stream):
    # why ChunkedSinkCache exists: SinkCache fed 7 tokens at a time shows later tokens of a chunk more
    # than W recent tokens, so its numbers are not the token-by-token ones
    cache = SinkCache(S, W, rope=model)
    logits = torch.cat([model(input_ids=stream[None, a:a + 7], **cache_kwargs(model, cache), use_cache=True).logits[0]
                        for a in range(0, N, 7)])
    naive = nll_of(logits, stream)
    exact = house_cache_token_by_token(model, stream, S, W)
    assert (naive - exact).abs().max() > 1e-3


@torch.no_grad()
def test_recompute_every_token_is_a_fresh_forward_on_the_last_w_tokens(model, stream):
    want = torch.stack([nll_of(model(input_ids=stream[None, max(0, t - W):t + 1]).logits[0, -1:], stream[t:t + 2])[0]
                        for t in range(N - 1)])
    got = stream_nll(model, stream, "recompute", window=W, recompute_every=1, chunk=8)  # 8 rows per forward
    torch.testing.assert_close(got.nll, want, atol=ATOL, rtol=0)


@torch.no_grad()
def test_recompute_blocks(model, stream):
    every, want = 5, []
    for b in range(0, N - 1, every):  # queries b..e-1, a fresh forward over [b - W, e)
        c, e = max(0, b - W), min(b + every, N - 1)
        want.append(nll_of(model(input_ids=stream[None, c:e]).logits[0, b - c:], stream[b:e + 1]))
    got = stream_nll(model, stream, "recompute", window=W, recompute_every=every, chunk=3)
    torch.testing.assert_close(got.nll, torch.cat(want), atol=ATOL, rtol=0)


@torch.no_grad()
def test_dense_equals_one_forward(model, stream):
    want = nll_of(model(input_ids=stream[None]).logits[0], stream)
    got = stream_nll(model, stream, "dense", chunk=9)
    torch.testing.assert_close(got.nll, want, atol=ATOL, rtol=0)
    assert got.peak_cache_bytes == 2 * 2 * 2 * (N - 1) * 8 * 4  # K+V, layers, G, tokens fed, d, fp32


@torch.no_grad()
def test_cache_is_bounded_and_positions_rebased(model):
    long = torch.randint(3, 64, (500,), generator=torch.Generator().manual_seed(8))
    cache = ChunkedSinkCache(S, W, rope=model)
    biggest = 0
    for a in range(0, 500, 9):
        pos, mask = cache.prepare(min(9, 500 - a))
        model(input_ids=long[None, a:a + 9], position_ids=pos, attention_mask=mask, **cache_kwargs(model, cache),
              use_cache=True)
        biggest = max(biggest, int(pos.max()))
        assert cache.cache_bytes() <= 2 * 2 * 2 * (S + W) * 8 * 4
    assert biggest < 2 * (S + W) + 9
    got = stream_nll(model, long, "sinks", window=W, sinks=S, chunk=9)
    assert got.peak_cache_bytes == 2 * 2 * 2 * (S + W) * 8 * 4


def test_buckets_and_verdict():
    nll = torch.log(torch.tensor([10.0] * 9 + [20.0] * 10, dtype=torch.float64))  # positions 1..19
    b = bucketize(nll, 10)
    assert [(x["start"], x["end"], x["tokens"]) for x in b] == [(0, 10, 9), (10, 20, 10)]
    assert b[0]["perplexity"] == pytest.approx(10) and b[1]["perplexity"] == pytest.approx(20)
    ref = bucketize(torch.log(torch.tensor([10.0] * 9 + [19.0] * 10, dtype=torch.float64)), 10)
    verdict = fluency(b, ref, 0.10)
    assert verdict["verdict"] == "fluent" and verdict["worst_bucket"] == [10, 20]
    assert fluency(b, ref, 0.06)["verdict"] == "fluent" and fluency(b, ref, 0.01)["verdict"] == "not fluent"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("stream")
    tok = tokenizer()
    (root / "text.txt").write_text(text(400, seed=4), encoding="utf-8")
    return {"root": root, "text": root / "text.txt", "model": checkpoint(root / "model", tok, max_positions=64)}


def test_cli_compares_policies_with_a_verdict(files):
    out_dir = files["root"] / "report"
    code, out, err = run_eval("stream", files["model"], "--text", files["text"], "--tokens", 150, "--policy",
                              "dense,window", "--policy", "sinks", "--policy", "recompute", "--window", 20, "--sinks",
                              4, "--chunk", 16, "--bucket", 25, "--bos", "-o", out_dir, "-q")
    assert code == 0, err
    assert "| sinks |" in out and "| recompute |" in out and "reference" in out
    record = report.read_report(out_dir)
    policies = record["results"]["policies"]
    assert list(policies) == ["dense", "window", "sinks", "recompute"]
    assert record["results"]["stream_tokens"] == 151 and record["config"]["recompute_every"] == 16
    for name in ("dense", "window", "sinks"):
        assert policies[name]["fluency"]["verdict"] in ("fluent", "not fluent")
        assert policies[name]["scored_tokens"] == 150  # BOS + 150 tokens: every text token scored
    assert policies["sinks"]["peak_cache_bytes"] == 2 * 2 * 2 * 24 * 8 * 4
    rows = list(csv.DictReader(open(out_dir / "results.csv")))
    assert len(rows) == 4 * 7 and rows[0]["policy"] == "dense"  # 151 positions in buckets of 25
    assert (out_dir / "ppl_vs_position.png").stat().st_size > 1000


@pytest.mark.parametrize("argv,needle", [
    (["--policy", "sink"], "did you mean 'sinks'"),
    (["--policy", "sinks", "--policy", "sinks"], "lists 'sinks' twice"),  # deduplicated without a word before
    (["--tokens", 100_000], "the text has only"),
    (["--window", 0], "--window must be at least 1"),
    (["--sinks", -1], "--sinks must be >= 0"),
    (["--chunk", 0], "--chunk must be at least 1"),
    (["--policy", "dense", "--recompute-every", 8], "--recompute-every is how often --policy recompute rebuilds"),
    (["--text-column", "body"], "--text-column names a column of a --dataset"),
    (["--policy", "window", "--sinks", 8], "--sinks is read by --policy sinks only, and none of them runs"),
    (["--policy", "dense", "--window", 16], "--window is read by --policy window / sinks / recompute only"),
    (["--policy", "sinks", "--fluent-within", 0.5], "--fluent-within judges another policy against --policy recompute"),
    (["--policy", "recompute", "--fluent-within", 0.5], "--policy recompute gives no such pair"),
    # typed at their default values, --sinks / --window were read by nothing and accepted (the CLI audit)
    (["--policy", "dense", "--sinks", 4], "--sinks is read by --policy sinks only, and none of them runs"),
    (["--policy", "dense", "--window", 1020], "--window is read by --policy window / sinks / recompute only"),
    (["--policy", "sinks", "--policy", "recompute", "--fluent-within", "inf"], "--fluent-within inf must be a finite"),
])
def test_bad_input_is_one_line(files, argv, needle):
    tokens = [] if "--tokens" in argv else ["--tokens", 100]  # a flag given twice is refused
    code, out, err = run_eval("stream", files["model"], "--text", files["text"], *tokens, *argv, "-q",
                              "-o", files["root"] / "never")
    assert one_line_error(code, err, needle), err
    assert not (files["root"] / "never").exists()


def test_missing_text_is_one_line(files):
    code, out, err = run_eval("stream", files["model"], "--text", files["root"] / "nope.txt", "-q")
    assert one_line_error(code, err, "does not exist")


def test_eager_attention_and_bfloat16_run_the_same_masks(stream):
    eager = tiny_llama(vocab=64, max_positions=32, attn="eager")
    want = house_cache_token_by_token(eager, stream, S, W)
    got = stream_nll(eager, stream, "sinks", window=W, sinks=S, chunk=13)
    torch.testing.assert_close(got.nll, want, atol=ATOL, rtol=0)
    half = tiny_llama(vocab=64, max_positions=32).to(torch.bfloat16)
    low = stream_nll(half, stream, "sinks", window=W, sinks=S, chunk=13)
    assert torch.isfinite(low.nll).all() and (low.nll - want).abs().mean() < 0.05  # bf16 rounding only


@pytest.fixture(scope="module")
def positions_models(tmp_path_factory):
    """A GPT-2 (learned positions, a 64-token context), a Mistral whose layers slide over 8 tokens and a GPT-J whose
    RoPE table holds 16 positions."""
    from transformers import AutoModelForCausalLM, GPT2Config, GPTJConfig, MistralConfig

    root, tok = tmp_path_factory.mktemp("positions"), tokenizer()
    ids = dict(bos_token_id=tok.eos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.eos_token_id)
    configs = {"gpt2": GPT2Config(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=4, n_positions=64, **ids),
               "mistral": MistralConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, sliding_window=8,
                                        **ids),
               "gptj": GPTJConfig(vocab_size=len(tok), n_embd=32, n_layer=1, n_head=4, rotary_dim=4, n_positions=16,
                                  **ids)}
    for name, config in configs.items():
        AutoModelForCausalLM.from_config(config).save_pretrained(root / name)
        tok.save_pretrained(root / name)
    (root / "text.txt").write_text(text(400, seed=4), encoding="utf-8")
    return root


@pytest.mark.parametrize("name,argv,needle", [
    ("gpt2", ["--policy", "dense"], "--policy dense feeds 99 positions but GPT2LMHeadModel's positions end at 64 "
                                    "(no RoPE); lower --tokens to 65 or use --policy recompute"),
    ("gptj", ["--policy", "sinks", "--sinks", 2, "--window", 8, "--chunk", 4],
     "--policy sinks feeds positions up to 21 (about 2 x (sinks + window) + --chunk: the window moves back once it has "
     "grown by sinks + window) but GPTJForCausalLM's positions end at 16 (its RoPE table); lower --sinks, --window "
     "or --chunk"),
    ("gpt2", ["--policy", "recompute", "--window", 60, "--chunk", 16], "--policy recompute feeds 76 positions per "
                                                                        "forward (--window + R) but GPT2LMHeadModel"),
    ("gpt2", ["--policy", "window", "--window", 16], "--policy window keeps a bounded cache whose keys it moves by "
                                                     "RoPE, but GPT2LMHeadModel has no rotary embedding"),
    ("mistral", ["--policy", "sinks", "--sinks", 2, "--window", 16], "MistralForCausalLM's sliding-window layers see "
                                                                      "8; lower --window to 5"),
])
def test_what_a_models_positions_cannot_run_is_refused_before_any_policy(positions_models, name, argv, needle):
    """Before: GPT-2 crashed past its position table (an IndexError) and a Mistral sliding over 8 tokens was scored
    as if it saw 19, its own mask replaced by the cache's."""
    out_dir = positions_models / f"never-{name}"
    code, out, err = run_eval("stream", positions_models / name, "--text", positions_models / "text.txt", "--tokens",
                              100, *argv, "-q", "-o", out_dir)
    assert one_line_error(code, err, needle), err
    assert not out_dir.exists()


def test_recompute_on_a_stream_shorter_than_its_window_runs_within_the_context(positions_models):
    """Its forwards hold min(W + R, tokens - 1) positions: 40 tokens at --window 60 fit a 64-position GPT-2 (they
    were refused by W + R = 76 alone)."""
    code, out, err = run_eval("stream", positions_models / "gpt2", "--text", positions_models / "text.txt", "--tokens",
                              40, "--policy", "recompute", "--window", 60, "--chunk", 16, "-q", "-o",
                              positions_models / "short")
    assert code == 0, err


def test_a_rope_table_model_streams_past_its_table_when_its_positions_fit(positions_models):
    """GPT-J's RoPE is a precomputed table of 16 positions (the bounded caches refused it: no inv_freq): sinks 2 +
    window 6 fed 4 tokens at a time re-base within 16 positions, over a 100-token stream."""
    code, out, err = run_eval("stream", positions_models / "gptj", "--text", positions_models / "text.txt", "--tokens",
                              100, "--policy", "sinks", "--sinks", 2, "--window", 6, "--chunk", 4, "-q", "-o",
                              positions_models / "gptj-sinks")
    assert code == 0, err


def test_a_sliding_window_the_cache_fits_in_is_scored_as_the_model_sees_it(positions_models):
    """Mistral sliding over 8 tokens, sinks 2 + window 5 (8 keys per token): the window never hides a key, and the
    sinks policy equals a recompute of [sinks | window | token] at positions 0..n-1 through the model's own masks."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(positions_models / "mistral", attn_implementation="eager").eval()
    ids = torch.randint(3, 64, (30,), generator=torch.Generator().manual_seed(2))
    want = []
    with torch.no_grad():
        for t in range(29):
            keep = sorted(set(range(min(2, t + 1))) | set(range(max(0, t - 5), t + 1)))
            logits = model(input_ids=ids[keep][None], position_ids=torch.arange(len(keep))[None]).logits[0, -1]
            want.append(-torch.log_softmax(logits.double(), -1)[ids[t + 1]])
    got = stream_nll(model, ids, "sinks", window=5, sinks=2, chunk=4)
    torch.testing.assert_close(got.nll, torch.stack(want), atol=ATOL, rtol=0)
