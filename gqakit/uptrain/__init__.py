"""Uptraining after conversion: `gqakit uptrain RECIPE.yaml [key=value ...]`, on one process or
several (torchrun / accelerate launch), with optional distillation and ring-attention context
parallelism. See `config.UptrainConfig` for every option.

`UptrainConfig` and `uptrain` are imported on first use: importing the package, or any module of it, runs
nothing else, and a recipe can be read and checked without torch."""
__all__ = ["UptrainConfig", "uptrain"]


def __getattr__(name: str):
    if name == "UptrainConfig":
        from gqakit.uptrain.config import UptrainConfig

        return UptrainConfig
    if name == "uptrain":
        from gqakit.uptrain.loop import uptrain

        return uptrain
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
