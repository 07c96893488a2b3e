"""The weights transformers looks for when it loads a config.json: its class's parameters, built on the meta device
(no memory at any size). convert-gqa checks the output it plans against them before writing anything: a tensor the
source lacks, or one of another shape, would otherwise be left random (or resized) when the output loads, with
nothing but transformers' loading report to say so."""
from __future__ import annotations

from gqakit.common.errors import GqakitError


def expected_weights(config: dict) -> list[dict[str, tuple[int, ...]]]:
    """One {name: shape} per parameter of the config's class: tied parameters (tie_word_embeddings) are one entry
    with every name they go by, any of which a checkpoint may store."""
    import torch

    from gqakit.hf.fields import config_object
    from gqakit.hf.loading import auto_model_class, quiet_transformers

    with quiet_transformers(), torch.device("meta"):  # the config's own warnings are the loader's to give
        try:
            cfg = config_object(config)
        except Exception as e:  # transformers' strict config classes: TypeError, ValueError, StrictDataclassError
            line = (str(e).strip().splitlines() or [type(e).__name__])
            raise GqakitError(f"transformers cannot read the output's config.json ({' '.join(line[:2])}), nor the "
                              "source's; fix that field in config.json") from None
        # eager: the weights do not depend on the kernel, and config.json may name one not installed here
        model = auto_model_class(cfg).from_config(cfg, attn_implementation="eager")
    model.tie_weights()
    groups: dict[int, dict[str, tuple[int, ...]]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), {})[name] = tuple(p.shape)
    return list(groups.values())


def check_complete(config: dict, written: dict[str, tuple[int, ...]], what: str) -> None:
    """Refuse, in one line, an output whose tensors (`written`: name -> shape) leave a parameter of the class
    that `config` builds absent or misshapen. `what` names the source in the message."""
    for names in expected_weights(config):
        stored = [n for n in names if n in written]
        if not stored:
            name = next(iter(names))
            raise GqakitError(f"{what} lacks {name}, which {config['architectures'][0]} needs: it would be left "
                              "random when the output loads; the checkpoint is incomplete: re-download or re-save it")
        for name in stored:
            if tuple(written[name]) != names[name]:
                raise GqakitError(f"{what}: {name} would be written as {list(written[name])} but config.json implies "
                                  f"{list(names[name])}; the weights do not match config.json")
