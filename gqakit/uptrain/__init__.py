"""Uptraining after conversion: `gqakit uptrain RECIPE.yaml [key=value ...]`, on one process or
several (torchrun / accelerate launch), with optional distillation and ring-attention context
parallelism. See `config.UptrainConfig` for every option."""
from gqakit.uptrain.config import UptrainConfig

__all__ = ["UptrainConfig", "uptrain"]


def __getattr__(name: str):
    if name == "uptrain":  # imported on first use: a recipe can be read and checked without torch
        from gqakit.uptrain.loop import uptrain

        return uptrain
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
