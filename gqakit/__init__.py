"""gqakit: turn multi-head-attention language models into grouped-query ones, and make them fast
and fluent on long inputs."""
__version__ = "0.1.0"
