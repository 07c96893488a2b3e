"""MHA -> GQA/MQA checkpoint surgery with torch and safetensors only.

`methods` (the merge-method registry) imports without torch; the rest is imported on first use, so the
command line can read the method choices before loading torch."""
__all__ = ["ConvertConfig", "Plan", "convert", "make_plan"]


def __getattr__(name: str):
    if name == "ConvertConfig":
        from gqakit.convert.options import ConvertConfig

        return ConvertConfig
    if name == "convert":
        from gqakit.convert.run import convert

        return convert
    if name in ("Plan", "make_plan"):
        from gqakit.convert import plan

        return getattr(plan, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
