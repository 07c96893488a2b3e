"""Long-context fluency (StreamingLLM's evaluation) and `gqakit eval stream`.

Feed a long text and score every next token with a KV-cache policy, C tokens per forward:

    dense      the full cache (DynamicCache); memory grows with the stream, positions go past the
               trained context (where models usually break down)
    window     the W most recent tokens only (a rolling window)
    sinks      S attention sinks (the first S tokens) + the W most recent (StreamingLLM)
    recompute  every R tokens (R = `recompute_every`, default C), rebuild from scratch on the W tokens
               before the block plus the block: token t sees W to W + R - 1 earlier tokens, all of them
               encoded with a fresh context. R = 1 is the paper's per-token "sliding window with
               re-computation" (cost about W + 1 token-forwards per token); the quality reference.

Chunking never changes a number (recompute: for a given R): per token, every policy equals feeding the stream one token
at a time (dense: causal attention is causal; window / sinks: `stream_cache.ChunkedSinkCache` shows each token exactly
what a SinkCache / WindowCache fed token by token shows it; recompute: blocks are independent forwards, batched up
to C // R rows). The tests check all four against C = 1.

Results per policy: per-token NLL, perplexity per position bucket and overall, peak bytes of cached
K/V, tokens per second. With recompute in the same run, each other policy gets a fluency verdict: its
worst bucket (largest perplexity ratio to recompute over the same tokens) within `fluent_within`
(default 10%) is "fluent", else "not fluent".
"""
from __future__ import annotations

import dataclasses
import difflib
import math
import sys
import time

import torch
from tqdm.auto import tqdm

from gqakit.common.errors import GqakitError, opt
from gqakit.common.options import each_once, options_given
from gqakit.evaluate.options import StreamConfig, check_text_column
from gqakit.hf.architectures.latent import is_latent
from gqakit.decode.stream_cache import ChunkedSinkCache
from gqakit.hf.compat import cache_kwargs

POLICIES = ("dense", "window", "sinks", "recompute")
RECOMPUTE_TOKENS = 32_768  # most tokens per recompute forward (rows x length), to bound activation memory


@dataclasses.dataclass
class StreamResult:
    """Per-token NLL of targets 1..n-1 (nll[i] scores token i + 1) and the cost of getting it."""

    policy: str
    nll: torch.Tensor  # (n - 1,) float64
    seconds: float
    peak_cache_bytes: int


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        close = difflib.get_close_matches(policy, POLICIES, n=1)
        hint = f"; did you mean '{close[0]}'?" if close else ""
        quoted = f"'{policy}'"
        raise GqakitError(f"unknown {opt('policies', quoted)}{hint} (choose from {', '.join(POLICIES)})")
    return policy


def _score(nll: torch.Tensor, logits: torch.Tensor, ids: torch.Tensor, first: int) -> None:
    """Write the NLL of the tokens that logits (q, V) predict (ids[first + 1 :]) into nll[first :]."""
    targets = ids[first + 1 : first + 1 + logits.shape[0]]  # the last token of the stream predicts nothing
    logp = torch.log_softmax(logits[: targets.numel()].float(), dim=-1)
    nll[first : first + targets.numel()] = -logp.gather(-1, targets[:, None].to(logp.device))[:, 0].double().cpu()


def _cache_bytes(cache) -> int:
    return sum(t.numel() * t.element_size() for layer in cache.layers if layer.is_initialized
               for t in (layer.keys, layer.values))


@torch.no_grad()
def _cached(model, ids: torch.Tensor, policy: str, window: int, sinks: int, chunk: int,
            rebase_every: int | None, progress: bool) -> tuple[torch.Tensor, int]:
    from transformers import DynamicCache

    device, dtype = next(model.parameters()).device, next(model.parameters()).dtype
    n = ids.numel()
    nll = torch.zeros(n - 1, dtype=torch.float64)
    if policy == "dense":
        cache = DynamicCache()
    else:
        try:  # the cache measures how the model's keys rotate (rope_probe), or refuses
            cache = ChunkedSinkCache(sinks if policy == "sinks" else 0, window, rope=model, rebase_every=rebase_every)
        except ValueError as e:
            raise GqakitError(str(e)) from None
    peak = 0
    for a in tqdm(range(0, n - 1, chunk), desc=policy, unit="chunk", disable=not progress, leave=False):
        piece = ids[a : min(a + chunk, n - 1)].to(device)[None]  # (1, q); the last token needs no forward
        kwargs = {}
        if policy != "dense":
            kwargs["position_ids"], kwargs["attention_mask"] = cache.prepare(piece.shape[1], dtype, device)
        logits = model(input_ids=piece, **cache_kwargs(model, cache), use_cache=True, **kwargs).logits[0]  # (q, V)
        _score(nll, logits, ids, a)
        stored = _cache_bytes(cache) if policy == "dense" else cache.cache_bytes()
        peak = max(peak, stored)
    return nll, peak


@torch.no_grad()
def _recompute(model, ids: torch.Tensor, window: int, every: int, chunk: int, progress: bool
               ) -> tuple[torch.Tensor, int]:
    """Blocks [b, b + R) of queries, each a fresh forward over [b - W, b + R); equal-shape blocks batched."""
    from gqakit.hf.loading import kv_bytes_per_token, model_dtype

    device = next(model.parameters()).device
    n = ids.numel()
    nll = torch.zeros(n - 1, dtype=torch.float64)
    blocks = [(max(0, b - window), b, min(b + every, n - 1)) for b in range(0, n - 1, every)]  # (ctx, b, end)
    longest = max(e - c for c, _, e in blocks)
    rows_per_forward = max(1, min(chunk // every, RECOMPUTE_TOKENS // longest))
    groups: list[list[tuple[int, int, int]]] = []
    for block in blocks:
        shape = (block[2] - block[0], block[2] - block[1])  # (input length, queries)
        last = groups[-1] if groups else None
        if last and len(last) < rows_per_forward and (last[0][2] - last[0][0], last[0][2] - last[0][1]) == shape:
            last.append(block)
        else:
            groups.append([block])
    for group in tqdm(groups, desc="recompute", unit="forward", disable=not progress, leave=False):
        batch = torch.stack([ids[c:e] for c, _, e in group]).to(device)  # (rows, L), fresh positions 0..L-1
        queries = group[0][2] - group[0][1]
        logits = model(input_ids=batch, use_cache=False, logits_to_keep=queries).logits  # (rows, q, V)
        for row, (_, b, _) in enumerate(group):
            _score(nll, logits[row], ids, b)
    return nll, longest * kv_bytes_per_token(model.config, model_dtype(model), longest)


def stream_nll(model, ids: torch.Tensor, policy: str, *, window: int = 1020, sinks: int = 4, chunk: int = 256,
               recompute_every: int | None = None, rebase_every: int | None = None,
               progress: bool = False) -> StreamResult:
    """Per-token NLL of the 1-D stream `ids` under `policy`, fed `chunk` tokens per forward (batch 1).

    `peak_cache_bytes`: the most K/V bytes the policy held between forwards (dense, window, sinks), or
    one block's K/V (W + R tokens) for recompute, which keeps no cache.
    """
    check_policy(policy)
    if ids.dim() != 1 or ids.numel() < 2:
        raise ValueError(f"ids must be 1-D with at least 2 tokens, got shape {tuple(ids.shape)}")
    for name, value in (("window", window), ("chunk", chunk)):
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
    if sinks < 0:
        raise ValueError(f"sinks must be >= 0, got {sinks}")
    t0 = time.perf_counter()
    if policy == "recompute":
        every = recompute_every or chunk
        if every < 1:
            raise ValueError(f"recompute_every must be >= 1, got {every}")
        nll, peak = _recompute(model, ids, window, every, chunk, progress)
    else:
        nll, peak = _cached(model, ids, policy, window, sinks, chunk, rebase_every, progress)
    return StreamResult(policy, nll, time.perf_counter() - t0, peak)


def bucketize(nll: torch.Tensor, size: int) -> list[dict]:
    """Perplexity per bucket of `size` stream positions; nll[i] is the token at position i + 1."""
    positions = torch.arange(1, nll.numel() + 1)
    out = []
    for start in range(0, nll.numel() + 1, size):
        pick = (positions >= start) & (positions < start + size)
        count = int(pick.sum())
        if count:
            total = float(nll[pick].sum())
            out.append({"start": start, "end": min(start + size, nll.numel() + 1), "tokens": count,
                        "nll": total, "perplexity": math.exp(total / count)})
    return out


def fluency(buckets: list[dict], reference: list[dict], within: float) -> dict:
    """The bucket with the largest perplexity ratio to the reference, and the verdict."""
    ratios = [b["perplexity"] / r["perplexity"] for b, r in zip(buckets, reference)]
    worst = max(range(len(ratios)), key=ratios.__getitem__)
    b, r = buckets[worst], reference[worst]
    verdict = "fluent" if ratios[worst] <= 1 + within else "not fluent"
    return {"verdict": verdict, "worst_bucket": [b["start"], b["end"]], "perplexity": b["perplexity"],
            "reference_perplexity": r["perplexity"], "ratio": ratios[worst], "within": within,
            "summary": f"{verdict}: worst bucket {b['start']:,}-{b['end'] - 1:,} perplexity {b['perplexity']:.3f} "
                       f"vs recompute {r['perplexity']:.3f} ({100 * (ratios[worst] - 1):+.1f}%; "
                       f"limit +{100 * within:.0f}%)"}


# ---------------------------------------------------------------------------------------------
# `gqakit eval stream MODEL --text FILE --tokens N --policy P [--policy P ...]`
# ---------------------------------------------------------------------------------------------

def _check(cfg: StreamConfig) -> tuple[str, ...]:
    policies = tuple(each_once([check_policy(p) for p in cfg.policies], opt("policies")))  # once each, in order
    if not policies:
        raise GqakitError(f"give at least one {opt('policies')} (dense, window, sinks, recompute)")
    for name, least in (("tokens", 2), ("window", 1), ("chunk", 1), ("recompute_every", 1), ("bucket", 1)):
        value = getattr(cfg, name)
        if value is not None and value < least:
            raise GqakitError(f"{opt(name)} must be at least {least}, got {value}")
    if cfg.sinks < 0:
        raise GqakitError(f"{opt('sinks')} must be >= 0, got {cfg.sinks}; use {opt('policies', 'window')} for no "
                          "sinks")
    check_text_column(cfg.text_column, cfg.dataset)
    if cfg.recompute_every is not None and "recompute" not in policies:
        raise GqakitError(f"{opt('recompute_every')} is how often {opt('policies', 'recompute')} rebuilds; add it "
                          f"to {opt('policies')} or drop {opt('recompute_every')}")
    given = options_given(cfg, cfg.given)
    for name, readers in (("sinks", ("sinks",)), ("window", ("window", "sinks", "recompute"))):
        if name in given and not set(readers) & set(policies):
            raise GqakitError(f"{opt(name)} is read by {opt('policies', ' / '.join(readers))} only, and none of "
                              f"them runs; add one to {opt('policies')} or drop {opt(name)}")
    if "fluent_within" in given and ("recompute" not in policies or len(policies) < 2):
        raise GqakitError(f"{opt('fluent_within')} judges another policy against {opt('policies', 'recompute')}, "
                          f"and {opt('policies', ','.join(policies))} gives no such pair; add both or drop "
                          f"{opt('fluent_within')}")
    if not cfg.fluent_within > 0:  # not finite: refused by the options' own check
        raise GqakitError(f"{opt('fluent_within')} must be a finite fraction > 0 (e.g. 0.1 for 10%), got "
                          f"{cfg.fluent_within}")
    return policies


def _check_model(model, policies: tuple[str, ...], cfg: StreamConfig, tokens: int) -> None:
    """Refuse, before any policy runs, a policy this model cannot run exactly: the bounded ones (window, sinks) move
    keys by RoPE, which the model's keys must follow (measured, `rope_probe`) and which must see what the model's own
    sliding windows would let it; no policy may feed positions past those a model has (learned positions, or a
    precomputed RoPE table as GPT-J's, end at its context)."""
    from gqakit.decode.rope import positions_end, rope_tables
    from gqakit.decode.rope_probe import measure_rotation
    from gqakit.decode.stream_cache import positions_needed

    name, full = type(model).__name__, f"use {opt('policies', 'dense')} or {opt('policies', 'recompute')}"
    context = positions_end(model)
    if context:
        ends = f"{name}'s positions end at {context:,} ({'its RoPE table' if rope_tables(model) else 'no RoPE'})"
        fed = tokens - 1  # the last token is not fed; recompute's forwards hold W + R of them at most
        longest = min(cfg.window + (cfg.recompute_every or cfg.chunk), fed)
        if "dense" in policies and fed > context:
            raise GqakitError(f"{opt('policies', 'dense')} feeds {fed:,} positions but {ends}; lower {opt('tokens')} "
                              f"to {context + 1 - cfg.bos:,} or use {opt('policies', 'recompute')}")
        if "recompute" in policies and longest > context:
            raise GqakitError(f"{opt('policies', 'recompute')} feeds {longest:,} positions per forward "
                              f"({opt('window')} + R) but {ends}; lower {opt('window')} or {opt('recompute_every')} "
                              f"(R, default {opt('chunk')})")
    bounded = [p for p in policies if p in ("sinks", "window")]
    if not bounded:
        return
    moves = f"{opt('policies', bounded[0])} keeps a bounded cache whose keys it moves by RoPE"
    if is_latent(model.config):
        raise GqakitError(f"{moves}, and a latent-attention model ({name}) caches them beside its latent; {full}")
    try:
        rotation = measure_rotation(model)  # once: both policies move the same keys
    except ValueError as e:
        raise GqakitError(f"{moves}, but {str(e).split(';')[0]}; {full}") from None
    narrow = rotation.narrowest_window()
    for policy in bounded:
        sinks = cfg.sinks if policy == "sinks" else 0
        needed = positions_needed(sinks, cfg.window, cfg.chunk, tokens)
        if rotation.positions is not None and needed > rotation.positions:
            raise GqakitError(f"{opt('policies', policy)} feeds positions up to {needed - 1:,} (about 2 x (sinks + "
                              f"window) + {opt('chunk')}: the window moves back once it has grown by sinks + window) "
                              f"but {ends}; lower {opt('sinks')}, {opt('window')} or {opt('chunk')}")
        if narrow is not None and narrow[1] < sinks + cfg.window + 1:
            width = narrow[1]
            fix = (f"lower {opt('window')} to {width - 1 - sinks:,}" if width - 1 - sinks >= 1 else
                   f"lower {opt('sinks')}")
            raise GqakitError(f"{opt('policies', policy)} keeps a bounded cache whose keys it moves by RoPE and shows "
                              f"each token {sinks + cfg.window + 1:,} keys, but {name}'s sliding-window layers see "
                              f"{width:,}; {fix} or {full}")


def _table(cfg: StreamConfig, summary: dict) -> str:
    lines = ["| policy | perplexity | highest bucket perplexity | peak cache bytes | tokens/s | fluency vs recompute |",
             "|---|---|---|---|---|---|"]
    for name, s in summary.items():
        verdict = s["fluency"]["summary"] if s.get("fluency") else ("reference" if name == "recompute" else "-")
        worst = max(b["perplexity"] for b in s["buckets"])
        lines.append(f"| {name} | {s['perplexity']:.3f} | {worst:.3f} | {s['peak_cache_bytes']:,} | "
                     f"{s['tokens_per_s']:,.1f} | {verdict} |")
    return "\n".join(lines)


def run_stream(cfg: StreamConfig, command: str = "", out=None) -> dict:
    """Stream the text under every policy; print a table, write the report; returns the results dict."""
    from gqakit.common import plots, report
    from gqakit.common.fitted import refuse_fitted_text
    from gqakit.common.text import encode_documents, load_documents
    from gqakit.hf.loading import describe, load_model

    out = out or sys.stdout
    policies = _check(cfg)
    target = report.prepare_for(cfg, "stream")
    fitted = refuse_fitted_text([cfg.model], cfg)
    documents = load_documents(cfg.text, cfg.dataset, cfg.text_column)
    model, tok = load_model(cfg.model, cfg.dtype, cfg.tokenizer, cfg.device)
    if getattr(model.config, "_attn_implementation", "sdpa") not in ("sdpa", "eager"):
        model.set_attn_implementation("sdpa")  # the chunk masks are 4-D additive masks
    ids = encode_documents(documents, tok, cfg.tokens)
    if ids.numel() < cfg.tokens:
        raise GqakitError(f"the text has only {ids.numel():,} tokens; pass a longer text or {opt('tokens')} <= "
                          f"{ids.numel()}")
    if cfg.bos:
        bos = tok.bos_token_id if tok.bos_token_id is not None else model.config.bos_token_id
        if bos is None:
            raise GqakitError(f"{opt('bos')}: neither the tokenizer nor config.json names a BOS token; drop "
                              f"{opt('bos')}")
        ids = torch.cat([torch.tensor([int(bos)]), ids])
    _check_model(model, policies, cfg, ids.numel())
    size = cfg.bucket or max(1, math.ceil(ids.numel() / 32))
    every = cfg.recompute_every or cfg.chunk
    summary: dict[str, dict] = {}
    for policy in policies:
        result = stream_nll(model, ids, policy, window=cfg.window, sinks=cfg.sinks, chunk=cfg.chunk,
                            recompute_every=every, progress=cfg.progress)
        total = float(result.nll.sum())
        summary[policy] = {"perplexity": math.exp(total / result.nll.numel()), "nll": total,
                           "scored_tokens": result.nll.numel(), "seconds": round(result.seconds, 3),
                           "tokens_per_s": result.nll.numel() / max(result.seconds, 1e-9),
                           "peak_cache_bytes": result.peak_cache_bytes, "buckets": bucketize(result.nll, size)}
        print(f"  {policy}: perplexity {summary[policy]['perplexity']:.3f} ({result.seconds:.1f}s)",
              file=out, flush=True)
    if "recompute" in summary:
        for policy, s in summary.items():
            if policy != "recompute":
                s["fluency"] = fluency(s["buckets"], summary["recompute"]["buckets"], cfg.fluent_within)
    print(_table(cfg, summary), file=out)
    if "recompute" not in summary:
        print("(no fluency verdict: add --policy recompute to compare against the recompute reference)", file=out)
    info = describe(model)
    record = {"model": info, "stream_tokens": ids.numel(), "bucket": size, "recompute_every": every,
              "fitted_text": fitted, "policies": summary}
    rows = [{"policy": p, "bucket_start": b["start"], "bucket_end": b["end"], "tokens": b["tokens"], "nll": b["nll"],
             "perplexity": b["perplexity"]} for p, s in summary.items() for b in s["buckets"]]
    marks = {}
    if any(p in summary for p in ("window", "sinks", "recompute")):
        marks["cache S+W" if "sinks" in summary else "window W"] = cfg.window + (cfg.sinks if "sinks" in summary else 0)
    if info["max_position_embeddings"] and info["max_position_embeddings"] < ids.numel():
        marks["trained context"] = info["max_position_embeddings"]
    curves = {p: s["buckets"] for p, s in summary.items()}
    written = report.write_report(
        target, kind="stream", command=command, config={**report.config_of(cfg), "recompute_every": every},
        results=record, rows=rows, force=cfg.force, default=not cfg.output,
        plots={"ppl_vs_position.png": lambda p: plots.ppl_vs_position(curves, p, marks)})
    print(f"wrote {written}", file=out)
    return record
