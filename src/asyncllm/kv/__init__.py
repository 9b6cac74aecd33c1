"""The paged KV cache's bookkeeping: which blocks exist and which request holds which."""

from asyncllm.kv.block_pool import BlockPool
from asyncllm.kv.manager import KVCacheManager

__all__ = ["BlockPool", "KVCacheManager"]
