"""A model folder's tokenizer.json run by the `tokenizers` library alone (no torch, no transformers), where that is
exactly what transformers' AutoTokenizer would run: what `convert-gqa --dry-run` counts calibration text with.

transformers 5.x loads such a tokenizer as its generic `TokenizersBackend`, which is tokenizer.json itself, when
tokenizer_config.json names that class (or PreTrainedTokenizerFast) and nothing makes it build another or change
the file's tokenizer: a model_type whose registered class it forces (`FORCED`), remote code (`auto_map`), a
Mistral `tekken.json`, the legacy special_tokens_map.json / added_tokens.json, or a special or added token in
tokenizer_config.json that tokenizer.json does not already hold as it is. Called without special tokens, padding
or truncation, it then encodes as `tokenizers.Tokenizer.encode(text, add_special_tokens=False)` does.
tests/hf/test_tokenizer_json.py compares the ids with AutoTokenizer's and `FORCED` with transformers' own set.
Anything else is refused here with the reason, and the caller leaves the tokenising to transformers.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

GENERIC = ("TokenizersBackend", "PreTrainedTokenizerFast")
# transformers' MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS (models/auto/tokenization_auto.py): for these model_types
# AutoTokenizer builds the registered class whatever tokenizer_config.json names. The union over the releases in our
# range (5.25 dropped camembertv2-base): a model_type here that the running release does not force only sends its
# tokenising to transformers (slower, the same ids); one missing here would count with the wrong tokenizer.
FORCED = frozenset({
    "arctic", "camembertv2-base", "chatlm", "cohere_asr", "ernie4_5", "ernie4_5_moe", "fuyu", "h2ovl_chat",
    "hyperclovax", "hyperclovax_vision_v2", "hyperclovax_vlm", "internlm2", "internlm3", "iquestcoder", "jamba",
    "llava", "llava_next", "minicpm3", "minicpmv", "minimax_m2", "modernbert", "modernbert-decoder", "molmo",
    "molmo2", "nemotron", "nvfp4", "opencua", "openvla", "paddleocr_vl", "phi3", "phi3_v", "phimoe", "qwen2",
    "qwen3_5", "qwen3_5_moe", "qwen3_5_moe_text", "qwen4_exp", "siglip2", "smolvlm", "step3_vl", "vipllava",
})
_LEGACY_FILES = ("tekken.json", "special_tokens_map.json", "added_tokens.json")
_FLAGS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")


@dataclasses.dataclass(frozen=True)
class PlainTokenizer:
    """tokenizer.json as transformers would run it; `eos_token_id` as its tokenizer_config.json names it."""

    backend: object  # tokenizers.Tokenizer
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids


def _named_tokens(settings: dict) -> list[str]:
    """Every special token tokenizer_config.json names: its `*_token` keys and its extra / additional lists."""
    def content(token) -> str | None:
        return token.get("content") if isinstance(token, dict) else token if isinstance(token, str) else None
    named = [content(v) for k, v in settings.items() if k.endswith("_token")]
    for key in ("extra_special_tokens", "additional_special_tokens"):
        more = settings.get(key) or []
        named += [content(v) for v in (more.values() if isinstance(more, dict) else more)]
    return [n for n in named if n]


def _why_not_plain(folder: Path, settings: dict, model_type, added: dict[int, dict]) -> str | None:
    """Why transformers would not run tokenizer.json unchanged (None: it would)."""
    named = settings.get("tokenizer_class")
    if named not in GENERIC:
        return f"its tokenizer_config.json names {named or 'no tokenizer_class'}, which transformers builds itself"
    if "auto_map" in settings:
        return "its tokenizer_config.json names remote code (auto_map)"
    if model_type in FORCED:
        return f"transformers builds model_type {model_type}'s own tokenizer class"
    if (legacy := next((f for f in _LEGACY_FILES if (folder / f).is_file()), None)) is not None:
        return f"it holds {legacy}, which transformers reads too"
    contents = {t.get("content") for t in added.values()}
    if (missing := next((t for t in _named_tokens(settings) if t not in contents), None)) is not None:
        return f"its tokenizer_config.json names the special token {missing!r}, which tokenizer.json does not hold"
    decoder = settings.get("added_tokens_decoder") or {}
    if not isinstance(decoder, dict):
        return "its tokenizer_config.json's added_tokens_decoder is not a JSON object"
    for index, token in decoder.items():
        held = added.get(int(index), {}) if str(index).isdigit() else {}
        if not isinstance(token, dict) or any(token.get(k) != held.get(k) for k in _FLAGS):
            return f"its tokenizer_config.json adds token {index}, which tokenizer.json holds otherwise or not at all"
    if settings.get("split_special_tokens"):
        return "its tokenizer_config.json sets split_special_tokens"
    return None


def plain_tokenizer(folder: Path, config: dict) -> PlainTokenizer | str:
    """The folder's tokenizer as transformers would run it, or, where only transformers can say, why not (a phrase
    about the folder: "its tokenizer_config.json names GPT2Tokenizer, ...")."""
    path, settings_path = folder / "tokenizer.json", folder / "tokenizer_config.json"
    if not path.is_file() or not settings_path.is_file():
        return f"{folder} has no {'tokenizer.json' if not path.is_file() else 'tokenizer_config.json'}"
    try:
        settings = json.loads(settings_path.read_text())
        added = {int(t["id"]): t for t in json.loads(path.read_text()).get("added_tokens") or []}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"its tokenizer files do not read as JSON here ({type(e).__name__})"
    if not isinstance(settings, dict):
        return "its tokenizer_config.json is not a JSON object"
    if (why := _why_not_plain(folder, settings, config.get("model_type"), added)) is not None:
        return why
    from tokenizers import Tokenizer

    try:
        backend = Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - a broken tokenizer.json: transformers' own error, when converting
        return f"its tokenizer.json does not load here ({type(e).__name__})"
    backend.no_truncation()  # transformers' call without truncation or padding turns both off
    backend.no_padding()
    eos = settings.get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    return PlainTokenizer(backend, backend.token_to_id(eos) if isinstance(eos, str) else None)
