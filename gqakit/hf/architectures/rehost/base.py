"""The schema of a re-host mapping and the check that it consumed every source tensor."""
from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from types import SimpleNamespace

from gqakit.common.errors import GqakitError
from gqakit.hf.architectures.spec import ArchSpec
from gqakit.hf.config_defaults import CLASSES, filled
from gqakit.hf.fields import positive_int
from gqakit.hf.headers import TensorInfo


@dataclasses.dataclass(frozen=True)
class Rehost:
    """One source family -> one target class."""

    family: str  # the source family, as users name it
    architectures: tuple[str, ...]  # config.architectures[0] values it takes
    target: str  # the target class (its ArchSpec is in the architecture table)
    build: Callable[[dict, dict[str, TensorInfo]], tuple[dict, dict[str, TensorInfo]]]
    exact: str  # what is exact, for the plan, the card and the docs
    # where the stock source keeps its attention, for uptraining it unconverted (trainable=attention / kv); None:
    # the source's tensors are the target's own (T5)
    layout: ArchSpec | None = None


@dataclasses.dataclass(frozen=True)
class Rehosted:
    config: dict  # the target's config.json
    tensors: dict[str, TensorInfo]  # the target's tensors (stored or derived)
    rehost: Rehost

    def describe(self) -> str:
        return f"{self.rehost.family} ({self.rehost.architectures[0]}) re-hosted on {self.rehost.target}: " \
               f"{self.rehost.exact}"


def source_config(config: dict, family: str, model_types: tuple[str, ...]) -> SimpleNamespace:
    """The source's config as its transformers class holds it (defaults filled, legacy keys such as rotary_pct mapped
    to today's: `hf.config_defaults`), without importing transformers; its integer fields checked."""
    model_type = config.get("model_type")
    source = filled(config) if model_type in model_types else None
    if source is None:
        raise GqakitError(f"{family} config.json has model_type {json.dumps(model_type)}; write "
                          f"{' or '.join(json.dumps(t) for t in model_types)} (its config class's model_type)")
    for key, default in CLASSES[model_type].defaults.items():  # what transformers' strict dataclasses would refuse
        if isinstance(default, int) and not isinstance(default, bool) and not key.endswith("_token_id"):
            positive_int(source, key)
    return SimpleNamespace(**source)


def head_dim_of(family: str, hidden: int, heads: int, hidden_key: str, heads_key: str) -> int:
    """hidden / heads, or a one-line refusal naming the family's own keys."""
    if hidden % heads:
        raise GqakitError(f"{family} {hidden_key} {hidden} is not divisible by {heads_key} {heads}; fix config.json")
    return hidden // heads


def token_ids(src) -> dict:
    """The special-token ids a target config carries over."""
    return {k: getattr(src, k) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}


def unused_check(family: str, tensors: dict[str, TensorInfo], used: set[str], buffers: tuple[str, ...] = ()) -> None:
    """Refuse a source tensor that the mapping neither consumed nor knows as a buffer."""
    ignorable = [re.compile(p) for p in buffers]
    for name in sorted(tensors):
        if name not in used and not any(p.fullmatch(name) for p in ignorable):
            raise GqakitError(f"tensor '{name}' is not part of the {family} layout gqakit re-hosts; the checkpoint "
                              f"has a variant gqakit does not know: report it, or remove the tensor if it is unused")
