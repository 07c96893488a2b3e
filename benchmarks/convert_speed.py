"""How fast and how lean is `convert-gqa` next to a plain `cp -r` of the same checkpoint?

Synthesises a Llama-2-7B-shaped bf16 MHA checkpoint (HF tensor names, <= 5 GB shards plus
model.safetensors.index.json, ~13.5 GB) -- or, with `--family gpt_neox`, a Pythia-6.9B-shaped one, which
convert-gqa re-hosts on PhiForCausalLM (~13.7 GB) -- in a scratch folder, then times, side by side in one run,
`cp -r SRC DST` and `convert-gqa --groups G SRC -o DST --quiet` (both as subprocesses, both reading
an equally cold -- or equally warm -- source), records the converter's peak RSS, checks the output
cheaply, and prints a markdown table. A benchmark, never a test.

    python benchmarks/convert_speed.py --small          # 4 layers, hidden 1024: seconds
    python benchmarks/convert_speed.py                  # 7B shape: needs ~30 GB free disk
    python benchmarks/convert_speed.py --repeats 3 --cache warm
    python benchmarks/convert_speed.py --family gpt_neox --layers 4   # Pythia-6.9B layer shape, 4 layers

Progress goes to stderr; stdout is only the markdown report.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors import safe_open

from _measure import (PRESETS, Shape, converter_command, entries_bytes, llama_config, llama_entries, logger,
                      neox_config, neox_entries, pattern, run_child, write_checkpoint)
from gqakit.hf.headers import INDEX, SINGLE
from gqakit.convert.output import max_shard_bytes
from gqakit.common.errors import GqakitError

RATIO_TARGET = 1.5  # convert may take at most 1.5x the time of cp -r
RSS_TARGET_MB = 1536  # and hold at most 1.5 GiB resident (MiB)


log = logger("convert_speed")


# ---------------------------------------------------------------------------------------------------
# The synthetic checkpoint


FAMILIES = {  # family -> (config, tensors, full preset, --small preset, label, class convert-gqa writes)
    "llama": (llama_config, llama_entries, "7b", "small", "Llama-2-7B", "LlamaForCausalLM"),
    "gpt_neox": (neox_config, neox_entries, "pythia-6.9b", "pythia-small", "Pythia-6.9B", "PhiForCausalLM"),
}


def synthesise(folder: Path, s: Shape, max_shard_bytes: int, family: str = "llama") -> None:
    """Write config.json, generation_config.json and the shards, one tensor at a time."""
    make_config, make_entries = FAMILIES[family][:2]
    config = make_config(s)
    write_checkpoint(folder, config, make_entries(s), max_shard_bytes, lambda k, shape: pattern(shape, k))
    ids = {k: config[k] for k in ("bos_token_id", "eos_token_id")}
    (folder / "generation_config.json").write_text(json.dumps(ids) + "\n")


def weight_files(folder: Path) -> list[Path]:
    index = folder / INDEX
    if index.is_file():
        return [folder / f for f in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [folder / SINGLE]


def tensor_locations(folder: Path) -> dict[str, Path]:
    """Tensor name -> file, read from the index or the single file's header (independent of gqakit)."""
    index = folder / INDEX
    if index.is_file():
        return {k: folder / v for k, v in json.loads(index.read_text())["weight_map"].items()}
    with safe_open(str(folder / SINGLE), framework="pt") as f:
        return {k: folder / SINGLE for k in f.keys()}


def tree_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


# ---------------------------------------------------------------------------------------------------
# Page cache control: every timed run starts from the same state of the source in the page cache


def evict(files: list[Path]) -> None:
    """Drop these files' clean pages from the page cache (per file, no root, nothing else touched)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def prewarm(files: list[Path]) -> None:
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass


def resident_fraction(files: list[Path]) -> float | None:
    """Share of these files' bytes now in the page cache (util-linux fincore), None if unavailable."""
    if not shutil.which("fincore"):
        return None
    try:
        out = subprocess.run(["fincore", "-b", "-n", "-r", "-o", "RES,SIZE", *map(str, files)],
                             capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    res = size = 0
    for line in out.split("\n"):
        if line.strip():
            r, sz = line.split()[:2]
            res, size = res + int(r), size + int(sz)
    return res / size if size else None


def prepare_cache(files: list[Path], mode: str) -> float | None:
    os.sync()  # earlier runs' dirty pages must not be flushed on the next run's clock
    if mode == "cold":
        evict(files)
    else:
        prewarm(files)
    return resident_fraction(files)


# ---------------------------------------------------------------------------------------------------
# Timed subprocesses


def fsync_tree(folder: Path) -> float:
    start = time.perf_counter()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    return time.perf_counter() - start


def import_overhead() -> float:
    """Seconds for a fresh interpreter to import the converter (warm): the fixed cost in every convert."""
    cmd = [sys.executable, "-c", "import gqakit.cli, gqakit.convert.run"]
    subprocess.run(cmd, check=True)
    start = time.perf_counter()
    subprocess.run(cmd, check=True)
    return time.perf_counter() - start


# ---------------------------------------------------------------------------------------------------
# A cheap, gqakit-independent check of the converted checkpoint


def read_tensor(loc: dict[str, Path], name: str) -> torch.Tensor:
    with safe_open(str(loc[name]), framework="pt") as f:
        return f.get_tensor(name)


def attention_rows(loc: dict[str, Path], family: str, s: Shape, layer: int, proj: str) -> torch.Tensor:
    """Layer `layer`'s q/k/v weight as the class convert-gqa writes holds it before pooling (float32): Llama's own;
    for GPT-NeoX, its rows of the fused query_key_value times input_layernorm's scale (folded in for Phi)."""
    if family == "llama":
        return read_tensor(loc, f"model.layers.{layer}.self_attn.{proj}.weight").float()
    a = f"gpt_neox.layers.{layer}."
    qkv = read_tensor(loc, a + "attention.query_key_value.weight").float()
    rows = qkv.view(s.heads, 3, s.head_dim, s.hidden)[:, "qkv".index(proj[0])]  # (H, d, in)
    return rows.reshape(s.heads * s.head_dim, s.hidden) * read_tensor(loc, a + "input_layernorm.weight").float()


def verify(src: Path, dst: Path, s: Shape, groups: int, family: str = "llama") -> list[str]:
    """Return a list of problems (empty when the output looks right)."""
    problems = []
    config = json.loads((dst / "config.json").read_text())
    if config.get("num_key_value_heads") != groups:
        problems.append(f"config num_key_value_heads={config.get('num_key_value_heads')}, expected {groups}")
    if config.get("architectures") != [FAMILIES[family][5]]:
        problems.append(f"config architectures={config.get('architectures')}, expected [{FAMILIES[family][5]}]")
    src_loc, dst_loc = tensor_locations(src), tensor_locations(dst)
    if family == "llama" and set(src_loc) != set(dst_loc):
        problems.append(f"tensor names differ: {sorted(set(src_loc) ^ set(dst_loc))[:4]}")
        return problems
    want = [groups * s.head_dim, s.hidden]
    for n in range(s.layers):
        for proj in ("k_proj", "v_proj"):
            name = f"model.layers.{n}.self_attn.{proj}.weight"
            if name not in dst_loc:
                return problems + [f"{name} is missing from the output"]
            with safe_open(str(dst_loc[name]), framework="pt") as f:
                got = f.get_slice(name).get_shape()
            if list(got) != want:
                problems.append(f"{name} has shape {got}, expected {want}")
    layer = s.layers // 2
    per = s.heads // groups
    for proj in ("k_proj", "v_proj", "q_proj"):
        name = f"model.layers.{layer}.self_attn.{proj}.weight"
        before = attention_rows(src_loc, family, s, layer, proj)
        after = read_tensor(dst_loc, name)
        if proj == "q_proj":
            expect = before.to(torch.bfloat16)  # passed through byte for byte (GPT-NeoX: folded, not pooled)
        else:
            heads = before.view(s.heads, s.head_dim, s.hidden)  # (H, d, in)
            expect = (heads.view(groups, per, s.head_dim, s.hidden).sum(dim=1) / per)  # (G, d, in)
            expect = expect.reshape(groups * s.head_dim, s.hidden).to(torch.bfloat16)
        if after.shape != expect.shape:
            problems.append(f"{name}: shape {list(after.shape)} != {list(expect.shape)}")
        elif not torch.equal(after, expect):
            diff = (after.float() - expect.float()).abs().max().item()
            ulp = expect.float().abs().max().item() * 2 ** -7  # one bf16 ulp at the largest value
            if proj == "q_proj" or diff > ulp:
                problems.append(f"{name}: differs from the {'source' if proj == 'q_proj' else 'head mean'} "
                                f"by up to {diff:.3g}")
    return problems


# ---------------------------------------------------------------------------------------------------


def measure_cp(src: Path, dst: Path, files: list[Path], cache: str, scratch: Path) -> dict:
    resident = prepare_cache(files, cache)
    log(f"cp -r (source {_pct(resident)} cached) ...")
    seconds, _ = run_child(["cp", "-r", str(src), str(dst)], scratch)
    sync_s = fsync_tree(dst)
    log(f"cp -r: {seconds:.2f} s (+{sync_s:.2f} s to fsync its output)")
    shutil.rmtree(dst)
    return {"seconds": seconds, "sync_seconds": seconds + sync_s, "resident": resident}


def measure_convert(src: Path, dst: Path, files: list[Path], cache: str, scratch: Path, groups: int,
                    max_shard: str, s: Shape, check: bool, family: str = "llama") -> dict:
    resident = prepare_cache(files, cache)
    log(f"convert-gqa --groups {groups} (source {_pct(resident)} cached) ...")
    cmd = [*converter_command(), "--groups", str(groups), str(src), "-o", str(dst), "--quiet",
           "--max-shard-size", max_shard]
    seconds, rss_kib = run_child(cmd, scratch)
    log(f"convert-gqa: {seconds:.2f} s, peak RSS {rss_kib / 1024:.0f} MiB")
    result = {"seconds": seconds, "rss_mb": rss_kib / 1024, "resident": resident,
              "out_bytes": tree_bytes(dst)}
    if check:
        result["problems"] = verify(src, dst, s, groups, family)
        log(f"output check: {'ok' if not result['problems'] else result['problems']}")
    shutil.rmtree(dst)
    return result


def _pct(x: float | None) -> str:
    return "?" if x is None else f"{100 * x:.0f}%"


def _times(runs: list[dict], key: str) -> str:
    return ", ".join(f"{r[key]:.2f}" for r in runs)


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Shape]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--family", choices=sorted(FAMILIES), default="llama",
                   help="source to synthesise: Llama-2-7B-shaped (default) or Pythia-6.9B-shaped GPT-NeoX")
    p.add_argument("--small", action="store_true", help="quick preset: 4 layers, hidden 1024, 16 heads")
    p.add_argument("--layers", type=int)
    p.add_argument("--hidden", type=int)
    p.add_argument("--intermediate", type=int)
    p.add_argument("--heads", type=int)
    p.add_argument("--vocab", type=int)
    p.add_argument("--groups", type=int, default=8, help="K/V heads after conversion (default 8)")
    p.add_argument("--max-shard-size", default="5GB", help="shard cap for source and output (default 5GB)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs of each command; the median is reported")
    p.add_argument("--cache", choices=["cold", "warm"], default="cold",
                   help="source state before every timed run: evicted from the page cache (default) or pre-read")
    p.add_argument("--scratch", default="scratch", help="parent of the temporary work folder (default ./scratch)")
    p.add_argument("--source", default=None, help="use this existing checkpoint instead of synthesising one")
    p.add_argument("--keep", action="store_true", help="keep the work folder (synthesised checkpoint)")
    args = p.parse_args(argv)
    base = PRESETS[FAMILIES[args.family][3 if args.small else 2]]
    shape = Shape(**{f.name: getattr(args, f.name) or getattr(base, f.name) for f in dataclasses.fields(Shape)})
    if shape.hidden % shape.heads:
        p.error(f"--hidden {shape.hidden} is not divisible by --heads {shape.heads}")
    if args.groups <= 0 or shape.heads % args.groups:
        p.error(f"--groups {args.groups} must divide --heads {shape.heads}")
    if args.repeats < 1:
        p.error("--repeats must be at least 1")
    try:
        max_shard_bytes(args.max_shard_size)
    except GqakitError as e:
        p.error(str(e))
    if args.source:
        cfg = json.loads((Path(args.source) / "config.json").read_text())
        args.family = "gpt_neox" if cfg.get("model_type") == "gpt_neox" else "llama"
        shape = Shape(cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"],
                      cfg["num_attention_heads"], cfg["vocab_size"])
    return args, shape


def main(argv: list[str] | None = None) -> int:
    args, shape = parse_args(argv)
    scratch = Path(args.scratch).resolve()
    scratch.mkdir(parents=True, exist_ok=True)
    entries = FAMILIES[args.family][1](shape)
    need = entries_bytes(entries) * (1 if args.source else 2) + (2 << 30)
    free = shutil.disk_usage(scratch).free
    if free < need:
        raise SystemExit(f"{scratch} has {free / 1e9:.1f} GB free; this shape needs about {need / 1e9:.1f} GB "
                         "(source plus one copy at a time); free space or pass --scratch elsewhere")
    work = Path(tempfile.mkdtemp(prefix="convert-speed-", dir=scratch))
    try:
        if args.source:
            src = Path(args.source).resolve()
            synth_s = None
        else:
            src = work / f"{args.family}-mha"
            log(f"synthesising a {shape.label(shape.heads)} bf16 checkpoint in {src} ...")
            start = time.perf_counter()
            synthesise(src, shape, max_shard_bytes(args.max_shard_size), args.family)
            synth_s = time.perf_counter() - start
        files = weight_files(src)
        src_bytes = tree_bytes(src)
        log(f"source: {src_bytes / 1e9:.2f} GB in {len(files)} weight file(s)"
            + (f", written in {synth_s:.1f} s" if synth_s else ""))
        overhead = import_overhead()
        # One untimed read of the whole source first, so that no timed run pays alone for caches below
        # this machine's (a VM's virtual disk may be cached by its host, where fadvise cannot reach).
        log("untimed warm-up read of the source ...")
        prewarm(files)

        cps, convs = [], []
        for rep in range(args.repeats):
            # Alternate the order so neither command always runs right after the other's writes.
            first_cp = rep % 2 == 0
            for which in (("cp", "convert") if first_cp else ("convert", "cp")):
                if which == "cp":
                    cps.append(measure_cp(src, work / "copy", files, args.cache, scratch))
                else:
                    convs.append(measure_convert(src, work / "gqa", files, args.cache, scratch, args.groups,
                                                 args.max_shard_size, shape, check=rep == 0, family=args.family))

        cp_s = statistics.median(r["seconds"] for r in cps)
        cp_sync_s = statistics.median(r["sync_seconds"] for r in cps)
        conv_s = statistics.median(r["seconds"] for r in convs)
        rss_mb = max(r["rss_mb"] for r in convs)
        problems = convs[0]["problems"]
        ratio, ratio_sync = conv_s / cp_s, conv_s / cp_sync_s

        print(f"## convert-gqa vs cp -r ({'median of ' + str(args.repeats) if args.repeats > 1 else '1 run'}, "
              f"{args.cache} page cache)\n")
        print("| shape | source GB | output GB | cp -r s | cp -r + fsync s | convert s | convert / cp | "
              "convert / (cp + fsync) | convert peak RSS MiB | output check |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        print(f"| {shape.label(args.groups)} | {src_bytes / 1e9:.2f} | {convs[0]['out_bytes'] / 1e9:.2f} | "
              f"{cp_s:.2f} | {cp_sync_s:.2f} | {conv_s:.2f} | {ratio:.2f}x | {ratio_sync:.2f}x | {rss_mb:.0f} | "
              f"{'ok' if not problems else 'WRONG'} |")
        print("\n| target | measured | limit | result |")
        print("|---|---|---|---|")
        print(f"| time: convert / cp -r | {ratio:.2f}x | <= {RATIO_TARGET}x | {_verdict(ratio <= RATIO_TARGET)} |")
        print(f"| time: convert / (cp -r + fsync) | {ratio_sync:.2f}x | <= {RATIO_TARGET}x | "
              f"{_verdict(ratio_sync <= RATIO_TARGET)} |")
        print(f"| memory: convert peak RSS | {rss_mb:.0f} MiB | <= {RSS_TARGET_MB} MiB (1.5 GiB) | "
              f"{_verdict(rss_mb <= RSS_TARGET_MB)} |")
        print(f"| output: k/v shapes [G*d, hidden], pooled k/v = head mean, q unchanged"
              f"{' (its norm folded in)' if args.family == 'gpt_neox' else ''} | "
              f"{'ok' if not problems else '; '.join(problems)} | exact | {_verdict(not problems)} |")

        load = os.getloadavg()
        print("\nNotes:")
        cache = ("evicted from the page cache (posix_fadvise DONTNEED on each file)" if args.cache == "cold"
                 else "pre-read into the page cache")
        print(f"- Every timed run starts after `sync`, with the source's weight files {cache}"
              f"; measured resident share before the runs: cp {', '.join(_pct(r['resident']) for r in cps)}; "
              f"convert {', '.join(_pct(r['resident']) for r in convs)}. Order alternates per repeat "
              f"(cp first on even repeats); each output is deleted before the next run.")
        print("- `cp -r` returns with its data in dirty pages; convert-gqa fsyncs every shard before publishing. "
              "The `cp -r + fsync` column adds the time to fsync cp's output, the like-for-like baseline.")
        print(f"- Before the timed runs the whole source was read once, untimed, so that caches below the guest "
              f"(e.g. a VM host's) are as warm for the first run as for the later ones. Raw timings, in run "
              f"order per command: cp -r {_times(cps, 'seconds')} s; cp -r + fsync "
              f"{_times(cps, 'sync_seconds')} s; convert "
              f"{_times(convs, 'seconds')} s.")
        print(f"- Peak RSS is the converter process's own VmHWM, written by it at exit. Every convert run includes "
              f"~{overhead:.2f} s of interpreter start and imports (torch), measured separately with a warm cache; "
              f"without it convert / cp -r would be {(conv_s - overhead) / cp_s:.2f}x.")
        _, _, full, _, label, _ = FAMILIES[args.family]
        arch = "GPTNeoXForCausalLM (re-hosted on PhiForCausalLM)" if args.family == "gpt_neox" else "LlamaForCausalLM"
        print(f"- Source: synthetic {label + '-shaped ' if shape == PRESETS[full] else ''}bf16 {arch} "
              f"({shape.label(shape.heads)}), {len(files)} weight file(s), shard cap {args.max_shard_size}; "
              f"converted with `convert-gqa --groups {args.groups} SRC -o DST --quiet --max-shard-size "
              f"{args.max_shard_size}`.")
        print(f"- Machine: {os.cpu_count()} CPUs, load average {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} "
              f"(1 / 5 / 15 min) at the end; python {sys.version.split()[0]}, torch {torch.__version__}.")
        return 0 if not problems else 1
    finally:
        if args.keep:
            log(f"kept {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
