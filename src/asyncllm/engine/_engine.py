"""``Engine``: the public face. An async context manager that owns one task group.

    async with Engine.open("path/to/model") as engine:
        async for chunk in engine.stream("Once upon a time", SamplingParams(max_tokens=64)):
            print(chunk.text, end="")

Entering it loads the model on the device thread and starts the step loop; leaving it aborts every
request, stops the loop, frees weights and KV cache and joins the device thread. Nothing starts
lazily and nothing outlives the ``async with`` block.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any

import anyio
import msgspec

from asyncllm.core._engine_core import EngineCore
from asyncllm.core._request import Request
from asyncllm.core._scheduler import Scheduler
from asyncllm.core._speculative import Speculator
from asyncllm.core.kv._manager import KVCacheManager
from asyncllm.engine._detokenizer import Tokenizer
from asyncllm.engine._input_processor import InputProcessor
from asyncllm.engine._metrics import EngineMetrics
from asyncllm.engine._options import EngineOptions
from asyncllm.engine._output_processor import OutputProcessor
from asyncllm.engine._pooling import BUILT_IN, PoolingDefaults, finish_vector, pooling_defaults
from asyncllm.engine._stream import RequestStream
from asyncllm.engine._tools import ToolPlan, plan_tools, tools_error
from asyncllm.errors import (
    DeviceStepTimeoutError,
    EngineClosedError,
    EngineDeadError,
    EngineOverloadedError,
    InvalidPromptError,
    InvalidRequestError,
    RequestFailedError,
    StructuredOutputError,
    UnsupportedModelError,
)
from asyncllm.executor._device import DeviceWorker
from asyncllm.executor._runner import ModelRunner, Pooling, RunnerInfo
from asyncllm.outputs import Completion, Embedding, EngineStatistics, FinishReason, Logprobs, Sample, StreamChunk
from asyncllm.sampling_params import SamplingParams
from asyncllm.structured import GrammarBackend, GrammarCompiler

if TYPE_CHECKING:
    from asyncllm.executor._ranks import RankProcesses

logger = logging.getLogger("asyncllm")


class Engine:
    """An LLM inference engine running inside the caller's event loop (asyncio or trio).

    Build one with ``Engine.open(...)`` and enter it with ``async with``.
    """

    def __init__(
        self, options: EngineOptions, runner: ModelRunner | None = None, tokenizer: Tokenizer | None = None
    ) -> None:
        self.options = options
        self._runner = runner
        self._tokenizer = tokenizer
        self._stack: AsyncExitStack | None = None
        self._core: EngineCore | None = None
        self._inputs: InputProcessor | None = None
        self._info: RunnerInfo | None = None
        self._max_model_len = 0
        self._closed = False
        self._pooling: PoolingDefaults = BUILT_IN
        self._device: DeviceWorker | None = None
        self._ranks: RankProcesses | None = None

    @classmethod
    def open(
        cls,
        model: str | os.PathLike[str] | None = None,
        *,
        runner: ModelRunner | None = None,
        tokenizer: Tokenizer | None = None,
        **options: Any,
    ) -> Engine:
        """Configure an engine; ``async with`` it to load the model and start serving.

        Args:
            model: A local HF-format folder (config.json, *.safetensors, tokenizer files); a
                Hugging Face hub id ``"org/name"`` (when no such local path exists), found in the hub
                cache or downloaded into it (``revision=`` picks a branch, tag or commit; see
                docs/models.md); or None for the default model (SmolLM2-135M-Instruct, converted
                once into a local cache).
            runner: A ``ModelRunner`` to use instead of the torch one (tests: ``asyncllm.testing``).
            tokenizer: The tokenizer to use with ``runner`` (by default loaded from ``model``).
            **options: Fields of ``EngineOptions`` (``device``, ``max_num_seqs``,
                ``kv_cache_blocks``, ``step_timeout``, ...): each one's meaning and default is
                stated there once (``help(asyncllm.EngineOptions)``), and each is a CLI flag.

        Returns:
            The engine, not started yet.

        Raises:
            TypeError: A keyword is not an engine option.
            ValueError: An option is out of range.

        Entering the engine raises ``ModelNotFoundError`` when the model cannot be found (the
        message names the folder, the hub cache and the hub tried) and ``UnsupportedModelError``
        when its config.json names an architecture asyncllm does not implement, needs
        ``trust_remote_code``, or has quantized weights.
        """
        checked = EngineOptions.from_keywords(model=model, **options)
        if runner is not None and tokenizer is None:
            raise ValueError("a custom runner needs a tokenizer too")
        if runner is not None and checked.tensor_parallel_size > 1:
            raise ValueError("tensor_parallel_size > 1 splits asyncllm's own model runner; not with a custom runner")
        return cls(checked, runner, tokenizer)

    # -- lifecycle -------------------------------------------------------------------------------

    async def __aenter__(self) -> Engine:
        if self._stack is not None or self._closed:
            raise RuntimeError("an Engine can be entered only once; call Engine.open() again")
        self._stack = stack = AsyncExitStack()
        await stack.__aenter__()
        try:
            await self._start(stack)
        except BaseException:
            self._closed = True
            await self._teardown()
            raise
        return self

    async def _teardown(self) -> None:
        # The exception that ends the block is not passed down: the task groups inside would wrap
        # it in an ExceptionGroup. Stopping is orderly (abort, finish the step in flight, free,
        # join) and bounded by one step; the device calls inside are shielded, so a cancelled
        # caller still frees the device and joins its thread.
        if self._core is not None:
            self._core.stop_nowait()
        if self._stack is not None:
            await self._stack.aclose()

    async def _start(self, stack: AsyncExitStack) -> None:
        runner, tokenizer = self._runner, self._tokenizer
        model_path = None
        if runner is None:
            from asyncllm.worker._cpu_threads import set_openmp_spin_default

            set_openmp_spin_default()  # before anything below imports torch
        if runner is None or tokenizer is None:
            model_path = await anyio.to_thread.run_sync(_resolve_model, self.options.model, self.options.revision)
            if runner is None:
                # A refused checkpoint (architecture, remote code, quantized) fails here, clearly,
                # before the tokenizer and weights load.
                await anyio.to_thread.run_sync(_check_model, self.options.model, model_path)
                if self.options.tensor_parallel_size > 1:
                    await anyio.to_thread.run_sync(_check_tensor_parallel, self.options, model_path)
            if tokenizer is None:
                tokenizer = await anyio.to_thread.run_sync(_load_tokenizer, model_path)
            if runner is None:
                if self.options.tensor_parallel_size > 1:
                    assert model_path is not None
                    await self._start_ranks(stack, model_path)
                runner = self._torch_runner(model_path)
        self._pooling = await anyio.to_thread.run_sync(pooling_defaults, self.options.pooling, model_path)
        self._device = worker = DeviceWorker()
        # Closing is bounded by step_timeout too: a device that hangs in close (or in a step the
        # engine no longer waits for) is left behind rather than waited for forever.
        stack.push_async_callback(worker.stop, self.options.step_timeout)
        info = await worker.run(runner.load)
        stack.push_async_callback(_close_runner, worker, runner, self.options.step_timeout)
        if self._ranks is not None:  # runs first: the ranks that exit from now on were asked to
            ranks = self._ranks
            stack.callback(lambda: ranks.mark_closing(graceful=self._core is None or self._core.dead is None))
        self._info = info
        self._max_model_len = self._resolve_max_model_len(info)
        kv_cache = KVCacheManager(
            info.num_kv_blocks,
            info.block_size,
            enable_prefix_caching=self.options.enable_prefix_caching,
            partial_block_hits=info.block_copies,
            sliding_window=info.sliding_window,
            sliding_group=info.sliding_group,
        )
        speculative = self.options.speculative_config()
        if speculative is not None and not info.speculative:
            raise ValueError(
                f"speculative_method={speculative.method!r} needs a model runner that verifies drafts; "
                f"this one ({info.description or type(runner).__name__}) does not"
            )
        if speculative is not None and speculative.method == "draft_model" and not info.draft_model:
            raise ValueError(
                'speculative_method="draft_model" needs a model runner that runs a draft model; '
                f"this one ({info.description or type(runner).__name__}) does not"
            )
        scheduler = Scheduler(
            kv_cache,
            max_num_seqs=self.options.max_num_seqs,
            max_num_batched_tokens=self.options.max_num_batched_tokens,
            policy=self.options.scheduling_policy,
            long_rope_length=info.long_rope_length,
            speculator=None if speculative is None else Speculator(speculative),
        )
        outputs = OutputProcessor(tokenizer)
        grammars = _grammar_compiler(tokenizer, info, self.options.grammar_cache_size)
        self._core = core = EngineCore(
            scheduler,
            worker,
            runner,
            outputs,
            async_scheduling=self.options.async_scheduling,
            step_timeout=self.options.step_timeout,
            grammars=grammars,
        )
        # Streams still open when the engine goes away end with an error instead of hanging.
        stack.callback(lambda: outputs.fail_all(EngineClosedError("the engine was closed")))
        self._inputs = InputProcessor(
            tokenizer,
            vocab_size=info.vocab_size,
            max_model_len=self._max_model_len,
            eos_token_ids=info.eos_token_ids,
            limits=self.options.request_limits(),
            grammars=grammars,
            scheduling_policy=self.options.scheduling_policy,
        )
        task_group = await stack.enter_async_context(anyio.create_task_group())
        await task_group.start(core.run)
        logger.info(
            "asyncllm engine ready: %s, %d KV blocks of %d tokens, max_model_len %d "
            "(max concurrency at max_model_len: %.1f requests)",
            info.description,
            info.num_kv_blocks,
            info.block_size,
            self._max_model_len,
            info.num_kv_blocks * info.block_size / self._max_model_len,
        )

    def _torch_runner(self, model_path: Path) -> ModelRunner:
        from asyncllm.worker._model_runner import TorchModelRunner

        return TorchModelRunner(model_path, self.options, ranks=self._ranks)

    async def _start_ranks(self, stack: AsyncExitStack, model_path: Path) -> None:
        """Start ranks 1..N-1's processes and their watcher, both ended by ``stack``."""
        from asyncllm.executor._ranks import RankProcesses

        options = dataclasses.asdict(self.options)
        options["model"] = None if self.options.model is None else os.fspath(self.options.model)
        self._ranks = ranks = await stack.enter_async_context(
            RankProcesses(self.options.tensor_parallel_size, model_path, options)
        )
        watcher = await stack.enter_async_context(anyio.create_task_group())
        stack.callback(ranks.stop_watching)  # before the watcher's task group waits for it
        watcher.start_soon(ranks.watch, self._rank_died)

    def _rank_died(self, error: EngineDeadError) -> None:
        # A rank's process exited while the engine ran: the engine dies with it, at once, even if a
        # step waits in a collective with that rank.
        logger.error("asyncllm: %s", error)
        if self._core is not None:
            self._core.kill(error)
        elif self._device is not None:
            self._device.fail(error)

    def _resolve_max_model_len(self, info: RunnerInfo) -> int:
        requested = self.options.max_model_len
        capacity = info.num_kv_blocks * info.block_size
        if requested is not None:
            if requested > capacity:
                raise ValueError(
                    f"max_model_len={requested} does not fit the KV cache ({info.num_kv_blocks} blocks of "
                    f"{info.block_size} tokens = {capacity} tokens); lower it or give more kv_cache_blocks"
                )
            return requested
        if info.max_model_len > capacity:
            logger.warning("max_model_len capped at %d tokens, what the KV cache holds", capacity)
        return min(info.max_model_len, capacity)

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._stack is None or self._closed:
            return
        self._closed = True
        await self._teardown()
        if exc_type is None and self._core is not None and self._core.dead is not None:
            raise self._core.dead

    # -- requests --------------------------------------------------------------------------------

    def _require_running(self) -> tuple[EngineCore, InputProcessor]:
        core, inputs = self._core, self._inputs
        if core is None or inputs is None or self._closed:
            raise EngineClosedError("the engine is not running; use `async with Engine.open(...) as engine:`")
        if core.dead is not None:
            raise EngineDeadError("the engine died earlier") from core.dead
        return core, inputs

    def stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """Submit a request and return its live output.

        Validation happens here, at the call: nothing is scheduled for a bad request. A text
        prompt is tokenized here too, in the caller's thread (bounded by ``max_prompt_bytes``);
        async code serving many users should prefer ``open_stream``, which tokenizes long
        prompts in a worker thread.

        Args:
            prompt: Text (tokenized with the model's tokenizer) or a sequence of token ids.
            params: How to sample: a ``SamplingParams`` or a mapping of its fields (unknown keys
                are rejected); defaults to ``SamplingParams()``.
            cache_salt: Requests share prefix-cache entries only when their salts are equal: give
                each tenant that must not share cached KV (or timing) its own salt.
            priority: With ``scheduling_policy="priority"``: lower values are scheduled first (ties
                in arrival order), and may preempt running requests of larger values; any int.
                Under the default ``"fcfs"`` only 0 is accepted.

        Returns:
            A ``RequestStream``: iterate it for ``StreamChunk`` deltas. Leaving it early by
            cancellation, a timeout, ``aclose()`` or ``async with`` aborts the request; a bare
            ``break`` aborts only once the stream object is dropped (use ``async with``).

        Raises:
            InvalidRequestError: The prompt, parameters or priority are invalid (a ``ValueError``).
            EngineOverloadedError: ``max_waiting_requests`` requests are already waiting.
            EngineClosedError: The engine is not running.
            EngineDeadError: The engine died.
        """
        return self._submit(prompt, params, cache_salt, priority, wake_at_end=False)

    def _submit(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | Mapping[str, Any] | None,
        cache_salt: str | None,
        priority: int,
        *,
        wake_at_end: bool,
    ) -> RequestStream:
        core, inputs = self._require_running()
        self._check_capacity(core)
        request = inputs.process(
            prompt, params if params is not None else SamplingParams(), cache_salt=cache_salt, priority=priority
        )
        return self._admit(core, request, wake_at_end=wake_at_end)

    async def _submit_async(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | Mapping[str, Any] | None,
        cache_salt: str | None,
        priority: int,
        *,
        wake_at_end: bool,
    ) -> RequestStream:
        core, inputs = self._require_running()
        self._check_capacity(core)  # an overloaded engine refuses before any tokenizing
        request = await inputs.process_async(
            prompt, params if params is not None else SamplingParams(), cache_salt=cache_salt, priority=priority
        )
        core, _ = self._require_running()  # it may have closed or died while the prompt was tokenized
        self._check_capacity(core)
        return self._admit(core, request, wake_at_end=wake_at_end)

    def _check_capacity(self, core: EngineCore) -> None:
        limit = self.options.max_waiting_requests
        if limit is not None and core.num_waiting >= limit:
            raise EngineOverloadedError(f"{limit} requests are already waiting (max_waiting_requests); retry later")

    def _admit(self, core: EngineCore, request: Request, *, wake_at_end: bool) -> RequestStream:
        stream = RequestStream(
            request.request_id,
            request.prompt_token_ids,
            core.abort_nowait,
            num_samples=len(request.group) or 1,
            wake_at_end=wake_at_end,
        )
        core.add(request, stream)
        return stream

    async def open_stream(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """Submit a request and return its live output, as ``stream`` does, without holding the event loop.

        ``stream`` tokenizes in the caller's thread, which is the event loop's: a long prompt then
        holds up every other stream while it is tokenized (``max_prompt_bytes`` bounds how long).
        This twin checks everything cheap in place, then tokenizes a long text prompt (8,192
        characters or more) or many bad words in a worker thread. Servers that take prompts from
        many users should use it (the HTTP app does); ``generate`` and ``chat`` do.

        Args:
            prompt: Text or token ids, as for ``stream``.
            params: How to sample, as for ``stream``.
            cache_salt: As for ``stream``.
            priority: As for ``stream``.

        Returns:
            A ``RequestStream``, as ``stream`` returns.

        Raises:
            InvalidRequestError: As for ``stream``.
            EngineOverloadedError: As for ``stream``.
            EngineClosedError: The engine is not running (or was closed while the prompt was tokenized).
            EngineDeadError: The engine died.
        """
        return await self._submit_async(prompt, params, cache_salt, priority, wake_at_end=False)

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> Completion:
        """Run a request to the end and return its whole output (a long prompt is tokenized in a
        worker thread, as ``open_stream`` does).

        Args:
            prompt: Text or token ids, as for ``stream``.
            params: How to sample.
            cache_salt: As for ``stream``.
            priority: As for ``stream``.

        Returns:
            The ``Completion``. Cancelling the call aborts the request.

        Raises:
            InvalidRequestError: As for ``stream``.
            EngineOverloadedError: As for ``stream``.
            EngineClosedError: The engine is not running (or closed while the request ran).
            EngineDeadError: The engine died.
        """
        parts: list[_SampleParts] = []
        prompt_logprobs: tuple[Logprobs | None, ...] | None = None
        # Woken once, when the request ends: the output arrives merged, one chunk per sample.
        async with await self._submit_async(prompt, params, cache_salt, priority, wake_at_end=True) as stream:
            parts = [_SampleParts() for _ in range(stream.num_samples)]
            async for chunk in stream:
                parts[chunk.index].add(chunk)
                if chunk.prompt_logprobs is not None:
                    prompt_logprobs = chunk.prompt_logprobs
        samples = tuple(part.sample(index) for index, part in enumerate(parts))
        first = samples[0]
        return Completion(
            first.text,
            first.token_ids,
            tuple(stream.prompt_token_ids),
            first.finish_reason,
            logprobs=first.logprobs,
            prompt_logprobs=prompt_logprobs,
            stop_reason=first.stop_reason,
            samples=samples,
            num_cached_tokens=stream.num_cached_tokens,
        )

    async def embed(
        self,
        inputs: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]],
        *,
        pooling: Pooling | None = None,
        normalize: bool | None = None,
        dimensions: int | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> list[Embedding]:
        """Embed each input: its prompt's final hidden states (after the final norm), pooled.

        Each input is a request of its own that goes through the same scheduler and batches as
        generation (chunked like any prompt, next to generating requests), computes its prompt and
        nothing else, and frees its KV blocks at once. Every input is checked, and tokenized (long
        texts in a worker thread), before any is queued.

        Args:
            inputs: A text, a list of texts, a list of token ids (one input), or a list of lists of
                token ids.
            pooling: "last" (the last token's hidden state) or "mean" (over every prompt token; such
                a request skips the prefix cache, as it needs every position's hidden state). None:
                the engine's default (``EngineOptions.pooling``: the model's sentence-transformers
                config, else "last").
            normalize: L2-normalize the vector. None: the default (True, unless the model's
                sentence-transformers config has no Normalize module).
            dimensions: Keep only the first ``dimensions`` values (Matryoshka truncation), normalized
                afterwards when normalizing; None keeps the hidden size.
            cache_salt: As for ``stream``.
            priority: As for ``stream``, for every input.

        Returns:
            One ``Embedding`` per input, in order (a list even for one input). Cancelling the call
            aborts every input's request and frees their blocks.

        Raises:
            InvalidPromptError: No input, an empty input, one of the wrong type or with ids outside the
                vocabulary (``param`` "input"; the message names the input's index).
            PromptTooLongError: An input is longer than ``max_model_len`` tokens, or its text larger
                than ``max_prompt_bytes``.
            InvalidRequestError: More inputs than ``max_embedding_inputs`` (or than
                ``max_waiting_requests``), a bad ``pooling``, ``normalize``, ``dimensions`` (outside
                1..hidden size) or ``priority``, no pooling to use, or a runner that cannot pool.
            EngineOverloadedError: The inputs do not fit in the waiting queue now (``max_waiting_requests``).
            EngineClosedError: The engine is not running (or closed while the inputs ran).
            EngineDeadError: The engine died.
            RequestFailedError: An input's request failed inside the engine.
        """
        core, processor = self._require_running()
        processor.check_priority(priority)  # once, rather than as "input 0: ..."
        prompts = _embedding_inputs(inputs, self.options.max_embedding_inputs)
        chosen, normalize = self._embedding_options(pooling, normalize, dimensions)
        self._check_room(core, len(prompts))
        requests = []
        for index, prompt in enumerate(prompts):
            try:
                requests.append(
                    await processor.process_pooling_async(prompt, chosen, cache_salt=cache_salt, priority=priority)
                )
            except InvalidRequestError as exc:
                param = "input" if exc.param in ("prompt", None) else exc.param
                where = f"input {index}: " if len(prompts) > 1 else ""
                raise type(exc)(f"{where}{exc}", param=param) from exc
        core, _ = self._require_running()  # it may have closed or died while the inputs were tokenized
        self._check_room(core, len(prompts))
        results: list[Embedding] = []
        async with AsyncExitStack() as stack:
            streams = []
            for request in requests:
                stream = RequestStream(
                    request.request_id, request.prompt_token_ids, core.abort_nowait, wake_at_end=True
                )
                stack.callback(stream._close)  # leaving early (cancelled, failed) aborts what is unfinished
                core.add(request, stream)
                streams.append(stream)
            for stream in streams:
                async for _ in stream:
                    pass
                if stream.embedding is None:
                    self._require_running()
                    raise RequestFailedError("the embedding request was aborted before its prompt was computed")
                vector = finish_vector(stream.embedding, dimensions=dimensions, normalize=normalize)
                results.append(Embedding(vector, tuple(stream.prompt_token_ids)))
        return results

    def _embedding_options(
        self, pooling: Pooling | None, normalize: bool | None, dimensions: int | None
    ) -> tuple[Pooling, bool]:
        hidden_size = None if self._info is None else self._info.hidden_size
        if hidden_size is None:
            raise InvalidRequestError("this engine's model runner cannot compute embeddings")
        if pooling is None:
            pooling = self._pooling.pooling
            if pooling is None:
                raise InvalidRequestError(
                    f"no default pooling: {self._pooling.problem}; pass pooling='last' or 'mean'", param="pooling"
                )
        elif pooling not in ("last", "mean"):
            raise InvalidRequestError(f"pooling must be 'last' or 'mean', got {pooling!r}", param="pooling")
        if normalize is None:
            normalize = self._pooling.normalize
        elif not isinstance(normalize, bool):
            raise InvalidRequestError(f"normalize must be a bool, got {normalize!r}", param="normalize")
        if dimensions is not None and (
            isinstance(dimensions, bool) or not isinstance(dimensions, int) or not 1 <= dimensions <= hidden_size
        ):
            raise InvalidRequestError(
                f"dimensions must be an int from 1 to the model's hidden size {hidden_size}, got {dimensions!r}",
                param="dimensions",
            )
        return pooling, normalize

    def _check_room(self, core: EngineCore, count: int) -> None:
        """Refuse ``count`` requests that the waiting queue could never hold, or cannot hold now.

        Raises:
            InvalidRequestError: ``count`` is more than ``max_waiting_requests``.
            EngineOverloadedError: They do not fit next to the requests already waiting.
        """
        limit = self.options.max_waiting_requests
        if limit is None:
            return
        if count > limit:
            raise InvalidRequestError(
                f"{count} inputs are more than the waiting queue holds (max_waiting_requests={limit})", param="input"
            )
        if core.num_waiting + count > limit:
            raise EngineOverloadedError(
                f"{count} inputs do not fit in the waiting queue now (max_waiting_requests={limit}); retry later"
            )

    @property
    def embedding_size(self) -> int | None:
        """The size of ``embed``'s vectors before ``dimensions`` (the model's hidden size); None before the
        engine is entered, or with a runner that cannot pool."""
        return None if self._info is None else self._info.hidden_size

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix (running requests keep their blocks).

        Returns:
            How many cached blocks were forgotten.

        Raises:
            EngineClosedError: The engine is not running.
        """
        core, _ = self._require_running()
        return core.reset_prefix_cache()

    def tool_plan(
        self,
        tools: Sequence[Mapping[str, Any]] | None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
    ) -> ToolPlan | None:
        """Check a chat's tool options and decide how this model serves them (``chat`` calls it).

        Args:
            tools: OpenAI function tools: ``{"type": "function", "function": {"name", "description",
                "parameters"}}``, ``parameters`` a JSON Schema (required: ``{"type": "object",
                "properties": {}}`` for a function without arguments).
            tool_choice: ``"none"``, ``"auto"`` (the default with tools), ``"required"``, or
                ``{"type": "function", "function": {"name": ...}}``.
            parallel_tool_calls: False: at most one call per reply (default True).

        Returns:
            The plan (the checked tools, the choice, the model's tool-call format), or None without tools.

        Raises:
            InvalidToolsError: A malformed tool or a duplicate name, a missing ``parameters`` schema,
                ``tool_choice`` naming no given tool, ``parallel_tool_calls`` not a bool.
            EngineClosedError: The engine is not running.
        """
        _, inputs = self._require_running()
        return plan_tools(tools, tool_choice, parallel_tool_calls, inputs.tool_format, inputs.grammars is not None)

    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, tools: ToolPlan | None = None
    ) -> list[int]:
        """Render a conversation with the model's chat template, the assistant's turn opened.

        Rendering and tokenizing run in the caller's thread (bounded by ``max_prompt_bytes``);
        ``encode_chat`` is the twin that moves a long conversation to a worker thread.

        Args:
            messages: ``{"role": ..., "content": ...}`` mappings, oldest first. Content is a str, a
                list of ``{"type": "text", "text": ...}`` parts, or null on an assistant message
                with ``tool_calls`` (OpenAI's shape); ``tool`` messages carry the results.
            tools: A ``tool_plan``: its tools are rendered by the template, or by the generic tool
                prompt when the template cannot render tools (docs/structured-output.md).

        Returns:
            The prompt's token ids (``add_generation_prompt=True``).

        Raises:
            ChatTemplateError: The model has no chat template, the messages are malformed (or
                hold text that is not valid UTF-8), or the template rejected them (an
                ``InvalidRequestError``).
            PromptTooLongError: The messages (and tools) hold more than ``max_prompt_bytes`` of text.
            EngineClosedError: The engine is not running.
            EngineDeadError: The engine died.
        """
        _, inputs = self._require_running()
        return inputs.render_chat(messages, tools)

    async def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: ToolPlan | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """``apply_chat_template``, with a long conversation (8,192 characters or more) rendered and
        tokenized in a worker thread, so the event loop keeps running meanwhile.

        Args:
            messages: As for ``apply_chat_template``.
            tools: As for ``apply_chat_template``.
            add_generation_prompt: False leaves the assistant's turn unopened (to count a history's tokens).

        Returns:
            The prompt's token ids, as ``apply_chat_template`` returns them.

        Raises:
            ChatTemplateError: As for ``apply_chat_template``.
            PromptTooLongError: As for ``apply_chat_template``.
            EngineClosedError: The engine is not running.
            EngineDeadError: The engine died.
        """
        _, inputs = self._require_running()
        return await inputs.render_chat_async(messages, tools, add_generation_prompt=add_generation_prompt)

    async def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids, as the model's tokenizer gives them; a long text (8,192 characters or
        more) is tokenized in a worker thread.

        Args:
            text: Any text up to ``max_prompt_bytes`` (empty included).
            add_special_tokens: False leaves out what the tokenizer adds on its own (a BOS).

        Raises:
            PromptTooLongError: ``text`` is larger than ``max_prompt_bytes``.
            InvalidPromptError: ``text`` is not valid UTF-8 text, or the tokenizer failed on it.
            EngineClosedError: The engine is not running.
        """
        _, inputs = self._require_running()
        return await inputs.encode_text_async(text, add_special_tokens=add_special_tokens)

    async def detokenize(self, token_ids: Sequence[int]) -> str:
        """The text of ``token_ids``, special tokens written out; many ids are decoded in a worker thread.

        Raises:
            InvalidPromptError: An id is outside the vocabulary (``param="tokens"``).
            EngineClosedError: The engine is not running.
        """
        _, inputs = self._require_running()
        return await inputs.decode_async(token_ids)

    def chat_stream(
        self,
        messages: Sequence[Mapping[str, Any]],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """Submit a conversation (see ``apply_chat_template``) and return the reply's live output.

        For tools, use ``chat`` (whole replies, calls parsed), or ``tool_plan`` with ``encode_chat``,
        ``ToolPlan.constrain`` and ``ToolPlan.parser()`` over ``open_stream`` (what the HTTP app does).

        Args:
            messages: The conversation so far, oldest first.
            params: How to sample.
            cache_salt: As for ``stream``.
            priority: As for ``stream``.

        Returns:
            A ``RequestStream``, as ``stream`` returns.

        Raises:
            ChatTemplateError: As for ``apply_chat_template``.
            InvalidRequestError: As for ``stream``.
            EngineClosedError: The engine is not running.
            EngineDeadError: The engine died.
        """
        _, inputs = self._require_running()
        inputs.check_priority(priority)  # before rendering: a refused request costs no tokenizing
        return self.stream(self.apply_chat_template(messages), params, cache_salt=cache_salt, priority=priority)

    async def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        params: SamplingParams | None = None,
        *,
        cache_salt: str | None = None,
        priority: int = 0,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool | None = None,
    ) -> Completion:
        """Run a conversation's next assistant turn to the end (see ``chat_stream``); a long
        conversation is rendered in a worker thread (see ``encode_chat``).

        With ``tools``, the reply is parsed for calls in the model's format: ``tool_calls`` holds
        them and ``text`` the text outside them. ``tool_choice="required"`` or a named function
        constrains the reply to calls whose arguments validate against their schemas; ``"auto"``
        lets the model choose, and constrains a call once it has started.

        Args:
            messages: The conversation so far, oldest first (see ``apply_chat_template``).
            params: How to sample.
            cache_salt: As for ``stream``.
            priority: As for ``stream``.
            tools: Functions the model may call (see ``tool_plan``).
            tool_choice: See ``tool_plan``.
            parallel_tool_calls: See ``tool_plan``.

        Returns:
            The reply as a ``Completion``. Cancelling the call aborts the request.

        Raises:
            ChatTemplateError: As for ``apply_chat_template``.
            InvalidToolsError: See ``tool_plan``; or a forced ``tool_choice`` with a ``structured_output``.
            StructuredOutputError: A tool's ``parameters`` schema cannot be enforced (``param="tools"``).
            InvalidRequestError: As for ``stream``.
            EngineClosedError: The engine is not running (or closed while the request ran).
            EngineDeadError: The engine died.
        """
        plan = self.tool_plan(tools, tool_choice, parallel_tool_calls)
        _, inputs = self._require_running()
        inputs.check_priority(priority)  # before rendering: a refused request costs no tokenizing
        prompt = await self.encode_chat(messages, tools=plan)
        if plan is None:
            return await self.generate(prompt, params, cache_salt=cache_salt, priority=priority)
        base = params if params is not None else SamplingParams()
        constrained = plan.constrain(base)
        try:
            completion = await self.generate(prompt, constrained, cache_salt=cache_salt, priority=priority)
        except StructuredOutputError as exc:
            if constrained is base:  # the caller's own structured_output
                raise
            raise tools_error(exc) from exc
        samples = []
        for sample in completion.samples:
            content, calls = plan.parse(sample.text)
            samples.append(msgspec.structs.replace(sample, text=content, tool_calls=calls))
        first = samples[0]
        return msgspec.structs.replace(
            completion, text=first.text, tool_calls=first.tool_calls, samples=tuple(samples)
        )

    def abort(self, request_id: int) -> bool:
        """End a live request by its id (``RequestStream.request_id``), as closing its stream would.

        For code that holds a request's id but not its stream: a supervisor, an admin endpoint, a
        deadline kept elsewhere. Every unfinished sample of the request gets a last chunk with
        ``finish_reason="abort"`` (``generate`` returns with it), and its KV blocks go back to the pool
        before the engine's next step. Call it from the engine's event loop.

        Args:
            request_id: A stream's ``request_id``.

        Returns:
            True when the request was still running or waiting; False when it had already ended (or
            no request had that id): aborting twice, or after the end, is harmless.

        Raises:
            EngineClosedError: The engine is not running.
            EngineDeadError: The engine died.
        """
        core, _ = self._require_running()
        if not core.is_live(request_id):
            return False
        core.abort_nowait(request_id)
        return True

    # -- introspection ---------------------------------------------------------------------------

    def check_health(self) -> None:
        """Return if the engine takes requests; raise why not (what ``GET /health`` asks).

        Raises:
            EngineClosedError: The engine is not running (not entered yet, or left).
            EngineDeadError: The engine died.
        """
        self._require_running()

    @property
    def metrics(self) -> EngineMetrics:
        """Live latency histograms and token counters (what ``/metrics`` exports).

        Raises:
            EngineClosedError: The engine was never entered.
        """
        if self._core is None:
            raise EngineClosedError("the engine is not running")
        return self._core.outputs.metrics

    @property
    def max_model_len(self) -> int:
        """The longest prompt plus output this engine accepts (0 before it is entered)."""
        return self._max_model_len

    @property
    def tokenizer(self) -> Tokenizer:
        """The model's tokenizer.

        Raises:
            EngineClosedError: The engine was never entered.
        """
        if self._inputs is None:
            raise EngineClosedError("the engine is not running")
        return self._inputs.tokenizer

    def statistics(self) -> EngineStatistics:
        """A snapshot of the engine's state (see ``EngineStatistics``).

        Raises:
            EngineClosedError: The engine was never entered.
        """
        core = self._core
        if core is None:
            raise EngineClosedError("the engine is not running")
        return core.statistics()


@dataclass(slots=True)
class _SampleParts:
    """One sample's chunks, gathered by ``Engine.generate``."""

    texts: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] | None = None
    finish_reason: FinishReason = "abort"
    stop_reason: int | str | None = None

    def add(self, chunk: StreamChunk) -> None:
        self.texts.append(chunk.text)
        self.token_ids.extend(chunk.token_ids)
        if chunk.logprobs is not None:
            self.logprobs = self.logprobs if self.logprobs is not None else []
            self.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason is not None:
            self.finish_reason = chunk.finish_reason
            self.stop_reason = chunk.stop_reason

    def sample(self, index: int) -> Sample:
        logprobs = None if self.logprobs is None else tuple(self.logprobs)
        return Sample(index, "".join(self.texts), tuple(self.token_ids), self.finish_reason, logprobs, self.stop_reason)


def _embedding_inputs(
    inputs: str | Sequence[str] | Sequence[int] | Sequence[Sequence[int]], limit: int
) -> list[str | Sequence[int]]:
    """``embed``'s inputs as a list of prompts (texts or token-id lists), checked for shape and count.

    Raises:
        InvalidPromptError: No input, or an input that is neither a str nor a sequence of token ids.
        InvalidRequestError: More inputs than ``limit``.
    """
    if isinstance(inputs, str):
        return [inputs]
    if isinstance(inputs, (bytes, bytearray)) or not isinstance(inputs, Sequence):
        raise InvalidPromptError(
            f"input must be a str, a list of str, or token ids, got {type(inputs).__name__}", param="input"
        )
    if len(inputs) == 0:
        raise InvalidPromptError("input is empty: give at least one text or token list", param="input")
    if all(isinstance(item, int) and not isinstance(item, bool) for item in inputs):
        return [inputs]  # type: ignore[list-item]  # one input of token ids
    if len(inputs) > limit:
        raise InvalidRequestError(
            f"{len(inputs)} inputs are more than one call may give (max_embedding_inputs={limit})", param="input"
        )
    prompts: list[str | Sequence[int]] = []
    for index, item in enumerate(inputs):
        if isinstance(item, (bytes, bytearray)) or not isinstance(item, (str, Sequence)):
            raise InvalidPromptError(
                f"input {index} must be a str or a list of token ids, got {type(item).__name__}", param="input"
            )
        prompts.append(item)
    return prompts


async def _close_runner(worker: DeviceWorker, runner: ModelRunner, timeout: float | None) -> None:
    if not worker.abandoned:  # an abandoned thread is stuck in a step: close() would queue behind it
        try:
            await worker.submit(runner.close).wait(timeout)
            return
        except DeviceStepTimeoutError:
            worker.abandon()
    elif not worker.stuck and await worker.wait_exited(timeout):
        # Failed from outside (a tensor-parallel rank died), not stuck: the thread ended once its call
        # (if any: a collective with the dead rank) returned. Closed off it, the runner's weights, KV
        # cache and process group go now, not whenever the dead engine object is dropped.
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(runner.close)
        return
    logger.warning("asyncllm: the model runner was not closed (its device thread is stuck)")


def _grammar_compiler(tokenizer: Tokenizer, info: RunnerInfo, cache_size: int) -> GrammarCompiler | None:
    """The compiler of ``structured_output`` grammars, when the runner applies them and llguidance can
    read the tokenizer (a Hugging Face fast tokenizer); None otherwise."""
    from transformers import PreTrainedTokenizerFast

    if not info.structured_output or not isinstance(tokenizer, PreTrainedTokenizerFast):
        return None

    def make_backend() -> GrammarBackend:
        from asyncllm.structured._llguidance import LLGuidanceBackend  # a Rust extension: loaded on first use

        return LLGuidanceBackend(tokenizer, info.vocab_size, info.eos_token_ids)

    return GrammarCompiler(make_backend, cache_size=cache_size)


def _resolve_model(model: str | os.PathLike[str] | None, revision: str | None) -> Path:
    from asyncllm.default_model import resolve_model_path

    return resolve_model_path(model, revision=revision)


def _check_model(model: str | os.PathLike[str] | None, model_path: Path) -> None:
    from asyncllm._model_source import check_model_folder

    check_model_folder(model_path, os.fspath(model) if model is not None else str(model_path))


def _check_tensor_parallel(options: EngineOptions, model_path: Path) -> None:
    # Before any rank process starts: a model that cannot be split, or too few CUDA devices for the ranks.
    from asyncllm.models import tensor_parallel_problem
    from asyncllm.worker._model_runner import resolve_device
    from asyncllm.worker._weights import load_config

    size = options.tensor_parallel_size
    problem = tensor_parallel_problem(load_config(model_path), size)
    if problem is not None:
        source = os.fspath(options.model) if options.model is not None else str(model_path)
        raise UnsupportedModelError(f"{source} cannot run with tensor_parallel_size={size}: {problem}")
    device = resolve_device(options.device)
    if device.type == "cuda":
        import torch

        first, count = device.index or 0, torch.cuda.device_count()
        if first + size > count:
            raise ValueError(
                f"tensor_parallel_size={size} on {options.device} needs CUDA devices {first}..{first + size - 1}, "
                f"and this machine has {count}"
            )


def _load_tokenizer(model_path: Path) -> Tokenizer:
    from transformers import AutoTokenizer

    # Never the repository's own tokenizer code (a tokenizer_config.json auto_map).
    tokenizer: Tokenizer = AutoTokenizer.from_pretrained(model_path, trust_remote_code=False)  # type: ignore[assignment]
    return tokenizer
