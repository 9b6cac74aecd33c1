"""The seam between the engine and whatever computes tokens: the ``ModelRunner`` protocol.

Like an httpx transport, the runner is injected: the real one runs the model with torch
(``asyncllm.worker._model_runner.TorchModelRunner``); ``asyncllm.testing`` ships a scripted one so the
layers above can be tested without weights. Everything here is plain Python: no torch.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Protocol

import numpy as np

from asyncllm.sampling_params import SamplingParams

if TYPE_CHECKING:
    from asyncllm.structured import CompiledGrammar

Pooling = Literal["last", "mean"]
"""How a pooling (embedding) request turns its prompt's final hidden states into one vector: the last
token's, or the mean over every prompt token."""

PooledVector = np.ndarray[Any, np.dtype[np.float32]]
"""A pooled vector as the runner hands it over: [hidden_size] float32 on the host, not normalized."""


@dataclass(frozen=True, slots=True)
class RunnerInfo:
    """What the engine needs to know about a loaded model."""

    num_kv_blocks: int
    block_size: int
    vocab_size: int
    max_model_len: int
    eos_token_ids: frozenset[int]
    description: str = ""
    structured_output: bool = False
    """The runner's sampler applies grammar masks (``SequenceInput.grammar``); without it requests
    with ``structured_output`` are refused."""
    hidden_size: int | None = None
    """The size of the vectors the runner pools (``SequenceInput.pooling``); None when it cannot pool
    (embedding requests are then refused)."""
    long_rope_length: int | None = None
    """LongRoPE's original context (``original_max_position_embeddings``): a request longer than this
    rotates every position by the long frequencies, as transformers does, so one that grows past it has
    its KV recomputed from position 0 (``SequenceInput.long_rope``). None: no such switch."""
    sliding_window: int | None = None
    """The window every layer of the model attends within (mistral's ``sliding_window``, a gemma config
    whose layers are all sliding): the engine then returns the blocks that leave it to the pool
    (``SequenceInput.block_offset``). None when some layer attends to the whole context."""
    speculative: bool = False
    """The runner verifies drafts (``SequenceInput.num_draft``, ``StepOutput.verified``); without it an
    engine with ``speculative_method`` refuses to start."""
    draft_model: bool = False
    """The runner runs a draft model beside the target (``SequenceInput.num_propose``,
    ``StepOutput.proposals``); without it an engine with ``speculative_method="draft_model"`` refuses
    to start."""
    sliding_group: tuple[int, int] | None = None
    """A hybrid model (sliding and global layers) whose sliding layers free the blocks that leave their
    window: ``(window, blocks of the sliding layers' pool)``. ``num_kv_blocks`` is then the global
    layers' pool; each request gets a second table (``SequenceInput.sliding_block_table``). None: one
    table per request (a model without global and sliding layers both)."""
    block_copies: bool = False
    """The runner runs ``StepBatch.block_copies``: the engine then finds partial-block prefix hits
    (``KVCacheManager(partial_block_hits=True)``); without it, only whole blocks are reused."""


@dataclass(frozen=True, slots=True)
class SequenceInput:
    """One request's share of a step, as the runner receives it."""

    request_id: int
    token_ids: list[int]
    """The tokens fed this step (a prefill chunk, or one decode token)."""
    start_position: int
    """Position of ``token_ids[0]``; every earlier token's KV is already cached."""
    block_table: list[int]
    """The request's KV blocks in sequence order, from sequence index ``block_offset`` on."""
    sample: bool
    """Sample a token after the last fed token."""
    params: SamplingParams
    num_generated: int = 0
    """Tokens the request has generated so far (a seeded sampler may key its stream on it)."""
    prompt_token_ids: Sequence[int] = ()
    """The request's whole prompt, by reference (never mutated). It tells prompt positions from
    output ones (penalties, ``min_tokens``), gives prompt tokens whose KV came from elsewhere (a
    prefix cache) and the targets of ``prompt_logprobs``."""
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    """``params.bad_words`` tokenized (each word alone and after a space)."""
    epoch: int = 0
    """The request's table epoch. Within one epoch its ``block_table`` only grows from step to
    step (and, with a sliding window, loses leading blocks as ``block_offset`` grows); a preempted
    request starts over, with new blocks, in a later epoch, and a table that a speculative trim cut
    at its end is in a later epoch too (the engine sends the preemption epoch plus the cuts)."""
    long_rope: bool = False
    """The request is longer than ``RunnerInfo.long_rope_length``: every position of it, earlier ones
    included, rotates by LongRoPE's long frequencies (its KV was computed, or recomputed, that way)."""
    block_offset: int = 0
    """The sequence index of ``block_table[0]``. The blocks before it held positions that left the
    sliding window of every token still to compute (``RunnerInfo.sliding_window``) and went back to the
    pool: attention never reads those positions again."""
    sliding_block_table: list[int] | None = None
    """With ``RunnerInfo.sliding_group``, the request's blocks in the sliding layers' pool, from sequence
    index ``sliding_block_offset`` on (the blocks before it left their window); None otherwise."""
    sliding_block_offset: int = 0
    """The sequence index of ``sliding_block_table[0]``."""
    grammar: CompiledGrammar | None = None
    """``params.structured_output`` compiled: the sampler masks what it does not allow."""
    pooling: Pooling | None = None
    """A pooling (embedding) request: it never samples (``sample`` is False); the runner pools its
    prompt's final hidden states and returns the vector in ``StepOutput.pooled`` in the step that feeds
    the prompt's last token. Mean pooling sums each chunk's rows (from ``start_position`` 0, which
    resets the sum: the scheduler gives such a request no prefix-cache hit)."""
    num_draft: int = 0
    """Speculative decoding: the last ``num_draft`` fed tokens are a draft, not the request's tokens (the
    sequence then samples, and every token before the draft is known: no ``PLACEHOLDER``). The runner
    verifies them against the distribution at each position and returns what it accepted, then one
    token of its own, in ``StepOutput.verified``."""
    num_propose: int = 0
    """Speculative decoding with a draft model (``RunnerInfo.draft_model``): after the step's token, the
    runner's draft model proposes this many tokens (``StepOutput.proposals``), running at the positions
    of that token and of the first ``num_propose - 1`` proposed ones; ``block_table`` has their slots."""


@dataclass(frozen=True, slots=True)
class PositionLogprobs:
    """Log-probabilities at one position, from the model's raw logits (no text yet)."""

    token_id: int
    """The token at this position: the sampled one, or the prompt's."""
    logprob: float
    rank: int
    """1 + the number of tokens with a strictly higher log-probability."""
    top_token_ids: tuple[int, ...]
    """The most likely tokens, best first (their ranks are 1, 2, ...)."""
    top_logprobs: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class VerifiedDraft:
    """A drafted sequence's result: the draft tokens the target accepted, then one it sampled."""

    token_ids: list[int]
    """The accepted draft tokens (a prefix of the draft), then the token sampled after them: a
    replacement for the first rejected one, or past the whole draft when all were accepted."""
    logprobs: list[PositionLogprobs] | None = None
    """Aligned with ``token_ids`` when the request asked for logprobs."""


@dataclass(frozen=True, slots=True)
class StepOutput:
    """What a step produced."""

    sampled_token_ids: list[int]
    """One id per sequence with ``sample=True``, in batch order."""
    logprobs: list[PositionLogprobs | None] | None = None
    """Aligned with ``sampled_token_ids`` when a request asked for logprobs (None entries otherwise)."""
    prompt_logprobs: dict[int, list[PositionLogprobs | None]] | None = None
    """Per request id that asked for them, its prompt logprobs, complete (aligned with the prompt; None
    for the first token and for positions never computed), in the step that completes its prompt."""
    failed: dict[int, str] | None = None
    """Requests whose own work failed in this step (a grammar that stopped matching), with why: the
    engine ends each one with ``RequestFailedError`` and discards its sampled token."""
    pooled: dict[int, PooledVector] | None = None
    """Per pooling request id whose prompt this step completed, its pooled vector (see
    ``SequenceInput.pooling``)."""
    verified: dict[int, VerifiedDraft] | None = None
    """Per request id that fed a draft (``SequenceInput.num_draft``), what verifying it produced; its
    entry in ``sampled_token_ids`` (and ``logprobs``) is the last of those tokens."""
    proposals: dict[int, list[int]] | None = None
    """Per request id with ``SequenceInput.num_propose``, the draft model's proposal: the tokens it
    guesses follow the last token this step produced for the request."""


@dataclass(frozen=True, slots=True)
class StepBatch:
    """Everything one model step computes."""

    sequences: list[SequenceInput]
    finished_request_ids: list[int]
    """Requests that ended since the previous step: the runner drops their state."""
    block_copies: tuple[tuple[int, int, int], ...] = ()
    """(source block, target block, rows): before its forward, the step copies the first ``rows`` rows of
    KV (every layer; the draft model's too) from the source block into the target block (partial-block
    prefix hits). In order: a later copy may overwrite an earlier one's target."""


@dataclass(slots=True)
class RunnerTimings:
    """Seconds a runner spent in each part of its steps, summed over steps (device thread only).

    A runner that keeps these exposes them as a ``timings`` attribute; ``Engine.statistics()``
    reports them as ``device_prepare``, ``device_forward`` and ``device_sample``.
    """

    prepare: float = 0.0
    """Building the step's input arrays and attention metadata."""
    forward: float = 0.0
    """The model forward, up to the final hidden states."""
    sample: float = 0.0
    """Logits, sampling (logprobs included) and the copy of the sampled ids to the host."""


class ModelRunner(Protocol):
    """Computes tokens. Every method runs on the engine's device thread, never on the event loop."""

    def load(self) -> RunnerInfo:
        """Load weights, allocate the KV cache and report its shape."""
        ...

    def execute(self, batch: StepBatch) -> StepOutput:
        """Run one step; sample a token for each sequence with ``sample=True``."""
        ...

    def close(self) -> None:
        """Free weights and KV memory. Called once, last."""
        ...


class PendingStep(Protocol):
    """A step launched on the device and not yet waited for (``OverlappingRunner.launch``)."""

    @property
    def sample_rows(self) -> Mapping[int, int]:
        """Each sampling request's index in the step's ``sampled_token_ids``."""
        ...

    def result(self) -> StepOutput:
        """Wait for the step and return its output (the same one on every call)."""
        ...


class OverlappingRunner(ModelRunner, Protocol):
    """A runner whose steps can be launched before the previous one's results are read back.

    On a device that computes asynchronously (CUDA) this lets the device thread prepare and launch
    step N+1 while step N computes, and read N's sampled ids only then (``LookaheadExecutor``).
    """

    @property
    def overlaps(self) -> bool:
        """Whether ``launch`` returns before the device has finished (False: use ``execute``)."""
        ...

    def launch(self, batch: StepBatch, after: PendingStep | None = None) -> PendingStep:
        """Launch a step; ``PLACEHOLDER`` tokens stand for ``after``'s samples, which the runner fills in."""
        ...
