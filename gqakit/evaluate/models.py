"""Loading the models under evaluation: checkpoint folder, tokenizer, compute dtype, attention kind.

Shared by the three evaluations so that every report describes its model the same way (K/V heads,
KV-cache bytes per token at the compute dtype, the attention options in force).
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..errors import GqakitError

DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_KINDS = ("default", "tiled", "sliding", "sinks")


def resolve_device(device: str = "auto") -> torch.device:
    """'auto' is CUDA when available, else CPU; anything else is checked by torch."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        resolved = torch.device(device)
    except RuntimeError:
        raise GqakitError(f"unknown --device {device!r}; use auto, cpu, cuda or cuda:N") from None
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise GqakitError(f"--device {device}: no CUDA device is available here; use --device cpu")
    return resolved


def load_model(path: str, dtype: str = "float32", tokenizer: str | None = None, device: str = "auto"):
    """(model in eval mode on `device`, tokenizer) of a local Hugging Face folder (or, online, a hub name)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if dtype not in DTYPES:
        raise GqakitError(f"unknown --dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    local = Path(path).is_dir() or "/" not in path or path.startswith((".", "/", "~"))
    if local and not Path(path).is_dir():
        raise GqakitError(f"model folder {path} does not exist; pass the path of a Hugging Face checkpoint folder")
    if local and not (Path(path) / "config.json").is_file():
        raise GqakitError(f"{path} has no config.json; point at a Hugging Face checkpoint folder")
    target = resolve_device(device)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(target).eval()
    source = tokenizer or path
    try:
        tok = AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError, TypeError) as e:
        raise GqakitError(f"cannot load a tokenizer from {source} ({type(e).__name__}); "
                          "pass --tokenizer FOLDER holding tokenizer files") from None
    if len(tok) > model.config.vocab_size and tokenizer is not None:
        raise GqakitError(f"tokenizer {source} has {len(tok)} tokens but {path} only {model.config.vocab_size}; "
                          "pass the tokenizer that belongs to the model")
    return model, tok


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_bytes_per_token(model) -> int:
    """Bytes that one token adds to a full KV cache: K and V, every layer, G heads, at the model's dtype."""
    cfg = model.config
    itemsize = next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim(cfg) * itemsize


def describe(model) -> dict:
    """What a report records about a model: heads, K/V heads, layers, context, bytes per cached token."""
    cfg = model.config
    return {
        "architecture": (getattr(cfg, "architectures", None) or [type(model).__name__])[0],
        "layers": cfg.num_hidden_layers,
        "heads": cfg.num_attention_heads,
        "kv_heads": cfg.num_key_value_heads,
        "head_dim": head_dim(cfg),
        "max_position_embeddings": getattr(cfg, "max_position_embeddings", None),
        "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "device": str(next(model.parameters()).device),
        "kv_bytes_per_token": kv_bytes_per_token(model),
    }


def attention_options(kind: str | None, window: int | None, sinks: int | None) -> dict:
    """The `gqakit.attention.use` options of --attention/--window/--sinks; {} for the model's default."""
    if kind in (None, "default"):
        if window is not None or sinks is not None:
            raise GqakitError("--window/--sinks only apply with --attention sliding or sinks; add one of them")
        return {}
    if kind not in ATTENTION_KINDS:
        raise GqakitError(f"unknown --attention {kind!r}; choose one of {', '.join(ATTENTION_KINDS)}")
    options: dict = {}
    if window is not None:
        if kind == "tiled":
            raise GqakitError("--attention tiled is full attention and takes no --window; use sliding or sinks")
        options["window"] = window
    if sinks is not None:
        if kind != "sinks":
            raise GqakitError(f"--sinks only applies with --attention sinks (got --attention {kind})")
        options["sinks"] = sinks
    return options


def apply_attention(model, kind: str | None, options: dict) -> dict:
    """Switch `model` to gqakit attention `kind` in place; returns the options in force ({} for default)."""
    if kind in (None, "default"):
        return {}
    from ..attention import use
    from ..attention.registry import CONFIG_KEY

    use(model, kind, **options)  # AttentionOptionError is a GqakitError: one line, exit 2
    return dict(getattr(model.config, CONFIG_KEY))
