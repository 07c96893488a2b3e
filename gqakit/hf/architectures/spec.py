"""The schema of an architecture table."""
from __future__ import annotations

import dataclasses
from enum import Enum


class KNorm(Enum):
    """How a family normalises keys, which decides what pooling must do and whether it is exact."""

    NONE = "none"
    # One weight vector of K*head_dim features (OLMo2): pooled head-wise like the projection rows;
    # its RMS spans all heads, so pooling is again exact only for identical heads.
    SPANS_HEADS = "spans_heads"
    # One [head_dim] weight shared by every head (Qwen3, Gemma3): unchanged, but applied after the
    # projection, so pooling W_k is not the same as pooling normalised keys.
    SHARED_PER_HEAD = "shared_per_head"
    # One norm module per K/V head (StableLM qk_layernorm): pooled per group; inexact as above.
    ONE_PER_HEAD = "one_per_head"


@dataclasses.dataclass(frozen=True)
class ArchSpec:
    """Where one family keeps its K/V heads. Templates take the layer index as `{i}`."""

    family: str  # config.json's model_type too, unless `model_type` says otherwise
    architectures: tuple[str, ...]
    # Unfused projections (None when the family fuses them).
    k_proj: str | None = "model.layers.{i}.self_attn.k_proj"
    v_proj: str | None = "model.layers.{i}.self_attn.v_proj"
    # Fused [q | k | v] projection along the output rows (Phi3 `qkv_proj`).
    qkv_proj: str | None = None
    # The query and output projections, which an aligned merge transforms alongside K and V.
    q_proj: str | None = "model.layers.{i}.self_attn.q_proj"
    o_proj: str | None = "model.layers.{i}.self_attn.o_proj"
    # Key norm: kind and tensor template ({h} is the K/V head index for ONE_PER_HEAD).
    k_norm: KNorm = KNorm.NONE
    k_norm_weight: str | None = None
    # Extra weights of each per-head norm module (e.g. a LayerNorm bias), same template scheme.
    k_norm_extra: tuple[str, ...] = ()
    # The boolean config.json key that switches the key norm on (Phi's and StableLM's qk_layernorm; its class's
    # default where config.json leaves it out): off, the family has no key norm. None: always as declared.
    k_norm_key: str | None = None
    notes: str = ""
    # config.json keys this family spells its own way: (transformers' common name, this family's key)
    config_names: tuple[tuple[str, str], ...] = ()
    # A family that holds K/V heads only as MQA or as MHA, picked by this boolean config key (GPTBigCode's
    # multi_query): true keeps one K/V head with fused rows [q | k | v]; false keeps every head with fused rows
    # per head [q_h, k_h, v_h]. Only G = 1 and G = H exist.
    multi_query_key: str | None = None
    # Row order of the fused projection: "blocks" [q | k | v]; "groups": per K/V head, its H/K query heads, then its
    # key, then its value (Falcon's new_decoder_architecture)
    qkv_layout: str = "blocks"
    # What the plan and the card must say about the family's runtime (Falcon's cache holds every head anyway)
    runtime_note: str = ""
    # transformers releases below this one keep the family's cache with K/V expanded to every query head (Falcon
    # before 5.25): what eval's KV-cache column counts there (`cache_holds_every_head`)
    cache_holds_every_head_before: str | None = None
    # gqakit's own class for a G the family's stock class cannot hold (GPTBigCode: 1 < G < H), or, on a family
    # without multi_query_key, the gqakit class the family itself is: (model_type, architecture, its K/V head key)
    grouped_class: tuple[str, str, str] | None = None
    # Whether config.json may carry an explicit head_dim (Falcon derives it, as a read-only property)
    head_dim_field: bool = True
    # More (name, k, v) projection templates per layer with the same K/V heads, regrouped exactly as k_proj / v_proj
    # are (T5's decoder cross-attention); the card reports them as columns `name k` / `name v`
    kv_sites: tuple[tuple[str, str, str], ...] = ()
    # An encoder's self-attention (k, v) templates, regrouped only when asked (--pool-encoder); its layer count and
    # K/V head count are read from these config.json keys
    encoder_kv: tuple[str, str] | None = None
    encoder_fields: tuple[str, str] = ("num_layers", "encoder_num_key_value_heads")
    # Why the layer-wise methods (aligned, fit, transfer) cannot convert this family, when a reason other than
    # fused projections or key norms applies
    not_layerwise: str | None = None
    # config.json's model_type where it is not `family` (Gemma3ForCausalLM's config class is gemma3_text)
    model_type: str | None = None

    def for_config(self, known: dict) -> ArchSpec:
        """The table as the model of this config has it (`known`: config.json with its class's defaults filled
        in): without the key norm where `k_norm_key` switches it off."""
        if self.k_norm_key is None or known.get(self.k_norm_key):
            return self
        return dataclasses.replace(self, k_norm=KNorm.NONE, k_norm_weight=None, k_norm_extra=(), k_norm_key=None)

    @property
    def config_model_type(self) -> str:
        return self.model_type or self.family

    @property
    def fused(self) -> bool:
        return self.qkv_proj is not None

    @property
    def alignable(self) -> str | None:
        """Why `--method aligned` cannot transform this family's heads exactly (None: it can)."""
        if self.fused:
            return "fuses Q, K and V into one projection"
        if self.k_norm is not KNorm.NONE:
            return "normalises keys between k_proj and RoPE, which the key rotations do not commute with"
        return self.not_layerwise

    @property
    def cache_holds_every_head(self) -> bool:
        """Does the running transformers keep this family's cache with K/V expanded to every query head?"""
        from gqakit.hf.compat import transformers_before

        before = self.cache_holds_every_head_before
        return before is not None and transformers_before(before)

    @property
    def pooling_exact_for_identical_heads_only(self) -> bool:
        """Per-head key norms make mean-pooling inexact unless the heads in a group are identical."""
        return self.k_norm is not KNorm.NONE
