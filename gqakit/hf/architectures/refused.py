"""Families gqakit knows and does not convert, each with the reason and what to do: a one-line refusal that names
the family, never a wrong "add this field" hint read off a config that spells its fields otherwise."""
from __future__ import annotations

_ALIBI = ("uses ALiBi position biases, and no stock transformers class with grouped K/V heads applies the same "
          "ALiBi slopes; gqakit does not convert ALiBi models")
_ENCODER = ("is an encoder: it keeps no KV cache, so grouping its K/V heads saves nothing at inference; gqakit "
            "converts decoders")
_NOT_YET = "is not converted by gqakit yet (the supported families are listed in docs/convert.md)"
_ENC_DEC = _NOT_YET + "; of the encoder-decoders gqakit converts T5, Flan-T5 and mT5"

REFUSED: dict[str, str] = {
    "BloomForCausalLM": _ALIBI,
    "MptForCausalLM": _ALIBI,
    "BartForConditionalGeneration": _ENC_DEC,
    "BertModel": _ENCODER, "BertForMaskedLM": _ENCODER, "RobertaModel": _ENCODER, "RobertaForMaskedLM": _ENCODER,
    "DistilBertModel": _ENCODER, "DistilBertForMaskedLM": _ENCODER, "DebertaV2Model": _ENCODER,
}


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


def refusal(architecture: str, config: dict) -> str | None:
    """Why this architecture is refused, as a line that names it, or None when gqakit converts it (or does not know
    it)."""
    if architecture in ("FalconForCausalLM", "RWForCausalLM"):
        why = falcon_reason(config)
        return f"{architecture} {why}" if why else None
    reason = REFUSED.get(architecture)
    return f"{architecture} {reason}" if reason else None
