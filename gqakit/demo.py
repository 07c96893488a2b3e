"""`gqakit demo`: convert the embedded MHA model to GQA-4, GQA-2 and MQA with each merge method, and
compare held-out perplexity and KV-cache size against the original."""
from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import torch

from gqakit import __version__
from gqakit.hf.compat import LOAD_KWARGS
from gqakit.convert import ConvertConfig, convert, methods
from gqakit.common.errors import GqakitError, opt
from gqakit.hf.loading import kv_bytes_per_token, kv_heading, model_dtype
from gqakit.evaluate.perplexity import perplexity
from gqakit.common.report import prepare_output, write_report
from gqakit.reference import HELDOUT_TEXT, reference_model_path

GROUPS = (4, 2, 1)
METHODS = methods.HEADWISE  # the weights-only merges of the GQA paper's table: no calibration


COMPUTE_DTYPE = torch.float32  # perplexity is computed, and so the KV cache held, in fp32


def evaluate_folder(path: Path, ids: torch.Tensor, window: int) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=COMPUTE_DTYPE, **LOAD_KWARGS).eval()
    return {
        "kv_heads": model.config.num_key_value_heads,
        "kv_bytes_per_token": kv_bytes_per_token(model.config, model_dtype(model)),  # as `gqakit eval` counts
        "perplexity": perplexity(model, ids, window, progress=False),
    }


def demo_table(rows: list[dict], dtype: torch.dtype = COMPUTE_DTYPE) -> str:
    header = f"| model | K/V heads | method | {kv_heading(dtype)} | held-out perplexity | vs MHA |"
    lines = [header, "|---|---|---|---|---|---|"]
    base = rows[0]["perplexity"]
    for r in rows:
        lines.append(f"| {r['model']} | {r['kv_heads']} | {r['method']} | {r['kv_bytes_per_token']:,} | "
                     f"{r['perplexity']:.2f} | {r['perplexity'] / base:.2f}x |")
    return "\n".join(lines)


def run_demo(output_dir: str | None = None, eval_tokens: int | None = None, keep: bool = False,
             force: bool = False, model_dir: str | None = None, command: str = "gqakit demo") -> list[dict]:
    """Convert, evaluate, print the table; with `output_dir`, also write a report (results.json/.csv) there."""
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line per model instead of a loading bar each
    for name, given in (("keep", keep), ("force", force)):
        if given and not output_dir:
            raise GqakitError(f"{opt(name)} acts on the {opt('output_dir')} folder, and none is given; add "
                              f"{opt('output_dir', 'DIR')} or drop {opt(name)}")
    source = Path(model_dir) if model_dir else reference_model_path()
    out = prepare_output(output_dir, "demo", force, [("the model", source)]) if output_dir else None
    tok = AutoTokenizer.from_pretrained(source)
    ids = torch.tensor(tok(HELDOUT_TEXT.read_text(encoding="utf-8")).input_ids)
    if eval_tokens:  # 0 or None: the whole held-out text
        if eval_tokens < 2:
            raise GqakitError(f"{opt('eval_tokens', eval_tokens)} is too small; score at least 2 tokens, or 0 for all")
        ids = ids[:eval_tokens]
    window = json.loads((source / "pretraining.json").read_text())["heldout"]["window"] \
        if (source / "pretraining.json").is_file() else 512
    window = min(window, ids.numel())  # a shorter text is one window of its length (it said the longer one)
    print(f"gqakit {__version__} demo: {source.name}, {ids.numel():,} held-out tokens "
          f"({HELDOUT_TEXT.name}), windows of {window}")

    work = Path(tempfile.mkdtemp(prefix="gqakit-demo-"))
    rows = []
    try:
        t0 = time.time()
        rows.append({"model": "original (MHA)", "method": "-", **evaluate_folder(source, ids, window)})
        for groups in GROUPS:
            for method in METHODS:
                name = f"{'MQA' if groups == 1 else f'GQA-{groups}'}"
                folder = work / f"{name.lower()}-{method}"
                convert(ConvertConfig(model_dir=str(source), groups=groups, output_dir=str(folder),
                                      method=method, progress=False))
                rows.append({"model": name, "method": method, **evaluate_folder(folder, ids, window)})
                print(f"  {name:6s} {method:6s} perplexity {rows[-1]['perplexity']:10.2f}", flush=True)
        print(demo_table(rows))
        print(f"({time.time() - t0:.0f}s; perplexity: disjoint {window}-token windows, fp32 compute)")
        if out is not None:
            # write_report's per-file hook also places the kept model folders before the atomic swap.
            kept = {f.name: (lambda dest, f=f: shutil.move(str(f), dest)) for f in sorted(work.iterdir())} \
                if keep else {}
            write_report(out, kind="demo", command=command, force=force, rows=rows, plots=kept,
                         config={"model": str(source), "eval_tokens": eval_tokens, "keep": keep},
                         results={"heldout_tokens": ids.numel(), "window": window, "rows": rows})
            print(f"wrote {out}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return rows
