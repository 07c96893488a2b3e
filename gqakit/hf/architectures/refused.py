"""Families gqakit knows and does not convert, each with the reason and what to do: a one-line refusal that names
the family, never a wrong "add this field" hint read off a config that spells its fields otherwise.

A family is recognised by its config.json `model_type` (every head of it at once: BertModel,
BertForSequenceClassification, ...), or, in a config without one, by its class name: the family's prefix followed by
`Model`, `LMHeadModel`, `MTModel` or `For...` (so `ModernBertDecoderForCausalLM` is not ModernBERT the encoder).
"""
from __future__ import annotations

import re

_ALIBI = ("uses ALiBi position biases, and no stock transformers class with grouped K/V heads applies the same "
          "ALiBi slopes; gqakit does not convert ALiBi models")
_ENCODER = ("is an encoder: it keeps no KV cache, so grouping its K/V heads saves nothing at inference; gqakit "
            "converts decoders and encoder-decoders")
_ENC_DEC = ("is an encoder-decoder that gqakit does not convert yet (no grouped-K/V class for it; the supported "
            "families are listed in docs/convert.md); of the encoder-decoders gqakit converts T5, Flan-T5 and mT5")

# model_type -> (reason, class-name prefixes)
FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
    "bloom": (_ALIBI, ("Bloom",)),
    "mpt": (_ALIBI, ("Mpt", "MPT")),  # the hub's MosaicML configs say MPTForCausalLM
    **{model_type: (_ENCODER, prefixes) for model_type, prefixes in (
        ("bert", ("Bert",)), ("roberta", ("Roberta",)), ("xlm-roberta", ("XLMRoberta",)),
        ("xlm-roberta-xl", ("XLMRobertaXL",)), ("camembert", ("Camembert",)), ("electra", ("Electra",)),
        ("albert", ("Albert",)), ("deberta", ("Deberta",)), ("deberta-v2", ("DebertaV2",)),
        ("distilbert", ("DistilBert",)), ("modernbert", ("ModernBert",)),
    )},
    **{model_type: (_ENC_DEC, prefixes) for model_type, prefixes in (
        ("bart", ("Bart",)), ("mbart", ("MBart",)), ("plbart", ("PLBart",)), ("mvp", ("Mvp",)),
        ("pegasus", ("Pegasus",)), ("pegasus_x", ("PegasusX",)), ("bigbird_pegasus", ("BigBirdPegasus",)),
        ("marian", ("Marian",)), ("blenderbot", ("Blenderbot",)), ("blenderbot-small", ("BlenderbotSmall",)),
        ("m2m_100", ("M2M100",)), ("nllb-moe", ("NllbMoe",)), ("fsmt", ("FSMT",)), ("led", ("LED",)),
        ("prophetnet", ("ProphetNet",)), ("umt5", ("UMT5",)), ("longt5", ("LongT5",)),
        ("switch_transformers", ("SwitchTransformers",)), ("t5gemma", ("T5Gemma",)),
    )},
}
# classes of a supported family's model_type that gqakit does not convert
REFUSED: dict[str, str] = {"T5EncoderModel": _ENCODER, "MT5EncoderModel": _ENCODER}
_FALCON = ("FalconForCausalLM", "RWForCausalLM")
_FALCON_TYPES = ("falcon", "RefinedWeb", "RefinedWebModel")
_CROSS_ATTENTION = ("GPTBigCodeForCausalLM", "GroupedGPTBigCodeForCausalLM")  # add_cross_attention: a second K/V
_HEAD = re.compile(r"Model|LMHeadModel|MTModel|For[A-Z]\w*")


def falcon_reason(config: dict) -> str | None:
    """Falcon converts natively with new_decoder_architecture (grouped K/V heads); the other variants are refused."""
    if config.get("alibi"):
        return _ALIBI
    if config.get("new_decoder_architecture"):
        return None
    if config.get("multi_query", True):
        return "is already multi-query (one K/V head): there is nothing to group"
    return ("without new_decoder_architecture keeps every K/V head with no field for fewer (grouped K/V needs the "
            "new decoder architecture, a different block); gqakit does not convert it")


def _by_class_name(architecture: str) -> str | None:
    """The reason of the family whose longest prefix, followed by a model head, spells `architecture`."""
    found = [(len(prefix), reason) for reason, prefixes in FAMILIES.values() for prefix in prefixes
             if architecture.startswith(prefix) and _HEAD.fullmatch(architecture[len(prefix):])]
    return max(found)[1] if found else None


def refusal(architecture: str | None, config: dict) -> str | None:
    """Why this model is refused, as a line that names it, or None when gqakit converts it (or does not know it).
    `architecture` is config.architectures[0], or None where config.json names none (then its model_type speaks)."""
    model_type = config.get("model_type") if isinstance(config.get("model_type"), str) else None
    name = architecture or f"{model_type} (config.json's model_type)"
    if architecture in _FALCON or (architecture is None and model_type in _FALCON_TYPES):
        why = falcon_reason(config)
        return f"{name} {why}" if why else None
    if architecture in _CROSS_ATTENTION and config.get("add_cross_attention"):
        return (f"{name} with add_cross_attention true has cross-attention, whose K/V heads gqakit does not regroup "
                "(and transformers' multi-query GPTBigCode cannot hold); gqakit converts it without")
    reason = REFUSED.get(architecture) if architecture else None
    if reason is None and model_type in FAMILIES:
        reason = FAMILIES[model_type][0]
    if reason is None and architecture:
        reason = _by_class_name(architecture)
    return f"{name} {reason}" if reason else None
