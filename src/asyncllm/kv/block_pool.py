"""``BlockPool``: fixed-size KV blocks with reference counts and an O(1) free queue."""

from __future__ import annotations

from collections import OrderedDict


class BlockPool:
    """Hands out KV cache block ids and takes them back.

    A block is either free (in the free queue, reference count 0) or held (count >= 1).
    The free queue is an ``OrderedDict`` used as a linked list: popping the oldest, appending and
    removing from the middle are all O(1), which is what LRU eviction of cached blocks needs.

    Args:
        num_blocks: How many blocks the cache has.
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        """Blocks that nobody holds."""
        return len(self._free)

    def allocate(self, count: int) -> list[int] | None:
        """Take ``count`` free blocks (reference count 1 each), or None if there are not enough."""
        if count > len(self._free):
            return None
        blocks = [self._free.popitem(last=False)[0] for _ in range(count)]
        for block_id in blocks:
            self._ref_counts[block_id] = 1
        return blocks

    def release(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; blocks nobody holds go back to the free queue.

        Blocks are released in reverse so that a sequence's tail blocks are reused first.
        """
        for block_id in reversed(block_ids):
            count = self._ref_counts[block_id] - 1
            if count < 0:
                raise RuntimeError(f"block {block_id} released more often than allocated")
            self._ref_counts[block_id] = count
            if count == 0:
                self._free[block_id] = None

    def ref_count(self, block_id: int) -> int:
        """How many holders the block has (0 means free)."""
        return self._ref_counts[block_id]
