"""Requests and KV-manager probes for tests of the scheduler and the KV cache manager (no torch).

Shared by the sliding-window and hybrid KV tests, which drive ``KVCacheManager`` by hand: one place
for how a test request is built and how a finished step's KV is confirmed.
"""

from __future__ import annotations

from asyncllm.core._request import Request
from asyncllm.core.kv import KVCacheManager
from asyncllm.sampling_params import SamplingParams

NEVER = 10**9
"""A stop id no fake model samples."""


def make_request(request_id: int, prompt: list[int], max_tokens: int) -> Request:
    """A request for ``prompt`` that stops only at ``max_tokens``."""
    return Request(
        request_id=request_id,
        prompt_token_ids=list(prompt),
        params=SamplingParams(max_tokens=max_tokens),
        stop_token_ids=frozenset({NEVER}),
        max_total_tokens=len(prompt) + max_tokens,
    )


def confirm(kv: KVCacheManager, request: Request, num_tokens: int) -> None:
    """A finished step computed the request's KV up to ``num_tokens`` (as ``Scheduler.update`` records it)."""
    request.num_computed_tokens = request.num_confirmed_tokens = num_tokens
    kv.cache_computed_blocks(request)


def held(kv: KVCacheManager) -> int:
    """The blocks of ``kv``'s pool that requests hold (or that are not free)."""
    return kv.pool.num_blocks - kv.num_free_blocks
