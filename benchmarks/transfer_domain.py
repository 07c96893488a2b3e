"""Which calibration text attention transfer should learn from: train one layer's merged attention on each text,
score it on the evaluation text's windows.

For each `--source NAME=PATH:WINDOWS` the original model (float32, sdpa) runs over WINDOWS windows of 512 tokens
of PATH (a .txt file, or a .jsonl file of `{"text": ...}` rows such as `gqakit sample` writes), and hooks keep each
probed layer's attention inputs and outputs; the evaluation text's first `--eval-tokens` tokens, in 1,024-token
windows as `gqakit eval ppl` scores them, are recorded the same way. Then for every layer and every `--mix`
(a comma-separated list of source names) the layer's K/V heads are mean-pooled to `--groups` and trained with
`convert.methods.transfer.transfer_layer` (the `TransferOptions` in `--options`) on the mix's windows, one in eight of
each source held out to pick the best weights, exactly as `convert-gqa --method transfer` trains; the table gives
the relative error of the attention output, sqrt(sum ||y' - y||^2 / sum ||y||^2), on the held-out calibration
windows and on the evaluation windows, before and after training.

    python benchmarks/transfer_domain.py runs/smollm2-135m-gqa --layers 4,16 \\
        --source austen=../shared/corpora/austen/prideprejudice.txt:64 \\
        --source wiki=runs/wikitext2-test-from-line-72.txt:64 --source samples=runs/smollm2-samples.jsonl:64 \\
        --eval ../shared/corpora/wikitext2_raw/wiki.test.raw --mix austen --mix wiki --mix samples

A benchmark, never a test. Progress goes to stderr; stdout is the markdown table.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from gqakit.common.text import ROW_SUFFIXES, encode_documents, load_documents
from gqakit.convert.methods.transfer import build_attention, output_error, transfer_layer
from gqakit.convert.options import TransferOptions
from gqakit.hf.compat import LOAD_KWARGS

WINDOW = 512


def read_ids(tokenizer, path: str, tokens: int) -> torch.Tensor:
    """The first `tokens` token ids of a text file, or of a .jsonl file's rows joined with EOS, read as `gqakit
    eval` reads them (`gqakit.common.text`)."""
    is_text = Path(path).suffix.lower() not in ROW_SUFFIXES
    documents = load_documents(text=path if is_text else None, dataset=None if is_text else path)
    ids = encode_documents(documents, tokenizer, tokens)
    if len(ids) < tokens:
        raise SystemExit(f"{path} gives {len(ids)} tokens, fewer than the {tokens} asked")
    return ids


class Recorder:
    """Each probed layer's attention inputs, outputs and keyword inputs over a list of windows."""

    def __init__(self, model, layers: list[int]):
        self.model, self.layers, self.seen = model, layers, {}
        for i in layers:
            attn = model.model.layers[i].self_attn
            attn.register_forward_pre_hook(self._pre(i), with_kwargs=True)
            attn.register_forward_hook(self._post(i), with_kwargs=True)

    def _pre(self, i):
        def hook(_module, _args, kwargs):
            self.seen[i]["kwargs"] = {k: v for k, v in kwargs.items()
                                      if k not in ("hidden_states", "past_key_values", "past_key_value")}
            self.seen[i]["x"].append(kwargs["hidden_states"][0].clone())
        return hook

    def _post(self, i):
        def hook(_module, _args, _kwargs, out):
            self.seen[i]["y"].append(out[0][0].clone())
        return hook

    def record(self, windows: torch.Tensor) -> dict[int, tuple[torch.Tensor, torch.Tensor, dict]]:
        self.seen = {i: {"x": [], "y": []} for i in self.layers}
        with torch.no_grad():
            for w in windows:
                self.model(w[None], use_cache=False)
        return {i: (torch.stack(s["x"]), torch.stack(s["y"]), s["kwargs"]) for i, s in self.seen.items()}


def main(argv=None) -> int:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("model")
    p.add_argument("--groups", type=int, default=1)
    p.add_argument("--layers", default="4,16")
    p.add_argument("--source", action="append", required=True, metavar="NAME=PATH:WINDOWS")
    p.add_argument("--eval", required=True, help="the evaluation text (.txt)")
    p.add_argument("--eval-tokens", type=int, default=4096)
    p.add_argument("--mix", action="append", required=True, metavar="NAME[,NAME...]")
    p.add_argument("--options", default='{"patience": 0, "dtype": "bfloat16"}', help="TransferOptions, JSON")
    args = p.parse_args(argv)
    layers = [int(x) for x in args.layers.split(",")]
    options = TransferOptions(**json.loads(args.options))
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="sdpa",
                                                 **LOAD_KWARGS).eval()
    recorder = Recorder(model, layers)
    t0 = time.perf_counter()
    data = {}
    for spec in args.source:
        name, _, rest = spec.partition("=")
        path, _, count = rest.rpartition(":")
        windows = read_ids(tokenizer, path, int(count) * WINDOW).view(-1, WINDOW)
        windows = windows[torch.randperm(len(windows), generator=torch.Generator().manual_seed(0))]
        data[name] = recorder.record(windows)
        print(f"[transfer_domain] recorded {name}: {len(windows)} windows", file=sys.stderr, flush=True)
    evaluation = recorder.record(read_ids(tokenizer, args.eval, args.eval_tokens).view(-1, 1024))
    print(f"[transfer_domain] recorded in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    config = model.config.to_dict()
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    grouped = dict(config, num_key_value_heads=args.groups)
    cls = type(model.model.layers[0].self_attn)
    rows = []
    for i in layers:
        original = {n: p.detach() for n, p in model.model.layers[i].self_attn.named_parameters()}
        pooled = {n: original[n].view(args.groups, kv // args.groups, head_dim, -1).mean(1).reshape(
            args.groups * head_dim, -1) for n in ("k_proj.weight", "v_proj.weight")}
        ex, ey, ekw = evaluation[i]
        for mix in args.mix:
            fit_x, fit_y, held_x, held_y = [], [], [], []
            for name in mix.split(","):
                x, y, kwargs = data[name][i]
                held = max(1, len(x) // 8)
                fit_x.append(x[:-held]), fit_y.append(y[:-held]), held_x.append(x[-held:]), held_y.append(y[-held:])
            x, y = torch.cat(fit_x), torch.cat(fit_y)
            student = build_attention(cls, grouped, i, {**original, **pooled}, "sdpa")
            eval_before = output_error(student, ex, ey, ekw)
            t1 = time.perf_counter()
            errors = transfer_layer(student, kwargs, len(x), lambda w: (x[w], y[w]), torch.cat(held_x),
                                    torch.cat(held_y), options, i, progress=False)
            rows.append((i, mix, len(x), errors["transfer_before"], errors["transfer_after"], eval_before,
                         output_error(student, ex, ey, ekw), time.perf_counter() - t1))
            print(f"[transfer_domain] {rows[-1]}", file=sys.stderr, flush=True)
    print(f"## Attention transfer on {args.model} ({kv} -> {args.groups} K/V heads, mean-pooled start), "
          f"{options}\n")
    print("| layer | calibration | fitting windows | held-out error before | after | evaluation text error before "
          "| after | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for i, mix, n, hb, ha, eb, ea, s in rows:
        print(f"| {i} | {mix} | {n} | {hb:.4f} | {ha:.4f} | {eb:.4f} | {ea:.4f} | {s:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
