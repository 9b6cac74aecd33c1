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

from asyncllm.outputs import FinishReason, StreamChunk


class RequestStream:
    """The live output of one request.

    Iterate it (``async for chunk in stream``) to receive ``StreamChunk`` deltas; the last one has
    ``finished=True``. Use it as ``async with engine.stream(...) as stream:`` to make the abort on
    early exit explicit; a stream dropped mid-way aborts too (when it is garbage collected).
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
        self._error: BaseException | None = None
        self._wakeup = anyio.Event()
        self._delivered_last = False  # the consumer has received the final chunk
        self._closed = False

    # -- producer side (the engine's loop) -------------------------------------------------------

    def _push(self, text: str, token_ids: list[int], finish_reason: FinishReason | None) -> None:
        if text:
            self._text.append(text)
        self._token_ids.extend(token_ids)
        if finish_reason is not None:
            self._finish_reason = finish_reason
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
            await self._wakeup.wait()
            self._wakeup = anyio.Event()
        if self._error is not None and not (self._text or self._token_ids):
            self._delivered_last = True
            raise self._error
        text, ids = "".join(self._text), tuple(self._token_ids)
        self._text.clear()
        self._token_ids.clear()
        finished = self._finish_reason is not None
        self._delivered_last = finished
        return StreamChunk(text, ids, finished, self._finish_reason)

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
