"""Quality against KV-cache bytes, side by side: every model under every cache asked for, one table and one plot.

What a user buys is a smaller KV cache at the least loss, so each converted model is set beside the original
under transformers' quantized caches (`gqakit eval ppl --kv-cache dense|fp8|int4|int2`), at the bytes per token
each cache really holds (measured from its tensors, scales and full-precision residual included). For every cache
kind this runs one `gqakit eval ppl` over all models (the whole text by default, disjoint windows, a bootstrap
interval per row), reads its results.json, and prints one markdown table sorted by bytes, each row's interval and
how it compares with the best row at no more bytes (overlaps it, better or worse beyond both intervals); `--plot`
writes one PNG (perplexity against bytes per token, one marker per cache kind, one colour per model).

    python benchmarks/kv_tradeoff.py gqakit/assets/austen-mha-8h runs/austen-mqa --text gqakit/assets/heldout_emma.txt
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from _measure import command_line, logger

log = logger("kv_tradeoff")
CACHES = ("dense", "fp8", "int4", "int2")


def evaluate(models: list[str], cache: str, args, folder: Path) -> list[dict]:
    """One `gqakit eval ppl` of every model under `cache`; its rows (results.json)."""
    out = folder / cache
    cmd = [sys.executable, "-m", "gqakit.cli", "eval", "ppl", *models, "--text", args.text,
           "--max-tokens", str(args.max_tokens), "--max-length", str(args.max_length), "--kv-cache", cache,
           "--kv-chunk", str(args.kv_chunk), "-o", str(out), "-q"]
    log(" ".join(["gqakit", *cmd[3:]]))
    if subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode != 0:  # its one-line error is on stderr above
        raise SystemExit(f"kv_tradeoff: gqakit eval ppl failed under --kv-cache {cache} (see its error above)")
    rows = json.loads((out / "results.json").read_text(encoding="utf-8"))["results"]["rows"]
    return [{**r, "cache": cache, "path": m} for r, m in zip(rows, models)]


def from_reports(reports: list[str]) -> list[dict]:
    """The rows of `gqakit eval ppl` reports already made (a report folder, or its results.json as kept under
    docs/results/), in order; the first report's first row is the reference. A report without --kv-cache (one plain
    forward per window) is a dense row: its bytes are what a dense cache holds at the compute dtype
    (`kv_bytes_per_token` at the window length), which the dense cache's measured bytes equal (checked by the
    tests)."""
    rows = []
    for given in reports:
        path = Path(given) / "results.json" if Path(given).is_dir() else Path(given)
        if not path.is_file():
            raise SystemExit(f"kv_tradeoff: {path} not found; pass a `gqakit eval ppl` report folder or its "
                             "results.json")
        try:
            report = json.loads(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as err:
            raise SystemExit(f"kv_tradeoff: {path} is not JSON ({err}); pass a `gqakit eval ppl` report's "
                             "results.json") from None
        if report.get("kind") != "ppl":
            raise SystemExit(f"kv_tradeoff: {given} is not a `gqakit eval ppl` report")
        for r in report["results"]["rows"]:
            held = r["kv_bytes_held_per_token"]
            cache = r["kv_cache"] if r["kv_cache"] != "none" else "dense"
            rows.append({**r, "cache": cache, "kv_bytes_held_per_token": held if held else r["kv_bytes_per_token"],
                         "first": not rows})
    return rows


def versus_cheaper(r: dict, best: dict | None) -> str:
    """Row `r` against `best`, the best row listed before it at no more bytes: "" (none), "overlaps MODEL CACHE"
    (the intervals overlap: the two cannot be told apart on this text), "better" (r's interval lies wholly below:
    r buys its bytes) or "worse" (wholly above: a cheaper row beats it)."""
    if best is None:
        return ""
    if r["ppl_ci_high"] < best["ppl_ci_low"]:
        return "better"
    if r["ppl_ci_low"] > best["ppl_ci_high"]:
        return "worse"
    return f"overlaps {best['model']} {best['cache']}"


def table(rows: list[dict]) -> str:
    """Rows by measured bytes per token, each against the best row at no more bytes (`versus_cheaper`)."""
    rows = sorted(rows, key=lambda r: (r["kv_bytes_held_per_token"], r["perplexity"]))
    dtypes = {r.get("dtype", "float32") for r in rows}  # the compute dtype the bytes are counted at
    one = dtypes.pop() if len(dtypes) == 1 else None  # in the heading; several: each row's cache column says its own
    lines = [f"| model | K/V heads | cache | bytes/token held{f' ({one} compute)' if one else ''} "
             "| held while decoding (mean) | vs the first model dense "
             "| perplexity | 95% interval | vs the best row at no more bytes |", "|---" * 9 + "|"]
    base = next((r for r in rows if r["cache"] == "dense" and r["first"]), None)  # the reference's dense row
    for i, r in enumerate(rows):
        cheaper = [o for o in rows[:i] if o["kv_bytes_held_per_token"] <= r["kv_bytes_held_per_token"]]
        overlap = versus_cheaper(r, min(cheaper, key=lambda o: o["perplexity"], default=None))
        ratio = f"{base['kv_bytes_held_per_token'] / r['kv_bytes_held_per_token']:.1f}x fewer" if base else ""
        plain = r.get("kv_cache") == "none"  # one forward per window: a dense row holds the same while decoding
        decoding = r.get("kv_bytes_held_decoding_mean") or (r.get("kv_bytes_per_token") if plain else None)
        decoding = f"{decoding:,.0f}" if decoding else "not measured"  # reports made before 2026-12-07
        cache = r["cache"] if one else f"{r['cache']} ({r.get('dtype', 'float32')} compute)"
        lines.append(f"| {r['model']} | {r['kv_heads']} | {cache} | {r['kv_bytes_held_per_token']:,.0f} "
                     f"| {decoding} | {ratio} "
                     f"| {r['perplexity']:.2f} | {r['ppl_ci_low']:.2f}-{r['ppl_ci_high']:.2f} | {overlap} |")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path) -> None:
    from matplotlib import colormaps

    from gqakit.common.plots import new_figure

    fig = new_figure(7.5, 4.5)
    ax = fig.add_subplot()
    markers = dict(zip(CACHES, "osD^"))
    # one colour per model from tab20's dark then light shades, without its greys: the cache-kind legend is grey
    tab20 = colormaps["tab20"].colors
    palette = [c for i, c in enumerate([*tab20[::2], *tab20[1::2]]) if i not in (7, 17)]
    models = list(dict.fromkeys(r["model"] for r in rows))
    colours = {m: palette[i % len(palette)] for i, m in enumerate(models)}
    for r in rows:
        ax.errorbar(r["kv_bytes_held_per_token"], r["perplexity"],
                    yerr=[[r["perplexity"] - r["ppl_ci_low"]], [r["ppl_ci_high"] - r["perplexity"]]],
                    marker=markers[r["cache"]], color=colours[r["model"]], linestyle="none", capsize=2)
    for m, c in colours.items():
        ax.plot([], [], color=c, marker="o", linestyle="none", label=m)
    for k, mk in markers.items():
        ax.plot([], [], color="grey", marker=mk, linestyle="none", label=k)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("KV-cache bytes per token held (measured)")
    ax.set_ylabel("perplexity (95% bootstrap interval)")
    ax.set_title("quality against KV-cache bytes")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the axes: it covers no point
    fig.savefig(path, bbox_inches="tight")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("models", nargs="*", help="model folders; the first is the reference (its dense row: 1x)")
    p.add_argument("--text", help="the evaluation text")
    p.add_argument("--reports", nargs="+", help="instead of evaluating: `gqakit eval ppl` reports already made, "
                                                "folders or their results.json (the first report's model is the "
                                                "reference)")
    p.add_argument("--caches", nargs="+", default=list(CACHES[:3]), choices=CACHES,
                   help="cache kinds (default: dense fp8 int4; int2 on request)")
    p.add_argument("--max-tokens", type=int, default=0, help="tokens scored (0: the whole text)")
    p.add_argument("--max-length", type=int, default=2048, help="window length (disjoint windows)")
    p.add_argument("--kv-chunk", type=int, default=128, help="tokens per forward through the cache")
    p.add_argument("--plot", help="write the PNG here")
    p.add_argument("--keep", help="keep the eval report folders here (default: a temporary folder)")
    args = p.parse_args(argv)
    if bool(args.reports) == bool(args.models) or (args.models and not args.text):
        p.error("give MODEL folders and --text, or --reports FOLDER ...")
    if args.reports:
        rows = from_reports(args.reports)
    else:
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(args.keep or tmp)
            rows = [r for cache in args.caches for r in evaluate(args.models, cache, args, folder)]
        for r in rows:
            r["first"] = r["path"] == args.models[0]
    print(f"`{command_line(__file__, argv)}`\n")
    print(table(rows))
    if args.reports:
        print("\n(read from the reports; each report's own command says its windows and chunking; bytes held = "
              "every tensor of every cache layer after the first window, over its positions; while decoding: the mean "
              "over the single-token steps after it, as gqakit eval ppl reports it)")
    else:
        print(f"\n(windows of {args.max_length} tokens, {'the whole text' if args.max_tokens == 0 else args.max_tokens}"
              f"; each fed through the cache {args.kv_chunk} tokens per forward; bytes held = every tensor of every "
              "cache layer after the first window, over its positions; while decoding: the mean over the single-token "
              "steps after it, as gqakit eval ppl reports it)")
    if args.plot:
        plot(rows, Path(args.plot))
        print(f"wrote {args.plot}")


if __name__ == "__main__":
    sys.exit(main())
