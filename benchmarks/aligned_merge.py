"""Does aligning K/V heads before merging them keep more of a model than mean-pooling? (issue 13)

Builds each converted model in memory (gqakit.convert.methods.align.align_and_merge_layer on every layer,
`num_key_value_heads = G`, `from_config` + `load_state_dict`), rounds the converted tensors to the
checkpoint's own dtype as `convert-gqa --dtype auto` would, and scores perplexity with
gqakit.evaluate.perplexity in fp32:

* embedded (gqakit/assets/austen-mha-8h): held-out *Emma* with the demo's tokenisation and 512-token
  disjoint windows (`gqakit demo`; `--eval-tokens 0` = the whole text, as in the README's table);
* smollm2 (runs/smollm2-135m-gqa, made by ../shared/scripts/prepare_smollm2.py runs): the first 4,096
  tokens of WikiText-2 test with 1,024-token disjoint windows (`gqakit eval ppl ... --max-tokens 4096`).

Calibrated variants take moments of each layer's attention input (E[x x^T]; with "attn", the
attention-weighted key covariance and the attention-averaged value moment) from the ORIGINAL model on text
disjoint from the evaluation text (embedded: *Pride and Prejudice*, a training text; smollm2: Austen
and TinyStories from ../shared/corpora). A benchmark, never a test.

    OMP_NUM_THREADS=2 python benchmarks/aligned_merge.py embedded --groups 4 2 1
    OMP_NUM_THREADS=2 python benchmarks/aligned_merge.py smollm2 --groups 1 --methods mean pca pca-calib
"""
from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch

from _measure import ROOT
from gqakit.convert.methods.align import align_and_merge_layer
from gqakit.evaluate.perplexity import perplexity
from gqakit.hf.compat import LOAD_KWARGS

SHARED = ROOT.parent / "shared"
SMOLLM2 = ROOT / "runs" / "smollm2-135m-gqa"  # python ../shared/scripts/prepare_smollm2.py runs

# name -> keyword arguments of align_and_merge_layer (+ "metric": None | "gamma" | "calib" | "calib-cov" |
# "attn" | "calib-attnv", and "shrink" toward the identity metric)
VARIANTS = {
    "mean": dict(align=False, restore="none"),
    "mean+norm": dict(align=False, restore="norm"),
    "mean+refit": dict(align=False, restore="refit"),
    "aligned-first": dict(key_scale="none", reference="first", restore="none"),
    "aligned": dict(key_scale="none", reference="mean", restore="none"),
    "aligned+norm": dict(key_scale="none", reference="mean", restore="norm"),
    "aligned+refit": dict(key_scale="none", reference="mean", restore="refit"),
    "aligned-match": dict(key_scale="match", reference="mean", restore="none"),
    "aligned-match+norm": dict(key_scale="match", reference="mean", restore="norm"),
    "aligned-match+refit": dict(key_scale="match", reference="mean", restore="refit"),
    "aligned-balance+refit": dict(key_scale="balance", reference="mean", restore="refit"),
    "pca": dict(merge="pca", restore="refit"),
    "pca-gamma": dict(merge="pca", restore="refit", metric="gamma"),
    "pca-calib": dict(merge="pca", restore="refit", metric="calib"),
    "pca-calib-cov": dict(merge="pca", restore="refit", metric="calib-cov"),  # keys: centred covariance
    # attention-aware calibration: keys in the attention-weighted covariance of the keys around each query's
    # attended mean (what a first-order change of the softmax sees), values in the moment of the
    # attention-averaged inputs (what reaches o_proj)
    "pca-attn": dict(merge="pca", restore="refit", metric="attn"),
    "pca-attn-s0.1": dict(merge="pca", restore="refit", metric="attn", shrink=0.1),  # 10% identity
    "pca-attn-s0.5": dict(merge="pca", restore="refit", metric="attn", shrink=0.5),
    "pca-calib-attnv": dict(merge="pca", restore="refit", metric="calib-attnv"),
    "aligned+refit-attn": dict(key_scale="none", reference="mean", restore="refit", metric="attn"),
    "aligned+refit-calib": dict(key_scale="none", reference="mean", restore="refit", metric="calib"),
    "aligned-match+norm-calib": dict(key_scale="match", reference="mean", restore="norm", metric="calib"),
    "pca+sim": dict(merge="pca", restore="refit", grouping="similarity"),
    "pca-calib+sim": dict(merge="pca", restore="refit", metric="calib", grouping="similarity"),
    "aligned+refit+sim": dict(key_scale="none", reference="mean", restore="refit", grouping="similarity"),
    "pca-attn+sim": dict(merge="pca", restore="refit", metric="attn", grouping="similarity"),
    "aligned-match+norm+sim": dict(key_scale="match", reference="mean", restore="norm", grouping="similarity"),
}


def load(name: str):
    """(model fp32, token ids to score, window, calibration ids, storage dtype)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name == "embedded":
        from gqakit.reference import HELDOUT_TEXT, reference_model_path

        path = reference_model_path()
        tok = AutoTokenizer.from_pretrained(path)
        ids = torch.tensor(tok(HELDOUT_TEXT.read_text(encoding="utf-8")).input_ids)  # as gqakit demo
        window = json.loads((path / "pretraining.json").read_text())["heldout"]["window"]
        calib_text = (ROOT / "gqakit/assets/pride_and_prejudice.txt").read_text(encoding="utf-8")
    else:
        from gqakit.common.text import encode_documents, load_documents

        path = SMOLLM2
        tok = AutoTokenizer.from_pretrained(path)
        ids = encode_documents(load_documents(str(SHARED / "corpora/wikitext2_raw/wiki.test.raw")), tok, 4096)
        window = 1024  # min(1024, context): `gqakit eval ppl`'s default
        calib_text = ((SHARED / "corpora/austen/prideprejudice.txt").read_text(encoding="utf-8")[:20000] + "\n"
                      + (SHARED / "corpora/tinystories_sample/tinystories.txt").read_text(encoding="utf-8")[:20000])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **LOAD_KWARGS).eval()
    stored = json.loads((Path(path) / "config.json").read_text()).get("dtype", "float32")
    calib = torch.tensor(tok(calib_text, add_special_tokens=False).input_ids)
    return model, ids, window, calib, getattr(torch, stored)


@torch.no_grad()
def input_moments(model, ids: torch.Tensor, tokens: int, window: int) -> list[tuple[torch.Tensor, ...]]:
    """Per layer, over `tokens` calibration tokens (float64), of the attention-projection input x:
    E[x x^T], E[x], E_{head, query m}[Cov_{n ~ a_m}(x_n)] and E_{head, m}[xbar_m xbar_m^T] (xbar_m = sum_n a_mn x_n)."""
    layers = model.model.layers
    n = model.config.hidden_size
    sums = [torch.zeros(n, n, dtype=torch.float64) for _ in layers]
    firsts = [torch.zeros(n, dtype=torch.float64) for _ in layers]
    counts = [0] * len(layers)

    keys = [torch.zeros(n, n, dtype=torch.float64) for _ in layers]  # sum over heads, queries of Cov_{n~a_m}(x_n)
    vals = [torch.zeros(n, n, dtype=torch.float64) for _ in layers]  # sum over heads, queries of xbar_m xbar_m^T
    xs: list[torch.Tensor] = [None] * len(layers)

    def hook(i):
        def f(_module, args):
            x = args[0].reshape(-1, args[0].shape[-1]).double()  # (B*T, n)
            sums[i].add_(x.T @ x)
            firsts[i].add_(x.sum(0))
            counts[i] += x.shape[0]
            xs[i] = x
        return f

    before = model.config._attn_implementation
    model.set_attn_implementation("eager")  # to read the attention probabilities
    handles = [layer.self_attn.q_proj.register_forward_pre_hook(hook(i)) for i, layer in enumerate(layers)]
    heads_seen = 0
    try:
        ids = ids[:tokens]
        for s in range(0, ids.numel(), window):
            att = model(input_ids=ids[s:s + window][None], output_attentions=True).attentions
            for i, a in enumerate(att):
                a, x = a[0].double(), xs[i]  # (H, T, T), (T, n)
                xbar = a @ x  # (H, T, n): each query's attended input
                keys[i].add_((x * a.sum(dim=(0, 1))[:, None]).T @ x - torch.einsum("htn,htm->nm", xbar, xbar))
                vals[i].add_(torch.einsum("htn,htm->nm", xbar, xbar))
            heads_seen += att[0].shape[1] * att[0].shape[2]
    finally:
        for h in handles:
            h.remove()
        model.set_attn_implementation(before)
    return [(s / c, f / c, k / heads_seen, v / heads_seen) for s, f, c, k, v in zip(sums, firsts, counts, keys, vals)]


def convert_in_memory(model, groups: int, variant: dict, moments=None, store_dtype=torch.float32,
                      only: str | None = None, layers=None):
    """The model with `groups` K/V heads built by the merge `variant` (fp32, tensors rounded to store_dtype).

    `only="keys"` / `"values"` (a diagnostic) merges just that side and keeps the model's K/V head count:
    the merged heads are repeated back (an exact stand-in for the merged side) and the other side is untouched;
    `"both"` repeats both back. `layers` (with `only`) merges just those layers.
    """
    from gqakit.convert.methods.pooling import expand_heads
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(model.config)
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    kw = {k: v for k, v in variant.items() if k not in ("metric", "shrink")}

    def shrunk(m):  # (1 - s) * M / mean(diag M) + s * I: a metric between the calibrated one and the identity
        lam = variant.get("shrink", 0.0)
        return m if not lam else (1 - lam) * m / m.diagonal().mean() + lam * torch.eye(m.shape[0], dtype=m.dtype)

    sd = {k: v.clone() for k, v in model.state_dict().items()}
    for i, layer in enumerate(model.model.layers):
        if layers is not None and i not in layers:
            continue
        a = layer.self_attn
        bias = lambda lin: None if lin.bias is None else lin.bias.detach()  # noqa: E731
        extra = {}
        if variant.get("metric") == "gamma":
            extra["input_scale"] = layer.input_layernorm.weight.detach()
        elif variant.get("metric") == "calib":
            extra["input_moment"] = moments[i][0]
        elif variant.get("metric") == "attn":
            extra["input_moment"], extra["value_moment"] = shrunk(moments[i][2]), shrunk(moments[i][3])
        elif variant.get("metric") == "calib-attnv":
            extra["input_moment"], extra["value_moment"] = moments[i][0], moments[i][3]
        elif variant.get("metric") == "calib-cov":
            mom, mu = moments[i]
            extra["input_moment"] = mom - torch.outer(mu, mu)
            extra["value_moment"] = mom
        out = align_and_merge_layer(a.q_proj.weight.detach(), a.k_proj.weight.detach(), a.v_proj.weight.detach(),
                                    a.o_proj.weight.detach(), bias(a.q_proj), bias(a.k_proj), bias(a.v_proj),
                                    heads, kv, groups, d, **kw, **extra)
        p = f"model.layers.{i}.self_attn."
        if only == "keys":  # (q', repeat(Kg)) with the original v and o
            out = out._replace(k_w=expand_heads(out.k_w, groups, kv), v_w=None, o_w=None, v_b=None,
                               k_b=None if out.k_b is None else expand_heads(out.k_b, groups, kv))
        elif only == "both":
            out = out._replace(**{f: None if getattr(out, f) is None else expand_heads(getattr(out, f), groups, kv)
                                  for f in ("k_w", "v_w", "k_b", "v_b")})
        elif only == "values":
            out = out._replace(v_w=expand_heads(out.v_w, groups, kv), q_w=None, k_w=None, q_b=None, k_b=None,
                               v_b=None if out.v_b is None else expand_heads(out.v_b, groups, kv))
        for name, t in zip(("q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight",
                            "q_proj.bias", "k_proj.bias", "v_proj.bias"), out[:7]):
            if t is not None:
                sd[p + name] = t.to(store_dtype).float()
    cfg.num_key_value_heads = groups if only is None else kv
    new = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    new.load_state_dict(sd)
    return new


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", choices=["embedded", "smollm2"])
    ap.add_argument("--groups", type=int, nargs="+", default=None)
    ap.add_argument("--methods", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    ap.add_argument("--eval-tokens", type=int, default=None,
                    help="tokens to score (embedded: 16,384 as gqakit demo, 0 = the whole held-out text; "
                         "smollm2: at most 4,096)")
    ap.add_argument("--calib-tokens", type=int, default=4096)
    ap.add_argument("--no-original", action="store_true", help="skip scoring the unconverted model")
    ap.add_argument("--only", choices=["keys", "values", "both"], default=None,
                    help="diagnostic: merge only keys or only values (the other side stays unmerged), or both, "
                         "repeated back to the model's K/V heads")
    ap.add_argument("--layers", type=int, nargs="+", default=None, help="diagnostic (with --only): merge only these")
    ap.add_argument("--per-layer", action="store_true", help="diagnostic (with --only): one row per merged layer")
    ap.add_argument("--json", default=None, help="append each result as one JSON line to this file")
    args = ap.parse_args(argv)
    if args.model == "smollm2" and not SMOLLM2.is_dir():
        raise SystemExit(f"{SMOLLM2} is missing; make it with python ../shared/scripts/prepare_smollm2.py runs")
    model, ids, window, calib, store = load(args.model)
    tokens = args.eval_tokens if args.eval_tokens is not None else (16384 if args.model == "embedded" else 0)
    if tokens:
        ids = ids[:tokens]
    groups = args.groups or ([4, 2, 1] if args.model == "embedded" else [1])
    print(f"{args.model}: {ids.numel():,} tokens, {window}-token windows, converted tensors stored as {store}, "
          f"{torch.get_num_threads()} threads", flush=True)
    moments = None
    if any(VARIANTS[m].get("metric") in ("calib", "calib-cov", "attn", "calib-attnv") for m in args.methods):
        t0 = time.time()
        moments = input_moments(model, calib, args.calib_tokens, window)
        print(f"calibration: E[xx^T] over {min(args.calib_tokens, calib.numel()):,} tokens ({time.time() - t0:.0f}s)",
              flush=True)
    results = []

    def record(row):
        results.append(row)
        print(f"  G={row['groups']:<2} {row['method']:26s} ppl {row['perplexity']:12.2f}  "
              f"(convert {row['convert_s']:.1f}s, eval {row['eval_s']:.0f}s)", flush=True)
        if args.json:
            with open(args.json, "a") as f:
                f.write(json.dumps({"model": args.model, "tokens": ids.numel(), "window": window, **row}) + "\n")

    if not args.no_original:
        t0 = time.time()
        ppl = perplexity(model, ids, window, progress=False)
        record({"groups": model.config.num_key_value_heads, "method": "original", "perplexity": ppl,
                "convert_s": 0.0, "eval_s": time.time() - t0})
    for g in groups:
        for name in args.methods:
            for layers in ([[i] for i in range(model.config.num_hidden_layers)] if args.per_layer else [args.layers]):
                t0 = time.time()
                new = convert_in_memory(model, g, VARIANTS[name], moments, store, args.only, layers)
                t1 = time.time()
                ppl = perplexity(new, ids, window, progress=False)
                record({"groups": g, "method": name if layers is None else f"{name} layers {layers}",
                        "only": args.only, "perplexity": ppl, "convert_s": t1 - t0, "eval_s": time.time() - t1})
                del new
    names = list(dict.fromkeys(r["method"] for r in results if r["method"] != "original"))
    print("\n| method | " + " | ".join(f"G={g}" for g in groups) + " |")
    print("|---|" + "---|" * len(groups))
    for name in names:
        cells = [next((f"{r['perplexity']:,.1f}" for r in results if r["method"] == name and r["groups"] == g), "-")
                 for g in groups]
        print(f"| {name} | " + " | ".join(cells) + " |")
    if not args.no_original:
        print(f"(original: {results[0]['perplexity']:,.2f})")


if __name__ == "__main__":
    main()
