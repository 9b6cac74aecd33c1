"""``KVCacheManager``: the block table of every running request."""

from __future__ import annotations

from asyncllm.kv.block_pool import BlockPool


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """How many blocks hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


class KVCacheManager:
    """Grows and frees per-request block tables over a shared ``BlockPool``.

    Args:
        num_blocks: Blocks in the cache.
        block_size: Tokens per block.
    """

    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks)
        self._tables: dict[int, list[int]] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks that no request holds."""
        return self.pool.num_free_blocks

    def allocate_slots(self, request_id: int, num_tokens: int) -> list[int] | None:
        """Make the request's table cover its first ``num_tokens`` tokens.

        Args:
            request_id: The request whose table grows (created on first use).
            num_tokens: Tokens the request will have KV for after this step.

        Returns:
            The newly added block ids (possibly empty), or None when the pool is too small right
            now; in that case nothing changes.
        """
        table = self._tables.setdefault(request_id, [])
        missing = blocks_needed(num_tokens, self.block_size) - len(table)
        if missing <= 0:
            return []
        new_blocks = self.pool.allocate(missing)
        if new_blocks is None:
            if not table:
                del self._tables[request_id]
            return None
        table.extend(new_blocks)
        return new_blocks

    def block_table(self, request_id: int) -> list[int]:
        """The request's blocks in sequence order (empty if it holds none)."""
        return self._tables.get(request_id, [])

    def free(self, request_id: int) -> None:
        """Return every block of the request to the pool; a no-op if it holds none."""
        table = self._tables.pop(request_id, None)
        if table:
            self.pool.release(table)
