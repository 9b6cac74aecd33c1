"""The engine's record of one request: its tokens, progress and fate. No torch here."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from asyncllm.executor._lookahead import PLACEHOLDER
from asyncllm.executor._runner import Pooling
from asyncllm.outputs import FinishReason
from asyncllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from asyncllm.core._speculative import DraftState
    from asyncllm.structured import CompiledGrammar


class RequestStatus(enum.Enum):
    """Where a request is in its life."""

    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Request:
    """One generation request as the scheduler sees it.

    ``num_computed_tokens`` chases ``num_tokens`` (prompt plus output so far): prefill, chunked
    prefill, decode and recompute after preemption are all the same motion.
    """

    request_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    stop_token_ids: frozenset[int]
    """EOS ids (unless ignore_eos) together with ``params.stop_token_ids``."""
    max_total_tokens: int
    """The request finishes with "length" when prompt plus output reaches this."""
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    cache_salt: str | None = None
    """Keeps this request's prefix-cache entries apart from requests with another salt."""
    priority: int = 0
    """Under the priority scheduling policy, lower values are scheduled first (ties in arrival
    order); the FCFS policy only takes 0 (``InputProcessor`` refuses others)."""
    block_hashes: list[bytes] = field(default_factory=list)
    """Chained hashes of the request's full blocks, extended as blocks fill."""
    num_cached_blocks: int = 0
    """Leading blocks of the table already listed in the prefix cache."""
    first_scheduled_time: float | None = None
    num_cached_tokens: int | None = None
    """Prompt tokens whose KV was found computed (prefix cache, or the group's first sample) at the
    request's first admission; None until then. A preempted request's recompute does not change it."""
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    """``params.bad_words`` tokenized (by the input processor, which has the tokenizer)."""
    stop_reason: int | str | None = None
    """The ``stop_token_ids`` id or stop string that finished the request, if one did."""
    num_pending_tokens: int = 0
    """Tokens sampled by steps still in flight (their ids are not known yet)."""
    num_confirmed_tokens: int = 0
    """Tokens whose KV finished steps have written (``num_computed_tokens`` counts scheduled ones)."""
    epoch: int = 0
    """Bumped by each preemption, so results of steps scheduled before it are recognised."""
    num_table_cuts: int = 0
    """Times a speculative trim took blocks off the end of its table. The runner's rows take a table
    of the same epoch for a grown one (the pool may hand a cut block back at another index), so the
    step's ``SequenceInput.epoch`` counts these too."""
    sample_index: int = 0
    """Which of its group's ``n`` samples this request is."""
    group: list[Request] = field(default_factory=list)
    """Every sample of the same prompt (this one included), in index order; empty when n == 1."""
    forks: list[Request] = field(default_factory=list)
    """The other samples, held back until this one (sample 0) has computed the prompt."""
    grammar: CompiledGrammar | None = None
    """``params.structured_output`` compiled; None without one, or while it compiles (the core holds
    such a request back from the scheduler until it is set)."""
    long_rope: bool = False
    """Longer than the model's LongRoPE original context (``RunnerInfo.long_rope_length``): its KV is
    computed with the long frequencies at every position, and its blocks hash apart from the short ones."""
    pooling: Pooling | None = None
    """An embedding request: its prompt is computed (in chunks like any other) and pooled, nothing is
    sampled, and it finishes with "stop" in the step that completes its prompt."""
    drafting: DraftState | None = None
    """Speculative decoding's state for this request (its tokens for lookup, how its drafts fare), kept
    by the scheduler's ``Speculator``; None until it first considers a draft."""

    @property
    def prefill_only(self) -> bool:
        """True for a request that computes its prompt and samples nothing: an embedding request, or a
        ``max_tokens=0`` one (which finishes with "length", its ``prompt_logprobs`` delivered)."""
        return self.pooling is not None or self.params.max_tokens == 0

    @property
    def num_tokens(self) -> int:
        """Prompt tokens plus tokens generated so far."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def finished(self) -> bool:
        """True once the request has ended, for any reason."""
        return self.status is RequestStatus.FINISHED

    def token_ids(self, start: int, end: int) -> list[int]:
        """The request's tokens in ``[start, end)``, across the prompt/output boundary.

        Positions of tokens still in flight (sampled by a step whose result has not arrived) read
        as ``PLACEHOLDER``; the device thread fills them in before the step runs.
        """
        known = self.num_tokens
        if end > known:
            return self.token_ids(start, known) + [PLACEHOLDER] * (end - max(start, known))
        prompt_len = len(self.prompt_token_ids)
        if end <= prompt_len:
            return self.prompt_token_ids[start:end]
        if start >= prompt_len:
            return self.output_token_ids[start - prompt_len : end - prompt_len]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - prompt_len]

    def append_token(self, token_id: int) -> FinishReason | None:
        """Record a sampled token; return why the request must now stop, if it must."""
        self.output_token_ids.append(token_id)
        # Before min_tokens the sampler masks stop ids out; a runner that emits one anyway goes on,
        # unless a grammar is done: its EOS then gets through the min_tokens mask (nothing else may).
        if token_id in self.stop_token_ids and (
            len(self.output_token_ids) > self.params.min_tokens or self.params.structured_output is not None
        ):
            if token_id in self.params.stop_token_ids:
                self.stop_reason = token_id
            return "stop"
        if len(self.output_token_ids) >= self.params.max_tokens:
            return "length"
        if self.num_tokens >= self.max_total_tokens:
            return "length"
        return None
