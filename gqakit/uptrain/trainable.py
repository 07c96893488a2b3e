"""Which parameters each `trainable` mode trains, by name, from the architecture tables: torch-free, so that the
memory plan counts them from the safetensors headers as `modeling.select_trainable` selects them in a model."""
from __future__ import annotations

from collections.abc import Callable

from gqakit.common.errors import GqakitError


def _sites(spec, decoder: int, encoder: int) -> list[tuple[str, str, int]]:
    """(k template, v template, layers) of every attention with K/V projections: the family's own, its other
    sites (T5's cross-attention) and an encoder's self-attention."""
    sites = [(spec.k_proj, spec.v_proj, decoder), *((k, v, decoder) for _, k, v in spec.kv_sites)]
    return sites + ([(*spec.encoder_kv, encoder)] if encoder else [])


def kv_names(arch: str, decoder: int, encoder: int = 0, encoder_grouped: bool = False) -> list[str]:
    """Parameter-name prefixes of the K/V projections (and key norms) per the architecture table: every grouped
    attention's (an encoder-decoder's encoder only where its K/V heads are grouped). `decoder` and `encoder` are
    the layer counts (0: no encoder)."""
    from gqakit.hf.architectures import KNorm
    from gqakit.hf.architectures.rehost import attention_layout

    spec = attention_layout(arch)
    if spec is None:
        raise GqakitError(f"trainable=kv does not know where {arch} keeps its K/V projections; "
                          "use trainable=attention or trainable=all")
    if spec.fused:
        raise GqakitError(f"trainable=kv needs separate K/V projections, but {arch} fuses them in "
                          f"{spec.qkv_proj.format(i='N')}; use trainable=attention")
    sites = _sites(spec, decoder, encoder)
    if spec.encoder_kv is not None and not encoder_grouped:
        sites = sites[:-1]  # an MHA encoder is not what was converted
    prefixes = [t.format(i=i) + "." for k, v, layers in sites for i in range(layers) for t in (k, v)]
    for i in range(decoder):
        if spec.k_norm in (KNorm.SPANS_HEADS, KNorm.SHARED_PER_HEAD) and spec.k_norm_weight:
            prefixes.append(spec.k_norm_weight.format(i=i))
        elif spec.k_norm is KNorm.ONE_PER_HEAD and spec.k_norm_weight:
            prefixes.append(spec.k_norm_weight.format(i=i, h=0).rsplit(".", 2)[0] + ".")
    return prefixes


def attention_names(arch: str, decoder: int, encoder: int = 0) -> list[str]:
    """Per layer, the prefix of each attention module (the parent of o_proj in the architecture table: `self_attn`,
    GPTBigCode's `attn`, Falcon's `self_attention`; T5's decoder self- and cross-attention and its encoder's
    self-attention); [] for a family outside the tables."""
    from gqakit.hf.architectures.rehost import attention_layout

    spec = attention_layout(arch)
    if spec is None:
        return []
    if spec.fused or spec.encoder_kv is None:
        return [spec.o_proj.format(i=i).rsplit(".", 1)[0] + "." for i in range(decoder)]
    return [k.format(i=i).rsplit(".", 1)[0] + "." for k, _, layers in _sites(spec, decoder, encoder)
            for i in range(layers)]


def trains(which: str, arch: str, decoder: int, encoder: int = 0, encoder_grouped: bool = False
           ) -> Callable[[str], bool]:
    """Does `which` ('all', 'attention' or 'kv') train the parameter of this name? GqakitError where the mode
    does not apply to the family."""
    if which == "kv":
        prefixes = tuple(kv_names(arch, decoder, encoder, encoder_grouped))
        return lambda name: name.startswith(prefixes)
    if which == "attention":
        prefixes = tuple(attention_names(arch, decoder, encoder))
        if prefixes:
            return lambda name: name.startswith(prefixes)
        return lambda name: ".self_attn." in name
    return lambda name: True
