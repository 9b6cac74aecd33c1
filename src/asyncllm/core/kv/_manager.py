"""``KVCacheManager``: every running request's block table, over a pool with a prefix cache."""

from __future__ import annotations

from dataclasses import dataclass

from asyncllm.core._request import Request
from asyncllm.core.kv import _hashing
from asyncllm.core.kv._block_pool import BlockPool
from asyncllm.core.kv._hashing import extend_block_hashes


def blocks_needed(num_tokens: int, block_size: int) -> int:
    """How many blocks hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)


@dataclass(frozen=True, slots=True)
class CacheHit:
    """The cached prefix of a request: its blocks and how many tokens they cover.

    With a sliding window the hit may start past the first block: ``block_ids`` are the blocks from
    sequence index ``block_offset`` on, those the request's next token still attends to; the
    earlier ones (positions it never reads again) are not taken.
    """

    block_ids: list[int]
    num_tokens: int
    block_offset: int = 0
    """The sequence index of ``block_ids[0]``: how many leading blocks of the prefix the hit leaves out."""
    sliding: CacheHit | None = None
    """With a sliding group (``KVCacheManager.sliding``), the same prefix's blocks in that group's pool,
    from the window of its first token to compute on; None without one."""
    copy_from: tuple[int, int] | None = None
    """A partial-block hit past ``block_ids``: (a cached block, rows) whose first ``rows`` rows hold the KV
    of the request's next ``rows`` tokens; they are copied into the request's next block (its first new
    one), and ``num_tokens`` counts them. None: the hit ends on a block boundary."""


@dataclass(frozen=True, slots=True)
class BlockCopy:
    """Rows a step copies, before its forward, from one KV block into another (a partial-block hit)."""

    source: int
    target: int
    rows: int


NO_HIT = CacheHit([], 0)
"""No cached prefix."""


class KVCacheManager:
    """Grows and frees per-request block tables; finds and records cached prefixes.

    With ``sliding_window`` set (a model whose every layer attends only to the last ``sliding_window``
    positions), a request's table drops the blocks that have left the window of every token still to
    be computed: they go back to the pool (listed in the prefix cache until evicted, like any freed
    block), and the table starts at sequence index ``block_offset(request_id)``.

    With ``sliding_group`` set (a hybrid model: global layers that read every position, sliding layers
    that read a window), every request holds two tables: this manager's, for the global layers, which
    keeps every block; and one in ``sliding``, a manager of its own over the sliding layers' pool, which
    frees as above. Both grow together: an allocation happens in both pools or in neither, a prefix hit
    holds in both (the whole chain here, the window there), and freeing a request frees both.

    Args:
        num_blocks: Blocks in the cache (with ``sliding_group``: in the global layers' pool).
        block_size: Tokens per block.
        enable_prefix_caching: Reuse the KV of identical prefixes (full blocks) across requests.
        partial_block_hits: With prefix caching and no sliding window or group, also reuse the leading
            rows of a cached block that a request's next block only starts like (the tokens after the
            full-block hit): the step copies them (``take_copies``) instead of computing them.
        sliding_window: The window every layer of the model attends within, or None (some layer sees
            the whole context: every block stays needed).
        sliding_group: ``(window, num_blocks)`` of a hybrid model's sliding layers: their window and
            the blocks of their own pool. None: one table per request.

    Raises:
        ValueError: ``sliding_window`` or a ``sliding_group`` value is not positive, or both are given.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        partial_block_hits: bool = False,
        sliding_window: int | None = None,
        sliding_group: tuple[int, int] | None = None,
    ) -> None:
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        if sliding_group is not None and sliding_window is not None:
            raise ValueError("sliding_window (every layer slides) and sliding_group (some do) exclude each other")
        self.sliding: KVCacheManager | None = None
        """The sliding layers' tables and pool of a hybrid model (``sliding_group``); None otherwise."""
        if sliding_group is not None:
            window, sliding_blocks = sliding_group
            self.sliding = KVCacheManager(
                sliding_blocks, block_size, enable_prefix_caching=enable_prefix_caching, sliding_window=window
            )
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.partial_block_hits = (
            partial_block_hits and enable_prefix_caching and sliding_window is None and sliding_group is None
        )
        """Whether lookups find partial-block hits (never with a window: a copied block's rows would have
        to be copied in every pool that holds them)."""
        self._copies: list[BlockCopy] = []
        self.pool = BlockPool(num_blocks)
        self._tables: dict[int, list[int]] = {}
        self._offsets: dict[int, int] = {}
        """Per request with a window, the leading blocks its table has dropped (absent: none)."""
        self.num_window_freed_blocks = 0
        """Blocks returned to the pool because they left the sliding window (every request, all along)."""
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
        if self.sliding_window is not None:
            return self._windowed_hit(request.block_hashes[:usable])
        blocks: list[int] = []
        for block_hash in request.block_hashes[:usable]:
            block_id = self.pool.lookup(block_hash)
            if block_id is None:
                break
            blocks.append(block_id)
        if self.sliding is None:
            num_tokens = len(blocks) * self.block_size
            copy_from = self._partial_hit(request, len(blocks)) if self.partial_block_hits else None
            return CacheHit(blocks, num_tokens + (copy_from[1] if copy_from else 0), copy_from=copy_from)
        # The sliding group's hit is at most the global chain; its length is the hit's for both.
        sliding = self.sliding._windowed_hit(request.block_hashes[: len(blocks)])
        return CacheHit(blocks[: sliding.num_tokens // self.block_size], sliding.num_tokens, 0, sliding)

    def _partial_hit(self, request: Request, num_full: int) -> tuple[int, int] | None:
        """The cached block sharing the most leading tokens with the request's block ``num_full`` (the
        first one not fully cached), short of its last token; None when none shares any."""
        start = num_full * self.block_size
        end = min(start + self.block_size - 1, request.num_tokens - 1)
        if end <= start:
            return None
        return self.pool.partial_match(self._parent_key(request, num_full), request.token_ids(start, end))

    def _parent_key(self, request: Request, index: int) -> bytes:
        """What block ``index`` of the request's chain hangs from: the previous block's hash, or for the
        first block the chain's root (the hash of no tokens with the request's extra keys)."""
        if index:
            return request.block_hashes[index - 1]
        return _hashing.block_hash(None, [], request.cache_salt, long_rope=request.long_rope)

    def take_copies(self) -> list[BlockCopy]:
        """The row copies the allocations since the last call need (partial-block hits), in allocation
        order: the step that computes those requests runs them first, before its forward."""
        copies, self._copies = self._copies, []
        return copies

    def _windowed_hit(self, hashes: list[bytes]) -> CacheHit:
        """The longest prefix of ``hashes`` whose blocks within the window of its next token are all cached.

        The chained hash of a block names every token before it, so a cached block is this prefix's
        whatever became of the blocks before it; only those the next token attends to must be there.
        """
        found = [self.pool.lookup(block_hash) for block_hash in hashes]
        best, run = 0, 0
        for index, block_id in enumerate(found):
            run = 0 if block_id is None else run + 1
            length = index + 1
            if run >= length - self.first_needed_block(length * self.block_size):
                best = length
        first = self.first_needed_block(best * self.block_size)
        return CacheHit([b for b in found[first:best] if b is not None], best * self.block_size, first)

    def first_needed_block(self, num_tokens: int) -> int:
        """The first block the token at position ``num_tokens`` (and every later one) attends to: 0
        without a window; with one, the block of position ``num_tokens - sliding_window + 1``."""
        if self.sliding_window is None:
            return 0
        return max(0, num_tokens - self.sliding_window + 1) // self.block_size

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

        With a sliding window, the blocks that have left the window of the request's first token
        without confirmed KV (``num_confirmed_tokens``: no step still to run or in flight reads them)
        go back to the pool first, whether or not the allocation then succeeds; so do the blocks of
        ``hit`` outside the window of its first token to compute, which are never taken.

        With a sliding group, the request's table there grows too (its blocks that left the window
        returned first, as above); the allocation happens in both pools or in neither.

        Args:
            request: The request whose table grows (created on first use).
            num_tokens: Tokens the request will have KV for after this step.
            hit: A cached prefix from ``find_cached_prefix`` (or ``prefix_of``) to start a new table with.

        Returns:
            The newly allocated block ids of this manager's table (possibly empty), or None when a pool
            is too small right now; in that case nothing else changes.

        Raises:
            ValueError: With a sliding group, ``hit`` covers tokens but carries no ``sliding`` part.
        """
        rid = request.request_id
        if self.sliding_window is not None:
            self._leave_window(rid, request.num_confirmed_tokens)
            hit = self._trim_hit(hit)
        if self.sliding is not None:
            if hit.num_tokens and hit.sliding is None:
                raise ValueError("a hit on a hybrid model's cache must carry its sliding group's blocks")
            self.sliding._leave_window(rid, request.num_confirmed_tokens)
        missing, available = self._shortfall(rid, num_tokens, hit)
        if missing > available:
            return None
        # This pool has room, so once the sliding group's allocation succeeds, this one cannot fail.
        if self.sliding is not None and self.sliding.allocate_slots(request, num_tokens, hit.sliding or NO_HIT) is None:
            return None
        return self._commit(rid, num_tokens, hit)

    def _shortfall(self, request_id: int, num_tokens: int, hit: CacheHit) -> tuple[int, int]:
        """Blocks the request's table lacks for ``num_tokens`` tokens, and the free blocks it may take."""
        table = self._tables.get(request_id, [])
        offset = self._offsets.get(request_id, hit.block_offset if not table else 0)
        missing = blocks_needed(num_tokens, self.block_size) - offset - len(table) - len(hit.block_ids)
        # Hit blocks that sit in the free queue stop being available once taken.
        available = self.pool.num_free_blocks - sum(1 for b in hit.block_ids if self.pool.ref_count(b) == 0)
        return missing, available

    def _commit(self, rid: int, num_tokens: int, hit: CacheHit) -> list[int]:
        """Take ``hit`` and the missing blocks (``_shortfall`` said they fit)."""
        table = self._tables.get(rid, [])
        offset = self._offsets.get(rid, hit.block_offset if not table else 0)
        missing = blocks_needed(num_tokens, self.block_size) - offset - len(table) - len(hit.block_ids)
        if hit.block_ids:
            self.pool.touch(hit.block_ids)
            table = table + hit.block_ids
        new_blocks = self.pool.allocate(max(missing, 0)) or []
        if hit.copy_from is not None and new_blocks:
            # The source keeps its rows until this step's copies run: a later allocation can take it, but
            # writes into it only in this step's forward or a later step's, both after the copies.
            self._copies.append(BlockCopy(hit.copy_from[0], new_blocks[0], hit.copy_from[1]))
        self._tables[rid] = table + new_blocks
        if offset:
            self._offsets[rid] = offset
        return new_blocks

    def _leave_window(self, request_id: int, num_tokens: int) -> None:
        """Return the blocks before the window of position ``num_tokens`` to the pool."""
        table = self._tables.get(request_id)
        if not table:
            return
        offset = self._offsets.get(request_id, 0)
        count = min(self.first_needed_block(num_tokens) - offset, len(table))
        if count > 0:
            self.pool.release(table[:count])
            del table[:count]
            self._offsets[request_id] = offset + count
            self.num_window_freed_blocks += count

    def _trim_hit(self, hit: CacheHit) -> CacheHit:
        """``hit`` without the blocks before the window of its first token to compute."""
        drop = self.first_needed_block(hit.num_tokens) - hit.block_offset
        if drop <= 0:
            return hit
        return CacheHit(hit.block_ids[drop:], hit.num_tokens, hit.block_offset + drop)

    def prefix_of(self, request_id: int, num_blocks: int) -> CacheHit | None:
        """The first ``num_blocks`` blocks of a request's table as a hit for another request with the
        same tokens (another sample of its prompt); None when a block that request's next token attends
        to has already left this one's window."""
        table = self._tables.get(request_id, [])
        offset = self._offsets.get(request_id, 0)
        num_tokens = num_blocks * self.block_size
        first = self.first_needed_block(num_tokens)
        if offset > first or offset + len(table) < num_blocks:
            return None
        sliding = None
        if self.sliding is not None:
            sliding = self.sliding.prefix_of(request_id, num_blocks)
            if sliding is None:
                return None
        return CacheHit(table[first - offset : num_blocks - offset], num_tokens, first, sliding)

    def cache_computed_blocks(self, request: Request) -> None:
        """List the request's newly completed full blocks in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_confirmed_tokens // self.block_size
        if num_full == 0:
            return
        self._hash_blocks(request, num_full * self.block_size)
        self._cache_table(request, num_full)
        if self.sliding is not None:  # the same blocks of the same chain, in the sliding layers' pool
            self.sliding._cache_table(request, num_full)
        request.num_cached_blocks = max(request.num_cached_blocks, num_full)

    def _cache_table(self, request: Request, num_full: int) -> None:
        table = self._tables.get(request.request_id, [])
        offset = self._offsets.get(request.request_id, 0)
        size = self.block_size
        for index in range(max(request.num_cached_blocks, offset), min(num_full, offset + len(table))):
            if self.partial_block_hits:
                tokens = tuple(request.token_ids(index * size, (index + 1) * size))
                parent = self._parent_key(request, index)
                self.pool.cache(table[index - offset], request.block_hashes[index], parent, tokens)
            else:
                self.pool.cache(table[index - offset], request.block_hashes[index])

    def _hash_blocks(self, request: Request, num_tokens: int) -> None:
        if len(request.block_hashes) * self.block_size + self.block_size <= num_tokens:
            tokens = request.token_ids(0, num_tokens)
            extend_block_hashes(
                request.block_hashes, tokens, self.block_size, request.cache_salt, long_rope=request.long_rope
            )

    def trim(self, request: Request, num_tokens: int) -> bool:
        """Give back the blocks of the request's table past its first ``num_tokens`` tokens.

        Speculative decoding allocates slots for a whole draft; the blocks that only rejected draft
        tokens used return to the pool (unlisted in the prefix cache: they were never confirmed).

        Returns:
            Whether a table (either group's) lost blocks: the caller must tell the runner, whose rows
            take a table of the same epoch for a grown one (``SequenceInput.epoch``).
        """
        cut = self.sliding is not None and self.sliding.trim(request, num_tokens)
        table = self._tables.get(request.request_id)
        if table is None:
            return cut
        # The table starts at block_offset: the blocks before it left the sliding window.
        keep = max(0, blocks_needed(num_tokens, self.block_size) - self.block_offset(request.request_id))
        if len(table) > keep:
            self.pool.release(table[keep:])
            del table[keep:]
            return True
        return cut

    def block_table(self, request_id: int) -> list[int]:
        """The request's blocks in sequence order from ``block_offset`` on (empty if it holds none)."""
        return self._tables.get(request_id, [])

    def block_offset(self, request_id: int) -> int:
        """The sequence index of the request's first block in ``block_table``: the blocks before it
        left the sliding window and went back to the pool (0 without a window)."""
        return self._offsets.get(request_id, 0)

    def sliding_block_table(self, request_id: int) -> list[int] | None:
        """The request's table in the sliding group (see ``block_table``); None without a sliding group."""
        return None if self.sliding is None else self.sliding.block_table(request_id)

    def sliding_block_offset(self, request_id: int) -> int:
        """The sequence index of the request's first block in ``sliding_block_table`` (0 without one)."""
        return 0 if self.sliding is None else self.sliding.block_offset(request_id)

    def free(self, request: Request) -> None:
        """Return every block of the request to its pool (both, with a sliding group); a no-op if it holds none."""
        if self.sliding is not None:
            self.sliding.free(request)
        table = self._tables.pop(request.request_id, None)
        self._offsets.pop(request.request_id, None)
        request.num_cached_blocks = 0
        if table:
            self.pool.release(table)

    def reset_prefix_cache(self) -> int:
        """Forget every cached block (in both pools, with a sliding group); return how many this pool listed."""
        if self.sliding is not None:
            self.sliding.reset_prefix_cache()
        return self.pool.reset_prefix_cache()
