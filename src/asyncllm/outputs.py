"""Values that leave the engine: stream chunks, completions and statistics."""

from __future__ import annotations

from typing import Literal

import msgspec

FinishReason = Literal["stop", "length", "abort"]


class TokenLogprob(msgspec.Struct, frozen=True):
    """One token's log-probability at one position, from the model's raw logits.

    Attributes:
        token_id: The token.
        logprob: Its natural-log probability (before penalties, biases and temperature).
        rank: 1 + the number of tokens that were more likely.
        text: The token decoded on its own (special tokens included).
    """

    token_id: int
    logprob: float
    rank: int
    text: str


class Logprobs(msgspec.Struct, frozen=True):
    """The log-probabilities at one position of the prompt or the output.

    Attributes:
        token: The token that is at this position (the sampled one, or the prompt's).
        top: The most likely tokens at this position, best first (ranks 1, 2, ...); as many as the
            request's ``logprobs`` (or ``prompt_logprobs``) asked for.
    """

    token: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()


class ToolCall(msgspec.Struct, frozen=True):
    """One function call the model made (``Engine.chat(..., tools=...)``).

    Attributes:
        id: A fresh identifier (``"call_"`` and 24 hex digits), to quote in the ``tool`` message
            that carries the result.
        name: The function's name (one of the tools given).
        arguments: The arguments as JSON text, as the model wrote them (an object; under
            ``tool_choice="required"`` or a named function it validates against the tool's
            ``parameters`` schema).
    """

    id: str
    name: str
    arguments: str


class StreamChunk(msgspec.Struct, frozen=True):
    """One step's worth of new output of a request (more when the consumer lagged).

    Attributes:
        text: The new text since the previous chunk.
        token_ids: The new token ids since the previous chunk.
        finished: True on the request's last chunk.
        finish_reason: "stop" (EOS or a stop token), "length" (max_tokens or max_model_len)
            or "abort"; None until finished.
        index: Which of the request's samples this chunk belongs to (0 unless n > 1).
        logprobs: With ``SamplingParams.logprobs``, one entry per token of ``token_ids``; else None.
        prompt_logprobs: With ``SamplingParams.prompt_logprobs``, on the first chunk only: one entry per
            prompt token (None for the first token, which nothing predicts); else None.
        stop_reason: On the last chunk of a request that finished with "stop": the stop string that
            matched, or the ``stop_token_ids`` id; None for EOS and other reasons.
    """

    text: str
    token_ids: tuple[int, ...]
    finished: bool = False
    finish_reason: FinishReason | None = None
    index: int = 0
    logprobs: tuple[Logprobs, ...] | None = None
    prompt_logprobs: tuple[Logprobs | None, ...] | None = None
    stop_reason: int | str | None = None


class Embedding(msgspec.Struct, frozen=True):
    """One input's embedding, as ``Engine.embed`` returns it.

    Attributes:
        embedding: The pooled vector: L2-normalized unless asked otherwise, truncated to ``dimensions``
            when asked.
        prompt_token_ids: The input as the model saw it (``len`` is its token count, for usage).
    """

    embedding: tuple[float, ...]
    prompt_token_ids: tuple[int, ...]


class Sample(msgspec.Struct, frozen=True):
    """One of a request's ``n`` samples, whole.

    Attributes:
        index: The sample's position (0 to n-1).
        text: Its generated text.
        token_ids: Its generated token ids.
        finish_reason: "stop", "length" or "abort".
        logprobs: Per generated token, with ``SamplingParams.logprobs``; else None.
        stop_reason: The stop string or id that ended it, if one did.
        tool_calls: The function calls parsed out of it, for a chat with tools (``text`` is then the
            text outside the calls); else empty.
    """

    index: int
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    logprobs: tuple[Logprobs, ...] | None = None
    stop_reason: int | str | None = None
    tool_calls: tuple[ToolCall, ...] = ()


class Completion(msgspec.Struct, frozen=True):
    """The whole result of one request.

    The top-level fields describe sample 0; with ``SamplingParams(n=...)`` every sample is in
    ``samples`` (sample 0 included), in index order.

    Attributes:
        text: The generated text.
        token_ids: The generated token ids (an EOS or stop token that ended it included).
        prompt_token_ids: The prompt as the model saw it.
        finish_reason: "stop", "length" or "abort".
        logprobs: Per generated token, with ``SamplingParams.logprobs``; else None.
        prompt_logprobs: Per prompt token (None first), with ``SamplingParams.prompt_logprobs``; else None.
        stop_reason: The stop string or ``stop_token_ids`` id that ended it (None for EOS and the rest).
        samples: Every sample (one when n == 1).
        tool_calls: For a chat with tools (``Engine.chat(..., tools=...)``): the function calls sample 0
            made, in order; ``text`` is then the text outside the calls ("" when there is none). Else empty.
        num_cached_tokens: Prompt tokens found in the prefix cache when the request was first
            scheduled (their KV was not computed again); None if it never was (aborted while waiting).
    """

    text: str
    token_ids: tuple[int, ...]
    prompt_token_ids: tuple[int, ...]
    finish_reason: FinishReason
    logprobs: tuple[Logprobs, ...] | None = None
    prompt_logprobs: tuple[Logprobs | None, ...] | None = None
    stop_reason: int | str | None = None
    samples: tuple[Sample, ...] = ()
    tool_calls: tuple[ToolCall, ...] = ()
    num_cached_tokens: int | None = None


class EngineStatistics(msgspec.Struct, frozen=True):
    """A snapshot of the engine's state, as returned by ``Engine.statistics()``.

    Attributes:
        num_running: Requests holding KV blocks and being stepped.
        num_waiting: Requests queued for admission (including preempted ones).
        kv_blocks_total: Blocks in the KV cache (of a hybrid model with a sliding pool: the global
            layers' pool, which keeps every block of a request).
        kv_blocks_free: Blocks not held by any request (of that pool).
        num_preemptions: Times a running request was preempted (its KV recomputed later).
        num_steps: Model steps run so far.
        num_prompt_tokens: Prompt tokens computed so far (recomputation after preemption included).
        num_generated_tokens: Tokens sampled so far.
        num_finished_requests: Requests that ended, for any reason.
        kv_usage: Fraction of KV blocks held by requests (0.0-1.0; of the global layers' pool for a
            hybrid model with a sliding pool).
        kv_sliding_blocks_total: A hybrid model's sliding layers' pool (Gemma 2/3, Qwen2 with
            ``layer_types``: ``RunnerInfo.sliding_group``), whose blocks leave with the window: its
            blocks; 0 without one.
        kv_sliding_blocks_free: Blocks of the sliding pool not held by any request (0 without one).
        kv_sliding_usage: Fraction of the sliding pool's blocks held by requests (0.0 without one).
        num_cached_blocks: Blocks listed in the prefix cache (held or evictable).
        prefix_cache_queries: Prompt tokens looked up in the prefix cache (requests that skip it, mean
            pooling and ``prompt_logprobs``, are not lookups).
        prefix_cache_hits: Of those, tokens whose KV was found cached.
        prefix_cache_hit_rate: hits / queries (0.0 before any query).
        time_schedule: Seconds the step loop spent scheduling, in all.
        time_prepare: Seconds it spent building steps' inputs for the device thread.
        time_output: Seconds it spent detokenizing and delivering outputs.
        device_busy: Seconds the device thread spent running steps (forward and sampling).
        device_idle: Seconds the device thread waited for its next step (the engine was idle,
            or the loop was late); ``device_idle / (device_busy + device_idle)`` over a busy
            period is the fraction of time the device starved.
        device_prepare: Of ``device_busy``, seconds the runner spent building steps' input arrays
            and attention metadata (0.0 for a runner that does not report its timings).
        device_forward: Of ``device_busy``, seconds in the model forward (on CUDA measured with
            events on the runner's stream, so device time, not launch time).
        device_sample: Of ``device_busy``, seconds computing logits, sampling (logprobs included)
            and copying the sampled ids to the host.
        grammars_compiled: ``structured_output`` specs compiled (successfully or not).
        grammar_cache_hits: Specs found already compiled (or already refused) in the grammar cache.
        grammar_compile_seconds: Seconds spent compiling grammars, in worker threads, in all.
        num_embedding_requests: Embedding (pooling) requests that returned their vector (``Engine.embed``
            makes one per input).
        num_embedding_tokens: Prompt tokens of those requests (``num_prompt_tokens`` counts them too,
            as computed).
        spec_num_drafts: Speculative decoding: steps in which a request fed a draft.
        spec_draft_tokens: Draft tokens fed.
        spec_accepted_tokens: Of those, tokens the model accepted (before a stop or ``max_tokens`` ended
            their request); each drafted step also samples one token of its own, not counted here.
        spec_acceptance_rate: ``spec_accepted_tokens / spec_draft_tokens`` (0.0 before any draft).
        spec_draft_tokens_per_position: Per draft position (the first token of a draft is position 0),
            the draft tokens fed there; empty without speculative decoding.
        spec_accepted_tokens_per_position: Per draft position, the tokens accepted there (a token is
            accepted only if every one before it in its draft was).
        spec_acceptance_rate_per_position: Per draft position, accepted / fed (0.0 where none was fed).
    """

    num_running: int
    num_waiting: int
    kv_blocks_total: int
    kv_blocks_free: int
    num_preemptions: int
    num_steps: int
    num_prompt_tokens: int
    num_generated_tokens: int
    num_finished_requests: int
    kv_usage: float = 0.0
    num_cached_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_hit_rate: float = 0.0
    time_schedule: float = 0.0
    time_prepare: float = 0.0
    time_output: float = 0.0
    device_busy: float = 0.0
    device_idle: float = 0.0
    device_prepare: float = 0.0
    device_forward: float = 0.0
    device_sample: float = 0.0
    grammars_compiled: int = 0
    grammar_cache_hits: int = 0
    grammar_compile_seconds: float = 0.0
    num_embedding_requests: int = 0
    num_embedding_tokens: int = 0
    spec_num_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    spec_acceptance_rate: float = 0.0
    spec_draft_tokens_per_position: tuple[int, ...] = ()
    spec_accepted_tokens_per_position: tuple[int, ...] = ()
    spec_acceptance_rate_per_position: tuple[float, ...] = ()
    kv_sliding_blocks_total: int = 0
    kv_sliding_blocks_free: int = 0
    kv_sliding_usage: float = 0.0
