"""Re-hosting: an MHA family without a grouped-K/V field, expressed exactly in a stock transformers class that has one.

A re-host maps the source's config.json to the target class's, and its tensors to the target's names, lazily: a
renamed tensor keeps its bytes (a plain copy), and a changed one (a transpose, a fused projection split per head,
a LayerNorm folded into the linears that read it, rotary rows permuted) is a `DerivedTensor` computed when the
conversion streams it. The conversion then runs on the target family's table as if the user had given a
checkpoint of the target class, so every method, the plan, the card and the output are the target's.

Every source tensor must be consumed or be a known buffer: a tensor the mapping does not understand is refused,
never dropped. Each mapping is tested (tests/hf/test_rehost.py): the re-hosted model at G = H computes the
source's logits (fp32, within 1e-5), and pooled ones equal mean-pooling computed in the source's own class.
"""
from __future__ import annotations

from gqakit.hf.architectures import ArchSpec, find_family
from gqakit.hf.architectures.rehost import bigcode, gptj, neox, t5
from gqakit.hf.architectures.rehost.base import Rehost, Rehosted
from gqakit.hf.headers import TensorInfo

REHOSTS: dict[str, Rehost] = {arch: entry for entry in (*neox.REHOSTS, *gptj.REHOSTS, *bigcode.REHOSTS, *t5.REHOSTS)
                               for arch in entry.architectures}


def find_rehost(architecture: str) -> Rehost | None:
    return REHOSTS.get(architecture)


def attention_layout(architecture: str) -> ArchSpec | None:
    """Where a model of `architecture` keeps its attention: its family's table, or, for the stock source of a re-host
    (GPT-2, GPT-NeoX, GPT-J, OPT, T5), the source's own layout (None: gqakit knows neither)."""
    spec = find_family(architecture)
    if spec is None and (entry := find_rehost(architecture)) is not None:
        spec = entry.layout or find_family(entry.target)
    return spec


def rehosted_architectures() -> list[str]:
    return sorted(REHOSTS)


def rehost(config: dict, tensors: dict[str, TensorInfo]) -> Rehosted | None:
    """The target's config and tensors when config.architectures[0] is a re-hosted family, else None."""
    archs = config.get("architectures")
    entry = find_rehost(archs[0]) if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
    if entry is None:
        return None
    new_config, new_tensors = entry.build(config, tensors)
    return Rehosted(new_config, new_tensors, entry)
