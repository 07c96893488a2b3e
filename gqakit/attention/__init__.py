"""Attention backends registered with transformers' AttentionInterface.

    import gqakit.attention
    gqakit.attention.use(model, "sliding", window=512)
    AutoModelForCausalLM.from_pretrained(path, attn_implementation="gqakit_tiled")

Importing this package loads neither torch nor transformers, so the command line can read the kinds
(`kinds`) at parse time. It makes `gqakit_tiled`, `gqakit_sliding`, `gqakit_sinks`, `gqakit_sparse` and
`gqakit_ring` (context-parallel ring attention; run it inside `ring.ring_context`, see ring.py) valid
`attn_implementation`s once transformers is loaded, and loads their kernels at their first call
(`lazy_registration`); `use()` registers them itself. `use`, `KINDS` and `AttentionOptionError` are
imported on first access, as is any submodule named as an attribute.
"""
import importlib

from gqakit.attention import lazy_registration

__all__ = ["KINDS", "AttentionOptionError", "use"]

lazy_registration.install()


def __getattr__(name: str):
    if name == "use":
        from gqakit.attention.registration import use

        return use
    if name == "KINDS":
        from gqakit.attention.kinds import KINDS

        return KINDS
    if name == "AttentionOptionError":
        from gqakit.attention.masks import AttentionOptionError

        return AttentionOptionError
    if not name.startswith("_"):  # `gqakit.attention.ring` and the like, as when this package imported them
        try:
            return importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"{__name__}.{name}":
                raise
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
