"""The schema of a re-host mapping and the check that it consumed every source tensor."""
from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable

from gqakit.common.errors import GqakitError
from gqakit.hf.architectures.spec import ArchSpec
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


def source_config(config: dict):
    """The source's normalised transformers config (legacy keys such as rotary_pct mapped to today's)."""
    from gqakit.hf.fields import config_object

    return config_object(config)


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
