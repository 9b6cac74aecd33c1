"""The paged KV cache's bookkeeping: which blocks exist and which request holds which."""

from asyncllm.core.kv._block_pool import BlockPool
from asyncllm.core.kv._manager import KVCacheManager

__all__ = ["BlockPool", "KVCacheManager"]
