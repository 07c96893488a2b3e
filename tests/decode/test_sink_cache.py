"""SinkCache / WindowCache (StreamingLLM) against DynamicCache and slow from-scratch references.

Tiny random fp32 Llama (hidden 32, 4 heads, 2 K/V heads, vocab 64), token-by-token unless stated.

Two references. (1) The recompute reference -- run the model with no cache on [sinks | window |
current token] at positions 0..S+W -- equals StreamingLLM only for a ONE-layer model: in deeper
models a cached token's layer-2+ keys were computed from the context it had when it was fed, which a
recompute changes (the paper's "sliding window with re-computation" baseline). (2) For any depth,
`streaming_reference` re-implements the forward in plain torch: each token's per-layer K/V are
computed once and kept un-rotated; token t attends to the sinks, the W tokens before its chunk and
the earlier tokens of its chunk, all placed at consecutive positions 0..n-1.
"""
from __future__ import annotations

import pytest
import torch

from gqakit.hf.compat import cache_kwargs
from gqakit.decode.cache import SinkCache, WindowCache
from gqakit.decode.streaming import _Detokenizer, sample_next, stream_tokens, streaming_generate

ATOL_SAME = 1e-5  # same maths, different cache bookkeeping
ATOL_REF = 1e-4  # against the from-scratch references (different op order)


def tiny_llama(layers: int = 2, attn: str = "sdpa", vocab: int = 64, seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                      pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(seed)
    return LlamaForCausalLM._from_config(cfg, attn_implementation=attn, dtype=torch.float32).eval()



@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def tokens(n: int, seed: int, batch: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 64, (batch, n), generator=g)


def make_cache(sinks: int, window: int, model, mask=None) -> SinkCache:
    if sinks == 0:
        return WindowCache(window, attention_mask=mask)
    return SinkCache(sinks, window, rope=model, attention_mask=mask)


def chunk_starts(total: int, prompt: int) -> list[int]:
    """Prompt as one chunk, then one token at a time (what generate() does)."""
    return [0] + list(range(prompt, total))


@torch.no_grad()
def run_cache(model, ids: torch.Tensor, cache, starts: list[int]) -> torch.Tensor:
    """Feed ids (1, T) in chunks starting at `starts` (model-default positions); logits (T, V)."""
    bounds = starts + [ids.shape[1]]
    out = [model(ids[:, a:b], **cache_kwargs(model, cache), use_cache=True).logits[0]
           for a, b in zip(bounds, bounds[1:])]
    return torch.cat(out)


class StreamingReference:
    """Slow, plain-torch StreamingLLM for one stream (batch 1), fed a token at a time.

    `step(token, chunk_start)` returns that token's logits (V,): it attends to the first `sinks`
    tokens, the `window` tokens before its chunk and the earlier tokens of its chunk, at consecutive
    positions 0..n-1. Per-layer K/V are computed once per token and kept un-rotated (full history).
    """

    def __init__(self, model, sinks: int, window: int):
        self.model, self.sinks, self.window = model, sinks, window
        self.uses_rope = getattr(model.config, "no_rope_layers", None) or [1] * len(model.model.layers)  # SmolLM3
        cfg = model.config
        self.H, self.G = cfg.num_attention_heads, cfg.num_key_value_heads
        self.d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.inv_freq = model.model.rotary_emb.inv_freq.double()
        self.raw_k = [[] for _ in model.model.layers]
        self.raw_v = [[] for _ in model.model.layers]

    def rope(self, x, pos):  # x (..., n, d) rotated to positions pos (n,), rotate-half layout
        angle = pos.double()[:, None] * self.inv_freq[None, :]
        angle = torch.cat([angle, angle], dim=-1)
        d = self.d
        rotated = torch.cat([-x[..., d // 2:], x[..., : d // 2]], dim=-1)
        return x * angle.cos().float() + rotated * angle.sin().float()

    @torch.no_grad()
    def step(self, token: torch.Tensor, chunk_start: int) -> torch.Tensor:
        inner, H, G, d = self.model.model, self.H, self.G, self.d
        t = len(self.raw_k[0])
        kept = sorted(set(range(min(self.sinks, t + 1))) | set(range(max(chunk_start - self.window, 0), t + 1)))
        pos = torch.arange(len(kept))  # in-cache positions
        h = inner.embed_tokens(token.reshape(1))  # (1, hidden)
        for layer, ks, vs, rope in zip(inner.layers, self.raw_k, self.raw_v, self.uses_rope):
            att = layer.self_attn
            x = layer.input_layernorm(h)
            ks.append(att.k_proj(x).view(G, d))
            vs.append(att.v_proj(x).view(G, d))
            q, k = att.q_proj(x).view(H, 1, d), torch.stack([ks[j] for j in kept], dim=1)  # (G, n, d)
            if rope:  # a NoPE layer (SmolLM3's no_rope_layers 0) leaves both unrotated
                q, k = self.rope(q, pos[-1:]), self.rope(k, pos)
            v = torch.stack([vs[j] for j in kept], dim=1)
            k, v = k.repeat_interleave(H // G, dim=0), v.repeat_interleave(H // G, dim=0)  # (H, n, d)
            w = torch.softmax(q @ k.transpose(1, 2) * d ** -0.5, dim=-1)  # (H, 1, n)
            h = h + att.o_proj((w @ v).reshape(1, H * d))
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        return self.model.lm_head(inner.norm(h))[0]


def streaming_reference(model, ids: torch.Tensor, sinks: int, window: int, starts: list[int]) -> torch.Tensor:
    """Reference logits (T, V) for ids (T,) fed in chunks starting at `starts`."""
    ref = StreamingReference(model, sinks, window)
    return torch.stack([ref.step(ids[t], max(s for s in starts if s <= t)) for t in range(ids.shape[0])])


# --------------------------------------------------------------------------------------------
# Everything fits: identical to the default DynamicCache
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("sinks,window", [(4, 40), (0, 44), (2, 41)])
def test_fits_matches_dynamic_cache_stepwise(attn, sinks, window):
    from transformers import DynamicCache

    model = tiny_llama(attn=attn)
    ids = tokens(42, seed=1)  # S + W >= 42 - 1: nothing is ever evicted
    starts = chunk_starts(42, prompt=7)
    want = run_cache(model, ids, DynamicCache(), starts)
    cache = make_cache(sinks, window, model)
    got = run_cache(model, ids, cache, starts)
    torch.testing.assert_close(got, want, atol=ATOL_SAME, rtol=0)
    assert cache.get_seq_length() == 42


@pytest.mark.parametrize("sinks,window", [(4, 40), (0, 44)])
def test_fits_matches_dynamic_cache_generate(model, sinks, window):
    ids = tokens(8, seed=2)
    kw = dict(max_new_tokens=30, do_sample=False, output_logits=True, return_dict_in_generate=True,
              pad_token_id=0)
    want = model.generate(ids, **kw)
    got = model.generate(ids, **cache_kwargs(model, make_cache(sinks, window, model)), **kw)
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=ATOL_SAME, rtol=0)


# --------------------------------------------------------------------------------------------
# Past the window: equal to the references
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("sinks,window", [(2, 6), (0, 7), (4, 3)])
def test_one_layer_matches_recompute_on_sinks_and_window(sinks, window):
    one = tiny_llama(layers=1)
    ids = tokens(40, seed=3)
    got = run_cache(one, ids, make_cache(sinks, window, one), list(range(40)))
    with torch.no_grad():
        for t in range(40):
            evicted = t > sinks + window  # the cache holds min(t, S + W) earlier tokens
            ctx = torch.cat([ids[:, :sinks], ids[:, t - window:t + 1]], dim=1) if evicted else ids[:, :t + 1]
            pos = torch.arange(ctx.shape[1])[None, :]  # in-cache positions 0..S+W
            ref = one(ctx, position_ids=pos).logits[0, -1]
            torch.testing.assert_close(got[t], ref, atol=ATOL_REF, rtol=0, msg=f"token {t}")


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("sinks,window", [(2, 6), (0, 7), (4, 5)])
def test_past_window_matches_streaming_reference_stepwise(attn, sinks, window):
    model = tiny_llama(attn=attn)
    ids = tokens(45, seed=4)
    cache = make_cache(sinks, window, model)
    starts = list(range(45))
    got = run_cache(model, ids, cache, starts)
    want = streaming_reference(model, ids[0], sinks, window, starts)
    torch.testing.assert_close(got, want, atol=ATOL_REF, rtol=0)
    assert cache.layers[0].keys.shape[-2] == sinks + window


@pytest.mark.parametrize("sinks,window", [(2, 6), (0, 7)])
def test_past_window_matches_streaming_reference_in_chunks(model, sinks, window):
    ids = tokens(50, seed=5)
    starts = [0, 5, 9, 21, 22, 30, 31, 47]  # chunks of 5, 4, 12, 1, 8, 1, 16, 3 tokens
    got = run_cache(model, ids, make_cache(sinks, window, model), starts)
    want = streaming_reference(model, ids[0], sinks, window, starts)
    torch.testing.assert_close(got, want, atol=ATOL_REF, rtol=0)


@pytest.mark.parametrize("prompt,prefill_chunk", [(5, None), (20, 6)])
@pytest.mark.parametrize("sinks,window", [(2, 6), (0, 7)])
def test_past_window_generate_matches_streaming_reference(model, sinks, window, prompt, prefill_chunk):
    ids = tokens(prompt, seed=6)
    out = model.generate(ids, **cache_kwargs(model, make_cache(sinks, window, model)), max_new_tokens=30,
                         prefill_chunk_size=prefill_chunk, do_sample=False, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0)
    seq = out.sequences[0]
    prefill = list(range(0, prompt, prefill_chunk or prompt))
    want = streaming_reference(model, seq, sinks, window, prefill + list(range(prompt, len(seq))))
    torch.testing.assert_close(torch.cat(out.logits), want[prompt - 1:-1], atol=ATOL_REF, rtol=0)
    assert torch.equal(want[prompt - 1:-1].argmax(-1), seq[prompt:])


@pytest.mark.parametrize("sinks,window", [(2, 6), (0, 7)])
def test_stream_tokens_rebase_matches_streaming_reference(model, sinks, window):
    prompt = tokens(11, seed=7)
    got = torch.stack(list(stream_tokens(model, prompt, 40, sinks=sinks, window=window, chunk_size=4,
                                         rebase_every=3)))[:, 0]
    assert torch.equal(got, greedy_reference(model, prompt[0], 40, sinks, window, chunk=4))


def greedy_reference(model, prompt: torch.Tensor, steps: int, sinks: int, window: int, chunk: int) -> torch.Tensor:
    """StreamingReference's greedy continuation of `prompt` (T,), read in chunks of `chunk`, then a token at a time."""
    ref = StreamingReference(model, sinks, window)
    logits = [ref.step(prompt[t], t - t % chunk) for t in range(prompt.shape[0])][-1]
    want = []
    for _ in range(steps):
        want.append(logits.argmax())
        logits = ref.step(want[-1], len(ref.raw_k[0]))
    return torch.stack(want)


def tiny_smollm3(uses_rope: list[int]):
    from transformers import SmolLM3Config, SmolLM3ForCausalLM

    cfg = SmolLM3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=len(uses_rope),
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                        no_rope_layers=uses_rope, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    return SmolLM3ForCausalLM._from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()


@pytest.mark.parametrize("uses_rope", [[1, 0], [0, 1]])
@pytest.mark.parametrize("sinks,window", [(2, 6), (0, 7)])
def test_nope_layers_keep_their_keys_where_they_are(uses_rope, sinks, window):
    """SmolLM3's NoPE layers cache keys without RoPE: the sinks of those layers are not moved, nor their windows
    re-based (before, every layer was rotated: 0.03 in NLL off on the review's one-layer model)."""
    model = tiny_smollm3(uses_rope)
    ids = tokens(30, seed=8)
    got = run_cache(model, ids, SinkCache(sinks, window, rope=model), list(range(30)))
    torch.testing.assert_close(got, streaming_reference(model, ids[0], sinks, window, list(range(30))),
                               atol=ATOL_REF, rtol=0)
    prompt = tokens(9, seed=9)
    generated = torch.stack(list(stream_tokens(model, prompt, 25, sinks=sinks, window=window, chunk_size=4,
                                               rebase_every=3)))[:, 0]
    assert torch.equal(generated, greedy_reference(model, prompt[0], 25, sinks, window, chunk=4))


# --------------------------------------------------------------------------------------------
# Left-padded batches: each row as if it were alone
# --------------------------------------------------------------------------------------------

@torch.no_grad()
def run_generate_style(model, prompt, mask, cont, cache) -> torch.Tensor:
    """Feed a (B, Tp) prompt in one chunk then `cont` one token at a time with generate()'s growing
    2D mask and cumsum position ids; logits (B, T, V)."""
    seq = torch.cat([prompt, cont], dim=1)
    full_mask = torch.cat([mask, torch.ones_like(cont)], dim=1)
    pos = (full_mask.cumsum(-1) - 1).clamp(min=0)
    bounds = chunk_starts(seq.shape[1], prompt.shape[1]) + [seq.shape[1]]
    return torch.cat([model(seq[:, a:b], attention_mask=full_mask[:, :b], position_ids=pos[:, a:b],
                            **cache_kwargs(model, cache), use_cache=True).logits
                      for a, b in zip(bounds, bounds[1:])], dim=1)


def left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return ids, mask


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("sinks,window", [(2, 6), (0, 7), (3, 4)])
@pytest.mark.parametrize("lengths", [(3, 7), (12, 20), (9, 2)])
def test_left_padded_batch_matches_rows_alone(attn, sinks, window, lengths):
    model = tiny_llama(attn=attn)
    rows = [tokens(n, seed=10 + i)[0] for i, n in enumerate(lengths)]
    cont = tokens(20, seed=20, batch=2)  # fed after the prompt: rows evict at different steps
    prompt, mask = left_pad(rows)
    batch = run_generate_style(model, prompt, mask, cont, make_cache(sinks, window, model, mask))
    for i, row in enumerate(rows):
        alone = run_generate_style(model, row[None], torch.ones(1, len(row), dtype=torch.long), cont[i:i + 1],
                                   make_cache(sinks, window, model))
        pad = prompt.shape[1] - len(row)
        torch.testing.assert_close(batch[i, pad:], alone[0], atol=ATOL_REF, rtol=0, msg=f"row {i}")


@pytest.mark.parametrize("sinks,window", [(2, 6), (0, 7)])
def test_left_padded_generate_matches_rows_alone(model, sinks, window):
    rows = [tokens(4, seed=30)[0], tokens(10, seed=31)[0]]
    prompt, mask = left_pad(rows)
    kw = dict(max_new_tokens=20, do_sample=False, output_logits=True, return_dict_in_generate=True,
              pad_token_id=0)
    cache = make_cache(sinks, window, model, mask)
    out = model.generate(prompt, attention_mask=mask, **cache_kwargs(model, cache), **kw)
    for i, row in enumerate(rows):
        alone = model.generate(row[None], **cache_kwargs(model, make_cache(sinks, window, model)), **kw)
        n = alone.sequences.shape[1] - len(row)  # the row alone stops at its EOS
        assert n >= 5 and torch.equal(out.sequences[i, prompt.shape[1]:][:n], alone.sequences[0, len(row):])
        torch.testing.assert_close(torch.stack(out.logits)[:n, i], torch.stack(alone.logits)[:, 0],
                                   atol=ATOL_REF, rtol=0)


def test_left_padded_stream_tokens_match_rows_alone(model):
    rows = [tokens(3, seed=40)[0], tokens(14, seed=41)[0]]
    prompt, mask = left_pad(rows)
    kw = dict(sinks=2, window=6, chunk_size=14, rebase_every=5)  # prompt in one chunk in both runs
    batch = torch.stack(list(stream_tokens(model, prompt, 25, attention_mask=mask, **kw)))
    for i, row in enumerate(rows):
        alone = torch.stack(list(stream_tokens(model, row[None], 25, **kw)))
        assert torch.equal(batch[:, i], alone[:, 0])


# --------------------------------------------------------------------------------------------
# Constant memory over a long stream
# --------------------------------------------------------------------------------------------

@torch.no_grad()
def test_memory_constant_over_20k_tokens(model):
    # Token-by-token through 20k steps would take minutes on 2 slow cores: feed chunks of 64 and
    # decode single tokens at a few points; the cache's bound does not depend on the chunk size.
    sinks, window, chunk = 4, 60, 64
    cache = SinkCache(sinks, window, rope=model)
    stream = tokens(20_000, seed=50)
    for start in range(0, 20_000, chunk):
        model(stream[:, start:start + chunk], **cache_kwargs(model, cache), use_cache=True)
        if start % 4096 == 0:
            for _ in range(3):
                model(tokens(1, seed=start), **cache_kwargs(model, cache), use_cache=True)
        for layer in cache.layers:
            assert layer.keys.shape[-2] <= sinks + window and layer.values.shape[-2] <= sinks + window
    assert cache.get_seq_length() == 20_000 + 3 * 5
    assert cache.cache_bytes() == 2 * 2 * 2 * (sinks + window) * 8 * 4  # K+V, layers, G, S+W, d, fp32


def test_stream_tokens_long_prompt_bounded_positions(model):
    sinks, window, chunk = 4, 28, 64
    prompt = tokens(20_000, seed=51)
    cache = SinkCache(sinks, window, rope=model, attention_mask=torch.ones_like(prompt))
    out = list(stream_tokens(model, prompt, 50, sinks=sinks, window=window, chunk_size=chunk, cache=cache))
    assert len(out) == 50
    assert all(layer.keys.shape[-2] == sinks + window for layer in cache.layers)
    next_pos = int(cache.position_ids(1).max())  # rebased: far below the 20,050 columns seen
    assert next_pos < 2 * (sinks + window) + chunk


# --------------------------------------------------------------------------------------------
# Sampling, text streaming, bad input
# --------------------------------------------------------------------------------------------

def test_sampling_is_seeded_and_top_p_narrows(model):
    prompt = tokens(6, seed=60)
    kw = dict(sinks=2, window=6, do_sample=True, temperature=1.3, top_p=0.9)
    a = torch.stack(list(stream_tokens(model, prompt, 20, seed=1, **kw)))
    b = torch.stack(list(stream_tokens(model, prompt, 20, seed=1, **kw)))
    assert torch.equal(a, b)
    logits = torch.randn(3, 64)
    g = torch.Generator().manual_seed(0)
    assert torch.equal(sample_next(logits, True, 1.0, 1e-6, g), logits.argmax(-1))


def test_streaming_generate_text_pieces_join_to_the_decoded_tokens():
    from gqakit.reference.tokenizer import train_bpe

    tok = train_bpe(["It is a truth universally acknowledged, café — naïve élan. " * 20], vocab_size=300)
    model = tiny_llama(vocab=len(tok))
    prompt = torch.tensor([tok.encode("It is a truth")])
    kw = dict(sinks=2, window=6, do_sample=True, seed=3, eos_token_id=None)
    pieces = list(streaming_generate(model, tok, prompt, 60, **kw))
    ids = torch.stack(list(stream_tokens(model, prompt, 60, **kw)))[:, 0].tolist()
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=True)


def test_detokenizer_holds_back_split_characters():
    class Bytes:  # one byte per token, decoded as UTF-8
        @staticmethod
        def decode(ids, skip_special_tokens=True):
            return bytes(ids).decode("utf-8", errors="replace")

    detok = _Detokenizer(Bytes())
    text = "naïve – ok"
    assert "".join(detok.push(b) for b in text.encode("utf-8")) == text


@pytest.mark.parametrize("make,match", [
    (lambda m: SinkCache(-1, 8, rope=m), "sinks must be an int >= 0"),
    (lambda m: SinkCache(4, 0, rope=m), "window must be an int >= 1"),
    (lambda m: WindowCache(-3), "window must be an int >= 1"),
    (lambda m: SinkCache(4, 8), "pass rope=model"),
    (lambda m: SinkCache(2, 8, rope=m, attention_mask=torch.tensor([[1, 1, 0]])), "padding_side='left'"),
    (lambda m: list(stream_tokens(m, tokens(3, 0), 5, temperature=0.0)), "temperature must be > 0"),
    (lambda m: list(stream_tokens(m, tokens(3, 0), 5, sinks=-2)), "sinks must be an int >= 0"),
])
def test_bad_input(model, make, match):
    with pytest.raises(ValueError, match=match) as err:
        make(model)
    assert "\n" not in str(err.value)


def test_wrong_batch_is_refused(model):
    cache = SinkCache(2, 6, rope=model, attention_mask=torch.ones(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="built for batch 2"):
        model(tokens(4, 0), **cache_kwargs(model, cache), use_cache=True)
