"""`gqakit eval ppl | stream | passkey`: flags -> the command's frozen dataclass -> its runner.

    gqakit eval ppl MODEL [MODEL ...] --text FILE [--max-length L] [--stride S] [--bos] [--attention KIND]
    gqakit eval stream MODEL --text FILE --tokens N --policy sinks --policy recompute [--window W] [--sinks S]
    gqakit eval passkey MODEL --lengths 1k,2k,4k --depths 0,0.25,0.5,0.75,1 --trials 5 --seed 0

Every run writes a report folder (results.json, results.csv, a plot): `--output DIR`, by default
`runs/eval-<kind>-<timestamp>`; an existing folder needs `--force`. No heavy import happens here.
"""
from __future__ import annotations

import argparse

from gqakit.common import attention_kinds, dtypes

ATTENTION_CHOICES = attention_kinds.CHOICES
DTYPE_CHOICES = dtypes.NAMES


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="float32", choices=DTYPE_CHOICES, help="compute dtype (default: float32)")
    p.add_argument("--device", default="auto", help="auto (CUDA when available), cpu, cuda, cuda:N")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's own)")
    p.add_argument("-o", "--output", default=None,
                   help="report folder (default: runs/eval-<kind>-<YYYYmmdd-HHMMSS>)")
    p.add_argument("--force", action="store_true", help="replace an existing report folder")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bars")


def _add_text(p: argparse.ArgumentParser) -> None:
    p.add_argument("--text", default=None, help="a UTF-8 .txt file (one document)")
    p.add_argument("--dataset", default=None,
                   help="a .jsonl / .json / .parquet file or folder; rows joined with the tokenizer's EOS")
    p.add_argument("--text-column", default="text", help="the text column of --dataset (default: text)")


def _add_attention(p: argparse.ArgumentParser) -> None:
    p.add_argument("--attention", default=None, choices=ATTENTION_CHOICES,
                   help="gqakit attention kind via gqakit.attention.use (default: the model's own)")
    p.add_argument("--window", type=int, default=None, help="window of --attention sliding/sinks")
    p.add_argument("--sinks", type=int, default=None, help="sink tokens of --attention sinks (default 4)")
    p.add_argument("--attention-option", action="append", default=[], metavar="NAME=VALUE",
                   help="any other option of the kind, e.g. stride=128 for --attention sparse (repeatable; see "
                        "docs/attention.md)")


def _run_ppl(args: argparse.Namespace, command: str) -> None:
    from gqakit.evaluate.perplexity import PplConfig, run_ppl

    run_ppl(PplConfig(
        models=tuple(args.models), text=args.text, dataset=args.dataset, text_column=args.text_column,
        max_tokens=args.max_tokens, max_length=args.max_length, stride=args.stride, bos=args.bos,
        attention=args.attention, window=args.window, sinks=args.sinks, attention_option=tuple(args.attention_option),
        dtype=args.dtype, device=args.device, tokenizer=args.tokenizer, output=args.output, force=args.force,
        progress=not args.quiet), command=command)


def _run_stream(args: argparse.Namespace, command: str) -> None:
    from gqakit.evaluate.stream import StreamConfig, run_stream

    policies = tuple(p.strip() for spec in (args.policy or ["sinks"]) for p in spec.split(",") if p.strip())
    run_stream(StreamConfig(
        model=args.model, text=args.text, dataset=args.dataset, text_column=args.text_column, tokens=args.tokens,
        policies=policies, window=args.window, sinks=args.sinks, chunk=args.chunk,
        recompute_every=args.recompute_every, bucket=args.bucket, bos=args.bos, fluent_within=args.fluent_within,
        dtype=args.dtype, device=args.device, tokenizer=args.tokenizer, output=args.output, force=args.force,
        progress=not args.quiet), command=command)


def _run_passkey(args: argparse.Namespace, command: str) -> None:
    from gqakit.evaluate.passkey import PasskeyConfig, parse_depths, parse_lengths, run_passkey

    run_passkey(PasskeyConfig(
        model=args.model, lengths=tuple(parse_lengths(args.lengths)), depths=tuple(parse_depths(args.depths)),
        trials=args.trials, seed=args.seed, new_tokens=args.new_tokens, attention=args.attention,
        window=args.window, sinks=args.sinks, attention_option=tuple(args.attention_option), dtype=args.dtype,
        device=args.device, tokenizer=args.tokenizer, output=args.output, force=args.force, progress=not args.quiet), command=command)


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    """Add `eval` (with `ppl`, `stream`, `passkey`) to an argparse subparsers object; returns `eval`'s parser.

    Each leaf sets `func(args, command)`, the convention of `gqakit.cli`.
    """
    ev = subparsers.add_parser("eval", help="perplexity, long-context fluency, passkey retrieval (with reports)",
                               description="Evaluate models; every run writes JSON, CSV and a plot.")
    sub = ev.add_subparsers(dest="eval_command", required=True, metavar="{ppl,stream,passkey}")

    ppl = sub.add_parser("ppl", help="token-weighted strided perplexity of one or more models (a comparison table)")
    ppl.add_argument("models", nargs="+", metavar="MODEL", help="Hugging Face checkpoint folder(s)")
    _add_text(ppl)
    ppl.add_argument("--max-tokens", type=int, default=None, help="score only the first N tokens of the text")
    ppl.add_argument("--max-length", type=int, default=None,
                     help="window in model positions (default: 1024, or the smallest model context if shorter)")
    ppl.add_argument("--stride", type=int, default=None,
                     help="window step in tokens (default: disjoint windows); smaller = more context per token")
    ppl.add_argument("--bos", action="store_true",
                     help="prefix each window with BOS and score its first text token too")
    _add_attention(ppl)
    _add_common(ppl)
    ppl.set_defaults(func=_run_ppl)

    st = sub.add_parser("stream", help="long-context fluency: perplexity by position under KV-cache policies")
    st.add_argument("model", help="Hugging Face checkpoint folder")
    _add_text(st)
    st.add_argument("--tokens", type=int, default=4096, help="text tokens to stream (default: 4096)")
    st.add_argument("--policy", action="append", default=None, metavar="POLICY",
                    help="dense, window, sinks or recompute; repeat (or comma-separate) to compare (default: sinks)")
    st.add_argument("--window", type=int, default=1020, help="recent tokens W kept (default: 1020)")
    st.add_argument("--sinks", type=int, default=4, help="attention-sink tokens S of --policy sinks (default: 4)")
    st.add_argument("--chunk", type=int, default=256,
                    help="tokens per forward C; per-token results do not depend on it, but recompute's R "
                         "defaults to it (default: 256)")
    st.add_argument("--recompute-every", type=int, default=None, metavar="R",
                    help="recompute: rebuild every R tokens (default: --chunk; 1 = exact per-token baseline, slow)")
    st.add_argument("--bucket", type=int, default=None, help="positions per perplexity bucket (default: tokens/32)")
    st.add_argument("--bos", action="store_true", help="start the stream with BOS")
    st.add_argument("--fluent-within", type=float, default=0.10,
                    help="fluent if the worst bucket is within this fraction of recompute (default: 0.10)")
    _add_common(st)
    st.set_defaults(func=_run_stream)

    pk = sub.add_parser("passkey", help="passkey retrieval accuracy per (length, depth), with a heatmap")
    pk.add_argument("model", help="Hugging Face checkpoint folder")
    pk.add_argument("--lengths", default="1k,2k,4k", help="prompt lengths in tokens, k = 1024 (default: 1k,2k,4k)")
    pk.add_argument("--depths", default="0,0.25,0.5,0.75,1",
                    help="relative depths of the key, 0 = start, 1 = end (default: 0,0.25,0.5,0.75,1)")
    pk.add_argument("--trials", type=int, default=5, help="prompts per (length, depth) (default: 5)")
    pk.add_argument("--seed", type=int, default=0, help="seed of the keys (default: 0)")
    pk.add_argument("--new-tokens", type=int, default=10, help="tokens decoded greedily (default: 10)")
    _add_attention(pk)
    _add_common(pk)
    pk.set_defaults(func=_run_passkey)
    return ev
