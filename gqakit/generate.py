"""`gqakit generate`: stream text from a model, far past its trained context with a sink or window cache."""
from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

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
    from .evaluate.models import apply_attention, load_model

    out, err = out or sys.stdout, err or sys.stderr
    _check(cfg)
    prompt = _prompt(cfg)
    model, tok = load_model(cfg.model, cfg.dtype, device="cpu")  # the prompt's ids stay on the CPU
    kernel = cfg.attention == "tiled"
    if kernel:
        apply_attention(model, "tiled", {})
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
