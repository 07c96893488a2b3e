"""`gqakit generate`: stream text from a model, far past its trained context with a sink or window cache."""
from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import torch

from .errors import GqakitError

ATTENTION = ("sinks", "sliding", "tiled", "default")


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    model: str
    prompt: str | None = None
    prompt_file: str | None = None
    attention: str = "sinks"
    sinks: int = 4
    window: int = 1020
    max_new_tokens: int = 256
    do_sample: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int = 0
    dtype: str = "float32"
    ignore_eos: bool = False


def load_model(path: str, dtype: str = "float32", attn_implementation: str | None = None):
    """A local Hugging Face folder (or, online, a hub name) with its tokenizer; clear errors otherwise."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # stderr carries only our own lines
    if not Path(path).is_dir() and ("/" not in path or path.startswith((".", "/"))):
        raise GqakitError(f"model folder {path} does not exist; pass the path of a Hugging Face checkpoint folder")
    if Path(path).is_dir() and not (Path(path) / "config.json").is_file():
        raise GqakitError(f"{path} has no config.json; point at a Hugging Face checkpoint folder")
    kwargs = {"dtype": getattr(torch, dtype)}
    if attn_implementation:
        kwargs["attn_implementation"] = attn_implementation
    model = AutoModelForCausalLM.from_pretrained(path, **kwargs).eval()
    return model, AutoTokenizer.from_pretrained(path)


def _prompt(cfg: GenerateConfig) -> str:
    if (cfg.prompt is None) == (cfg.prompt_file is None):
        raise GqakitError("give exactly one of --prompt TEXT or --prompt-file FILE")
    if cfg.prompt is not None:
        return cfg.prompt
    path = Path(cfg.prompt_file)
    if not path.is_file():
        raise GqakitError(f"prompt file {path} does not exist; pass a UTF-8 text file")
    text = path.read_text(encoding="utf-8")
    if not text.strip():
        raise GqakitError(f"prompt file {path} is empty; write a prompt into it")
    return text


def _check(cfg: GenerateConfig) -> None:
    if cfg.attention not in ATTENTION:
        raise GqakitError(f"unknown --attention {cfg.attention!r}; choose one of {', '.join(ATTENTION)}")
    if cfg.window <= 0:
        raise GqakitError(f"--window must be a positive number of tokens, got {cfg.window}")
    if cfg.sinks < 0:
        raise GqakitError(f"--sinks must be >= 0, got {cfg.sinks}; use 0 for a plain sliding window")
    if cfg.max_new_tokens < 0:
        raise GqakitError(f"--max-new-tokens must be >= 0, got {cfg.max_new_tokens}")


def generate(cfg: GenerateConfig, out=None, err=None) -> str:
    """Stream the continuation of the prompt to `out` (stdout); report speed and policy on `err` (stderr)."""
    from .attention import streaming

    out, err = out or sys.stdout, err or sys.stderr
    _check(cfg)
    prompt = _prompt(cfg)
    kernel = "gqakit_tiled" if cfg.attention == "tiled" else None
    if kernel:
        import gqakit.attention  # noqa: F401  (registers the kernels)
    model, tok = load_model(cfg.model, cfg.dtype, kernel)
    ids = tok(prompt, return_tensors="pt").input_ids
    eos = None if cfg.ignore_eos else tok.eos_token_id
    if cfg.attention in ("sinks", "sliding"):
        sinks = cfg.sinks if cfg.attention == "sinks" else 0
        pieces = streaming.streaming_generate(
            model, tok, ids, cfg.max_new_tokens, sinks=sinks, window=cfg.window, do_sample=cfg.do_sample,
            temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed, eos_token_id=eos)
        policy = f"{sinks} sinks + {cfg.window} recent tokens"
    else:
        limit = model.config.max_position_embeddings
        if ids.shape[1] + cfg.max_new_tokens > limit:
            raise GqakitError(
                f"prompt ({ids.shape[1]} tokens) + --max-new-tokens {cfg.max_new_tokens} exceeds the model's "
                f"{limit}-token context; use --attention sinks to stream past it")
        # A cache wide enough never to evict is exactly the full (dynamic) cache.
        pieces = streaming.streaming_generate(
            model, tok, ids, cfg.max_new_tokens, sinks=0, window=ids.shape[1] + cfg.max_new_tokens,
            do_sample=cfg.do_sample, temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed,
            eos_token_id=eos)
        policy = "full cache" + (", tiled attention" if kernel else "")
    t0, text, count = time.time(), [], 0
    for piece in pieces:
        out.write(piece)
        out.flush()
        text.append(piece)
        count += 1
    seconds = time.time() - t0
    print(f"\n[{policy}; {count} pieces in {seconds:.1f}s]", file=err)
    return "".join(text)
