"""gqakit: turn multi-head-attention language models into grouped-query ones, and make them fast
and fluent on long inputs."""
__version__ = "0.1.0"

from gqakit.hf.models.registry import install as _install_model_classes  # noqa: E402  (transformers-free)

_install_model_classes()  # gqakit's own classes join transformers' Auto classes once transformers is imported
