"""The output tensors of one layer written as latent attention: DeepseekV3's q/kv_a/kv_b/o tensors, all made from
the layer's q/k/v/o projections (the plan makes each a `latent` op; the engine makes the layer once,
`construct.py`). Checks the sources first: q/k/v rows and o's columns must match the config."""
from __future__ import annotations

from collections.abc import Callable

from gqakit.common.errors import GqakitError, opt
from gqakit.hf.architectures import ArchSpec
from gqakit.hf.architectures.latent import ATTENTION, LatentShape
from gqakit.hf.headers import TensorInfo


def latent_tensors(spec: ArchSpec, tensors: dict[str, TensorInfo], i: int, heads: int, kv_heads: int, head_dim: int,
                   shape: LatentShape, check_rows: Callable) -> tuple[tuple[str, ...], str, dict[str, tuple]]:
    """Layer i's (sources, the key projection's name, {target tensor name: shape}). `check_rows(name, rows, what)`
    refuses a source whose row count differs from the config's."""
    roles = {"q": spec.q_proj, "k": spec.k_proj, "v": spec.v_proj, "o": spec.o_proj}
    names = {role: template.format(i=i) + ".weight" for role, template in roles.items()}
    rows = {"q": heads * head_dim, "k": kv_heads * head_dim, "v": kv_heads * head_dim}
    for role in ("q", "k", "v"):
        check_rows(names[role], rows[role], f"{heads if role == 'q' else kv_heads} heads of {head_dim}")
    o = tensors.get(names["o"])
    if o is None or len(o.shape) != 2 or o.shape[1] != heads * head_dim:
        raise GqakitError(f"tensor '{names['o']}' is missing or not [hidden, {heads * head_dim}]; the weights do not "
                          "match the config")
    biases = {role: template.format(i=i) + ".bias" for role, template in roles.items()}
    for role in ("q", "o"):
        if biases[role] in tensors:
            raise GqakitError(f"tensor '{biases[role]}' is a bias that DeepseekV3's {role}_proj cannot take; "
                              f"drop {opt('to', 'mla')}")
    sources = (*names.values(), *(biases[r] for r in ("k", "v") if biases[r] in tensors))
    hidden = tensors[names["k"]].shape[1]
    prefix = ATTENTION.format(i=i)
    return sources, names["k"], {prefix + name: size for name, size in shape.shapes(hidden).items()}
