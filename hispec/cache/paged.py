"""A model's paged KV cache: the block bookkeeping and the tensors it addresses, made together."""
from __future__ import annotations

from dataclasses import dataclass

from .block_manager import BlockManager
from .kv_cache import KVPool


@dataclass
class PagedCache:
    blocks: BlockManager
    pool: KVPool

    @classmethod
    def for_model(cls, model, num_blocks: int, block_size: int) -> "PagedCache":
        cfg, layers = model.cfg, model.kv_layers  # the model's layers, then its exit blocks
        return cls(BlockManager(num_blocks, block_size, cfg.num_layers, layers - cfg.num_layers),
                   KVPool(layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, model.kv_dtype,
                          model.device))

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def block_size(self) -> int:
        return self.blocks.block_size
