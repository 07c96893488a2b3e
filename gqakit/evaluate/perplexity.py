"""Token-weighted strided perplexity (the transformers documentation's method) and `gqakit eval ppl`.

The text is cut into windows that start every `stride` tokens; each window runs the model once and
scores only the tokens that no earlier window scored, so every scored token is scored exactly once,
with the context its window gives it (up to `max_length - stride` earlier tokens when windows overlap).
Perplexity is exp(total NLL / scored tokens): token-weighted, not an average of window perplexities.

BOS convention (`bos=None`, the default, as in the transformers docs): a window is `max_length` text
tokens; the first window scores all but its first token, so the very first token of the text is never
scored, and with `stride == max_length` (disjoint windows) the first token of *every* window is not
scored either (it has no context). With `bos=ID`: a window is BOS + `max_length - 1` text tokens (the
model still sees at most `max_length` positions) and the first text token of a window is scored too,
conditioned on BOS alone; so every text token is scored exactly once, for any stride <= max_length - 1.
"""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from gqakit.attention.kinds import DEFAULT, command_attention_options, position_bias_refusal
from gqakit.common.errors import GqakitError, opt
from gqakit.evaluate.kvcache import (DEFAULT_CHUNK, GROUP, chunked_window_nll, feed_pieces, report_fields,
                                     residual_length)
from gqakit.evaluate.options import PplConfig, check_text_column
from gqakit.evaluate.spread import bootstrap_interval, window_spread


@dataclasses.dataclass
class Scored:
    """What one model scored: summed NLL (nats) and count of scored tokens, and the same per window (one forward:
    a strided window, a span-corrupted window, an input/target row), in order; with a `--kv-cache`, the bytes per
    token that the cache held after the first (full-length) window."""

    nll: float
    count: int
    window_nll: list[float]
    window_tokens: list[int]
    kv_bytes_held_per_token: float | None = None
    kv_bytes_held_decoding: tuple[float, float] | None = None  # (mean, max) over the decoding steps after it


@torch.no_grad()
def strided_windows(model, input_ids: torch.Tensor, max_length: int, stride: int | None = None,
                    progress: bool = True, bos: int | None = None, kv_cache: str | None = None,
                    kv_chunk: int | None = None) -> Scored:
    """`strided_nll` window by window. With `kv_cache` (dense, fp8, int4, int2), each window is fed through a
    fresh cache of that kind in chunks of `kv_chunk` tokens (`kvcache.chunked_window_nll`) instead of one forward."""
    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must be 1-D, got shape {tuple(input_ids.shape)}")
    lead = 0 if bos is None else 1  # the BOS column in front of each window
    span = max_length - lead  # text tokens per window
    if span < 1:
        raise ValueError(f"max_length {max_length} leaves no text token per window")
    stride = span if stride is None else stride
    if not 0 < stride <= span:
        raise ValueError(f"stride {stride} must be in 1..{span} (text tokens per window)")
    n = input_ids.numel()
    if n < 2 - lead:
        raise ValueError(f"text has {n} token(s); perplexity needs at least {2 - lead}")
    device = next(model.parameters()).device
    prefix = torch.full((lead,), -1 if bos is None else bos, dtype=input_ids.dtype)
    total, count, prev_end = 0.0, 0, 0
    window_nll, window_tokens, held, decoding = [], [], None, None
    starts = range(0, n, stride)
    if kv_cache is not None:  # a window too short for whole groups is refused before any window is scored
        last_begin = -(-max(n - span, 0) // stride) * stride  # the first window that reaches the text's end
        shortest = lead + n - last_begin  # every earlier window is a full one
        try:
            feed_pieces(shortest, kv_chunk or DEFAULT_CHUNK, kv_cache)
        except GqakitError:
            raise GqakitError(f"{opt('kv_cache', kv_cache)} quantizes a window's first tokens at once, in groups of "
                              f"{GROUP} tokens, and the text's last window holds {shortest}; choose "
                              f"{opt('max_length')} or {opt('max_tokens')} so that it holds at least {GROUP}") from None
    for begin in tqdm(starts, desc="perplexity", unit="window", disable=not progress, leave=False):
        end = min(begin + span, n)
        window = torch.cat([prefix, input_ids[begin:end]]).to(device)[None]  # (1, lead + end - begin)
        # Targets are text indices j in [first, end) not scored before; without BOS a window's own first
        # token has no context. Text index j sits in column j - begin + lead, predicted by the column before.
        first = max(prev_end, begin + 1 - lead)
        if first < end and kv_cache is not None:
            nll, scored, per_token, after = chunked_window_nll(model, window, first - begin + lead,
                                                               kv_chunk or DEFAULT_CHUNK, kv_cache, held is None)
            if held is None:  # the first window, a full one
                held, decoding = per_token, after
            total += nll
            count += scored
            window_nll.append(nll)
            window_tokens.append(scored)
        elif first < end:
            logits = model(input_ids=window, logits_to_keep=end - first + 1).logits[0, :-1].float()  # (end - first, V)
            logp = torch.log_softmax(logits, dim=-1)
            targets = input_ids[first:end].to(device)
            summed = logp.gather(-1, targets[:, None]).sum().item()
            total -= summed
            count += end - first
            window_nll.append(-summed)
            window_tokens.append(end - first)
        prev_end = end
        if end == n:
            break
    return Scored(total, count, window_nll, window_tokens, held, decoding)


def strided_nll(model, input_ids: torch.Tensor, max_length: int, stride: int | None = None,
                progress: bool = True, bos: int | None = None) -> tuple[float, int]:
    """Summed negative log-likelihood (nats) and the number of scored tokens of a 1-D token tensor.

    `max_length` counts the model's input positions (BOS included when `bos` is given); `stride`
    defaults to the text tokens per window (disjoint windows). See the module docstring.
    """
    scored = strided_windows(model, input_ids, max_length, stride, progress, bos)
    return scored.nll, scored.count


@torch.no_grad()
def span_corruption_windows(model, input_ids: torch.Tensor, window: int, tokenizer, seed: int = 0,
                            batch_size: int = 8, progress: bool = True) -> Scored:
    """`span_corruption_nll` window by window (a window = one corrupted row)."""
    from gqakit.common.span_corruption import corrupt_rows, sentinel_ids
    from gqakit.common.text import eos_id

    if input_ids.dim() != 1:
        raise ValueError(f"input_ids must be 1-D, got shape {tuple(input_ids.shape)}")
    rows = input_ids[: input_ids.numel() // window * window].view(-1, window)
    if not len(rows):
        raise ValueError(f"text has {input_ids.numel()} token(s), fewer than one window of {window}")
    sentinels, eos = sentinel_ids(tokenizer), eos_id(tokenizer)
    device = next(model.parameters()).device
    total, count, window_nll, window_tokens = 0.0, 0, [], []
    starts = range(0, len(rows), batch_size)
    for b in tqdm(starts, desc="perplexity", unit="batch", disable=not progress, leave=False):
        inputs, targets = (t.to(device) for t in corrupt_rows(rows[b : b + batch_size], sentinels, eos, seed))
        logits = model(input_ids=inputs, labels=targets).logits.float()
        total += torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten(), reduction="sum").item()
        count += targets.numel()
        per_row = torch.nn.functional.cross_entropy(logits.transpose(1, 2), targets, reduction="none")  # (B, T)
        window_nll.extend(per_row.sum(dim=1).tolist())
        window_tokens.extend([targets.shape[1]] * targets.shape[0])
    return Scored(total, count, window_nll, window_tokens)


def span_corruption_nll(model, input_ids: torch.Tensor, window: int, tokenizer, seed: int = 0,
                        batch_size: int = 8, progress: bool = True) -> tuple[float, int]:
    """An encoder-decoder's summed NLL (nats) and count of target tokens under T5's span corruption: the text cut
    into disjoint windows of `window` tokens (a shorter tail is dropped), each corrupted with masks that depend on
    its tokens and `seed` only (`common.span_corruption.corrupt_rows`, with the tokenizer's sentinels and EOS),
    every target token scored (sentinels and EOS included), given the corrupted input and the earlier targets."""
    scored = span_corruption_windows(model, input_ids, window, tokenizer, seed, batch_size, progress)
    return scored.nll, scored.count


@torch.no_grad()
def pair_windows(model, pairs: list[tuple[torch.Tensor, torch.Tensor]], progress: bool = True) -> Scored:
    """`pair_nll` pair by pair (a window = one pair)."""
    device = next(model.parameters()).device
    total, count, window_nll, window_tokens = 0.0, 0, [], []
    for inputs, targets in tqdm(pairs, desc="perplexity", unit="pair", disable=not progress, leave=False):
        logits = model(input_ids=inputs[None].to(device), labels=targets[None].to(device)).logits[0].float()
        nll = torch.nn.functional.cross_entropy(logits, targets.to(device), reduction="sum").item()
        total += nll
        count += targets.numel()
        window_nll.append(nll)
        window_tokens.append(targets.numel())
    return Scored(total, count, window_nll, window_tokens)


def pair_nll(model, pairs: list[tuple[torch.Tensor, torch.Tensor]], progress: bool = True) -> tuple[float, int]:
    """An encoder-decoder's summed NLL (nats) and count of target tokens over (input ids, target ids) pairs: each
    target scored token by token given its input and its earlier tokens, one pair per forward."""
    scored = pair_windows(model, pairs, progress)
    return scored.nll, scored.count


def encode_pairs(rows: list[tuple[str, str]], tok, max_length: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(input, target) texts -> token ids, each ending in EOS as in T5's pretraining; a side longer than
    `max_length` tokens is refused (never cut short: that would change what is scored)."""
    from gqakit.common.text import eos_id

    eos = eos_id(tok)
    pairs = []
    for i, row in enumerate(rows):
        ids = [tok(text, add_special_tokens=False).input_ids + [eos] for text in row]
        longest = max(len(x) for x in ids)
        if longest > max_length:
            raise GqakitError(f"row {i} of the dataset has {longest:,} tokens in one column, more than "
                              f"{opt('max_length', f'{max_length:,}')}; raise {opt('max_length')} (rows are never cut "
                              "short)")
        pairs.append(tuple(torch.tensor(x) for x in ids))
    return pairs


def perplexity(model, input_ids: torch.Tensor, max_length: int, stride: int | None = None,
               progress: bool = True, bos: int | None = None) -> float:
    """exp(mean NLL) over the scored tokens; see `strided_nll`."""
    nll, count = strided_nll(model, input_ids, max_length, stride, progress, bos)
    return math.exp(nll / count)


# ---------------------------------------------------------------------------------------------
# `gqakit eval ppl MODEL [MODEL ...]`
# ---------------------------------------------------------------------------------------------

def _check(cfg: PplConfig) -> None:
    if not cfg.models:
        raise GqakitError("give at least one MODEL folder")
    if cfg.max_tokens is not None and cfg.max_tokens < 0:
        raise GqakitError(f"{opt('max_tokens')} must be a number of tokens (0 = the whole text), got {cfg.max_tokens}")
    for name in ("max_length", "stride"):
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise GqakitError(f"{opt(name)} must be a positive number of tokens, got {value}")
    if cfg.bootstrap < 1:
        raise GqakitError(f"{opt('bootstrap')} must be a positive number of resamples, got {cfg.bootstrap}")
    from gqakit.evaluate.kvcache import check_options

    check_options(cfg.kv_cache, cfg.kv_chunk, cfg.attention)
    if cfg.max_length is not None and cfg.max_length < 2:
        raise GqakitError(f"{opt('max_length', cfg.max_length)} is too short; a window needs at least 2 positions")
    check_text_column(cfg.text_column, cfg.dataset)
    if cfg.target_column is not None and cfg.dataset is None:
        raise GqakitError(f"{opt('target_column')} reads the input/target rows of a {opt('dataset')}; pass "
                          f"{opt('dataset', 'FILE.jsonl')}")
    if cfg.target_column is not None and cfg.text is not None:
        raise GqakitError(f"{opt('target_column')} scores the input/target rows of {opt('dataset')} alone, so "
                          f"{opt('text')} would be read nowhere; drop {opt('text')}")
    if cfg.target_column is not None and cfg.max_tokens:
        raise GqakitError(f"{opt('target_column')} scores every row of the dataset; drop {opt('max_tokens')}")


def check_context(max_length: int, context: int | None) -> None:
    """Positions the model never saw are extrapolation, not its perplexity: refused in one line."""
    if context and max_length > context:
        raise GqakitError(f"{opt('max_length', max_length)} exceeds a model's {context:,}-token context; use "
                          f"{opt('max_length')} <= {context}")


def resolve_window(cfg: PplConfig, contexts: list[int | None]) -> tuple[int, int]:
    """(max_length, stride) in model positions / text tokens, checked against each other (one-line errors)."""
    known = [c for c in contexts if c]
    max_length = cfg.max_length or min([1024, *known])
    check_context(max_length, min(known, default=None))
    span = max_length - (1 if cfg.bos else 0)
    stride = cfg.stride or span
    if stride > span:
        what = opt("max_length", max_length) + (" minus the BOS column" if cfg.bos else "")
        raise GqakitError(f"{opt('stride', stride)} is longer than a window ({span} text tokens = {what}); "
                          f"use {opt('stride')} <= {span}, or leave it out for disjoint windows")
    if cfg.kv_chunk is not None and cfg.kv_chunk > max_length:
        raise GqakitError(f"{opt('kv_chunk', cfg.kv_chunk)} is longer than a window of {max_length} positions; "
                          f"use {opt('kv_chunk')} <= {max_length}")
    return max_length, stride


def _context(path: str) -> tuple[int | None, bool | None]:
    """(max_position_embeddings, is it an encoder-decoder) of a local checkpoint folder, checked early (config.json,
    safetensors headers) so that a broken second model fails before the first is evaluated; (None, None) for a hub
    name (known once loaded)."""
    from gqakit.hf.fields import context_length
    from gqakit.hf.loading import check_model_folder, is_encoder_decoder

    config = check_model_folder(path)
    if config is None:  # a hub name: one that neither the cache nor the hub can serve is refused now, not after
        from gqakit.hf.hub import check_hub_name  # the models before it were scored

        check_hub_name(path)
        return None, None
    return context_length(config), is_encoder_decoder(config)


_MIXED = ("the models mix decoders and encoder-decoders, whose perplexities (next tokens vs. span-corruption "
          "targets) are not comparable; evaluate them in separate runs")


def _check_seq2seq(cfg: PplConfig, kinds: list[bool | None]) -> None:
    """Encoder-decoders are scored on T5's span corruption of each window (`span_corruption_nll`), or on a
    dataset's input/target rows (`--target-column`, `pair_nll`): not beside decoders, and without the options that
    only next-token windows have. A hub name's kind (None) is checked once it is loaded."""
    kinds = [k for k in kinds if k is not None]
    if not kinds:
        return
    if not any(kinds):
        if cfg.target_column is not None:
            raise GqakitError(f"{opt('target_column')} scores targets given inputs, which needs encoder-decoders; a "
                              f"decoder scores one text: drop {opt('target_column')}")
        return
    if not all(kinds):
        raise GqakitError(_MIXED)
    if cfg.attention not in (None, DEFAULT):
        raise GqakitError(f"{position_bias_refusal('the encoder-decoder', cfg.attention)}, or drop {opt('attention')}")
    if cfg.kv_cache is not None:
        raise GqakitError(f"{opt('kv_cache')} scores a decoder's text through its self-attention cache; "
                          f"encoder-decoders are scored in one forward per window: drop {opt('kv_cache')}")
    for name in ("stride", "bos"):
        if getattr(cfg, name):
            raise GqakitError(f"{opt(name)} does not apply to encoder-decoders, which are scored on T5's span "
                              f"corruption of disjoint windows of {opt('max_length')} tokens; drop {opt(name)}")


def _bos_id(tok, model) -> int:
    bos = getattr(tok, "bos_token_id", None)
    if bos is None:
        bos = getattr(model.config, "bos_token_id", None)
    if bos is None:
        raise GqakitError(f"{opt('bos')}: neither the tokenizer nor config.json names a BOS token; drop {opt('bos')}")
    return int(bos)


def _decoding_fields(decoding: tuple[float, float] | None) -> dict:
    """The report's bytes per token held while decoding after the first window (mean, max; None without a cache)."""
    mean, most = decoding if decoding is not None else (None, None)
    return {"kv_bytes_held_decoding_mean": mean, "kv_bytes_held_decoding_max": most}


def perplexity_table(rows: list[dict], dtype: str = "float32", kv_cache: str | None = None) -> str:
    """A markdown table: model, K/V heads, KV-cache bytes per token (at `dtype`; with a `kv_cache`, the bytes
    that cache held after the first window and while decoding on from it, measured), perplexity, scored tokens,
    windows, per-window perplexity range, 95% interval."""
    from gqakit.hf.loading import kv_heading

    heading = kv_heading(dtype) if kv_cache is None else (f"KV-cache bytes/token held ({kv_cache} cache, measured) "
                                                         "| held while decoding (mean / max)")
    lines = [f"| model | K/V heads | {heading} | perplexity | scored tokens | windows | window perplexity "
             "(min-max) | 95% interval |", "|---|---|---|---|---|---|---|---|" + ("---|" if kv_cache else "")]
    for r in rows:
        plain = r["kv_bytes_per_token"]  # fractional where sliding-window layers keep fewer tokens than a window
        kv = (f"{plain:,.{0 if float(plain).is_integer() else 1}f}" if kv_cache is None else
              f"{r['kv_bytes_held_per_token']:,.1f} | "
              f"{r['kv_bytes_held_decoding_mean']:,.1f} / {r['kv_bytes_held_decoding_max']:,.1f}")
        lines.append(f"| {r['model']} | {r['kv_heads']} | {kv} "
                     f"| {r['perplexity']:.3f} | {r['scored_tokens']:,} | {r['windows']:,} "
                     f"| {r['window_ppl_min']:.3f}-{r['window_ppl_max']:.3f} "
                     f"| {r['ppl_ci_low']:.3f}-{r['ppl_ci_high']:.3f} |")
    return "\n".join(lines)


def _score(cfg: PplConfig, model, tok, path: str, documents: list, max_length: int, stride: int
           ) -> tuple[str, int, Scored]:
    """(objective, text tokens, what was scored) of one model: next tokens of the text (a decoder), or an
    encoder-decoder's span-corruption targets of it, or the targets of the dataset's input/target rows."""
    from gqakit.common.text import encode_documents

    if cfg.target_column is not None:
        pairs = encode_pairs(documents, tok, max_length)
        return "targets_given_inputs", sum(a.numel() + b.numel() for a, b in pairs), pair_windows(model, pairs,
                                                                                                  cfg.progress)
    ids = encode_documents(documents, tok, cfg.max_tokens or None)  # 0 or None: the whole text
    span = max_length - (1 if cfg.bos else 0)
    if ids.numel() < span:
        raise GqakitError(f"the text has {ids.numel():,} tokens ({Path(path).name}'s tokenizer), shorter than "
                          f"one window of {span:,}; pass a longer text or {opt('max_length')} <= {ids.numel()}")
    if model.config.is_encoder_decoder:
        return "span_corruption", ids.numel(), span_corruption_windows(model, ids, max_length, tok,
                                                                       progress=cfg.progress)
    bos = _bos_id(tok, model) if cfg.bos else None
    return "next_token", ids.numel(), strided_windows(model, ids, max_length, stride, cfg.progress, bos,
                                                      cfg.kv_cache, cfg.kv_chunk)


_JSON_ONLY = ("attention_options", "kv_cache_settings", "window_nll", "window_tokens")  # not CSV columns


def run_ppl(cfg: PplConfig, command: str = "", out=None) -> dict:
    """Evaluate every model, print the table, write the report (JSON, CSV, plot); returns the report dict."""
    from gqakit.common import plots, report
    from gqakit.common.fitted import refuse_fitted_text
    from gqakit.common.text import load_columns, load_documents
    from gqakit.attention.registration import apply_attention
    from gqakit.hf.fields import context_length
    from gqakit.hf.loading import describe, load_model

    out = out or sys.stdout
    _check(cfg)
    options = command_attention_options(cfg.attention, cfg.window, cfg.sinks, cfg.attention_option)
    target = report.prepare_for(cfg, "ppl")
    fitted = refuse_fitted_text(cfg.models, cfg)
    contexts, kinds = zip(*[_context(path) for path in cfg.models])
    _check_seq2seq(cfg, list(kinds))
    if cfg.target_column is not None:  # input/target rows
        documents = load_columns(cfg.dataset, (cfg.text_column, cfg.target_column))
    else:
        documents = load_documents(cfg.text, cfg.dataset, cfg.text_column)
    max_length, stride = resolve_window(cfg, list(contexts))  # same windows for all
    names = [Path(p).name or p for p in cfg.models]
    if len(set(names)) < len(names):  # same folder names in different places: show the paths
        names = list(cfg.models)
    rows = []
    for path, name in zip(cfg.models, names):
        model, tok = load_model(path, cfg.dtype, cfg.tokenizer, cfg.device, seq2seq=True)
        seq2seq = model.config.is_encoder_decoder
        if rows and (rows[0]["objective"] == "next_token") == seq2seq:  # a hub name, known only now
            raise GqakitError(_MIXED)
        _check_seq2seq(cfg, [seq2seq])
        check_context(max_length, context_length(model.config.to_dict()))  # a hub name's, known only now
        in_force = {} if seq2seq else apply_attention(model, cfg.attention, options)
        t0 = time.perf_counter()
        objective, text_tokens, scored = _score(cfg, model, tok, path, documents, max_length, stride)
        seconds = time.perf_counter() - t0
        nll, count = scored.nll, scored.count
        low, high = bootstrap_interval(scored.window_nll, scored.window_tokens, cfg.bootstrap, cfg.seed)
        rows.append({"model": name, "path": str(path), **describe(model, max_length), "objective": objective,
                     "attention": cfg.attention or "default", "attention_options": in_force,
                     "text_tokens": text_tokens, "scored_tokens": count, "nll": nll,
                     "perplexity": math.exp(nll / count), "seconds": round(seconds, 3),
                     **window_spread(scored.window_nll, scored.window_tokens), "ppl_ci_low": low, "ppl_ci_high": high,
                     **report_fields(cfg.kv_cache, cfg.kv_chunk),
                     "kv_bytes_held_per_token": scored.kv_bytes_held_per_token,
                     **_decoding_fields(scored.kv_bytes_held_decoding),
                     "window_nll": scored.window_nll, "window_tokens": scored.window_tokens})
        print(f"  {rows[-1]['model']}: perplexity {rows[-1]['perplexity']:.3f} over {count:,} tokens "
              f"({seconds:.1f}s)", file=out, flush=True)
        del model
    print(perplexity_table(rows, rows[0]["dtype"], cfg.kv_cache), file=out)
    if rows[0]["objective"] == "targets_given_inputs":
        print(f"(encoder-decoders: each row's {cfg.target_column!r} given its {cfg.text_column!r}, both ending in EOS; "
              f"perplexity over the target tokens; {cfg.dtype})", file=out)
    elif rows[0]["objective"] == "span_corruption":
        print(f"(encoder-decoders: T5's span corruption of disjoint windows of {max_length} tokens, a shorter tail "
              f"unscored, masks seeded by each window; perplexity over the corrupted targets; {cfg.dtype})", file=out)
    else:
        print(f"(windows of {max_length} positions, stride {stride}, {'BOS-prefixed' if cfg.bos else 'no BOS'}, "
              f"{cfg.dtype})", file=out)
    if cfg.kv_cache:
        print(f"(each window fed through a fresh {cfg.kv_cache} cache, {rows[0]['kv_chunk']} tokens per forward; "
              f"bytes held = every tensor of every cache layer after the first window / its positions; while "
              f"decoding: over the {max(1, residual_length(cfg.kv_cache))} single-token step(s) after it"
              f"{', as the residual refills' if residual_length(cfg.kv_cache) else ''})", file=out)
    print(f"(95% interval: percentile bootstrap over windows, {cfg.bootstrap} resamples, seed {cfg.seed})", file=out)
    record = {"max_length": max_length, "stride": stride, "bootstrap": cfg.bootstrap, "seed": cfg.seed,
              "fitted_text": fitted, "rows": rows}
    csv_rows = [{k: v for k, v in r.items() if k not in _JSON_ONLY} for r in rows]
    plotted = rows if not cfg.kv_cache else [{**r, "kv_bytes_per_token": r["kv_bytes_held_per_token"]} for r in rows]
    written = report.write_report(target, kind="ppl", command=command, config=dataclasses.asdict(cfg),
                                  results=record, rows=csv_rows, force=cfg.force, default=not cfg.output,
                                  plots={"ppl_vs_kv_bytes.png": lambda p: plots.ppl_vs_kv_bytes(plotted, p)})
    print(f"wrote {written}", file=out)
    return record
