"""``EngineOptions``: every option of an engine, its default and its meaning stated once.

``Engine.open(model, **options)`` takes these fields as keywords, ``asyncllm generate/chat/serve``
make a flag of each, and the torch model runner reads the same struct, so an option is added in
one place and appears everywhere.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from dataclasses import dataclass, field
from typing import Any

from asyncllm.core._priority import SCHEDULING_POLICIES, SchedulingPolicy
from asyncllm.core._speculative import SPECULATIVE_METHODS, SpeculativeConfig
from asyncllm.engine._input_processor import RequestLimits
from asyncllm.worker._memory import check_kv_cache_memory

DEFAULT_MAX_WAITING_REQUESTS = 4096
"""``max_waiting_requests``' default: sixteen full batches at the default ``max_num_seqs``, so a
burst queues rather than fails, while the queue (each entry holds its prompt's ids, at most
``max_model_len`` of them) stays bounded; beyond it requests fail fast with ``EngineOverloadedError``."""

DEFAULT_MAX_EMBEDDING_INPUTS = 2048
"""``max_embedding_inputs``' default: OpenAI's limit on the inputs of one embeddings request."""

DEFAULT_STEP_TIMEOUT = 300.0
"""Seconds a model step may take before the device counts as hung: far above any real step (a full
``max_num_batched_tokens`` prefill of a large model on a CPU takes a minute or two)."""


def _doc(text: str) -> dict[str, str]:
    return {"doc": " ".join(text.split())}


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineOptions:
    """An engine's options, checked at construction (``ValueError`` naming the option).

    Each field's meaning is ``option_doc(name)``; the list below is generated from the same text.
    """

    model: str | os.PathLike[str] | None = field(
        default=None,
        metadata=_doc("""A local HF-format folder (config.json, *.safetensors, tokenizer files); a Hugging Face
        hub id "org/name" (when no such local path exists), taken from the hub cache or downloaded
        into it (no network call under HF_HUB_OFFLINE=1 or when the cache holds a complete
        snapshot); or None for the default model (SmolLM2-135M-Instruct, converted once into a
        local cache)."""),
    )
    revision: str | None = field(
        default=None,
        metadata=_doc("""The branch, tag or commit hash of a hub model id; None: "main". Only for hub ids."""),
    )
    device: str = field(
        default="auto", metadata=_doc(""""auto" (CUDA if available, else CPU), "cpu", "cuda", "cuda:N".""")
    )
    dtype: str = field(
        default="auto",
        metadata=_doc(""""auto" (bfloat16 on CUDA, float32 on CPU), "float32", "float16", "bfloat16"."""),
    )
    block_size: int = field(default=16, metadata=_doc("Tokens per KV cache block."))
    max_num_seqs: int = field(default=256, metadata=_doc("The most requests running at once."))
    max_num_batched_tokens: int = field(
        default=2048, metadata=_doc("The most tokens computed in one step (longer prompts are prefilled in chunks).")
    )
    max_model_len: int | None = field(
        default=None,
        metadata=_doc("""The longest prompt plus output; None: the model's context length (capped by what the KV
        cache holds)."""),
    )
    kv_cache_blocks: int | None = field(
        default=None, metadata=_doc("Number of KV blocks; None sizes the cache from memory.")
    )
    kv_cache_memory: int | float | None = field(
        default=None,
        metadata=_doc("""With kv_cache_blocks=None, the KV cache's size: bytes (an int) or a fraction (a float in
        (0, 1]). On the CPU the fraction is of the memory left after the weights and the measured
        activation peak of a max_num_batched_tokens step; on CUDA it is the share of the whole device
        that weights, activations and cache may fill together (vLLM's gpu_memory_utilization). None: a
        quarter of what is left (at most 4 GiB) on the CPU, 0.9 of the device on CUDA. The block count
        and the concurrency it allows at max_model_len are logged."""),
    )
    kv_cache_prefault: bool = field(
        default=True,
        metadata=_doc("""On the CPU, make the whole KV cache resident on a background thread once it is allocated
        (Linux 5.14+), so that steps need not pay for first touches of fresh memory, which on virtual
        machines can stall a step for hundreds of milliseconds. The thread (lower priority) works only while
        no step runs and none ended in the last 0.2 s: under steady load from the start, steps fault in what
        they reach first. It stops while less than 512 MiB of the host's (or the container's) memory would be left.
        False leaves pages to be faulted in as the cache fills: resident memory grows with use."""),
    )
    kv_cache_prefault_wait: bool = field(
        default=False,
        metadata=_doc("""With kv_cache_prefault, fault the whole CPU KV cache in while the model loads: open()
        returns (and `asyncllm serve` and Ray Serve replicas, where this is on by default, take requests) once
        the cache is resident, so the first requests run at full speed, as on a server whose cache was zeroed
        at start (vLLM's). Loading takes longer by the time the host needs to back the cache (4 GiB took
        about 12 s in a virtual machine whose host backs memory on first touch) and cannot be interrupted
        meanwhile. Tensor-parallel ranks fault their own caches in at the same time and the load returns once
        every rank's is resident. False: in the background, while the engine is idle."""),
    )
    cpu_kernel_pool: bool = field(
        default=True,
        metadata=_doc("""On the CPU, run the lean forward's decode-sized steps (up to 64 tokens: matmuls, decode
        attention, SiLU, the head's logits and the bfloat16 head's fused argmax) on asyncllm's own thread pool
        instead of OpenMP's, and torch's own ops in those steps on the device thread alone: when another process
        takes one of the compute threads' CPUs, the device thread finishes that thread's work itself instead of
        waiting for it at a barrier. Same outputs either way. False runs them on OpenMP's threads
        (docs/performance.md, "Sharing the machine")."""),
    )
    seed: int | None = field(
        default=None, metadata=_doc("Seed of the generator that unseeded sampling requests share.")
    )
    enable_prefix_caching: bool = field(
        default=True, metadata=_doc("Reuse the KV cache of identical prompt prefixes (full blocks) across requests.")
    )
    scheduling_policy: SchedulingPolicy = field(
        default="fcfs",
        metadata=_doc(""""fcfs": first come, first served, and a request's priority must be 0
        (InvalidRequestError otherwise). "priority": each request's priority (stream(priority=...),
        the HTTP field "priority"; any int, 0 by default) orders the waiting queue, lower values
        first and ties in arrival order; under memory pressure the running request with the largest
        value (the latest arrival among equals) is preempted first, and a waiting request that finds
        no seat (max_num_seqs) or no KV blocks preempts running requests of larger values, largest
        first. No aging: a steady load of better priorities starves worse ones."""),
    )
    max_waiting_requests: int | None = field(
        default=DEFAULT_MAX_WAITING_REQUESTS,
        metadata=_doc("""Bound of the queue of requests not yet running; beyond it stream() raises
        EngineOverloadedError at once (HTTP 503). Default 4096 (sixteen batches of the default
        max_num_seqs); None: unbounded."""),
    )
    step_timeout: float | None = field(
        default=DEFAULT_STEP_TIMEOUT,
        metadata=_doc("""Seconds a model step may take (from when the engine waits for it; a step queued
        behind another is not charged with that one's time) before the device counts as hung: the
        engine then dies with DeviceStepTimeoutError on every stream, check_health (/health)
        fails, and leaving `async with` returns at once, leaving the stuck thread behind (logged).
        Closing is bounded by it too. None waits forever."""),
    )
    attention_backend: str = field(
        default="auto",
        metadata=_doc(""""auto" (the Triton kernels on CUDA when triton is installed; on the CPU the cpu kernel
        when it can run, else the torch reference), "torch", "cpu" (C kernels for float32 on the
        CPU, built once with the system C compiler), or "triton" (on the CPU only under
        TRITON_INTERPRET=1: slow, for tests). See docs/gpu.md and docs/performance.md."""),
    )
    enforce_eager: bool = field(
        default=False,
        metadata=_doc("""Never use CUDA graphs. By default, on CUDA with the triton backend, decode-only steps
        replay graphs captured at start-up for batch sizes up to max_num_seqs."""),
    )
    async_scheduling: bool = field(
        default=True,
        metadata=_doc("""Schedule step N+1 while step N still runs on the device (its sampled tokens are filled in
        on the device thread), so the device never waits for the event loop. False runs one step at
        a time; outputs are identical either way."""),
    )
    compile: bool = field(
        default=False,
        metadata=_doc("""torch.compile the dense parts of every layer at start-up (norms, fused matmuls, rotary,
        MLP): tens of seconds at the first start-up for a few percent more throughput on the CPU
        when last measured (docs/performance.md), so off by default."""),
    )
    num_threads: int | None = field(
        default=None,
        metadata=_doc("""torch's intra-op threads for the forward on the CPU (set at start-up on the device
        thread; torch's count is per process). None: OMP_NUM_THREADS if set, else the CPUs the
        process may use (its affinity mask, capped by its cgroup's CPU quota), less one from 8 on
        (the spare one runs the event loop), and fewer while other work holds those CPUs (the
        thread governor: docs/performance.md, "Sharing the machine"). An explicit count is kept as it
        is, and so is the automatic one with ``compile=True`` (inductor's kernels depend on their count)."""),
    )
    max_logprobs: int = field(
        default=20,
        metadata=_doc("""The most alternatives a request's logprobs or prompt_logprobs may ask for (vLLM's
        default); more is an InvalidSamplingParamsError."""),
    )
    max_prompt_bytes: int | None = field(
        default=None,
        metadata=_doc("""The largest text prompt (or chat conversation) in UTF-8 bytes, checked before it is
        tokenized (PromptTooLongError); None: 16 bytes per token of max_model_len. It bounds the
        tokenizing stream() does in the caller's thread; open_stream() and generate() tokenize long
        prompts in a worker thread."""),
    )
    max_stop: int = field(default=64, metadata=_doc("The most stop strings a request may give."))
    max_stop_bytes: int = field(
        default=4096,
        metadata=_doc("The most UTF-8 bytes of a request's stop strings together (searched at every step)."),
    )
    max_bad_words: int = field(default=256, metadata=_doc("The most bad_words a request may give."))
    max_bad_words_bytes: int = field(
        default=8192,
        metadata=_doc("""The most UTF-8 bytes of a request's bad_words together (each is tokenized twice at the
        call and checked at every step)."""),
    )
    max_structured_output_bytes: int = field(
        default=1 << 20,
        metadata=_doc("""The largest structured_output (its JSON Schema, regex or grammar) a request may give, in
        bytes of canonical JSON; the grammar engine's own limits bound the work of compiling it."""),
    )
    grammar_cache_size: int = field(
        default=256,
        metadata=_doc("""The most compiled grammars (structured_output) kept for reuse; the least recently used
        are dropped first."""),
    )
    pooling: str = field(
        default="auto",
        metadata=_doc("""How embed() pools a prompt's final hidden states when the call does not say: "last"
        (the last token's) or "mean" (over every prompt token). "auto": the model folder's
        sentence-transformers config (modules.json and the Pooling module's config.json; its Normalize
        module sets the default normalize) where there is one, else "last", normalized."""),
    )
    tensor_parallel_size: int = field(
        default=1,
        metadata=_doc("""Split the model over this many ranks (Megatron-style tensor parallelism: attention
        heads, MLP columns, the vocabulary and the KV cache's heads): the device thread drives rank 0
        and ranks 1..N-1 run in worker processes that the engine starts and ends. On CUDA rank r
        runs on the r-th device after the engine's; on the CPU the ranks share the host's CPUs
        (num_threads is then per rank; None splits the usable CPUs between them, unless
        OMP_NUM_THREADS is set: every rank then takes that count as its own). The llama,
        mistral, qwen2 and qwen3 families; not with compile, and without CUDA graphs. See
        docs/tensor-parallel.md."""),
    )
    max_embedding_inputs: int = field(
        default=DEFAULT_MAX_EMBEDDING_INPUTS,
        metadata=_doc("""The most inputs one embed() call (one /v1/embeddings request) may give; more is an
        InvalidRequestError. Each input is a request of its own, bounded by max_model_len."""),
    )
    speculative_method: str | None = field(
        default=None,
        metadata=_doc("""Speculative decoding: None (off), "ngram" (prompt lookup: a request in decode feeds,
        after its newest token, the tokens that followed the latest earlier occurrence of its last
        tokens in its prompt and output; the model verifies them in the same forward, so a step may
        yield several tokens) or "draft_model" (a small model of the same vocabulary,
        speculative_model, proposes them). Outputs keep their distribution (greedy outputs are the
        same tokens); a request whose drafts are seldom accepted stops drafting for a while. See
        docs/speculative.md."""),
    )
    speculative_model: str | None = field(
        default=None,
        metadata=_doc("""With speculative_method="draft_model", the draft model: a local HF-format folder
        (config.json, *.safetensors, tokenizer files) of a family the engine runs, whose tokenizer is
        the target's. It runs beside the target on the device thread, its KV cache in the same blocks
        (a block's memory counts both). Not with tensor_parallel_size > 1."""),
    )
    num_speculative_tokens: int = field(
        default=4,
        metadata=_doc("""With speculative_method, the most draft tokens one request carries per step (1-16);
        they count against max_num_batched_tokens. A request may lower it
        (SamplingParams.num_speculative_tokens)."""),
    )
    speculative_ngram_min: int = field(
        default=2, metadata=_doc("""With speculative_method="ngram", the shortest run of last tokens looked up.""")
    )
    speculative_ngram_max: int = field(
        default=4,
        metadata=_doc("""With speculative_method="ngram", the longest run of last tokens looked up (tried
        first; the longest run found wins)."""),
    )
    speculative_disable_by_batch_size: int | None = field(
        default=None,
        metadata=_doc("""With speculative_method, no request drafts while more than this many requests run
        (vLLM's disable_by_batch_size): a large batch keeps the device busy without drafts, which then
        only add compute. None: drafts at any batch size."""),
    )

    def __post_init__(self) -> None:
        check_kv_cache_memory(self.kv_cache_memory)
        if self.revision is not None and (not isinstance(self.revision, str) or not self.revision.strip()):
            raise ValueError(f"revision must be a non-empty str or None, got {self.revision!r}")
        if self.attention_backend not in ("auto", "torch", "cpu", "triton"):
            raise ValueError(
                f"attention_backend must be 'auto', 'torch', 'cpu' or 'triton', got {self.attention_backend!r}"
            )
        booleans = (
            "compile",
            "enforce_eager",
            "async_scheduling",
            "enable_prefix_caching",
            "kv_cache_prefault",
            "kv_cache_prefault_wait",
        )
        for name in (*booleans, "cpu_kernel_pool"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("block_size", "max_num_seqs", "max_num_batched_tokens", "tensor_parallel_size"):
            _check_positive(name, getattr(self, name))
        for name in ("max_model_len", "kv_cache_blocks", "max_waiting_requests", "num_threads", "max_prompt_bytes"):
            if getattr(self, name) is not None:
                _check_positive(name, getattr(self, name))
        if self.step_timeout is not None and (
            isinstance(self.step_timeout, bool)
            or not isinstance(self.step_timeout, (int, float))
            or not 0 < self.step_timeout < math.inf
        ):
            raise ValueError(f"step_timeout must be a positive number of seconds or None, got {self.step_timeout!r}")
        if self.dtype not in ("auto", "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be 'auto', 'float32', 'float16' or 'bfloat16', got {self.dtype!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.pooling not in ("auto", "last", "mean"):
            raise ValueError(f"pooling must be 'auto', 'last' or 'mean', got {self.pooling!r}")
        for name in (
            "max_embedding_inputs",
            "max_stop",
            "max_stop_bytes",
            "max_bad_words",
            "max_bad_words_bytes",
            "max_structured_output_bytes",
            "grammar_cache_size",
        ):
            _check_positive(name, getattr(self, name))
        if isinstance(self.max_logprobs, bool) or not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs must be an int >= 0, got {self.max_logprobs!r}")
        if self.tensor_parallel_size > 1 and self.compile:
            raise ValueError(
                "compile=True does not run with tensor_parallel_size > 1 (the collectives are not compiled)"
            )
        if self.tensor_parallel_size > 1 and self.speculative_method == "draft_model":
            raise ValueError(
                'speculative_method="draft_model" does not run with tensor_parallel_size > 1 yet (the draft '
                'model is not sharded over the ranks); "ngram" does'
            )
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**64
        ):
            raise ValueError(f"seed must be an int in [0, 2**64), got {self.seed!r}")
        if self.speculative_method is not None and self.speculative_method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative_method must be 'ngram', 'draft_model' or None, got {self.speculative_method!r}"
            )
        if self.speculative_model is not None and (
            not isinstance(self.speculative_model, str) or not self.speculative_model.strip()
        ):
            raise ValueError(
                f"speculative_model must be a local folder (a non-empty str) or None, got {self.speculative_model!r}"
            )
        if self.speculative_method == "draft_model" and self.speculative_model is None:
            raise ValueError('speculative_method="draft_model" needs speculative_model (the draft model\'s folder)')
        if self.speculative_model is not None and self.speculative_method != "draft_model":
            raise ValueError(
                'speculative_model is for speculative_method="draft_model", '
                f"got speculative_method={self.speculative_method!r}"
            )
        SpeculativeConfig(
            num_tokens=self.num_speculative_tokens,
            ngram_min=self.speculative_ngram_min,
            ngram_max=self.speculative_ngram_max,
            disable_by_batch_size=self.speculative_disable_by_batch_size,
        )  # checks the sizes even while speculation is off, so a typo shows before it is turned on

    def speculative_config(self) -> SpeculativeConfig | None:
        """The speculative decoding these options ask for, or None when it is off."""
        if self.speculative_method is None:
            return None
        return SpeculativeConfig(
            method="draft_model" if self.speculative_method == "draft_model" else "ngram",
            num_tokens=self.num_speculative_tokens,
            ngram_min=self.speculative_ngram_min,
            ngram_max=self.speculative_ngram_max,
            disable_by_batch_size=self.speculative_disable_by_batch_size,
        )

    @classmethod
    def from_keywords(cls, **options: Any) -> EngineOptions:
        """Build the options from keywords, as ``Engine.open`` receives them.

        Raises:
            TypeError: A keyword is not an option (the message suggests the closest one).
            ValueError: An option is out of range.
        """
        names = [f.name for f in dataclasses.fields(cls)]
        for key in options:
            if key not in names:
                close = difflib.get_close_matches(key, names, n=1)
                hint = f"; did you mean {close[0]!r}?" if close else ""
                raise TypeError(f"unknown engine option {key!r}{hint} (the options are EngineOptions' fields)")
        return cls(**options)

    def request_limits(self) -> RequestLimits:
        """The caps on one request these options set."""
        return RequestLimits(
            max_logprobs=self.max_logprobs,
            max_prompt_bytes=self.max_prompt_bytes,
            max_stop=self.max_stop,
            max_stop_bytes=self.max_stop_bytes,
            max_bad_words=self.max_bad_words,
            max_bad_words_bytes=self.max_bad_words_bytes,
            max_structured_output_bytes=self.max_structured_output_bytes,
            max_speculative_tokens=self.num_speculative_tokens if self.speculative_method is not None else 0,
        )


def option_doc(name: str) -> str:
    """What the option ``name`` means (one paragraph)."""
    docs: dict[str, str] = {f.name: f.metadata["doc"] for f in dataclasses.fields(EngineOptions)}
    return docs[name]


def _check_positive(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")


def _document_fields() -> None:
    # help(EngineOptions) lists every option with its default, from the fields themselves.
    lines = ["", "    Attributes:"]
    for item in dataclasses.fields(EngineOptions):
        lines.append(f"        {item.name} (default {item.default!r}): {item.metadata['doc']}")
    EngineOptions.__doc__ = (EngineOptions.__doc__ or "") + "\n".join(lines) + "\n"


_document_fields()
