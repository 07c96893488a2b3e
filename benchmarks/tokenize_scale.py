"""Does tokenising into the token cache keep memory flat, and how fast is it? Do training reads stay flat?

1. Synthesises a corpus of about --tokens tokens (words sampled from the embedded held-out Emma text,
   as JSON lines rows of 100-3,000 words in ~32 MB files, or as .txt files with --format txt) in a
   scratch folder.
2. Tokenises it, each variant in a fresh subprocess: into the token cache (`build_cache`) with
   --num-proc 1 and 2, and the old in-memory path (`read_documents` + `tokenize_stream`: a Python list
   and a torch tensor). Reports seconds, tokens/s, the process's peak RSS (VmHWM), its growth over the
   RSS after imports, the largest worker's peak RSS, and whether the streams are identical (blake2b of
   the old tensor as the cache's dtype against the cache's checksum).
3. Reads --batches random batches of --batch-size x (--seq-len + 1) windows, training-loop style, from
   the big cache and from a 1M-token cache, each in a fresh subprocess: with positioned reads (what
   `Windows` does) and, for contrast, through np.memmap.

    python benchmarks/tokenize_scale.py --tokens 5000000      # quick check (~2 min on 2 cores)
    python benchmarks/tokenize_scale.py                       # 100M tokens (the old path needs ~10 GB; --no-old)

Targets: the cache path's RSS growth does not grow with the corpus (PASS when under 300 MiB), and
reading windows from the big cache costs no more resident memory than from the small one (PASS within
32 MiB). Progress goes to stderr; stdout is the markdown report. Scratch data goes under
./scratch/tokenize_scale and is deleted unless --keep.
"""
from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

from _measure import logger, maxrss_kib, status_mib

RSS_GROWTH_TARGET_MIB = 300
FLAT_READ_MIB = 32


log = logger("tokenize_scale")


def _children_peak_mib() -> float:
    return maxrss_kib(children=True) / 1024


# ---------------------------------------------------------------------------------------------------
# The corpus


def _tokens_per_char(tokenizer, text: str) -> float:
    return len(tokenizer(text, add_special_tokens=False, verbose=False).input_ids) / len(text)


def write_corpus(folder: Path, tokens: int, fmt: str, seed: int = 0) -> int:
    """~`tokens` tokens of Emma words in `folder`; returns the characters written."""
    from gqakit.reference import HELDOUT_TEXT, reference_model_path
    from gqakit.uptrain.data.token_build import load_tokenizer

    words = Path(HELDOUT_TEXT).read_text(encoding="utf-8").split()
    rng = random.Random(seed)
    sample = " ".join(rng.choices(words, k=50_000))
    target_chars = int(tokens / _tokens_per_char(load_tokenizer(str(reference_model_path())), sample))
    folder.mkdir(parents=True)
    written, part, out, part_chars = 0, 0, None, 0
    while written < target_chars:
        n = rng.randint(100, 3_000)
        paragraphs = [" ".join(rng.choices(words, k=min(n, 120))) for _ in range(max(1, n // 120))]
        doc = "\n\n".join(paragraphs)
        if out is None or part_chars > 32 << 20 or fmt == "txt" and part_chars > 1 << 20:
            if out is not None:
                out.close()
            out = open(folder / f"part-{part:05d}.{'jsonl' if fmt == 'jsonl' else 'txt'}", "w", encoding="utf-8")
            part, part_chars = part + 1, 0
        out.write(json.dumps({"text": doc}) + "\n" if fmt == "jsonl" else doc + "\n\n")
        written += len(doc)
        part_chars += len(doc)
    out.close()
    return written


def _entries(folder: Path, fmt: str) -> list[str]:
    return [str(folder)] if fmt == "jsonl" else sorted(str(p) for p in folder.glob("*.txt"))


# ---------------------------------------------------------------------------------------------------
# Children: one measurement each, in a fresh process; print one JSON line


def child_build(args) -> dict:
    from gqakit.reference import reference_model_path
    from gqakit.uptrain.data.sources import resolve_source
    from gqakit.uptrain.data.token_build import build_cache, load_tokenizer

    tokenizer = load_tokenizer(str(reference_model_path()))
    base = status_mib("VmRSS")
    t0 = time.perf_counter()
    header = build_cache([resolve_source(e) for e in args.entries], Path(args.out), tokenizer, num_proc=args.num_proc)
    seconds = time.perf_counter() - t0
    return {"tokens": header["tokens"], "seconds": seconds, "checksum": header["checksums"]["tokens.bin"],
            "base": base, "peak": status_mib("VmHWM"), "workers": _children_peak_mib()}


def child_old(args) -> dict:
    import hashlib

    from gqakit.reference import reference_model_path
    from gqakit.uptrain.data.batches import read_documents, tokenize_stream
    from gqakit.uptrain.data.token_build import load_tokenizer

    tokenizer = load_tokenizer(str(reference_model_path()))
    base = status_mib("VmRSS")
    t0 = time.perf_counter()
    stream = tokenize_stream(read_documents(tuple(args.entries)), tokenizer)
    seconds = time.perf_counter() - t0
    digest = hashlib.blake2b(stream.numpy().astype("<u2").tobytes(), digest_size=16).hexdigest()
    return {"tokens": stream.numel(), "seconds": seconds, "checksum": digest, "base": base,
            "peak": status_mib("VmHWM"), "workers": _children_peak_mib()}


def child_windows(args) -> dict:
    import numpy as np
    import torch

    from gqakit.uptrain.data.token_cache import TOKENS, open_cache
    from gqakit.uptrain.data.windows import Corpus, Windows

    cache = open_cache(args.cache)
    corpus = Corpus([cache])
    windows = Windows(corpus.spans(0, corpus.tokens), args.seq_len)
    mapped = np.memmap(Path(args.cache) / TOKENS, dtype=cache.dtype, mode="r") if args.reader == "memmap" else None
    g = torch.Generator().manual_seed(0)
    base = status_mib("VmRSS")
    t0, total = time.perf_counter(), 0
    for _ in range(args.batches):
        idx = torch.randint(len(windows), (args.batch_size,), generator=g).tolist()
        if mapped is None:
            batch = windows[idx]
        else:
            batch = torch.from_numpy(np.stack([mapped[i * args.seq_len: i * args.seq_len + args.seq_len + 1]
                                               .astype(np.int64) for i in idx]))
        total += int(batch[:, -1].sum())  # touch the data
    return {"tokens": cache.tokens, "seconds": time.perf_counter() - t0, "base": base, "peak": status_mib("VmHWM"),
            "rss_end": status_mib("VmRSS")}


def run_child(kind: str, *extra: str) -> dict:
    cmd = [sys.executable, __file__, "--child", kind, *extra]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"child {kind} failed:\n{result.stderr[-3000:]}")
    out = json.loads(result.stdout.strip().splitlines()[-1])
    log(f"  {out}")
    return out


# ---------------------------------------------------------------------------------------------------


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=100_000_000)
    p.add_argument("--small-tokens", type=int, default=1_000_000, help="the small cache for the flat-read check")
    p.add_argument("--format", default="jsonl", choices=["jsonl", "txt"])
    p.add_argument("--num-proc", default="1,2", help="comma-separated tokenising process counts")
    p.add_argument("--no-old", action="store_true", help="skip the old in-memory path")
    p.add_argument("--batches", type=int, default=2_000)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--scratch", default="scratch/tokenize_scale")
    p.add_argument("--keep", action="store_true")
    # child mode (internal)
    p.add_argument("--child", choices=["build", "old", "windows"], help=argparse.SUPPRESS)
    p.add_argument("--entries", nargs="*", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    p.add_argument("--cache", help=argparse.SUPPRESS)
    p.add_argument("--reader", default="pread", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.num_proc = int(args.num_proc) if args.child == "build" else 1
        print(json.dumps({"build": child_build, "old": child_old, "windows": child_windows}[args.child](args)))
        return

    scratch = Path(args.scratch)
    shutil.rmtree(scratch, ignore_errors=True)
    try:
        report(args, scratch)
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)


def report(args, scratch: Path) -> None:
    log(f"writing a ~{args.tokens:,}-token {args.format} corpus and a ~{args.small_tokens:,}-token one")
    big_chars = write_corpus(scratch / "corpus", args.tokens, args.format)
    write_corpus(scratch / "small", args.small_tokens, args.format, seed=1)
    big, small = _entries(scratch / "corpus", args.format), _entries(scratch / "small", args.format)

    rows, checksums = [], {}
    for n in [int(x) for x in args.num_proc.split(",")]:
        log(f"cache, num_proc={n}")
        r = run_child("build", "--num-proc", str(n), "--out", str(scratch / f"cache-{n}"), "--entries", *big)
        rows.append((f"token cache, num_proc={n}", r))
        checksums[f"cache-{n}"] = r["checksum"]
    if not args.no_old:
        log("old path: Python list + torch.tensor")
        r = run_child("old", "--entries", *big)
        rows.append(("old: list + torch.tensor", r))
        checksums["old"] = r["checksum"]
    same = len(set(checksums.values())) == 1

    print(f"## Tokenising ~{args.tokens:,} tokens ({big_chars / 1e6:,.0f} M characters of {args.format}, "
          f"{len(big)} entr{'y' if len(big) == 1 else 'ies'})\n")
    print("| variant | tokens | seconds | tokens/s | peak RSS (MiB) | growth over imports (MiB) "
          "| largest worker (MiB) |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, r in rows:
        print(f"| {name} | {r['tokens']:,} | {r['seconds']:.1f} | {r['tokens'] / r['seconds']:,.0f} "
              f"| {r['peak']:,.0f} | {r['peak'] - r['base']:,.0f} | {r['workers']:,.0f} |")
    growth = max(r["peak"] - r["base"] for name, r in rows if name.startswith("token cache"))
    print(f"\nidentical streams (blake2b): {'yes' if same else 'NO'} ({', '.join(checksums)})")
    print(f"cache path RSS growth {growth:,.0f} MiB (target < {RSS_GROWTH_TARGET_MIB}): "
          f"{'PASS' if growth < RSS_GROWTH_TARGET_MIB else 'FAIL'}")

    first = int(args.num_proc.split(",")[0])
    log("small cache")
    run_child("build", "--num-proc", "1", "--out", str(scratch / "cache-small"), "--entries", *small)
    reads = []
    for label, cache in ((f"{args.tokens / 1e6:g}M", scratch / f"cache-{first}"),
                         (f"{args.small_tokens / 1e6:g}M", scratch / "cache-small")):
        for reader in ("pread", "memmap"):
            log(f"windows from the {label} cache via {reader}")
            r = run_child("windows", "--cache", str(cache), "--reader", reader, "--batches", str(args.batches),
                          "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len))
            reads.append((label, reader, r))
    print(f"\n## Reading {args.batches:,} random batches of {args.batch_size} x {args.seq_len + 1} tokens\n")
    print("| cache | reader | cache tokens | seconds | batches/s | RSS after setup (MiB) | peak RSS (MiB) "
          "| growth (MiB) |")
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for label, reader, r in reads:
        note = " (Windows)" if reader == "pread" else " (contrast)"
        print(f"| {label} | {reader}{note} | {r['tokens']:,} | {r['seconds']:.2f} "
              f"| {args.batches / r['seconds']:,.0f} | {r['base']:,.0f} | {r['peak']:,.0f} "
              f"| {r['peak'] - r['base']:,.0f} |")
    growth = {label: r["peak"] - r["base"] for label, reader, r in reads if reader == "pread"}
    spread = max(growth.values()) - min(growth.values())
    print(f"\nWindows (pread) growth big vs small cache differs by {spread:,.1f} MiB (target < {FLAT_READ_MIB}): "
          f"{'PASS' if spread < FLAT_READ_MIB else 'FAIL'}")


if __name__ == "__main__":
    main()
