"""Speculative decoding's host side: n-gram drafts, when a request drafts, and the acceptance counters.

A request in decode may feed, after its newest token, a *draft*: up to ``num_speculative_tokens``
tokens guessed by prompt lookup (the continuation of the latest earlier occurrence of the request's
last n tokens, n from ``ngram_max`` down to ``ngram_min``, in its prompt and output so far). The model
computes the newest token and the draft in one forward; the sampler verifies the draft against the
target distribution and returns the accepted draft tokens plus one token of its own, so a step yields
between 1 and ``num_speculative_tokens + 1`` tokens, exactly as many as plain decoding would have (see
``Sampler.verify``).

A draft is made from known tokens only: a request drafts in a step only when no step in flight samples
for it. With async scheduling, a request whose newest token is still being sampled, and whose tokens
so far already find a match, skips the step being scheduled and drafts in the next one; one without a
match keeps decoding one token per step, overlapped as usual. A request drafting in a step in flight
is never scheduled again before that step's result (its next position is unknown until then).

Drafts that are not accepted cost compute and, for the request, the overlap of async scheduling: the
``Speculator`` watches each request's accepted tokens per draft (an exponential moving average) and,
when it falls below ``MIN_ACCEPTED_PER_DRAFT``, stops drafting for that request for a while
(``INITIAL_BACKOFF`` tokens, doubled at each further failure up to ``MAX_BACKOFF``), then tries again.

Pure Python: no torch, no numpy. Token ids are kept per request as a ``bytearray`` of native int32s,
so a lookup is ``bytearray.rfind`` (C speed) rather than a Python loop over tokens.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from asyncllm.core._request import Request

SpeculativeMethod = Literal["ngram", "draft_model"]
"""The proposers: ``"ngram"`` (prompt lookup, no extra model) and ``"draft_model"`` (a small model of the
same vocabulary, run by the model runner beside the target: ``SequenceInput.num_propose``)."""

SPECULATIVE_METHODS: tuple[SpeculativeMethod, ...] = ("ngram", "draft_model")

MAX_SPECULATIVE_TOKENS = 16
"""The most draft tokens one step may carry for one request."""

MIN_ACCEPTED_PER_DRAFT = 0.6
"""A request whose drafts have lately had fewer accepted tokens than this, on average, stops drafting
for a while: below it a draft's extra compute and lost overlap cost more than its tokens save."""

GAIN_SMOOTHING = 0.5
"""Weight of the newest draft in a request's moving average of accepted tokens per draft."""

INITIAL_BACKOFF = 8
"""Output tokens a request decodes plainly after its drafts first fail, before it drafts again."""

MAX_BACKOFF = 256
"""The longest pause (in output tokens) after repeated failures."""

_ITEM = 4  # bytes per token id in a request's buffer (native int32)


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """How an engine speculates (``Engine.open``'s speculative options, checked there).

    Attributes:
        method: The proposer.
        num_tokens: The most draft tokens per request and step.
        ngram_min: The shortest suffix the n-gram proposer matches.
        ngram_max: The longest suffix it tries first.
        disable_by_batch_size: No request drafts while more than this many run (None: any number).
    """

    method: SpeculativeMethod = "ngram"
    num_tokens: int = 4
    ngram_min: int = 2
    ngram_max: int = 4
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_method must be 'ngram', 'draft_model' or None, got {self.method!r}")
        for name in ("num_tokens", "ngram_min", "ngram_max"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{_OPTION[name]} must be a positive int, got {value!r}")
        if self.num_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be <= {MAX_SPECULATIVE_TOKENS}, got {self.num_tokens}")
        size = self.disable_by_batch_size
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"speculative_disable_by_batch_size must be a positive int or None, got {size!r}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(
                f"speculative_ngram_min ({self.ngram_min}) must be <= speculative_ngram_max ({self.ngram_max})"
            )


_OPTION = {
    "num_tokens": "num_speculative_tokens",
    "ngram_min": "speculative_ngram_min",
    "ngram_max": "speculative_ngram_max",
}


@dataclass(slots=True)
class DraftState:
    """What the speculator keeps for one request (``Request.drafting``)."""

    buffer: bytearray = field(default_factory=bytearray)
    """The request's known tokens (prompt, then output), native int32 each."""
    num_buffered: int = 0
    gain: float = 0.0
    """Moving average of accepted tokens per draft; starts at ``num_speculative_tokens`` (as if every
    draft were accepted), so a request's first drafts are tried."""
    resume_at: int = 0
    """No draft before the request has this many output tokens (a pause after failing drafts)."""
    backoff: int = INITIAL_BACKOFF
    proposal: list[int] = field(default_factory=list)
    """``"draft_model"``: the draft model's latest proposal, made after the request's first
    ``proposal_base`` tokens (valid only while the request still has exactly that many)."""
    proposal_base: int = -1
    awaiting_proposal: bool = False
    """``"draft_model"``: a step in flight proposes for the request (it waits for that proposal)."""


def propose_ngram(tokens: bytearray, ngram_min: int, ngram_max: int, num_tokens: int) -> list[int]:
    """Prompt lookup: the tokens that followed the latest earlier occurrence of the sequence's last n tokens.

    The longest n in ``[ngram_min, ngram_max]`` with an earlier occurrence wins. The continuation may run
    into the sequence's own end; it then goes on with the draft itself, so a sequence that repeats a
    period shorter than the draft gets the whole draft.

    Args:
        tokens: The token ids so far, native int32 each (``array("i", ids).tobytes()``).
        ngram_min: The shortest suffix to match.
        ngram_max: The longest.
        num_tokens: The most tokens to propose.

    Returns:
        Up to ``num_tokens`` ids; empty when no suffix occurs earlier.
    """
    length = len(tokens) // _ITEM
    for n in range(min(ngram_max, length - 1), ngram_min - 1, -1):
        pattern = bytes(tokens[(length - n) * _ITEM :])
        # The occurrence must end before the last token, so that at least one token follows it.
        end = (length - 1) * _ITEM
        while True:
            found = tokens.rfind(pattern, 0, end)
            if found < 0 or found % _ITEM == 0:
                break
            end = found + len(pattern) - 1  # a match across token boundaries: look further back
        if found < 0:
            continue
        follow = found // _ITEM + n
        ids = array("i", tokens[follow * _ITEM : (follow + num_tokens) * _ITEM]).tolist()
        while len(ids) < num_tokens:  # the continuation reached the end: it repeats the draft itself
            ids.append(ids[len(ids) - (length - follow)])
        return ids
    return []


@dataclass(frozen=True, slots=True)
class SpeculativeCounters:
    """Drafts and their acceptance since the engine started (``Speculator.counters``)."""

    num_drafts: int
    """Steps in which a request carried a draft."""
    draft_tokens_per_position: tuple[int, ...]
    """Per draft position (0 first): draft tokens proposed there."""
    accepted_tokens_per_position: tuple[int, ...]
    """Per draft position: of those, tokens the target accepted."""


class Speculator:
    """Decides each request's draft for a step and learns from what the target accepted.

    Args:
        config: The method and its sizes.
    """

    def __init__(self, config: SpeculativeConfig) -> None:
        self.config = config
        self._num_drafts = 0
        self._proposed = [0] * config.num_tokens
        self._accepted = [0] * config.num_tokens

    def draft(self, request: Request, num_running: int = 1) -> list[int] | None:
        """The draft ``request`` feeds after its newest token in the step being scheduled.

        Args:
            request: A running request.
            num_running: How many requests run (``disable_by_batch_size`` turns drafts off above it).

        Returns:
            The draft (capped so that ``max_tokens`` and ``max_model_len`` hold even if all of it is
            accepted); ``[]`` to decode one token plainly (always for a seeded sampled request); None
            to leave the request out of this step: its newest token is being sampled and its tokens
            so far find a match, so it drafts next step.
        """
        limit = self._limit(request, request.num_tokens + request.num_pending_tokens)
        prefilling = request.num_computed_tokens < len(request.prompt_token_ids)
        if self._busy(num_running) or limit < 1 or request.prefill_only or prefilling:
            return []
        if request.params.seed is not None and not request.params.greedy:
            # A seeded draw must not depend on what else runs; a draft's length does (the budget and the
            # blocks left), and verifying it draws other random numbers. Plainly, it gets plain decoding's.
            return []
        state = request.drafting
        if state is None:
            state = request.drafting = DraftState(gain=float(self.config.num_tokens))
        if len(request.output_token_ids) < state.resume_at:
            return []
        config = self.config
        if config.method == "draft_model":
            if request.num_pending_tokens:  # the step in flight proposes from its token: wait for it
                return None if state.awaiting_proposal else []
            if request.num_computed_tokens != request.num_tokens - 1 or state.proposal_base != request.num_tokens:
                return []
            return state.proposal[:limit]
        self._buffer(request, state)
        if request.num_pending_tokens:
            found = propose_ngram(state.buffer, config.ngram_min, config.ngram_max, 1)
            return None if found else []
        if request.num_computed_tokens != request.num_tokens - 1:  # not decoding (a recompute): no draft
            return []
        return propose_ngram(state.buffer, config.ngram_min, config.ngram_max, limit)

    def _limit(self, request: Request, num_positions: int) -> int:
        """The most draft tokens ``request`` may carry once its sequence holds ``num_positions`` positions:
        the engine's and its own count, with room left for one sampled token beyond the draft under
        ``max_tokens`` and ``max_model_len`` (a draft all accepted must never pass them)."""
        limit = self.config.num_tokens
        own = request.params.num_speculative_tokens
        if own is not None:
            limit = min(limit, own)
        in_hand = len(request.output_token_ids) + request.num_pending_tokens
        return min(limit, request.params.max_tokens - in_hand - 1, request.max_total_tokens - num_positions - 1)

    def _busy(self, num_running: int) -> bool:
        threshold = self.config.disable_by_batch_size
        return threshold is not None and num_running > threshold

    def num_propose(self, request: Request, num_running: int = 1) -> int:
        """``"draft_model"``: how many tokens the runner's draft model proposes after this step's token.

        Called once the step is scheduled (its token pending, its tokens counted as computed). The count
        the request may draft in its next step, as far as it is known now: 0 when it does not draft
        (another method, drafts off for it or for the batch, a seeded sampled request, a pause after failing drafts,
        ``max_tokens`` or ``max_model_len`` within reach, a prefill-only request). The proposal passes
        write positions up to ``count`` past the step's last fed token, which stay within
        ``max_model_len``; the next step's ``draft`` cuts the proposal to what fits then.
        """
        if self.config.method != "draft_model" or request.prefill_only:
            return 0
        if request.params.seed is not None and not request.params.greedy:
            return 0  # never drafts (see ``draft``); sampling a proposal would draw from its generator too
        # After this step at least one more token is in hand; one token beyond a draft must still fit.
        limit = self._limit(request, request.num_computed_tokens)
        state = request.drafting
        paused = state is not None and len(request.output_token_ids) + 1 < state.resume_at
        if self._busy(num_running) or limit < 1 or paused:
            return 0
        return limit

    def proposed(self, request: Request, token_ids: list[int] | None) -> None:
        """``"draft_model"``: take the proposal a step returned for ``request`` (None: it made none)."""
        state = request.drafting
        if state is None:
            state = request.drafting = DraftState(gain=float(self.config.num_tokens))
        state.awaiting_proposal = False
        state.proposal = token_ids or []
        state.proposal_base = request.num_tokens if token_ids else -1

    def awaiting(self, request: Request) -> None:
        """``"draft_model"``: the step being scheduled proposes for ``request``."""
        state = request.drafting
        if state is None:
            state = request.drafting = DraftState(gain=float(self.config.num_tokens))
        state.awaiting_proposal = True

    def _buffer(self, request: Request, state: DraftState) -> None:
        known = request.num_tokens
        if state.num_buffered < known:
            state.buffer += array("i", request.token_ids(state.num_buffered, known)).tobytes()
            state.num_buffered = known

    def record(self, request: Request, num_proposed: int, num_accepted: int) -> None:
        """Count a verified draft and adapt the request's drafting to how much of it was accepted."""
        self._num_drafts += 1
        for position in range(num_proposed):
            self._proposed[position] += 1
        for position in range(num_accepted):
            self._accepted[position] += 1
        state = request.drafting
        if state is None:
            return
        state.gain += GAIN_SMOOTHING * (num_accepted - state.gain)
        if state.gain < MIN_ACCEPTED_PER_DRAFT:
            # Pause; the next try starts at the bar, so one more failure pauses again, longer.
            state.resume_at = len(request.output_token_ids) + state.backoff
            state.backoff = min(2 * state.backoff, MAX_BACKOFF)
            state.gain = MIN_ACCEPTED_PER_DRAFT
        elif num_accepted:
            state.backoff = INITIAL_BACKOFF

    @property
    def counters(self) -> SpeculativeCounters:
        """The counters so far."""
        return SpeculativeCounters(self._num_drafts, tuple(self._proposed), tuple(self._accepted))
