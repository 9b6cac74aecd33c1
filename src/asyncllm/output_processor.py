"""``OutputProcessor``: sampled tokens in, text deltas into each request's stream."""

from __future__ import annotations

from dataclasses import dataclass

from asyncllm.detokenizer import IncrementalDetokenizer, Tokenizer
from asyncllm.scheduler import TokenEvent
from asyncllm.stream import RequestStream


@dataclass(slots=True)
class _Output:
    stream: RequestStream
    detokenizer: IncrementalDetokenizer


class OutputProcessor:
    """Detokenizes each request's new tokens and pushes the deltas to its stream, never waiting.

    Args:
        tokenizer: The model's tokenizer.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._outputs: dict[int, _Output] = {}

    def register(self, request_id: int, stream: RequestStream) -> None:
        """Start routing a request's output to ``stream``."""
        self._outputs[request_id] = _Output(stream, IncrementalDetokenizer(self._tokenizer))

    def process(self, events: list[TokenEvent]) -> None:
        """Deliver one step's events; a finished request's held-back text is flushed and it is forgotten."""
        for event in events:
            output = self._outputs.get(event.request.request_id)
            if output is None:
                continue
            text = output.detokenizer.push(event.new_token_ids)
            if event.finish_reason is not None:
                text += output.detokenizer.flush()
                del self._outputs[event.request.request_id]
            output.stream._push(text, event.new_token_ids, event.finish_reason)

    def fail_all(self, error: BaseException) -> None:
        """End every open stream with ``error``."""
        outputs, self._outputs = self._outputs, {}
        for output in outputs.values():
            output.stream._fail(error)

    @property
    def num_open(self) -> int:
        """Requests whose streams are still fed."""
        return len(self._outputs)
