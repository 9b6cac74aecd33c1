"""``Scheduler``: token-budget continuous batching with chunked prefill and recompute preemption.

There are no prefill or decode phases. Every request has ``num_computed_tokens`` catching up with
``num_tokens``; each step hands out at most ``max_num_batched_tokens`` tokens, running requests
first (in arrival order), then waiting ones. A long prompt simply takes several steps (chunked
prefill). When the cache runs out of blocks, the latest-arrived running request is preempted: its
blocks are freed and it goes back to the front of the queue to be recomputed later.

Under the priority policy (``_priority.py``) both lists are kept in rank order, ``(priority,
arrival)``: the same code then serves the best-ranked first and preempts the worst-ranked first,
and a waiting request that cannot be admitted (no seat or no blocks) preempts running requests
it outranks, worst first, until it can.

With a ``Speculator`` (speculative decoding), a decoding request may feed a draft after its newest
token: the draft counts against the token budget and gets KV slots like any token (a draft that does
not fit is dropped, never the cause of a preemption); ``update`` keeps the accepted part and rolls the
rest back (its slots are reused, its blocks never enter the prefix cache).
"""

from __future__ import annotations

import bisect
import time
from collections import deque
from dataclasses import dataclass, field

from asyncllm.core._priority import SCHEDULING_POLICIES, SchedulingPolicy, WaitingHeap, rank
from asyncllm.core._request import Request, RequestStatus
from asyncllm.core._speculative import Speculator
from asyncllm.core.kv._manager import BlockCopy, CacheHit, KVCacheManager
from asyncllm.executor._runner import PooledVector, PositionLogprobs, StepOutput, VerifiedDraft
from asyncllm.outputs import FinishReason


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step."""

    request: Request
    start: int
    """``num_computed_tokens`` when scheduled: the position of the first token fed."""
    num_new_tokens: int
    sample: bool
    """True when this chunk reaches the end of the request's tokens, so a token is sampled."""
    epoch: int = 0
    """The request's preemption epoch when scheduled."""
    pool: bool = False
    """A prefill-only request's last prompt chunk (``Request.prefill_only``): it finishes with this
    step, a pooling request with the vector the step returns, a ``max_tokens=0`` one with "length"."""
    draft: list[int] = field(default_factory=list)
    """Speculative decoding: the draft fed after the request's newest token (the last ``len(draft)`` of
    the ``num_new_tokens``); the step verifies it."""
    num_propose: int = 0
    """``speculative_method="draft_model"``: how many tokens the runner's draft model proposes after the
    token this step samples (``SequenceInput.num_propose``); their slots are allocated."""


@dataclass(slots=True)
class SchedulerOutput:
    """What one step computes."""

    scheduled: list[ScheduledRequest]
    finished_request_ids: list[int] = field(default_factory=list)
    """Requests that ended since the previous step that ran, so the runner can drop their state
    (the scheduler keeps them until a step with work carries them)."""
    block_copies: list[BlockCopy] = field(default_factory=list)
    """KV rows to copy before the forward: the partial-block hits of the requests admitted here."""

    @property
    def num_batched_tokens(self) -> int:
        """Tokens fed to the model in this step."""
        return sum(s.num_new_tokens for s in self.scheduled)


@dataclass(slots=True)
class TokenEvent:
    """A request got a token, or ended, in a step."""

    request: Request
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    logprobs: list[PositionLogprobs | None] | None = None
    """Aligned with ``new_token_ids`` when the request asked for logprobs."""
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    """The whole prompt's logprobs, on the event of the step that completed the prompt."""
    embedding: PooledVector | None = None
    """A pooling request's vector, on the event that finishes it."""


class Scheduler:
    """Decides which tokens of which requests each step computes.

    Args:
        kv_cache: The block tables the scheduler allocates into.
        max_num_seqs: The most requests running at once.
        max_num_batched_tokens: The most tokens fed to the model in one step.
        policy: ``"fcfs"`` (arrival order) or ``"priority"`` (``Request.priority``, then arrival).
        long_rope_length: The model's LongRoPE original context (``RunnerInfo.long_rope_length``): a
            request longer than this is computed with the long frequencies at every position, and one
            that grows past it is recomputed from position 0; None: the model has no such switch.
        speculator: Drafts for speculative decoding (None: no drafts).

    Raises:
        ValueError: ``policy`` is neither.
    """

    def __init__(
        self,
        kv_cache: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        policy: SchedulingPolicy = "fcfs",
        long_rope_length: int | None = None,
        speculator: Speculator | None = None,
    ) -> None:
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {policy!r}")
        self.kv_cache = kv_cache
        self.speculator = speculator
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.policy = policy
        self.long_rope_length = long_rope_length
        self.num_long_rope_recomputes = 0
        """Running requests recomputed from position 0 because they grew past ``long_rope_length``."""
        self.waiting: deque[Request] | WaitingHeap = deque() if policy == "fcfs" else WaitingHeap()
        self.running: list[Request] = []
        """In admission order (FCFS) or rank order (priority): the last is preempted first."""
        self.num_preemptions = 0
        self._finished_ids: list[int] = []

    def add(self, request: Request) -> None:
        """Queue a new request for admission."""
        self.waiting.append(request)

    @property
    def pending_finished_request_ids(self) -> list[int]:
        """Requests that ended and that no step has carried to the runner yet."""
        return list(self._finished_ids)

    def has_work(self) -> bool:
        """True while any request waits or runs."""
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        """Pick this step's tokens, allocating their KV slots and preempting when blocks run out."""
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if self._fully_scheduled(request):
                index += 1
                continue
            if self._grows_long(request):
                self._recompute_long(request)
            draft: list[int] = []
            if self.speculator is not None:
                planned = self.speculator.draft(request, len(self.running))
                if planned is None:  # its newest token is being sampled; it drafts from it next step
                    index += 1
                    continue
                draft = planned[: budget - 1]
                if self.long_rope_length is not None and not request.long_rope:
                    # A draft position past LongRoPE's original context would be computed short, where
                    # one token at a time would have recomputed everything long first.
                    draft = draft[: max(0, self.long_rope_length - request.num_tokens - request.num_pending_tokens)]
            num_new = min(request.num_tokens + request.num_pending_tokens - request.num_computed_tokens, budget)
            wanted = request.num_computed_tokens + num_new + len(draft)
            if draft and self.kv_cache.allocate_slots(request, wanted) is None:
                draft = []  # a draft is a guess: it never preempts anyone
            num_new += len(draft)
            while self.kv_cache.allocate_slots(request, request.num_computed_tokens + num_new) is None:
                preempted = True
                victim = self.running.pop()
                self._preempt(victim)
                if victim is request:
                    break
            if request.status is not RequestStatus.RUNNING:
                break
            item = self._scheduled(request, num_new, draft)
            self._reserve_proposal(item, len(self.running))
            scheduled.append(item)
            budget -= num_new
            index += 1
        # Admitting new work right after a preemption would only thrash the cache. (Preempting
        # outranked requests to admit one is not that: see _preempt_outranked.)
        evicted: list[Request] = []
        while not preempted and self.waiting and budget > 0:
            request = self.waiting[0]
            if any(request is victim for victim in evicted):  # it waits a step, as any preempted request
                break
            if len(self.running) >= self.max_num_seqs:
                if not self._preempt_outranked(request, scheduled, evicted):
                    break
                budget = self.max_num_batched_tokens - sum(item.num_new_tokens for item in scheduled)
                continue
            if self._grows_long(request):  # before its hashes are looked up: long KV hashes apart
                self._go_long(request)
            # Waiting requests hold no blocks. A sample shares its first sample's computed prompt
            # blocks while that one runs; every other request (or sample) asks the prefix cache.
            shared = self._shared_prompt(request)
            hit = shared if shared is not None else self.kv_cache.find_cached_prefix(request)
            start = hit.num_tokens
            num_new = min(request.num_tokens + request.num_pending_tokens - start, budget)
            if self.kv_cache.allocate_slots(request, start + num_new, hit) is None:
                if not self._preempt_outranked(request, scheduled, evicted):
                    break
                budget = self.max_num_batched_tokens - sum(item.num_new_tokens for item in scheduled)
                continue
            if shared is None:
                self.kv_cache.record_lookup(request, hit)
            request.num_computed_tokens = start
            if request.num_cached_tokens is None:  # the first admission counts, as vLLM reports it
                request.num_cached_tokens = start
            self.waiting.popleft()
            if request.first_scheduled_time is None:
                request.first_scheduled_time = time.monotonic()
            request.status = RequestStatus.RUNNING
            if self.policy == "fcfs":
                self.running.append(request)
            else:
                bisect.insort(self.running, request, key=rank)
            item = self._scheduled(request, num_new)
            self._reserve_proposal(item, len(self.running))
            scheduled.append(item)
            budget -= num_new
        if not scheduled:  # no step to carry them: they go with the next one that runs
            return SchedulerOutput([])
        finished, self._finished_ids = self._finished_ids, []
        return SchedulerOutput(scheduled, finished, self.kv_cache.take_copies())

    def _reserve_proposal(self, item: ScheduledRequest, num_running: int) -> None:
        """``"draft_model"``: give a sampling step the slots its draft model's proposal passes write.

        The draft model runs ``k`` single-token passes after the step's token, at the positions of that
        token and of the first ``k - 1`` proposed ones: slots up to ``k`` past the step's last fed token
        (a verified draft's token lands at most there). Those KV entries are scratch: the next step
        feeds the same positions and writes them again. Slots that are not free mean no proposal:
        a proposal never preempts anyone.
        """
        speculator = self.speculator
        if speculator is None or not item.sample:
            return
        request = item.request
        count = speculator.num_propose(request, num_running)
        if count and self.kv_cache.allocate_slots(request, request.num_computed_tokens + count) is not None:
            item.num_propose = count
            speculator.awaiting(request)

    def _preempt_outranked(self, request: Request, scheduled: list[ScheduledRequest], evicted: list[Request]) -> bool:
        """Priority policy: preempt the worst-ranked running request if ``request`` outranks it.

        Only a strictly greater ``priority`` value is outranked (ties are first come, first served),
        so two requests never preempt each other back and forth. A victim scheduled earlier in this
        step is taken out of ``scheduled`` again; it is appended to ``evicted``.

        Returns:
            Whether a request was preempted (never under FCFS).
        """
        if self.policy == "fcfs" or not self.running or self.running[-1].priority <= request.priority:
            return False
        victim = self.running.pop()
        for index, item in enumerate(scheduled):
            if item.request is victim:
                del scheduled[index]
                if item.sample:  # the token it would have sampled is not coming after all
                    victim.num_pending_tokens -= 1
                if item.num_propose and victim.drafting is not None:  # nor the proposal
                    victim.drafting.awaiting_proposal = False
                break
        self._preempt(victim)
        evicted.append(victim)
        return True

    def _fully_scheduled(self, request: Request) -> bool:
        if request.prefill_only:  # no output tokens: done once its prompt is
            return request.num_tokens <= request.num_computed_tokens
        # Every token it may still produce is already in flight (it will finish with "length"):
        # one more step would only compute a token to throw away.
        in_hand = len(request.output_token_ids) + request.num_pending_tokens
        return (
            in_hand >= request.params.max_tokens
            or request.num_tokens + request.num_pending_tokens >= request.max_total_tokens
            or request.num_tokens + request.num_pending_tokens <= request.num_computed_tokens
        )

    def update(self, output: SchedulerOutput, step_output: StepOutput) -> list[TokenEvent]:
        """Advance the scheduled requests by a finished step.

        Args:
            output: The step's schedule, as ``schedule()`` returned it.
            step_output: What the runner returned: one token per scheduled request with
                ``sample=True``, in order, and the vectors of the chunks with ``pool=True``.

        Returns:
            One event per request that got a token, or its pooled vector; finished requests have
            freed their blocks.
        """
        events: list[TokenEvent] = []
        samples = iter(step_output.sampled_token_ids)
        logprobs = iter(step_output.logprobs or ())
        prompt_logprobs = step_output.prompt_logprobs or {}
        pooled = step_output.pooled or {}
        for item in output.scheduled:
            request = item.request
            if item.sample:
                token_id = next(samples)
                token_logprobs = next(logprobs, None)
            if request.finished:  # ended while the step ran (abort, stop): its token is discarded
                continue
            if item.draft:
                verified = (step_output.verified or {}).get(request.request_id)
                events.append(self._verified(item, verified))
                self._take_proposal(item, step_output)
                continue
            if item.epoch == request.epoch:  # not preempted since: its KV really is there
                request.num_confirmed_tokens = max(request.num_confirmed_tokens, item.start + item.num_new_tokens)
                self.kv_cache.cache_computed_blocks(request)
                if request.forks and request.num_confirmed_tokens >= len(request.prompt_token_ids) and not item.pool:
                    self._release_samples(request)
            if item.pool:
                # Preempted or not, the step computed the whole prompt before any later step could reuse
                # its blocks (steps run in order): its vector or prompt logprobs stand, as a sampled
                # token does, and end the request. (A recompute would lose the prompt logprobs: the
                # runner sends them once.)
                if request.pooling is not None:
                    events.append(self._pooled(request, pooled.get(request.request_id)))
                else:
                    events.extend(self._prefilled(request, prompt_logprobs.get(request.request_id)))
                continue
            if not item.sample:
                continue
            request.num_pending_tokens -= 1
            finish_reason = request.append_token(token_id)
            if finish_reason is not None:
                self.finish(request, finish_reason)
            self._take_proposal(item, step_output)
            events.append(
                TokenEvent(
                    request,
                    [token_id],
                    finish_reason,
                    None if token_logprobs is None else [token_logprobs],
                    prompt_logprobs.get(request.request_id),
                )
            )
        return events

    def _take_proposal(self, item: ScheduledRequest, step_output: StepOutput) -> None:
        """Hand the draft model's proposal for ``item`` (made after its step's last token) to the speculator."""
        if not item.num_propose or self.speculator is None:
            return
        request = item.request
        proposal = (step_output.proposals or {}).get(request.request_id)
        # Preempted since (its KV is gone, the proposal with it) or ended: no proposal.
        usable = item.epoch == request.epoch and not request.finished
        self.speculator.proposed(request, proposal[: item.num_propose] if proposal and usable else None)

    def _verified(self, item: ScheduledRequest, verified: VerifiedDraft | None) -> TokenEvent:
        """Take a drafted step's tokens: the accepted draft, then the one sampled after it.

        The rejected draft tokens' KV is discarded (their positions are written again by later steps,
        their whole blocks go back to the pool) and only the accepted tokens are confirmed, so no block
        holding a rejected token ever enters the prefix cache. A stop token or ``max_tokens`` inside
        the accepted run ends the request there; the tokens after it are dropped.
        """
        request = item.request
        if verified is None or not 1 <= len(verified.token_ids) <= len(item.draft) + 1:
            raise RuntimeError(f"the runner did not verify request {request.request_id}'s draft")
        tokens = verified.token_ids
        accepted = len(tokens) - 1
        if tokens[:accepted] != item.draft[:accepted]:
            raise RuntimeError(f"the runner accepted tokens request {request.request_id} did not draft")
        request.num_pending_tokens -= 1
        if self.speculator is not None:  # the one that drafted: it learns how the draft fared
            self.speculator.record(request, len(item.draft), accepted)
        kept: list[int] = []
        finish_reason = None
        for token_id in tokens:
            kept.append(token_id)
            finish_reason = request.append_token(token_id)
            if finish_reason is not None:
                break
        if item.epoch == request.epoch:  # not preempted since: its KV really is there
            request.num_computed_tokens -= len(item.draft) - accepted
            # The newest token fed and the accepted draft tokens still in the output have their KV.
            confirmed = item.start + 1 + min(len(kept), accepted)
            request.num_confirmed_tokens = max(request.num_confirmed_tokens, confirmed)
            self.kv_cache.cache_computed_blocks(request)
            if self.kv_cache.trim(request, request.num_computed_tokens):
                request.num_table_cuts += 1
        if finish_reason is not None:
            self.finish(request, finish_reason)
        logprobs: list[PositionLogprobs | None] | None = None
        if verified.logprobs is not None:
            logprobs = list(verified.logprobs[: len(kept)])
        return TokenEvent(request, kept, finish_reason, logprobs)

    def _pooled(self, request: Request, vector: PooledVector | None) -> TokenEvent:
        # The runner pools in the step that feeds the prompt's last token; a runner that returned no
        # vector ends the request with "abort" and no embedding (the engine reports it as failed).
        reason: FinishReason = "stop" if vector is not None else "abort"
        self.finish(request, reason)
        return TokenEvent(request, [], reason, embedding=vector)

    def _prefilled(self, request: Request, prompt_logprobs: list[PositionLogprobs | None] | None) -> list[TokenEvent]:
        # A max_tokens=0 request ends with its prompt. Its other samples (n > 1) would only compute the
        # same prompt again to generate nothing either: they end with it, without running.
        samples, request.forks = request.forks, []
        self.finish(request, "length")
        events = [TokenEvent(request, [], "length", prompt_logprobs=prompt_logprobs)]
        for sample in samples:
            self.finish(sample, "length")
            events.append(TokenEvent(sample, [], "length"))
        return events

    def finish(self, request: Request, reason: FinishReason) -> None:
        """End a request (finished or aborted) and free its blocks; idempotent."""
        if request.finished:
            return
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        # else: a sample held until its first sample computes the prompt; it holds nothing yet.
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self.kv_cache.free(request)
        self._finished_ids.append(request.request_id)
        if request.forks:
            # It ended before its prompt was computed (a preempted step's token can finish it):
            # the samples it held back must not wait for it any longer.
            self._release_samples(request)

    def _release_samples(self, first: Request) -> None:
        # The other samples queue up at the front, holding no blocks: at admission each one shares
        # the prompt blocks of ``first`` if it still runs with them computed (``_shared_prompt``).
        for sample in reversed(first.forks):
            if not sample.finished:
                self.waiting.appendleft(sample)
        first.forks = []

    def _shared_prompt(self, request: Request) -> CacheHit | None:
        """The full prompt blocks a sample can share with its group's first sample, if it can now.

        Each sample computes at least the partial last block itself (at least one token, to have
        logits of its own), where its continuation will be written. With a sliding window, only the
        blocks within the window of that token are shared, and not at all once the first sample has
        dropped one of them (the sample then asks the prefix cache, which may still list it).
        """
        if request.sample_index == 0 or not request.group:
            return None
        first = request.group[0]
        if first.long_rope != request.long_rope:  # the first grew past LongRoPE's switch: its KV rotates otherwise
            return None
        num_blocks = (len(request.prompt_token_ids) - 1) // self.kv_cache.block_size
        num_tokens = num_blocks * self.kv_cache.block_size
        if first.status is not RequestStatus.RUNNING or first.num_confirmed_tokens < num_tokens:
            return None
        return self.kv_cache.prefix_of(first.request_id, num_blocks)

    def _scheduled(self, request: Request, num_new: int, draft: list[int] | None = None) -> ScheduledRequest:
        # Optimistic: the tokens count as computed from now on, so the next step can be scheduled
        # before this one's result arrives; a sampled token is pending until update() sees it. A
        # drafted request is not scheduled again before update() (``_fully_scheduled``: its draft
        # counts as computed).
        start = request.num_computed_tokens
        if draft:
            request.num_computed_tokens += num_new
            request.num_pending_tokens += 1
            return ScheduledRequest(request, start, num_new, True, request.epoch, draft=draft)
        last = start + num_new == request.num_tokens + request.num_pending_tokens
        request.num_computed_tokens += num_new
        if request.prefill_only:  # its last chunk pools (or, for max_tokens=0, just ends) instead of sampling
            return ScheduledRequest(request, start, num_new, False, request.epoch, pool=last)
        if last:
            request.num_pending_tokens += 1
        return ScheduledRequest(request, start, num_new, last, request.epoch)

    def _grows_long(self, request: Request) -> bool:
        """The request is past LongRoPE's original context and its KV is still computed short."""
        limit = self.long_rope_length
        return limit is not None and not request.long_rope and request.num_tokens + request.num_pending_tokens > limit

    @staticmethod
    def _go_long(request: Request) -> None:
        request.long_rope = True
        request.block_hashes.clear()  # the long KV is another KV: its blocks hash apart
        request.num_cached_blocks = 0

    def _recompute_long(self, request: Request) -> None:
        """Recompute a running request from position 0 with the long frequencies, as transformers' Phi-3
        drops its cache when a sequence first grows past the original context. The step in flight (short)
        still delivers its token; its KV is discarded with the new epoch."""
        self.kv_cache.free(request)
        self._go_long(request)
        request.num_computed_tokens = request.num_confirmed_tokens = 0
        request.epoch += 1
        self.num_long_rope_recomputes += 1

    def _preempt(self, request: Request) -> None:
        self.kv_cache.free(request)
        request.status = RequestStatus.WAITING
        request.num_computed_tokens = request.num_confirmed_tokens = 0
        request.epoch += 1
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
