"""Continuous batching over the paged KV cache."""
from .engine import Engine
from .outputs import GenerationOutput, RequestOutput

__all__ = ["Engine", "GenerationOutput", "RequestOutput"]
