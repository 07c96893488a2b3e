"""Loading the models under evaluation: checkpoint folder, tokenizer, compute dtype, attention kind.

Shared by the three evaluations, `gqakit generate` and `gqakit demo`, so that every report describes its
model the same way (K/V heads, KV-cache bytes per token at the dtype the cache is held in, the attention
options in force). A local folder is checked before transformers touches it (config.json, safetensors
headers, then every weight present with the shape config.json implies), so a broken checkpoint is one
line, never a traceback or a silently half-random model.
"""
from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from gqakit.common.dtypes import NAMES as DTYPES
from gqakit.common.errors import GqakitError, opt
from gqakit.hf.compat import LOAD_KWARGS
from gqakit.hf.architectures.latent import is_latent



def resolve_device(device: str = "auto") -> torch.device:
    """'auto' is CUDA when available, else CPU; anything else must exist here (`common.devices.check_device`)."""
    from gqakit.common.devices import check_device

    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(check_device(device, "device"))


def is_local(path: str) -> bool:
    """A folder on this machine (or meant to be one), rather than an `org/name` on the Hugging Face hub."""
    return Path(path).exists() or "/" not in path or path.startswith((".", "/", "~"))


def check_model_folder(path: str) -> dict | None:
    """The config.json of a local checkpoint folder, once its safetensors headers are read and valid
    (cheap at any model size; pickled-only folders are refused); None for a hub name."""
    if not is_local(path):
        return None
    from gqakit.hf.folder import model_folder

    folder = model_folder(path)
    folder.tensors  # every header read and checked
    return folder.config


def check_loading(path: str, info: dict) -> None:
    """Refuse weights that do not fit config.json: absent tensors would be random, resized ones wrong."""
    mismatched = sorted(info.get("mismatched_keys") or ())
    if mismatched:
        name, stored, expected = mismatched[0]
        more = f" (and {len(mismatched) - 1} more)" if len(mismatched) > 1 else ""
        raise GqakitError(f"{path}: {name} is {list(stored)} in the weights but config.json implies {list(expected)}"
                          f"{more}; config.json does not belong to these weights: restore the matching pair")
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise GqakitError(f"{path}: the weights lack {missing[0]}{more}, which would be left random; "
                          "the checkpoint is incomplete: re-download or re-save it")


@contextlib.contextmanager
def quiet_transformers():
    """transformers' loading report is many lines; check_loading says what matters in one."""
    from transformers.utils import logging as hf_logging

    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


def is_encoder_decoder(config) -> bool:
    """Whether a config (transformers object or config.json dict) is an encoder-decoder's (T5)."""
    value = config.get("is_encoder_decoder") if isinstance(config, dict) else getattr(config, "is_encoder_decoder", 0)
    return bool(value)


def auto_model_class(config):
    """transformers' Auto class that builds this config's model with its LM head: seq2seq for encoder-decoders."""
    from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

    return AutoModelForSeq2SeqLM if is_encoder_decoder(config) else AutoModelForCausalLM


def _first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]


def load_model(path: str, dtype: str = "float32", tokenizer: str | None = None, device: str = "auto",
               seq2seq: bool = False, with_tokenizer: bool = True):
    """(model in eval mode on `device`, tokenizer) of a local Hugging Face folder (or, online, a hub name). An
    encoder-decoder is refused in one line unless the caller handles one (`seq2seq`). A caller that reads no text
    passes `with_tokenizer=False` and gets (model, None)."""
    from transformers import AutoConfig, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if dtype not in DTYPES:
        raise GqakitError(f"unknown {opt('dtype', repr(dtype))}; choose one of {', '.join(DTYPES)}")
    local_only, local = False, check_model_folder(path) is not None
    if not local:  # a hub name: refused at once where the hub cannot serve it
        from gqakit.hf.hub import check_hub_name

        local_only = check_hub_name(path)
    target = resolve_device(device)
    if dtype == "bfloat16" and target.type == "cpu":
        from gqakit.common.precision import warn_if_slow_bf16

        warn_if_slow_bf16("gqakit", "--dtype bfloat16", "--dtype float32")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=local_only)
    except ValueError as e:  # e.g. no model_type, an architecture this transformers does not know
        raise GqakitError(f"transformers cannot read the config of {path} ({_first_line(e)}); "
                          "repair config.json or upgrade transformers") from None
    except OSError as e:  # only a hub name gets here: local folders were checked above
        raise GqakitError(f"cannot fetch {path} from the Hugging Face hub ({_first_line(e)}); "
                          "pass a local checkpoint folder") from None
    if is_encoder_decoder(config) and not seq2seq:
        arch = (getattr(config, "architectures", None) or [type(config).__name__])[0]
        raise GqakitError(f"{path} is an encoder-decoder ({arch}) and this command runs decoders (next-token "
                          "prediction over one growing sequence); score it with gqakit eval ppl")
    with quiet_transformers():
        model, info = auto_model_class(config).from_pretrained(
            path, config=config, dtype=getattr(torch, dtype), ignore_mismatched_sizes=True, output_loading_info=True,
            local_files_only=local_only, **LOAD_KWARGS)
    check_loading(path, info)
    model = model.to(target).eval()
    if not with_tokenizer:
        return model, None
    source = tokenizer or path
    if tokenizer is not None:
        from gqakit.hf.hub import tokenizer_files_only

        local_only = tokenizer_files_only(tokenizer)
    try:
        tok = AutoTokenizer.from_pretrained(source, local_files_only=local_only)
    except (OSError, ValueError, TypeError) as e:
        raise GqakitError(f"cannot load a tokenizer from {source} ({type(e).__name__}); "
                          "pass --tokenizer FOLDER holding tokenizer files") from None
    if len(tok) > model.config.vocab_size and tokenizer is not None:
        raise GqakitError(f"tokenizer {source} has {len(tok)} tokens but {path} only {model.config.vocab_size}; "
                          "pass the tokenizer that belongs to the model")
    if tokenizer is not None and local:
        _same_ids_as_own(path, tok, tokenizer)
    return model, tok


def _same_ids_as_own(path: str, tok, tokenizer: str) -> None:
    """A --tokenizer beside a local model folder that holds its own must number tokens as that one does: another
    vocabulary of the same size scored the embedded model at 33,699 against 145.6 without a word."""
    from transformers import AutoTokenizer

    from gqakit.hf.folder import model_folder

    if not model_folder(path).has_tokenizer:
        return
    try:
        own = AutoTokenizer.from_pretrained(path, local_files_only=True).get_vocab()
    except Exception:  # its own files do not load (tokenizers raises bare Exceptions): the one given reads the text
        return
    given = tok.get_vocab()
    differ = sum(given.get(token) != i for token, i in own.items())  # tokens added beyond its own are not counted
    if differ:
        raise GqakitError(f"{opt('tokenizer', tokenizer)} gives {differ:,} of {len(own):,} tokens other ids than "
                          f"{path}'s own tokenizer, so the model would read other tokens; drop {opt('tokenizer')} "
                          "or pass one with the model's vocabulary")


def end_token_ids(model, tokenizer=None) -> list[int]:
    """The ids that end a text, as `model.generate` reads them: the generation config's `eos_token_id` (one id or
    a list: Llama-3-style models end on several), else config.json's, else the tokenizer's; [] when none says."""
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            return [int(v) for v in (value if isinstance(value, (list, tuple)) else [value])]
    return []


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def kv_bytes_per_token(config, dtype: torch.dtype | str, tokens: int | None = None) -> float:
    """Bytes that one token adds to a full KV cache: K and V, every layer, G heads of head_dim, at `dtype`. With
    `tokens`, the bytes per token that transformers' own dense cache holds after that many: the same, except where
    sliding-window layers keep at most their window (Mistral, Gemma 2 / 3, Qwen2's `layer_types`),
    measured by filling that cache with `tokens` positions of meta tensors (no memory, no model run); a cache with
    other layers (a hybrid's state layers) is refused in one line rather than counted as K/V.

    The one definition for every table (demo, eval ppl / stream / passkey): pass the dtype the cache is
    held in at run time, which is the compute dtype (transformers caches K and V as attention computes
    them), not the dtype stored on disk; `kv_heading` names it in the column heading.
    An encoder-decoder's is its decoder's self-attention cache per generated token (its cross-attention cache
    holds as many bytes per input token). A family whose transformers cache holds K/V expanded to every query head
    (Falcon) counts every head: that is what its runtime keeps. Latent attention (DeepSeek V2/V3, `convert-gqa
    --to mla`) caches a latent and one shared RoPE key per token and layer.
    """
    from gqakit.hf.architectures import find_family

    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if is_latent(config):  # latent attention (DeepSeek V2/V3): the latent and the RoPE key
        return cached_layers(config) * (config.kv_lora_rank + config.qk_rope_head_dim) * itemsize
    spec = find_family((getattr(config, "architectures", None) or [""])[0])
    heads = config.num_attention_heads if spec is not None and spec.cache_holds_every_head else kv_heads(config)
    full = 2 * cached_layers(config) * heads * head_dim(config) * itemsize
    return full if tokens is None else _dense_cache_bytes(config, dtype, heads, tokens, full)


def _dense_cache_bytes(config, dtype: torch.dtype, heads: int, tokens: int, full: int) -> float:
    """Bytes per token of transformers' DynamicCache for `config` after `tokens` positions (`full` when every layer
    keeps every token)."""
    from transformers import DynamicCache

    if is_encoder_decoder(config):
        return full  # its decoder keeps every token (its config builds no decoder layer types)
    cache = DynamicCache(config=config)
    kinds = {type(layer).__name__ for layer in cache.layers}
    if kinds <= {"DynamicLayer"}:
        return full  # every layer keeps every token
    if not kinds <= {"DynamicLayer", "DynamicSlidingWindowLayer"}:  # e.g. a hybrid's state layers
        raise GqakitError(f"cannot count the KV cache of {type(config).__name__}: its layers are {sorted(kinds)}, "
                          "not K/V layers gqakit measures; evaluate a model whose attention layers all cache K and V")
    kv = torch.empty(1, heads, tokens, head_dim(config), dtype=dtype, device="meta")  # (B, G, T, d)
    for index in range(len(cache.layers)):
        cache.update(kv, kv, index)
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)) / tokens


def cached_layers(config) -> int:
    """Layers that keep a KV cache: an encoder-decoder's decoder layers, else every layer."""
    return config.num_decoder_layers if is_encoder_decoder(config) else config.num_hidden_layers


def kv_heads(config) -> int:
    return getattr(config, "num_key_value_heads", None) or config.num_attention_heads


def kv_heading(dtype: torch.dtype | str) -> str:
    """The table heading of `kv_bytes_per_token`'s column, naming the dtype it counts."""
    return f"KV-cache bytes/token ({str(dtype).removeprefix('torch.')})"


def model_dtype(model) -> torch.dtype:
    return next(model.parameters()).dtype


def describe(model, tokens: int | None = None) -> dict:
    """What a report records about a model: heads, K/V heads, layers, context, bytes per cached token (with
    `tokens`, per token of a dense cache holding that many: `kv_bytes_per_token`)."""
    cfg = model.config
    return {
        "architecture": (getattr(cfg, "architectures", None) or [type(model).__name__])[0],
        "layers": cached_layers(cfg),
        "heads": cfg.num_attention_heads,
        "kv_heads": "latent" if is_latent(cfg) else kv_heads(cfg),  # MLA: a latent, no heads
        "head_dim": head_dim(cfg),
        "max_position_embeddings": getattr(cfg, "max_position_embeddings", None),
        "dtype": str(model_dtype(model)).removeprefix("torch."),
        "device": str(next(model.parameters()).device),
        "kv_bytes_per_token": kv_bytes_per_token(cfg, model_dtype(model), tokens),
    }
