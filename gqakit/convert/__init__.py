"""MHA -> GQA/MQA checkpoint surgery with torch and safetensors only."""
from gqakit.convert.plan import Plan, make_plan
from gqakit.convert.run import ConvertConfig, convert

__all__ = ["ConvertConfig", "Plan", "convert", "make_plan"]
