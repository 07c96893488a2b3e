"""Uptraining after conversion: `gqakit uptrain RECIPE.yaml [key=value ...]`, on one process or
several (torchrun / accelerate launch), with optional distillation and ring-attention context
parallelism. See `config.UptrainConfig` for every option."""
from .config import UptrainConfig
from .loop import uptrain

__all__ = ["UptrainConfig", "uptrain"]
