"""The finished run: a stock Hugging Face folder whose card extends the conversion's card."""
from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import torch

from gqakit.common import dtypes, fitted
from gqakit.common.atomic import interrupts_deferred
from gqakit import __version__
from gqakit.uptrain.run.folder import FINISHED



def source_dtype(model_dir: str) -> str:
    """The dtype the source checkpoint's config.json names (save_dtype=auto), float32 if none of ours."""
    from gqakit.hf.folder import model_folder

    config = model_folder(model_dir).config
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    return dtype if dtype in dtypes.NAMES else "float32"


def _reproduced_by(cfg: dict, source: Path, data: dict) -> str:
    """The eval ppl windows that score the same targets as the held-out sequences (docs/uptrain.md); with eval_data,
    the --max-tokens that cuts its text to them (held out of the training data, they are no prefix of a file)."""
    from gqakit.hf.folder import model_folder

    seq_len, rows = cfg["seq_len"], data.get("eval_sequences") or 0
    if cfg.get("target_column"):
        return ", input/target pairs as `gqakit eval ppl --target-column` reads them"
    on = data.get("held_out") == "eval_data"
    if model_folder(source).config.get("is_encoder_decoder"):
        cut = f" --max-tokens {rows * seq_len}" if on else ""
        return f", span-corrupted as `gqakit eval ppl --max-length {seq_len}{cut}` corrupts the same tokens"
    cut = f" --max-tokens {rows * seq_len + 1}" if on else ""
    return (f": {seq_len} targets each from {seq_len + 1} tokens, as `gqakit eval ppl --max-length {seq_len + 1} "
            f"--stride {seq_len}{cut}` scores the same tokens" + (" of eval_data" if on else ""))


def _card(source: Path, record: dict) -> str:
    text = (source / "README.md").read_text() if (source / "README.md").is_file() else (
        f"---\nlibrary_name: transformers\ntags: [gqakit]\n---\n# {source.name}\n")
    cfg = record["recipe"]
    budget = record["budget"]
    lines = [
        "", "## Uptraining", "",
        f"Uptrained by gqakit {__version__} from `{cfg['model']}`"
        + (f" with `{record['command']}`" if record.get("command") else "") + ".", "",
        "| | |", "|---|---|",
        f"| budget | {budget['steps']} steps x {budget['tokens_per_step']:,} tokens = {budget['tokens']:,} tokens "
        f"({budget['source']}) |",
        f"| data | {', '.join(cfg['data'])} |",
        "| loss | " + (f"(1 - w) x cross-entropy + w x T^2 x KL(teacher &#124;&#124; student), "
                       f"w={cfg['distill_weight']}, "
                       f"T={cfg['distill_temperature']}, teacher `{cfg['teacher']}`"
                       + (f", the teacher's top {cfg['distill_top_k']} logits per position"
                          if cfg.get("distill_top_k") else "") if cfg.get("teacher")
                       else "cross-entropy") + " |",
        f"| optimiser | AdamW lr {cfg['lr']}, warmup {record['warmup_steps']} steps, "
        + (f"cosine to {cfg['min_lr_ratio']} x lr" if record['warmup_steps'] < budget['steps'] else
           "no decay (the warmup takes every step)") + f", weight decay {cfg['weight_decay']} |",
        f"| trained parameters | {cfg['trainable']} ({record['trainable_parameters']:,} of "
        f"{record['parameters']:,}) |",
        f"| sequence | {cfg['seq_len']} tokens, global batch {record['global_batch']} sequences |",
        f"| attention | {cfg['attention']}" + (f" {record['attention_options']}" if record['attention_options'] else "")
        + (f", context parallel {cfg['context_parallel']}" if cfg['context_parallel'] > 1 else "") + " |",
        f"| processes | {record['processes']} (sharding {record.get('sharding', 'ddp')}"
        + (f", {cfg['mixed_precision']} mixed precision" if cfg.get("mixed_precision", "no") != "no" else "") + ") |",
    ]
    if record.get("final_eval_ppl") is not None and record.get("initial_eval_ppl") is not None:
        precision = cfg.get("mixed_precision", "no")
        lines.append(f"| held-out perplexity | {record['initial_eval_ppl']:.2f} before, "
                     f"{record['final_eval_ppl']:.2f} after (held-out sequences as training reads them, no BOS"
                     f"{_reproduced_by(cfg, source, record.get('data') or {})}; the float32 weights, "
                     + ("saved as they are" if record.get("save_dtype") == "float32" else
                        f"before the cast to {record.get('save_dtype', 'the source dtype')}")
                     + (f", computed in {precision} mixed precision as training" if precision != "no" else "") + ") |")
    if record['attention_options']:
        lines += ["", f"Trained with gqakit attention `{cfg['attention']}`: load it with "
                      f"`attn_implementation=\"gqakit_{cfg['attention']}\"` after `import gqakit.attention` to "
                      "evaluate it as trained (the options are in config.json under `gqakit_attention`)."]
    return text.rstrip("\n") + "\n" + "\n".join(lines) + "\n"


def final_tensors(model) -> list[tuple[str, torch.Tensor]]:
    """The tensors a stock checkpoint of `model` holds: its state dict with tied weights once (under
    the first name, as `save_pretrained` keeps it); FSDP parameters stay sharded DTensors."""
    seen: set[int] = set()
    out = []
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            out.append((name, t))
    return out


def _fitted_entries(data) -> list[dict]:
    """The record of fitted texts for the uptraining data: a token cache stands for the files it was tokenised
    from, as digested when it was built (its header's `fitted`), or, for a cache made before that, as its sources
    read now (said on stderr when they are gone)."""
    from gqakit.uptrain.data.token_cache import HEADER, is_token_cache

    found, paths = [], []
    for entry in data:
        if not is_token_cache(entry):
            paths.append(entry)
            continue
        header = json.loads((Path(entry) / HEADER).read_text())
        if "fitted" in header:
            found += header["fitted"]
            continue
        sources = [s["path"] for s in header["sources"] if s["size"] is not None]  # one per file it read
        gone = [path for path in sources if not Path(path).is_file()]
        if gone:
            print(f"gqakit uptrain: {gone[0]}{f' (and {len(gone) - 1} more)' if len(gone) > 1 else ''}, which the "
                  f"token cache {entry} was made from, is gone, so the model's gqakit-fitted.json cannot name it: "
                  "rebuild the cache (gqakit tokenize) to record it", file=sys.stderr)
        paths += [path for path in sources if path not in gone]
    return found + fitted.entries(paths, "uptraining")


def save_final(model, tokenizer, output_dir: Path, record: dict, *, is_main: bool, barrier,
               max_shard_bytes: int = 5 * 10**9) -> None:
    """Every rank: stream the final weights into a stock Hugging Face folder in the run folder. A sharded
    tensor is gathered whole, one tensor at a time, and written by the main process as it arrives (a
    safetensors header is planned up front), so no rank ever holds more than one full tensor.
    `uptraining.json`, written last, marks the run finished."""
    from gqakit.hf.checkpoint import DTYPE_NAMES, ShardWriter
    from gqakit.hf.folder import copy_side_files
    from gqakit.uptrain.fsdp import full_tensor

    out = Path(output_dir)
    source = Path(record["recipe"]["model"])
    tmp = out / ".final.tmp"
    dtype = dtypes.torch_dtype(record["save_dtype"])
    tensors = final_tensors(model)
    writer = None
    if is_main:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        entries = [(name, DTYPE_NAMES[dtype if t.is_floating_point() else t.dtype], tuple(t.shape))
                   for name, t in tensors]
        writer = ShardWriter(tmp, entries, max_shard_bytes)
    for name, t in tensors:
        whole = full_tensor(t.detach())  # a collective for DTensors: every rank takes part
        if writer is not None:
            writer.write_tensor(name, whole.to(dtype) if whole.is_floating_point() else whole)
        del whole
    if is_main:
        writer.finish()
        model.config.save_pretrained(tmp)
        config = json.loads((tmp / "config.json").read_text())
        config["dtype"] = record["save_dtype"]
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        copy_side_files(source, tmp)  # a source that is itself a run folder: its records stay there (RUN_RECORDS)
        fitted.add(tmp, _fitted_entries(record["recipe"]["data"]))  # after the source's record, copied above
        if not (tmp / "tokenizer_config.json").exists():
            tokenizer.save_pretrained(tmp)
        if not (tmp / "generation_config.json").exists() and getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        (tmp / "README.md").write_text(_card(source, record))
        files = sorted(path.name for path in tmp.iterdir())
        with interrupts_deferred():  # a stop between two moves left a half-published model no rerun could clear
            for name in files:
                os.replace(tmp / name, out / name)
            tmp.rmdir()
            finished = {**record, "files": files}  # what --force may later replace (run_folder.own_entries)
            (out / FINISHED).write_text(json.dumps(finished, indent=2, default=str) + "\n")
    barrier()
