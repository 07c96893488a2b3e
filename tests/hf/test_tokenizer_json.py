"""gqakit/hf/tokenizer_json.py: where it runs tokenizer.json alone, its ids are AutoTokenizer's (the embedded models'
tokenizers, as saved and as variants transformers still loads as tokenizer.json); where transformers would build
another tokenizer or change this one, it says why and tokenises nothing; its copy of transformers' list of
model_types whose tokenizer class is forced is transformers' own."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from transformers import AutoTokenizer
from transformers.models.auto import tokenization_auto

from gqakit.hf.tokenizer_json import FORCED, PlainTokenizer, plain_tokenizer

ASSETS = Path(__file__).resolve().parents[2] / "gqakit" / "assets"
TEXTS = [
    (ASSETS / "heldout_emma.txt").read_text()[:20_000],
    "A literal <|endoftext|> and <pad> inside the text, and <extra_id_3> too.",
    "naïve café — 東京 🙂 ﬁne\u00a0spaces",
    "  leading spaces\n\n\ttabs   and trailing   ",
    "",
]


def _folder(tmp_path: Path, model: str, settings: dict | None = None, config: dict | None = None,
            tokenizer: dict | None = None, extra: dict | None = None) -> Path:
    """A copy of an embedded model's config and tokenizer files, with its tokenizer_config.json / config.json /
    tokenizer.json updated and extra files written."""
    folder = tmp_path / model
    folder.mkdir()
    for name, more in (("tokenizer_config.json", settings), ("config.json", config), ("tokenizer.json", tokenizer)):
        data = json.loads((ASSETS / model / name).read_text())
        (folder / name).write_text(json.dumps({**data, **(more or {})}))
    for name, text in (extra or {}).items():
        (folder / name).write_text(text)
    return folder


def _same_as_transformers(folder: Path) -> None:
    plain = plain_tokenizer(folder, json.loads((folder / "config.json").read_text()))
    assert isinstance(plain, PlainTokenizer), plain
    real = AutoTokenizer.from_pretrained(str(folder))
    assert plain.eos_token_id == real.eos_token_id
    for text in TEXTS:
        assert plain.encode(text) == real(text, add_special_tokens=False, verbose=False).input_ids, text[:40]


def test_forced_holds_transformers_own_list():
    """A superset is safe (those model_types are tokenised by transformers itself); a missing one is not."""
    assert frozenset(tokenization_auto.MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS) <= FORCED


@pytest.mark.parametrize("model", ["austen-mha-8h", "austen-t5-8h"])
def test_the_embedded_tokenizers_encode_as_transformers_does(model):
    _same_as_transformers(ASSETS / model)


@pytest.mark.parametrize("variant", ["fast alias", "truncation and padding", "added_tokens_decoder"])
def test_variants_transformers_loads_as_tokenizer_json_encode_alike(tmp_path, variant):
    tokenizer = json.loads((ASSETS / "austen-mha-8h" / "tokenizer.json").read_text())
    if variant == "fast alias":
        folder = _folder(tmp_path, "austen-mha-8h", settings={"tokenizer_class": "PreTrainedTokenizerFast"})
    elif variant == "truncation and padding":  # transformers' call turns both off
        folder = _folder(tmp_path, "austen-mha-8h", tokenizer={
            "truncation": {"direction": "Right", "max_length": 5, "strategy": "LongestFirst", "stride": 0},
            "padding": {"strategy": {"Fixed": 64}, "direction": "Right", "pad_to_multiple_of": None, "pad_id": 0,
                        "pad_type_id": 0, "pad_token": "<|endoftext|>"}})
    else:  # what transformers 4.x wrote: the added tokens again, as tokenizer.json holds them
        decoder = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in tokenizer["added_tokens"]}
        folder = _folder(tmp_path, "austen-mha-8h", settings={"added_tokens_decoder": decoder})
    _same_as_transformers(folder)


@pytest.mark.parametrize("variant, reason", [
    ({"settings": {"tokenizer_class": "GPT2Tokenizer"}}, "names GPT2Tokenizer"),
    ({"settings": {"tokenizer_class": None}}, "names no tokenizer_class"),
    ({"config": {"model_type": "qwen2"}}, "model_type qwen2"),
    ({"settings": {"auto_map": {"AutoTokenizer": ["x.Tok", None]}}}, "auto_map"),
    ({"extra": {"special_tokens_map.json": "{}"}}, "special_tokens_map.json"),
    ({"extra": {"tekken.json": "{}"}}, "tekken.json"),
    ({"settings": {"bos_token": "<s>"}}, "special token '<s>'"),
    ({"settings": {"extra_special_tokens": ["<|endoftext|>", "<sep>"]}}, "special token '<sep>'"),
    ({"settings": {"added_tokens_decoder": {"0": {"content": "<|endoftext|>", "lstrip": True, "rstrip": False,
                                                  "single_word": False, "normalized": False, "special": True}}}},
     "adds token 0"),
    ({"settings": {"split_special_tokens": True}}, "split_special_tokens"),
    ({"extra": {"tokenizer.json": "{not json"}}, "do not read as JSON"),
])
def test_what_only_transformers_can_say_is_named_not_guessed(tmp_path, variant, reason):
    folder = _folder(tmp_path, "austen-mha-8h", **variant)
    why = plain_tokenizer(folder, json.loads((folder / "config.json").read_text()))
    assert isinstance(why, str) and reason in why, why


def test_no_tokenizer_files(tmp_path):
    shutil.copy(ASSETS / "austen-mha-8h" / "config.json", tmp_path / "config.json")
    assert plain_tokenizer(tmp_path, {}) == f"{tmp_path} has no tokenizer.json"
