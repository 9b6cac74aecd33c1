"""``KVCacheManager``: every running request's block table, over a pool with a prefix cache."""

from __future__ import annotations

from dataclasses import dataclass

from asyncllm.core._request import Request
from asyncllm.core.kv._block_pool import BlockPool
from asyncllm.core.kv._hashing import extend_block_hashes


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """How many blocks hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True, slots=True)
class CacheHit:
    """The cached prefix of a request: its blocks and how many tokens they cover."""

    block_ids: list[int]
    num_tokens: int


NO_HIT = CacheHit([], 0)
"""No cached prefix."""


class KVCacheManager:
    """Grows and frees per-request block tables; finds and records cached prefixes.

    Args:
        num_blocks: Blocks in the cache.
        block_size: Tokens per block.
        enable_prefix_caching: Reuse the KV of identical prefixes (full blocks) across requests.
    """

    def __init__(self, num_blocks: int, block_size: int, *, enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._tables: dict[int, list[int]] = {}
        self.num_query_tokens = 0
        """Prompt tokens looked up in the prefix cache."""
        self.num_hit_tokens = 0
        """Of those, tokens found cached."""

    @property
    def num_free_blocks(self) -> int:
        """Blocks that no request holds."""
        return self.pool.num_free_blocks

    def find_cached_prefix(self, request: Request) -> CacheHit:
        """The longest cached run of the request's full blocks.

        At least one token is always left to compute, so the step has logits to sample from.
        Nothing is taken yet: pass the hit to ``allocate_slots``. A request that wants
        ``prompt_logprobs`` gets no hit: it needs the logits of every prompt position; nor does one that
        mean-pools, which needs every prompt position's hidden state (a last-token pooling request
        computes its last token, as any request does).
        """
        if not self.looks_up(request):
            return NO_HIT
        self._hash_blocks(request, request.num_tokens)
        usable = (request.num_tokens - 1) // self.block_size
        blocks: list[int] = []
        for block_hash in request.block_hashes[:usable]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        return CacheHit(blocks, len(blocks) * self.block_size)

    def looks_up(self, request: Request) -> bool:
        """Whether ``find_cached_prefix`` looks the request up at all (see there for who does not)."""
        return self.enable_prefix_caching and request.params.prompt_logprobs is None and request.pooling != "mean"

    def record_lookup(self, request: Request, hit: CacheHit) -> None:
        """Count an admitted request's prefix-cache lookup (failed admissions are not counted).

        A request that skips the cache (``looks_up``) is not counted: its tokens were never looked up,
        and counting them as misses would lower ``prefix_cache_hit_rate`` with every such request.
        """
        if self.looks_up(request):
            self.num_query_tokens += len(request.prompt_token_ids)
            self.num_hit_tokens += min(hit.num_tokens, len(request.prompt_token_ids))

    def allocate_slots(self, request: Request, num_tokens: int, hit: CacheHit = NO_HIT) -> list[int] | None:
        """Make the request's table cover its first ``num_tokens`` tokens.

        Args:
            request: The request whose table grows (created on first use).
            num_tokens: Tokens the request will have KV for after this step.
            hit: A cached prefix from ``find_cached_prefix`` to start a new table with.

        Returns:
            The newly allocated block ids (possibly empty), or None when the pool is too small
            right now; in that case nothing changes.
        """
        table = self._tables.get(request.request_id, [])
        missing = blocks_needed(num_tokens, self.block_size) - len(table) - len(hit.block_ids)
        # Hit blocks that sit in the free queue stop being available once taken.
        available = self.pool.num_free_blocks - sum(1 for b in hit.block_ids if self.pool.ref_count(b) == 0)
        if missing > available:
            return None
        if hit.block_ids:
            self.pool.touch(hit.block_ids)
            table = table + hit.block_ids
        new_blocks = self.pool.allocate(max(missing, 0)) or []
        self._tables[request.request_id] = table + new_blocks
        return new_blocks

    def cache_computed_blocks(self, request: Request) -> None:
        """List the request's newly completed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_confirmed_tokens // self.block_size
        if num_full == 0:
            return
        self._hash_blocks(request, num_full * self.block_size)
        table = self._tables.get(request.request_id, [])
        for index in range(request.num_cached_blocks, min(num_full, len(table))):
            self.pool.cache(table[index], request.block_hashes[index])
        request.num_cached_blocks = max(request.num_cached_blocks, num_full)

    def _hash_blocks(self, request: Request, num_tokens: int) -> None:
        if len(request.block_hashes) * self.block_size + self.block_size <= num_tokens:
            tokens = request.token_ids(0, num_tokens)
            extend_block_hashes(request.block_hashes, tokens, self.block_size, request.cache_salt)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Give back the blocks of the request's table past its first ``num_tokens`` tokens.

        Speculative decoding allocates slots for a whole draft; the blocks that only rejected draft
        tokens used return to the pool (unlisted in the prefix cache: they were never confirmed).
        """
        table = self._tables.get(request.request_id)
        if table is None:
            return
        keep = blocks_needed(num_tokens, self.block_size)
        if len(table) > keep:
            self.pool.release(table[keep:])
            del table[keep:]

    def block_table(self, request_id: int) -> list[int]:
        """The request's blocks in sequence order (empty if it holds none)."""
        return self._tables.get(request_id, [])

    def free(self, request: Request) -> None:
        """Return every block of the request to the pool; a no-op if it holds none."""
        table = self._tables.pop(request.request_id, None)
        request.num_cached_blocks = 0
        if table:
            self.pool.release(table)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block; return how many were listed."""
        return self.pool.reset_prefix_cache()
