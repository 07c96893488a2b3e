"""Shared by the `gqakit eval` tests: tiny random Llamas with a tiny BPE tokenizer, and an in-process CLI.

`run_eval` builds its own parser with `add_eval_parser` (so the tests do not depend on the wiring in
gqakit/cli.py) and dispatches exactly as `gqakit.cli` does: a GqakitError is one line and exit 2.
"""
from __future__ import annotations

import argparse
import io
import random
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path

import torch

from gqakit.cli import _dispatch
from gqakit.evaluate.cli import add_eval_parser

WORDS = ("the sky is blue and the grass is green while emma walks to the village with her sister "
         "a single man in possession of a good fortune must be in want of a wife it is a truth").split()


def text(n_words: int, seed: int = 0) -> str:
    """Pseudo-English (random words, sentences of 5-12 words); deterministic in `seed`."""
    rng = random.Random(seed)
    out, sentence = [], []
    for _ in range(n_words):
        sentence.append(rng.choice(WORDS))
        if len(sentence) >= rng.randint(5, 12):
            out.append(" ".join(sentence).capitalize() + ".")
            sentence = []
    return " ".join(out + [" ".join(sentence)]).strip()


def tokenizer():
    from gqakit.reference.tokenizer import train_bpe

    return train_bpe([text(4000, seed=1)], vocab_size=300)


def tiny_llama(vocab: int, kv_heads: int = 2, layers: int = 2, seed: int = 0, max_positions: int = 128,
               bos: int = 1, eos: int = 2, attn: str = "sdpa"):
    """A random fp32 Llama: hidden 32, 4 heads of 8, `kv_heads` K/V heads, a short trained context."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=8,
                      max_position_embeddings=max_positions, bos_token_id=bos, eos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(seed)
    return LlamaForCausalLM._from_config(cfg, attn_implementation=attn, dtype=torch.float32).eval()


def checkpoint(path: Path, tok, kv_heads: int = 2, seed: int = 0, max_positions: int = 128) -> Path:
    """Save a tiny Llama and `tok` to `path` (a folder `gqakit eval` can load)."""
    eos = tok.eos_token_id
    tiny_llama(len(tok), kv_heads, seed=seed, max_positions=max_positions, bos=eos, eos=eos).save_pretrained(path)
    tok.save_pretrained(path)
    return Path(path)


def run_eval(*argv) -> tuple[int, str, str]:
    """`gqakit eval ARGV...` in-process: (exit code, stdout, stderr)."""
    parser = argparse.ArgumentParser(prog="gqakit")
    add_eval_parser(parser.add_subparsers(dest="command", required=True))
    out, err = io.StringIO(), io.StringIO()
    with redirect_stdout(out), redirect_stderr(err):
        code = _dispatch(parser, ["eval", *map(str, argv)], "gqakit")
    return code, out.getvalue(), err.getvalue()


def one_line_error(code: int, err: str, needle: str) -> bool:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    return code == 2 and len(lines) == 1 and needle in lines[0]
