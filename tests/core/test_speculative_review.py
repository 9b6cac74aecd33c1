"""Drafts in the scheduler together with everything else it does: sliding windows (every layer, or a
hybrid model's second pool), priority preemption, aborts, samples of one prompt (n > 1), LongRoPE's
switch, prefill-only requests, requests arriving while others run, with async scheduling on or off.

``tests/core/test_speculative.py`` checks drafts on a plain cache with FCFS; the sliding-window and
hybrid tests check those caches without drafts. Here a fake paged model reads through both tables
of the step as the engine copied them: it writes, in every slot a step feeds, a key of the whole
prefix it computed there (draft tokens included), then reads, for every query, the positions it
attends to (all of them through the global table, the window through a sliding one). A rejected
draft token's KV read later, a block freed too early or handed to another request, or a prefix-cache
block holding anything but the tokens its hash names fails the test; so does a block left held.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from asyncllm.core._request import Request
from asyncllm.core._scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from asyncllm.core._speculative import SpeculativeConfig, Speculator
from asyncllm.core.kv import KVCacheManager
from asyncllm.core.kv._hashing import extend_block_hashes
from asyncllm.core.kv._manager import blocks_needed
from asyncllm.executor._lookahead import PLACEHOLDER
from asyncllm.executor._runner import StepOutput, VerifiedDraft
from asyncllm.sampling_params import SamplingParams

NEVER = 10**9  # a stop id the truth never produces


def truth(request: Request, index: int) -> int:
    """The "model" output at output index ``index``: the prompt's period, broken now and then."""
    period = request.prompt_token_ids[: 3 + request.request_id % 3]
    return 50 + request.request_id if index % 7 == 6 else period[index % len(period)]


def key(tokens: list[int]) -> int:
    return hash(tuple(tokens))


@dataclass
class _Copied:
    """A scheduled request as the engine hands it to the device: fed tokens and snapshots of its tables."""

    item: ScheduledRequest
    fed: list[int]
    table: list[int]
    offset: int
    sliding_table: list[int] | None
    sliding_offset: int


class PagedModel:
    """The device. ``window``: the sliding window (None: none); ``hybrid``: only a second pool slides."""

    def __init__(self, scheduler: Scheduler, window: int | None, hybrid: bool) -> None:
        self.scheduler = scheduler
        self.kv = scheduler.kv_cache
        self.window = window
        self.hybrid = hybrid
        self.slots: dict[tuple[str, int, int], int] = {}

    def copy(self, out: SchedulerOutput) -> list[_Copied]:
        kv, limit = self.kv, self.scheduler.long_rope_length
        copied = []
        for item in out.scheduled:
            request = item.request
            rid = request.request_id
            if limit is not None and not request.long_rope:  # short KV never goes past the switch
                assert item.start + item.num_new_tokens <= limit
            fed = request.token_ids(item.start, item.start + item.num_new_tokens - len(item.draft)) + item.draft
            sliding = kv.sliding_block_table(rid)
            copied.append(
                _Copied(
                    item,
                    fed,
                    list(kv.block_table(rid)),
                    kv.block_offset(rid),
                    None if sliding is None else list(sliding),
                    kv.sliding_block_offset(rid),
                )
            )
        return copied

    def _slot(self, group: str, table: list[int], offset: int, pos: int) -> tuple[str, int, int]:
        size = self.kv.block_size
        index = pos // size - offset
        assert index >= 0, f"position {pos} is read after its {group} block left the table"
        return (group, table[index], pos % size)

    def execute(self, copied: list[_Copied]) -> StepOutput:
        prefixes: list[tuple[bool, list[int]]] = []
        for c in copied:  # every write of the step first, then the reads, as attention does
            request, start = c.item.request, c.item.start
            live = c.item.epoch == request.epoch and not request.finished
            if live:  # the previous step's samples are known on the "device" now
                fed = [
                    request.token_ids(start + i, start + i + 1)[0] if t == PLACEHOLDER else t
                    for i, t in enumerate(c.fed)
                ]
            else:  # its result is dropped
                fed = [0 if t == PLACEHOLDER else t for t in c.fed]
            prefix = (request.token_ids(0, start) if live else [0] * start) + fed
            prefixes.append((live, prefix))
            for pos in range(start, start + len(fed)):
                self.slots[self._slot("global", c.table, c.offset, pos)] = key(prefix[: pos + 1])
                if c.sliding_table is not None:
                    self.slots[self._slot("sliding", c.sliding_table, c.sliding_offset, pos)] = key(prefix[: pos + 1])
        sampled: list[int] = []
        verified: dict[int, VerifiedDraft] = {}
        for c, (live, prefix) in zip(copied, prefixes):
            request, start = c.item.request, c.item.start
            for query in range(start, start + len(c.fed)) if live else ():
                low = 0 if self.window is None or self.hybrid else max(0, query - self.window + 1)
                for pos in range(low, query + 1):
                    assert self.slots.get(self._slot("global", c.table, c.offset, pos)) == key(prefix[: pos + 1])
                if c.sliding_table is not None:
                    assert self.window is not None
                    for pos in range(max(0, query - self.window + 1), query + 1):
                        slot = self._slot("sliding", c.sliding_table, c.sliding_offset, pos)
                        assert self.slots.get(slot) == key(prefix[: pos + 1])
            if not c.item.sample:
                continue
            first = start + len(c.fed) - len(c.item.draft) - len(request.prompt_token_ids)  # output index
            if not c.item.draft:
                sampled.append(truth(request, first))
                continue
            tokens: list[int] = []
            for j in range(len(c.item.draft) + 1):  # a greedy verifier: accept while the draft is the truth
                tokens.append(truth(request, first + j))
                if j == len(c.item.draft) or tokens[-1] != c.item.draft[j]:
                    break
            verified[request.request_id] = VerifiedDraft(tokens)
            sampled.append(tokens[-1])
        return StepOutput(sampled, verified=verified or None)


def check_cached_blocks(kv: KVCacheManager | None, model: PagedModel, requests: list[Request], group: str) -> None:
    """Every block listed in the prefix cache holds the KV of the tokens its hash names."""
    if kv is None:
        return
    size = kv.block_size
    tokens_of: dict[bytes, list[int]] = {}
    for request in requests:
        tokens = request.token_ids(0, request.num_tokens)
        for long_rope in (False, True):
            hashes: list[bytes] = []
            extend_block_hashes(hashes, tokens, size, None, long_rope=long_rope)
            for index, block_hash in enumerate(hashes):
                tokens_of[block_hash] = tokens[: (index + 1) * size]
    for block_hash, block in kv.pool._cached.items():
        prefix = tokens_of[block_hash]  # a hash of tokens no request has: a rejected draft's block
        for offset in range(size):
            assert model.slots.get((group, block, offset)) == key(prefix[: len(prefix) - size + offset + 1])


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.data())
def test_drafts_with_windows_priorities_aborts_samples_and_long_rope(data: st.DataObject) -> None:
    mode = data.draw(st.sampled_from(["plain", "sliding", "hybrid"]))
    window = data.draw(st.integers(1, 12)) if mode != "plain" else None
    block_size = data.draw(st.sampled_from([1, 2, 4]))
    budget = data.draw(st.integers(1, 24))
    count = data.draw(st.integers(1, 4))
    prompts = [data.draw(st.lists(st.integers(1, 4), min_size=3, max_size=24)) for _ in range(count)]
    max_tokens = [data.draw(st.integers(0, 25)) for _ in range(count)]
    num_blocks = -(-max(len(p) + m for p, m in zip(prompts, max_tokens)) // block_size) + data.draw(st.integers(7, 14))
    caching = data.draw(st.booleans())
    if mode == "sliding":
        kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching, sliding_window=window)
    elif mode == "hybrid":
        assert window is not None
        floor = -(-(window + 2 * budget + 12) // block_size) + 4  # a window, two chunks and a draft
        group = (window, max(floor, data.draw(st.integers(1, num_blocks))))
        kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching, sliding_group=group)
    else:
        kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
    scheduler = Scheduler(
        kv,
        max_num_seqs=data.draw(st.integers(1, 4)),
        max_num_batched_tokens=budget,
        policy=data.draw(st.sampled_from(["fcfs", "priority"])),
        long_rope_length=data.draw(st.one_of(st.none(), st.integers(4, 40))),
        speculator=Speculator(SpeculativeConfig(num_tokens=data.draw(st.integers(1, 5)), ngram_min=1, ngram_max=3)),
    )
    model = PagedModel(scheduler, window, mode == "hybrid")
    requests: list[Request] = []
    samples: list[Request] = []
    for index, (prompt, limit) in enumerate(zip(prompts, max_tokens)):
        request = Request(
            request_id=index,
            prompt_token_ids=list(prompt),
            params=SamplingParams(max_tokens=limit),
            stop_token_ids=frozenset({NEVER}),
            max_total_tokens=len(prompt) + limit + 100,
            priority=data.draw(st.integers(0, 2)),
        )
        requests.append(request)
        if limit and data.draw(st.integers(0, 3)) == 0:  # n = 2: a second sample of the prompt
            sample = dataclasses.replace(
                request, request_id=100 + index, sample_index=1, output_token_ids=[], block_hashes=[], forks=[]
            )
            request.group = sample.group = [request, sample]
            request.forks = [sample]
            samples.append(sample)
    arrivals = sorted(data.draw(st.lists(st.integers(0, 30), min_size=count, max_size=count)))
    aborts = data.draw(st.lists(st.tuples(st.integers(0, 60), st.integers(0, count - 1)), max_size=2))
    async_scheduling = data.draw(st.booleans())
    in_flight: tuple[SchedulerOutput, list[_Copied]] | None = None
    added = 0
    for step in range(3000):
        if not (scheduler.has_work() or in_flight is not None or added < count):
            break
        while added < count and arrivals[added] <= step:
            scheduler.add(requests[added])
            added += 1
        for when, which in aborts:
            victim = requests[which]
            if when == step and (victim in scheduler.running or victim in scheduler.waiting):
                scheduler.finish(victim, "abort")
        out = copied = None
        if scheduler.has_work() and (in_flight is None or async_scheduling):
            out = scheduler.schedule()
            copied = model.copy(out)
        if in_flight is not None:
            scheduler.update(in_flight[0], model.execute(in_flight[1]))
            in_flight = None
            for request in scheduler.running:  # rolled back: a table reaches what is computed, no further
                if not request.num_pending_tokens:
                    needed = blocks_needed(request.num_computed_tokens, block_size)
                    rid = request.request_id
                    assert kv.block_offset(rid) + len(kv.block_table(rid)) == needed
                    sliding = kv.sliding_block_table(rid)
                    assert sliding is None or kv.sliding_block_offset(rid) + len(sliding) == needed
        if out is not None and out.scheduled and copied is not None:
            in_flight = (out, copied)
    else:
        raise AssertionError("the scheduler does not terminate")
    for request in requests + samples:
        if request.finish_reason != "abort":
            assert request.output_token_ids == [truth(request, i) for i in range(request.params.max_tokens)]
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert kv.sliding is None or kv.sliding.num_free_blocks == kv.sliding.pool.num_blocks
    check_cached_blocks(kv, model, requests + samples, "global")
    check_cached_blocks(kv.sliding, model, requests + samples, "sliding")
