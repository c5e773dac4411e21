"""Continuous batching over the paged KV cache."""
from .engine import Engine, RequestOutput

__all__ = ["Engine", "RequestOutput"]
