"""``OutputProcessor``: sampled tokens in, text deltas into each request's stream, metrics stamped."""

from __future__ import annotations

import time
from dataclasses import dataclass

from asyncllm.detokenizer import IncrementalDetokenizer, Tokenizer
from asyncllm.metrics import EngineMetrics
from asyncllm.request import Request
from asyncllm.scheduler import TokenEvent
from asyncllm.stream import RequestStream


@dataclass(slots=True)
class _Output:
    stream: RequestStream
    detokenizer: IncrementalDetokenizer
    last_token_time: float | None = None


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

    def register(self, request_id: int, stream: RequestStream) -> None:
        """Start routing a request's output to ``stream``."""
        self._outputs[request_id] = _Output(stream, IncrementalDetokenizer(self._tokenizer))

    def process(self, events: list[TokenEvent]) -> None:
        """Deliver one step's events; a finished request's held-back text is flushed and it is forgotten."""
        now = time.monotonic()
        for event in events:
            output = self._outputs.get(event.request.request_id)
            if output is None:
                continue
            if event.new_token_ids:
                self._record_tokens(event.request, output, len(event.new_token_ids), now)
            text = output.detokenizer.push(event.new_token_ids)
            if event.finish_reason is not None:
                text += output.detokenizer.flush()
                del self._outputs[event.request.request_id]
                self._record_finish(event.request, event.finish_reason, now)
            output.stream._push(text, event.new_token_ids, event.finish_reason)

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
            output.stream._fail(error)

    @property
    def num_open(self) -> int:
        """Requests whose streams are still fed."""
        return len(self._outputs)
