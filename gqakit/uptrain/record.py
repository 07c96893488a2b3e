"""The finished run: a stock Hugging Face folder whose card extends the conversion's card."""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from .. import __version__
from .run_folder import FINISHED, MARKER

RUN_FILES = (FINISHED, MARKER, "metrics.csv", "loss.png", "tensorboard", "checkpoints")

_SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def source_dtype(model_dir: str) -> str:
    config = json.loads((Path(model_dir) / "config.json").read_text())
    dtype = config.get("dtype") or config.get("torch_dtype") or "float32"
    return dtype if dtype in _SAVE_DTYPES else "float32"


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
        "| loss | " + (f"(1 - w) x cross-entropy + w x T^2 x KL(teacher &#124;&#124; student), w={cfg['distill_weight']}, "
                       f"T={cfg['distill_temperature']}, teacher `{cfg['teacher']}`" if cfg.get("teacher")
                       else "cross-entropy") + " |",
        f"| optimiser | AdamW lr {cfg['lr']}, warmup {record['warmup_steps']} steps, cosine to "
        f"{cfg['min_lr_ratio']} x lr, weight decay {cfg['weight_decay']} |",
        f"| trained parameters | {cfg['trainable']} ({record['trainable_parameters']:,} of "
        f"{record['parameters']:,}) |",
        f"| sequence | {cfg['seq_len']} tokens, global batch {record['global_batch']} sequences |",
        f"| attention | {cfg['attention']}" + (f" {record['attention_options']}" if record['attention_options'] else "")
        + (f", context parallel {cfg['context_parallel']}" if cfg['context_parallel'] > 1 else "") + " |",
        f"| processes | {record['processes']} |",
    ]
    if record.get("final_eval_ppl") is not None and record.get("initial_eval_ppl") is not None:
        lines.append(f"| held-out perplexity | {record['initial_eval_ppl']:.2f} before, "
                     f"{record['final_eval_ppl']:.2f} after |")
    if record['attention_options']:
        lines += ["", f"Trained with gqakit attention `{cfg['attention']}`: load it with "
                      f"`attn_implementation=\"gqakit_{cfg['attention']}\"` after `import gqakit.attention` to "
                      "evaluate it as trained (the options are in config.json under `gqakit_attention`)."]
    return text.rstrip("\n") + "\n" + "\n".join(lines) + "\n"


def save_final(model, tokenizer, output_dir: Path, record: dict, state_dict: dict | None = None) -> None:
    """Main process: write the final model into the run folder; `uptraining.json` last marks it done."""
    from ..convert.run import copy_side_files

    out = Path(output_dir)
    source = Path(record["recipe"]["model"])
    tmp = out / ".final.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    dtype = _SAVE_DTYPES[record["save_dtype"]]
    state = state_dict if state_dict is not None else model.state_dict()
    cast: dict[int, torch.Tensor] = {}  # one cast per storage, so tied weights stay tied (saved once)
    model.save_pretrained(tmp, state_dict={k: cast.setdefault(v.data_ptr(), v.to(dtype)) for k, v in state.items()})
    config = json.loads((tmp / "config.json").read_text())
    config["dtype"] = record["save_dtype"]
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    copy_side_files(source, tmp)
    for name in RUN_FILES:  # when the source is itself an uptraining run folder
        if (tmp / name).exists():
            shutil.rmtree(tmp / name) if (tmp / name).is_dir() else (tmp / name).unlink()
    if not (tmp / "tokenizer_config.json").exists():
        tokenizer.save_pretrained(tmp)
    (tmp / "README.md").write_text(_card(source, record))
    for path in sorted(tmp.iterdir()):
        os.replace(path, out / path.name)
    tmp.rmdir()
    (out / FINISHED).write_text(json.dumps(record, indent=2, default=str) + "\n")
