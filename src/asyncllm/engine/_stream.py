"""``RequestStream``: what ``Engine.stream()`` returns.

It is an async iterator and an async context manager, deliberately not an async generator: the
engine pushes deltas into it without ever waiting for the consumer, and a consumer that lags finds
them merged into one chunk (memory stays bounded by the text itself). Leaving it early aborts the
request so its KV blocks come back: at once on leaving ``async with``, on ``aclose()``, or when the
consumer is cancelled while it waits for output; after a bare ``break`` only when the stream is
dropped, since ``__del__`` is then the engine's only way to hear of it (a stream still held in a
variable keeps generating until that reference goes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from types import TracebackType

import anyio

from asyncllm.executor._runner import PooledVector
from asyncllm.outputs import FinishReason, Logprobs, StreamChunk


@dataclass(slots=True, eq=False)
class _Pending:
    """One sample's output not yet handed to the consumer."""

    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Logprobs] | None = None  # a list once the engine sends any
    prompt_logprobs: tuple[Logprobs | None, ...] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    delivered_last: bool = False

    @property
    def ready(self) -> bool:
        return not self.delivered_last and bool(self.text or self.token_ids or self.finish_reason)

    def take(self, index: int) -> StreamChunk:
        text, ids = "".join(self.text), tuple(self.token_ids)
        self.text.clear()
        self.token_ids.clear()
        logprobs = None
        if self.logprobs is not None:
            logprobs = tuple(self.logprobs)
            self.logprobs.clear()
        prompt_logprobs, self.prompt_logprobs = self.prompt_logprobs, None
        finished = self.finish_reason is not None
        self.delivered_last = finished
        return StreamChunk(
            text,
            ids,
            finished,
            self.finish_reason,
            index=index,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            stop_reason=self.stop_reason if finished else None,
        )


class RequestStream:
    """The live output of one request.

    Iterate it (``async for chunk in stream``) to receive ``StreamChunk`` deltas; each sample's
    last chunk has ``finished=True`` (with ``SamplingParams(n=...)`` chunks of the samples
    interleave, told apart by ``chunk.index``). Use it as ``async with engine.stream(...) as
    stream:`` to make the abort on early exit explicit; a stream dropped mid-way aborts too (when it
    is garbage collected), and so does a cancellation (or timeout) that hits while waiting for the
    next chunk.

    With ``wake_at_end`` (what ``Engine.generate`` uses) the consumer is woken only when the request
    ends or fails, and reads the output merged into one chunk per sample.
    """

    def __init__(
        self,
        request_id: int,
        prompt_token_ids: list[int],
        abort: Callable[[int], None],
        *,
        num_samples: int = 1,
        wake_at_end: bool = False,
    ) -> None:
        self.request_id = request_id
        """The engine's id for this request."""
        self.prompt_token_ids = prompt_token_ids
        """The prompt as the model sees it."""
        self.num_samples = num_samples
        """How many samples (``SamplingParams.n``) the stream carries."""
        self.num_cached_tokens: int | None = None
        """Prompt tokens whose KV the request found already computed in the prefix cache when it was
        first scheduled (a multiple of the block size; 0 without a hit); None until its first output."""
        self._abort = abort
        self._samples = [_Pending() for _ in range(num_samples)]
        self._next = 0  # round-robin start, so one busy sample cannot starve the others
        self._error: BaseException | None = None
        self._wakeup = anyio.Event()
        self._closed = False
        # A consumer that only wants the whole output (``Engine.generate``) is woken once, at the end:
        # a wake-up per step and request is event-loop time the device waits for.
        self._wake_at_end = wake_at_end
        self.embedding: PooledVector | None = None
        """An embedding request's pooled vector (raw: not normalized), once it finished with "stop"."""

    @property
    def wakes_at_end(self) -> bool:
        """Whether the consumer is woken only when the request ends (``Engine.generate``)."""
        return self._wake_at_end

    # -- producer side (the engine's loop) -------------------------------------------------------

    def _push(
        self,
        index: int,
        text: str,
        token_ids: list[int],
        finish_reason: FinishReason | None,
        *,
        logprobs: list[Logprobs] | None = None,
        prompt_logprobs: tuple[Logprobs | None, ...] | None = None,
        stop_reason: int | str | None = None,
    ) -> None:
        pending = self._samples[index]
        if text:
            pending.text.append(text)
        pending.token_ids.extend(token_ids)
        if logprobs is not None:
            if pending.logprobs is None:
                pending.logprobs = []
            pending.logprobs.extend(logprobs)
        if prompt_logprobs is not None:
            pending.prompt_logprobs = prompt_logprobs
        if finish_reason is not None:
            pending.finish_reason = finish_reason
            pending.stop_reason = stop_reason
        if not self._wake_at_end or self.finished:
            self._wakeup.set()

    def _push_embedding(self, vector: PooledVector | None, finish_reason: FinishReason) -> None:
        """End an embedding request: its vector (None when it did not get one) and its one chunk."""
        self.embedding = vector
        self._push(0, "", [], finish_reason)

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._wakeup.set()

    @property
    def finished(self) -> bool:
        """True once the engine has ended the request (the consumer may not have read it all)."""
        return self._error is not None or all(p.finish_reason is not None for p in self._samples)

    # -- consumer side ---------------------------------------------------------------------------

    def __aiter__(self) -> RequestStream:
        return self

    def _ready(self) -> int | None:
        count = len(self._samples)
        for offset in range(count):
            index = (self._next + offset) % count
            if self._samples[index].ready:
                self._next = (index + 1) % count
                return index
        return None

    async def __anext__(self) -> StreamChunk:
        if self._closed or all(p.delivered_last for p in self._samples):
            raise StopAsyncIteration
        try:
            # Always a checkpoint, even with output ready: a consumer loop stays cancellable (a
            # timeout around it fires) and cannot starve the event loop, and so the engine.
            await anyio.lowlevel.checkpoint()
            while (index := self._ready()) is None:
                if self._error is not None:
                    self._closed = True
                    raise self._error
                await self._wakeup.wait()
                self._wakeup = anyio.Event()
        except anyio.get_cancelled_exc_class():
            # The consumer was cancelled (its task, a scope, a timeout) while waiting for output:
            # it is not coming back for the rest, so free the request's blocks now rather than
            # whenever the exception's traceback lets go of this stream.
            self._close()
            raise
        return self._samples[index].take(index)

    async def aclose(self) -> None:
        """Stop reading; abort the request if it has not finished. Safe to call more than once."""
        self._close()

    def _close(self) -> None:
        if not self._closed:
            self._closed = True
            if not self.finished:
                self._abort(self.request_id)

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._close()

    def __del__(self) -> None:
        # A `break` out of `async for` just drops the stream; this is how the engine hears of it, once
        # the last reference goes (at once under CPython's reference counting, unless a cycle holds it).
        if not self._closed and not self.finished:
            self._abort(self.request_id)
