"""``RequestStream``: what ``Engine.stream()`` returns.

It is an async iterator and an async context manager, deliberately not an async generator: the
engine pushes deltas into it without ever waiting for the consumer, and a consumer that lags finds
them merged into one chunk (memory stays bounded by the text itself). Leaving it early by any route
(``break``, cancellation, a timeout, ``aclose()``) aborts the request so its KV blocks come back.
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

import anyio

from asyncllm.outputs import FinishReason, Logprobs, StreamChunk


class RequestStream:
    """The live output of one request.

    Iterate it (``async for chunk in stream``) to receive ``StreamChunk`` deltas; the last one has
    ``finished=True``. Use it as ``async with engine.stream(...) as stream:`` to make the abort on
    early exit explicit; a stream dropped mid-way aborts too (when it is garbage collected), and so
    does a cancellation (or timeout) that hits while waiting for the next chunk.
    """

    def __init__(self, request_id: int, prompt_token_ids: list[int], abort: Callable[[int], None]) -> None:
        self.request_id = request_id
        """The engine's id for this request."""
        self.prompt_token_ids = prompt_token_ids
        """The prompt as the model sees it."""
        self._abort = abort
        self._text: list[str] = []
        self._token_ids: list[int] = []
        self._finish_reason: FinishReason | None = None
        self._logprobs: list[Logprobs] | None = None  # a list once the engine sends any
        self._prompt_logprobs: tuple[Logprobs | None, ...] | None = None
        self._stop_reason: int | str | None = None
        self._error: BaseException | None = None
        self._wakeup = anyio.Event()
        self._delivered_last = False  # the consumer has received the final chunk
        self._closed = False

    # -- producer side (the engine's loop) -------------------------------------------------------

    def _push(
        self,
        text: str,
        token_ids: list[int],
        finish_reason: FinishReason | None,
        *,
        logprobs: list[Logprobs] | None = None,
        prompt_logprobs: tuple[Logprobs | None, ...] | None = None,
        stop_reason: int | str | None = None,
    ) -> None:
        if text:
            self._text.append(text)
        self._token_ids.extend(token_ids)
        if logprobs is not None:
            if self._logprobs is None:
                self._logprobs = []
            self._logprobs.extend(logprobs)
        if prompt_logprobs is not None:
            self._prompt_logprobs = prompt_logprobs
        if finish_reason is not None:
            self._finish_reason = finish_reason
            self._stop_reason = stop_reason
        self._wakeup.set()

    def _fail(self, error: BaseException) -> None:
        self._error = error
        self._wakeup.set()

    @property
    def finished(self) -> bool:
        """True once the engine has ended the request (the consumer may not have read it all)."""
        return self._finish_reason is not None or self._error is not None

    # -- consumer side ---------------------------------------------------------------------------

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> StreamChunk:
        if self._delivered_last or self._closed:
            raise StopAsyncIteration
        while not (self._text or self._token_ids or self.finished):
            try:
                await self._wakeup.wait()
            except anyio.get_cancelled_exc_class():
                # The consumer was cancelled (its task, a scope, a timeout) while waiting for output:
                # it is not coming back for the rest, so free the request's blocks now rather than
                # whenever the exception's traceback lets go of this stream.
                self._close()
                raise
            self._wakeup = anyio.Event()
        if self._error is not None and not (self._text or self._token_ids):
            self._delivered_last = True
            raise self._error
        text, ids = "".join(self._text), tuple(self._token_ids)
        self._text.clear()
        self._token_ids.clear()
        logprobs = None
        if self._logprobs is not None:
            logprobs = tuple(self._logprobs)
            self._logprobs.clear()
        prompt_logprobs, self._prompt_logprobs = self._prompt_logprobs, None
        finished = self._finish_reason is not None
        self._delivered_last = finished
        return StreamChunk(
            text,
            ids,
            finished,
            self._finish_reason,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
            stop_reason=self._stop_reason if finished else None,
        )

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
        # A `break` out of `async for` just drops the stream; this is how the engine hears of it.
        if not self._closed and not self.finished:
            self._abort(self.request_id)
