"""The floating-point dtypes a user names (`--dtype`, `save_dtype`, ...): declared once, read by every command.

`AUTO` ("auto") means "keep each tensor's own dtype" where a command offers it. The safetensors dtype codes
of a checkpoint (F32, BF16, ...) are a separate, file-format vocabulary: `hf/checkpoint.py`. No torch import
here, so the command line parses without loading torch."""
from __future__ import annotations

NAMES = ("float32", "bfloat16", "float16")  # the choices of a --dtype without auto
AUTO = "auto"
WITH_AUTO = (AUTO, *NAMES)


def torch_dtype(name: str):
    """'bfloat16' -> torch.bfloat16 (a name of NAMES)."""
    if name not in NAMES:
        raise KeyError(name)
    import torch

    return getattr(torch, name)
