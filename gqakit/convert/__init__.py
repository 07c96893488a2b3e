"""MHA -> GQA/MQA checkpoint surgery with torch and safetensors only."""
from .plan import Plan, make_plan
from .run import ConvertConfig, convert

__all__ = ["ConvertConfig", "Plan", "convert", "make_plan"]
