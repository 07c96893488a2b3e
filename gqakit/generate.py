"""`gqakit generate`: stream text from a model, far past its trained context with a sink or window cache."""
from __future__ import annotations

import dataclasses
import math
import sys
import time
from pathlib import Path

from gqakit.common.dtypes import NAMES as DTYPES
from gqakit.attention import kinds as attention_kinds
from gqakit.common.errors import GqakitError, opt
from gqakit.common.options import option
from gqakit.hf.architectures.latent import is_latent

# sinks and sliding bound the KV cache (sink/window caches); the other kinds keep a full cache and switch the
# model's attention kernel (gqakit.attention.use), as `gqakit eval --attention` does.
BOUNDED = ("sinks", "sliding")
ATTENTION = (*BOUNDED, *(kind for kind in attention_kinds.CHOICES if kind not in BOUNDED))
SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)  # what torch.Generator.manual_seed accepts


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    """`gqakit generate`; every field is checked on construction (`check`), before any model is loaded."""

    model: str = option(flag="MODEL", help="Hugging Face checkpoint folder")
    prompt: str | None = option(None, help="prompt text (give exactly one of --prompt and --prompt-file)")
    prompt_file: str | None = option(None, help="UTF-8 file holding the prompt")
    attention: str = option("sinks", choices=ATTENTION,
                            help="sinks: keep --sinks first + --window recent tokens (StreamingLLM); sliding: the "
                                 "--window recent tokens only; default, tiled, sparse: a full cache, with the model's "
                                 "own or that gqakit attention kernel")
    sinks: int = option(4, remember=True, help="attention-sink tokens kept, with --attention sinks")
    window: int = option(1020, remember=True,
                         help="recent tokens kept, with --attention sinks or sliding")
    max_new_tokens: int = option(256, help="tokens to generate, >= 1")
    do_sample: bool = option(False, flag="--sample", help="sample instead of greedy decoding", default_text="greedy")
    temperature: float = option(1.0, remember=True, help="with --sample: softmax temperature > 0")
    top_p: float = option(1.0, remember=True, help="with --sample: nucleus probability mass kept, in (0, 1]; 1.0 = "
                                                   "every token")
    seed: int = option(0, remember=True, help="with --sample: seed of the sampler")
    dtype: str = option("float32", choices=DTYPES, help="compute dtype")
    ignore_eos: bool = option(False, help="keep going past the end-of-text token")
    attention_option: tuple[str, ...] = option((), metavar="NAME=VALUE",
                                               help="with --attention tiled or sparse: any option of the kind, e.g. "
                                                    "stride=64 for sparse (repeatable; see docs/attention.md)")
    given: frozenset = frozenset()  # options typed on the command line, even at their default values

    def __post_init__(self):
        check(self)


def _default(name: str):
    return GenerateConfig.__dataclass_fields__[name].default


def _set(cfg: GenerateConfig, name: str) -> bool:
    """Was option `name` given: typed on the command line (even at its default value) or changed?"""
    return name in cfg.given or getattr(cfg, name) != _default(name)


def _ignored(cfg: GenerateConfig) -> str | None:
    """The first option given that this configuration would not honour, with why."""
    if not cfg.do_sample:
        for name in ("temperature", "top_p", "seed"):
            if _set(cfg, name):
                return (f"{opt(name)} only applies with {opt('do_sample')} (greedy decoding ignores it); add "
                        f"{opt('do_sample')} or drop {opt(name)}")
    full = f"{opt('attention', cfg.attention)} keeps the full cache"
    if cfg.attention not in BOUNDED and _set(cfg, "window"):
        return (f"{opt('window')} only applies with {opt('attention', 'sinks')} or sliding ({full}); drop "
                f"{opt('window')} or choose one of them")
    if cfg.attention != "sinks" and _set(cfg, "sinks") and cfg.sinks != 0:
        why = "sliding keeps no sink tokens" if cfg.attention == "sliding" else full
        return f"{opt('sinks')} only applies with {opt('attention', 'sinks')} ({why}); drop {opt('sinks', cfg.sinks)}"
    if cfg.attention_option and cfg.attention in (*BOUNDED, attention_kinds.DEFAULT):
        kernels = " or ".join(k for k in ATTENTION if k not in (*BOUNDED, attention_kinds.DEFAULT))
        takes = (f"takes {opt('sinks')} / {opt('window')}" if cfg.attention in BOUNDED
                 else "is the model's own attention and takes no options")
        return (f"{opt('attention_option')} only applies with {opt('attention', kernels)} "
                f"({opt('attention', cfg.attention)} {takes}); drop it or choose one of them")
    return None


def check(cfg: GenerateConfig) -> None:
    """Every option in one place: one line naming the flag, the value and what is allowed."""
    if cfg.attention not in ATTENTION:
        raise GqakitError(f"unknown {opt('attention', repr(cfg.attention))}; choose one of {', '.join(ATTENTION)}")
    if cfg.dtype not in DTYPES:
        raise GqakitError(f"unknown {opt('dtype', repr(cfg.dtype))}; choose one of {', '.join(DTYPES)}")
    if cfg.window <= 0:
        raise GqakitError(f"{opt('window')} must be a positive number of tokens, got {cfg.window}")
    if cfg.sinks < 0:
        raise GqakitError(f"{opt('sinks')} must be >= 0, got {cfg.sinks}; use 0 for a plain sliding window")
    if cfg.max_new_tokens < 1:
        raise GqakitError(f"{opt('max_new_tokens')} must be >= 1 (tokens to generate), got {cfg.max_new_tokens}")
    if not (math.isfinite(cfg.temperature) and cfg.temperature > 0):
        raise GqakitError(f"{opt('temperature')} must be a finite number > 0, got {cfg.temperature}; "
                          f"for greedy decoding leave out {opt('do_sample')}")
    if not (math.isfinite(cfg.top_p) and 0 < cfg.top_p <= 1):
        raise GqakitError(f"{opt('top_p')} must be in (0, 1], got {cfg.top_p}; 1 keeps every token")
    if not SEED_RANGE[0] <= cfg.seed <= SEED_RANGE[1]:
        raise GqakitError(f"{opt('seed')} must be an integer in [-2**63, 2**64 - 1], got {cfg.seed}")
    ignored = _ignored(cfg)
    if ignored:
        raise GqakitError(ignored)
    if (cfg.prompt is None) == (cfg.prompt_file is None):
        raise GqakitError(f"give exactly one of {opt('prompt', 'TEXT')} or {opt('prompt_file', 'FILE')}")
    if cfg.prompt is not None:
        _check_text(cfg.prompt, opt("prompt"))


def _check_text(text: str, where: str) -> None:
    if not text.strip():
        raise GqakitError(f"{where} is empty (or only whitespace); give the text to continue")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # argv bytes that are not UTF-8 arrive as lone surrogates
        raise GqakitError(f"{where} is not valid UTF-8 text; pass UTF-8 (or use {opt('prompt_file')})") from None


def _prompt(cfg: GenerateConfig) -> str:
    if cfg.prompt is not None:
        return cfg.prompt
    path = Path(cfg.prompt_file)
    if not path.exists():
        raise GqakitError(f"prompt file {path} does not exist; pass a UTF-8 text file")
    if not path.is_file():
        raise GqakitError(f"prompt file {path} is not a file; pass a UTF-8 text file")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise GqakitError(f"prompt file {path} is not UTF-8 (byte 0x{data[e.start]:02x} at offset {e.start}); "
                          "re-save it as UTF-8") from None
    _check_text(text, f"prompt file {path}")
    return text


def generate(cfg: GenerateConfig, out=None, err=None) -> str:
    """Stream the continuation of the prompt to `out` (stdout); report speed and policy on `err` (stderr)."""
    out, err = out or sys.stdout, err or sys.stderr
    prompt = _prompt(cfg)  # before the heavy imports: a bad prompt file is refused at once

    from gqakit.decode import streaming
    from gqakit.decode.rope_probe import measure_rotation
    from gqakit.attention.registration import apply_attention
    from gqakit.hf.loading import end_token_ids, load_model

    kernel = cfg.attention not in (*BOUNDED, attention_kinds.DEFAULT)
    options = attention_kinds.command_attention_options(cfg.attention, None, None, cfg.attention_option) \
        if kernel else {}
    model, tok = load_model(cfg.model, cfg.dtype, device="cpu")  # the prompt's ids stay on the CPU
    if kernel:
        apply_attention(model, cfg.attention, options)
    ids = tok(prompt, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        raise GqakitError("the prompt encodes to no tokens with this model's tokenizer; give some text to continue")
    eos = None if cfg.ignore_eos else end_token_ids(model, tok) or None  # the model's own, as generate() reads
    if cfg.attention in BOUNDED and is_latent(model.config):
        raise GqakitError(f"{opt('attention', cfg.attention)} re-rotates cached RoPE keys, and a latent-attention "
                          f"model ({type(model).__name__}) caches them beside its latent; use "
                          f"{opt('attention', 'default')} (a full cache)")
    if cfg.attention in BOUNDED:
        sinks = cfg.sinks if cfg.attention == "sinks" else 0
        if sinks > 0 or ids.shape[1] + cfg.max_new_tokens > sinks + cfg.window:  # the cache will re-rotate keys
            try:
                measure_rotation(model)  # the model's keys, as the cache will move them
            except ValueError as e:
                why = str(e).split(";")[0].split(": ")[0]
                raise GqakitError(f"{opt('attention', cfg.attention)} keeps a bounded cache whose keys it re-rotates "
                                  f"by RoPE, but {why}; use {opt('attention', 'default')} (a full cache, within the "
                                  "model's context)") from None
        over = streaming.position_overrun(model, ids.shape[1], cfg.max_new_tokens, sinks, cfg.window)
        if over is not None:  # before the stream starts (stream_tokens checks it too, lazily, for library callers)
            raise GqakitError(f"{opt('attention', cfg.attention)} feeds positions up to {over[0] - 1:,} (sinks + "
                              f"window + a prompt chunk, or twice sinks + window before the cache moves back) but "
                              f"{type(model).__name__}'s positions end at {over[1]:,}; lower {opt('sinks')} or "
                              f"{opt('window')}")
        pieces = streaming.streaming_generate(
            model, tok, ids, cfg.max_new_tokens, sinks=sinks, window=cfg.window, do_sample=cfg.do_sample,
            temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed, eos_token_id=eos)
        policy = f"{sinks} sinks + {cfg.window} recent tokens"
    else:
        limit = model.config.max_position_embeddings
        if ids.shape[1] + cfg.max_new_tokens > limit:
            raise GqakitError(
                f"prompt ({ids.shape[1]} tokens) + {opt('max_new_tokens', cfg.max_new_tokens)} exceeds the model's "
                f"{limit}-token context; use {opt('attention', 'sinks')} to stream past it")
        # A cache wide enough never to evict is exactly the full (dynamic) cache.
        pieces = streaming.streaming_generate(
            model, tok, ids, cfg.max_new_tokens, sinks=0, window=ids.shape[1] + cfg.max_new_tokens,
            do_sample=cfg.do_sample, temperature=cfg.temperature, top_p=cfg.top_p, seed=cfg.seed,
            eos_token_id=eos)
        policy = "full cache" + (f", {cfg.attention} attention" if kernel else "")
    t0, text, count = time.time(), [], 0
    for piece in pieces:
        out.write(piece)
        out.flush()
        text.append(piece)
        count += 1
    seconds = time.time() - t0
    print(f"\n[{policy}; {count} pieces in {seconds:.1f}s]", file=err)
    return "".join(text)
