"""``BlockPool``: fixed-size KV blocks with reference counts, an O(1) LRU free queue and a prefix cache.

A block is either held (reference count >= 1) or free (count 0, in the free queue). A free block
may still hold the KV of a full block of some earlier sequence and be listed in the hash → block
map; a later request with the same prefix takes it straight out of the free queue (a cache hit).
Cached free blocks are evicted lazily, only when ``allocate`` needs a block and pops them.

A cached block can also be indexed by its leading tokens under its parent's hash (``cache`` with
``tokens``): ``partial_match`` then finds the cached block that shares the longest run of leading
tokens with a request's next, not-fully-cached block, whose rows the request copies instead of
computing them (``KVCacheManager``'s partial-block hits).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator


class BlockPool:
    """Hands out KV cache block ids, takes them back, and remembers which full blocks hold what.

    The free queue is an ``OrderedDict`` used as a doubly linked list: popping the least recently
    freed block, appending and removing from the middle (a cache hit) are all O(1).

    Args:
        num_blocks: How many blocks the cache has.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self._hash_of: list[bytes | None] = [None] * num_blocks
        self._leading: dict[tuple[bytes, int, int], dict[int, None]] = {}
        """(parent key, run length, run hash) → the cached blocks whose first tokens are that run, oldest
        first (an ordered set); runs of 1 to block_size - 1 tokens (``_runs``)."""
        self._leading_of: dict[int, tuple[bytes, tuple[int, ...]]] = {}
        """A block indexed in ``_leading``: its parent key and tokens (to unindex it, and to check a match)."""

    @property
    def num_free_blocks(self) -> int:
        """Blocks that nobody holds (cached ones included: they are evictable)."""
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks listed in the prefix cache, held or free."""
        return len(self._cached)

    def allocate(self, count: int) -> list[int] | None:
        """Take ``count`` free blocks (reference count 1 each), evicting cached ones as needed.

        Returns:
            The block ids, or None (and nothing changes) when fewer than ``count`` are free.
        """
        if count > len(self._free):
            return None
        blocks = [self._free.popitem(last=False)[0] for _ in range(count)]
        for block_id in blocks:
            self._evict(block_id)
            self._ref_counts[block_id] = 1
        return blocks

    def _evict(self, block_id: int) -> None:
        block_hash = self._hash_of[block_id]
        if block_hash is not None:
            self._hash_of[block_id] = None
            if self._cached.get(block_hash) == block_id:
                del self._cached[block_hash]
        indexed = self._leading_of.pop(block_id, None)
        if indexed is not None:
            parent, tokens = indexed
            for key in _runs(parent, tokens[:-1]):
                blocks = self._leading.get(key)
                if blocks is not None:
                    blocks.pop(block_id, None)
                    if not blocks:
                        del self._leading[key]

    def lookup(self, block_hash: bytes) -> int | None:
        """The block caching ``block_hash``, if any."""
        return self._cached.get(block_hash)

    def touch(self, block_ids: list[int]) -> None:
        """Add a holder to each block (cache hits); free ones leave the free queue."""
        for block_id in block_ids:
            if self._ref_counts[block_id] == 0:
                del self._free[block_id]
            self._ref_counts[block_id] += 1

    def cache(
        self, block_id: int, block_hash: bytes, parent: bytes | None = None, tokens: tuple[int, ...] = ()
    ) -> None:
        """Record that held block ``block_id`` now holds the full block ``block_hash``.

        The first block to cache a hash keeps it; an identical block computed concurrently by
        another request simply stays uncached. With ``parent`` (the previous block's hash, or the
        chain's root key for a first block) and the block's ``tokens``, its leading tokens are indexed
        for ``partial_match`` too (which prefers the latest block among those that start alike).
        """
        if self._hash_of[block_id] is None and block_hash not in self._cached:
            self._hash_of[block_id] = block_hash
            self._cached[block_hash] = block_id
            if parent is not None and tokens:
                self._leading_of[block_id] = (parent, tokens)
                for key in _runs(parent, tokens[:-1]):
                    self._leading.setdefault(key, {})[block_id] = None

    def partial_match(self, parent: bytes, tokens: list[int]) -> tuple[int, int] | None:
        """The cached block under ``parent`` whose first tokens match the longest run of ``tokens`` (shorter
        than a block), and that run's length; None when no cached block there starts with ``tokens[0]``.

        Among blocks that match as far, the latest cached. Runs are found by hash, then checked token by
        token, so a hash collision costs a hit, never a wrong one.
        """
        best: tuple[int, int] | None = None
        for key in _runs(parent, tuple(tokens)):
            blocks = self._leading.get(key)
            if not blocks:
                break  # a block matching a longer run would match this one too
            best = next(reversed(blocks)), key[1]
        if best is None:
            return None
        block_id, length = best
        indexed = self._leading_of.get(block_id)
        if indexed is None or indexed[0] != parent or list(indexed[1][:length]) != tokens[:length]:
            return None
        return best

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks nobody holds go back to the free queue.

        Blocks are released in reverse so that a sequence's tail blocks are evicted first: a
        prefix is worth more than the suffix that depends on it.
        """
        # Check everything first: a bad id must not leave the pool half-released.
        for block_id in block_ids:
            if not 0 <= block_id < self.num_blocks or self._ref_counts[block_id] < 1:
                raise RuntimeError(f"block {block_id} released more often than allocated (or not a block)")
        for block_id in reversed(block_ids):
            count = self._ref_counts[block_id] - 1
            self._ref_counts[block_id] = count
            if count == 0:
                self._free[block_id] = None

    def ref_count(self, block_id: int) -> int:
        """How many holders the block has (0 means free)."""
        return self._ref_counts[block_id]

    def is_cached(self, block_id: int) -> bool:
        """True when the block is listed in the prefix cache."""
        return self._hash_of[block_id] is not None

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (their KV stays until overwritten); return how many were listed."""
        count = len(self._cached)
        self._cached.clear()
        self._hash_of = [None] * self.num_blocks
        self._leading.clear()
        self._leading_of.clear()
        return count


def _runs(parent: bytes, tokens: tuple[int, ...]) -> Iterator[tuple[bytes, int, int]]:
    """The index keys of the runs ``tokens[:1]``, ``tokens[:2]``, ...: each run's hash extends the previous
    one's by a token, so indexing a block costs time and memory linear in its size."""
    run_hash = 0
    for length, token in enumerate(tokens, 1):
        run_hash = hash((run_hash, token))
        yield parent, length, run_hash
