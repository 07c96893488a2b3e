"""A tiny model that `gqakit uptrain` can train in seconds: the embedded tokenizer, a 4-head Llama."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
import yaml

from gqakit.reference import HELDOUT_TEXT, reference_model_path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def make_uptrain_model(path: Path, kv_heads: int = 2, seed: int = 0, pretraining_tokens: int | None = 20_000,
                       attention_dropout: float = 0.0) -> Path:
    """Save a tiny random Llama (vocab of the embedded tokenizer) with its tokenizer and, unless None,
    a pretraining record so that alpha budgets resolve."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    source = reference_model_path()
    cfg = LlamaConfig(vocab_size=4096, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=8, max_position_embeddings=128,
                      tie_word_embeddings=True, bos_token_id=0, eos_token_id=0, pad_token_id=0,
                      attention_dropout=attention_dropout)
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, Path(path) / name)
    if pretraining_tokens:
        (Path(path) / "pretraining.json").write_text(json.dumps({"pretraining_tokens": pretraining_tokens}))
    return Path(path)


def make_family_model(family: str, path: Path, **overrides) -> Path:
    """Save a tiny random model of `family` (tests/support/families.py: a table family or a re-hosted source) with
    the embedded tokenizer and its vocabulary."""
    from families import make_model

    source = reference_model_path()
    make_model(family, path, vocab_size=json.loads((source / "config.json").read_text())["vocab_size"], **overrides)
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, Path(path) / name)
    return Path(path)


def make_text(path: Path, chars: int = 12_000, start: int = 0) -> Path:
    """`chars` characters of held-out Emma from `start` (texts from disjoint slices are different texts to
    gqakit's overlap check; two from the same start are one)."""
    Path(path).write_text(Path(HELDOUT_TEXT).read_text(encoding="utf-8")[start:start + chars], encoding="utf-8")
    return Path(path)


def write_recipe(path: Path, **fields) -> Path:
    defaults = {"seq_len": 32, "batch_size": 2, "lr": 1.0e-3, "eval_sequences": 4, "progress": False,
                "warmup_steps": 1, "threads": 1}
    Path(path).write_text(yaml.safe_dump({**defaults, **fields}))
    return Path(path)


def make_t5_model(path: Path, kv_heads: int | None = 4, seed: int = 0, pretraining_tokens: int | None = 20_000
                  ) -> Path:
    """Save a tiny random encoder-decoder (gqakit's grouped T5 with `kv_heads` of 4 decoder K/V heads; None: stock
    T5ForConditionalGeneration) with a small byte-level tokenizer that has T5's <pad>, EOS and 16 <extra_id_N>
    sentinels."""
    from transformers import AutoModelForSeq2SeqLM, T5Config

    from gqakit.hf.models.grouped_t5 import GroupedT5Config
    from gqakit.reference.tokenizer import train_bpe

    tok = train_bpe([Path(HELDOUT_TEXT).read_text(encoding="utf-8")[:30_000]], 400, sentinel_count=16)
    fields = dict(vocab_size=len(tok), d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                  relative_attention_num_buckets=8, dropout_rate=0.0, pad_token_id=tok.pad_token_id,
                  eos_token_id=tok.eos_token_id, decoder_start_token_id=tok.pad_token_id)
    if kv_heads is None:
        cfg = T5Config(**fields, architectures=["T5ForConditionalGeneration"])
    else:
        cfg = GroupedT5Config(**fields, num_key_value_heads=kv_heads,
                              architectures=["GroupedT5ForConditionalGeneration"])
    torch.manual_seed(seed)
    AutoModelForSeq2SeqLM.from_config(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    if pretraining_tokens:
        (Path(path) / "pretraining.json").write_text(json.dumps({"pretraining_tokens": pretraining_tokens}))
    return Path(path)


def make_pairs(path: Path, n: int, seed: int = 0) -> tuple[Path, list[dict]]:
    """A .jsonl of n short input/target rows ("text", "target") of Austen words."""
    import random

    rng = random.Random(seed)
    words = "the a house of Emma sister Bennet morning letter walk garden".split()
    rows = [{"text": " ".join(rng.choices(words, k=rng.randint(2, 8))),
             "target": " ".join(rng.choices(words, k=rng.randint(1, 5)))} for _ in range(n)]
    Path(path).write_text("".join(json.dumps(r) + "\n" for r in rows))
    return Path(path), rows
