"""``OutputProcessor``: sampled tokens in, text deltas into each request's stream, metrics stamped.

It also ends requests on stop strings, which only the detokenized text can show. While the end
of the text could still grow into a stop string it is held back, so no chunk ever carries text
that a later match removes; on a match the text is cut before the string (after it with
``include_stop_str_in_output``), the stream gets its last chunk (finish_reason "stop",
``stop_reason`` the string) and ``process`` returns the request so the core ends it in the
scheduler too.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field

from asyncllm.core._request import Request
from asyncllm.core._scheduler import TokenEvent
from asyncllm.engine._detokenizer import IncrementalDetokenizer, Tokenizer
from asyncllm.engine._metrics import EngineMetrics
from asyncllm.engine._stream import RequestStream
from asyncllm.errors import RequestFailedError
from asyncllm.executor._runner import PositionLogprobs
from asyncllm.outputs import FinishReason, Logprobs, TokenLogprob
from asyncllm.sampling_params import SamplingParams

logger = logging.getLogger("asyncllm")


@dataclass(slots=True)
class Delivery:
    """What delivering a step's events left for the core to end in the scheduler."""

    stopped: list[Request] = field(default_factory=list)
    """Requests a stop string ended while the scheduler still runs them: finish them with "stop"."""
    failed: list[Request] = field(default_factory=list)
    """Requests whose output processing failed (their stream already ended with the error): end
    them and the rest of their group with "abort"."""
    num_dropped_tokens: int = 0
    """Tokens of verified drafts after the one that completed a stop string: never delivered, and not
    generated as plain decoding goes (it stops at the match), so not counted as generated."""


@dataclass(slots=True)
class _Output:
    stream: weakref.ref[RequestStream]
    """Weak, so that a consumer dropping its stream (``break``) lets it be collected: that is how
    the engine hears of the abort (``RequestStream.__del__``)."""
    index: int
    """Which of the stream's samples this request is."""
    detokenizer: IncrementalDetokenizer | None = None  # built at the first event, from the request's params
    text_at_end: bool = False
    """Detokenize once, when the request ends: its consumer reads only then and no stop string needs the text."""
    last_token_time: float | None = None
    num_tokens: int = 0
    held: str = ""
    """Text not sent yet because it could be the start of a stop string."""
    tail: str = ""
    """With ``include_stop_str_in_output``: sent text that could be the start of a stop string."""
    prompt_logprobs_sent: bool = False


class OutputProcessor:
    """Detokenizes each request's new tokens and pushes the deltas to its stream, never waiting.

    Args:
        tokenizer: The model's tokenizer.
        metrics: Where latencies and token counts are recorded.
    """

    def __init__(self, tokenizer: Tokenizer, metrics: EngineMetrics | None = None) -> None:
        self._tokenizer = tokenizer
        self.metrics = metrics if metrics is not None else EngineMetrics()
        self._outputs: dict[int, _Output] = {}
        self._token_texts: dict[int, str] = {}  # decoded single tokens, for logprobs

    def register(self, request_id: int, stream: RequestStream, index: int = 0) -> None:
        """Start routing a request's output to ``stream``."""
        self._outputs[request_id] = _Output(weakref.ref(stream), index)

    def process(self, events: list[TokenEvent]) -> Delivery:
        """Deliver one step's events; a finished request's held-back text is flushed and it is forgotten.

        A failure while handling one request's event (its tokenizer raising, say) ends that
        request's stream with ``RequestFailedError`` and touches no other request.

        Returns:
            The requests the caller must still end in the scheduler (see ``Delivery``).
        """
        now = time.monotonic()
        delivery = Delivery()
        for event in events:
            try:
                self._deliver(event, now, delivery)
            except Exception as exc:
                logger.exception("asyncllm: request %d failed in output processing", event.request.request_id)
                error = RequestFailedError(f"request failed while its output was processed: {exc!r}")
                error.__cause__ = exc
                self.fail_one(event.request.request_id, error)
                delivery.failed.append(event.request)
        return delivery

    def fail_one(self, request_id: int, error: BaseException) -> None:
        """End one request's stream with ``error`` (every sample of it: a stream fails as a whole)."""
        output = self._outputs.pop(request_id, None)
        stream = None if output is None else output.stream()
        if stream is not None:
            stream._fail(error)

    def discard(self, request_id: int) -> None:
        """Stop routing a request's output (its stream has already ended)."""
        self._outputs.pop(request_id, None)

    def _deliver(self, event: TokenEvent, now: float, delivery: Delivery) -> None:
        request = event.request
        output = self._outputs.get(request.request_id)
        if output is None:
            return
        if request.pooling is not None:
            self._deliver_embedding(event, output, now)
            return
        params = request.params
        if output.detokenizer is None:
            output.detokenizer = IncrementalDetokenizer(
                self._tokenizer, params.skip_special_tokens, params.spaces_between_special_tokens
            )
            stream = output.stream()
            output.text_at_end = stream is not None and stream.wakes_at_end and not params.stop
        token_ids = event.new_token_ids
        finish_reason: FinishReason | None = event.finish_reason
        stop_reason = request.stop_reason if finish_reason == "stop" else None
        matched = None
        if params.stop and len(token_ids) > 1:
            # Several tokens at once (a verified draft): looked at one by one, so that the tokens after
            # the one that completes a stop string are dropped, as one token per step would have.
            text, matched, kept = _stop_token_by_token(output, params, token_ids, finished=finish_reason is not None)
            delivery.num_dropped_tokens += len(token_ids) - kept
            token_ids = token_ids[:kept]
        else:
            output.num_tokens += len(token_ids)
            if output.text_at_end:
                # Two decodes per token and step are loop time the device waits for; the flush below
                # decodes the whole output once.
                output.detokenizer.defer(token_ids)
                text = ""
            else:
                text = output.detokenizer.push(token_ids)
            if finish_reason is not None:
                text += output.detokenizer.flush()
            if params.stop:
                text, matched = _apply_stop_strings(output, params, text, finished=finish_reason is not None)
        if token_ids:
            self._record_tokens(request, output, len(token_ids), now)
        if matched is not None:
            if finish_reason is None:
                delivery.stopped.append(request)
            finish_reason, stop_reason = "stop", matched
            request.stop_reason = matched
        logprobs = None
        if event.logprobs is not None:
            logprobs = [self._logprobs(entry) for entry in event.logprobs[: len(token_ids)] if entry is not None]
        prompt_logprobs = None
        if event.prompt_logprobs is not None and not output.prompt_logprobs_sent:
            output.prompt_logprobs_sent = True
            prompt_logprobs = tuple(None if e is None else self._logprobs(e) for e in event.prompt_logprobs)
        stream = output.stream()
        if stream is not None and output.index == 0:
            stream.num_cached_tokens = request.num_cached_tokens
        if stream is not None:  # else dropped by its consumer; its abort is on the way
            stream._push(
                output.index,
                text,
                token_ids,
                finish_reason,
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                stop_reason=stop_reason,
            )
        if finish_reason is not None:  # routed until its last chunk is out, so a failure can still end it
            if output.last_token_time is None and finish_reason == "length":
                # Nothing generated (max_tokens=0): its prompt was computed all the same.
                self.metrics.prompt_tokens += len(request.prompt_token_ids)
            del self._outputs[request.request_id]
            self._record_finish(request, finish_reason, now)

    def _deliver_embedding(self, event: TokenEvent, output: _Output, now: float) -> None:
        # An embedding request has one event, the one that ends it: no text, no tokens.
        if event.finish_reason is None:
            return
        request = event.request
        stream = output.stream()
        if stream is not None:
            stream._push_embedding(event.embedding, event.finish_reason)
        del self._outputs[request.request_id]
        if event.embedding is not None:
            self.metrics.prompt_tokens += len(request.prompt_token_ids)
        self._record_finish(request, event.finish_reason, now)

    def _token_text(self, token_id: int) -> str:
        text = self._token_texts.get(token_id)
        if text is None:
            text = self._token_texts[token_id] = self._tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def _logprobs(self, entry: PositionLogprobs) -> Logprobs:
        token = TokenLogprob(entry.token_id, entry.logprob, entry.rank, self._token_text(entry.token_id))
        top = tuple(
            TokenLogprob(token_id, logprob, rank, self._token_text(token_id))
            for rank, (token_id, logprob) in enumerate(zip(entry.top_token_ids, entry.top_logprobs), start=1)
        )
        return Logprobs(token, top)

    def _record_tokens(self, request: Request, output: _Output, count: int, now: float) -> None:
        metrics = self.metrics
        metrics.generation_tokens += count
        if output.last_token_time is None:
            metrics.time_to_first_token.observe(now - request.arrival_time)
            metrics.prompt_tokens += len(request.prompt_token_ids)
            count -= 1
        else:
            metrics.inter_token_latency.observe((now - output.last_token_time) / count, count)
        output.last_token_time = now

    def _record_finish(self, request: Request, reason: str, now: float) -> None:
        metrics = self.metrics
        metrics.e2e_latency.observe(now - request.arrival_time)
        if request.first_scheduled_time is not None:
            metrics.queue_time.observe(request.first_scheduled_time - request.arrival_time)
        metrics.finished_requests[reason] += 1

    def fail_all(self, error: BaseException) -> None:
        """End every open stream with ``error``."""
        outputs, self._outputs = self._outputs, {}
        for output in outputs.values():
            stream = output.stream()
            if stream is not None:
                stream._fail(error)

    @property
    def num_open(self) -> int:
        """Requests whose streams are still fed."""
        return len(self._outputs)


def _stop_token_by_token(
    output: _Output, params: SamplingParams, token_ids: list[int], *, finished: bool
) -> tuple[str, str | None, int]:
    """Decode and search for stop strings one token at a time; return the text to send, the match, and
    how many tokens to keep (up to the one whose text completes the match)."""
    assert output.detokenizer is not None
    sent = ""
    for index, token_id in enumerate(token_ids):
        last = index == len(token_ids) - 1
        output.num_tokens += 1
        text = output.detokenizer.push([token_id])
        if last and finished:
            text += output.detokenizer.flush()
        text, matched = _apply_stop_strings(output, params, text, finished=last and finished)
        sent += text
        if matched is not None:
            return sent, matched, index + 1
    return sent, None, len(token_ids)


def _apply_stop_strings(
    output: _Output, params: SamplingParams, text: str, *, finished: bool
) -> tuple[str, str | None]:
    """Look for the stop strings in the text not yet searched; return the text to send and the match.

    A match can only begin in the text held back (or, with ``include_stop_str_in_output``, in the
    sent ``tail``) or in the new text: any earlier start would have been held back or kept as tail.
    """
    if output.num_tokens < params.min_tokens:
        return text, None  # stop strings count only once min_tokens are out
    window = output.tail + output.held + text
    sent = len(output.tail)  # the window's first `sent` characters already went out
    output.tail = output.held = ""
    match: tuple[int, str] | None = None
    for stop in params.stop:
        index = window.find(stop)
        if index >= 0 and (match is None or index < match[0]):
            match = (index, stop)
    if match is not None:
        index, stop = match
        end = index + len(stop) if params.include_stop_str_in_output else index
        return window[sent:end], stop
    if finished:
        return window[sent:], None
    partial = _partial_stop_length(window, params.stop)
    if params.include_stop_str_in_output:
        # The stop string will stay in the text, so nothing needs holding back; only remember the
        # end of the text to find a string that straddles two steps.
        output.tail = window[len(window) - partial :] if partial else ""
        return window[sent:], None
    output.held = window[len(window) - partial :] if partial else ""
    return window[: len(window) - partial], None


def _partial_stop_length(text: str, stops: Sequence[str]) -> int:
    """The length of the longest end of ``text`` that begins one of ``stops`` (without being all of it)."""
    best = 0
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:length]):
                best = length
                break
    return best
