"""``SamplingParams``: how one request samples, validated when it is built."""

from __future__ import annotations

import msgspec

from asyncllm.errors import InvalidSamplingParamsError


def _check_int(name: str, value: object, *, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    # bool is an int subclass; True as max_tokens is a bug, not a request for one token.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSamplingParamsError(f"{name} must be an int, got {value!r}")
    if value < minimum:
        raise InvalidSamplingParamsError(f"{name} must be >= {minimum}, got {value}")


def _check_float(name: str, value: object, *, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidSamplingParamsError(f"{name} must be a number, got {value!r}")
    below = value <= low if low_open else value < low
    if below or value > high or value != value:  # value != value catches NaN
        bracket = "(" if low_open else "["
        raise InvalidSamplingParamsError(f"{name} must be in {bracket}{low}, {high}], got {value}")


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to sample one request. Immutable; every field is checked at construction.

    Attributes:
        max_tokens: The most tokens to generate (>= 1).
        temperature: 0 means greedy (argmax); higher flattens the distribution.
        top_k: Keep only the k most likely tokens; 0 or -1 disables the filter.
        top_p: Keep the smallest set of tokens whose probability reaches top_p (0 < top_p <= 1).
        seed: Seeds this request's own random generator, so its tokens do not depend on what else
            is in the batch.
        stop_token_ids: Token ids that end the request (finish_reason "stop"), besides EOS.
        ignore_eos: Keep generating past the model's end-of-sequence token.

    Raises:
        InvalidSamplingParamsError: A field is out of range or of the wrong type; the message
            names the field.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        _check_int("max_tokens", self.max_tokens, minimum=1)
        _check_float("temperature", self.temperature, low=0.0, high=100.0)
        _check_int("top_k", self.top_k, minimum=-1)
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_int("seed", self.seed, minimum=0, allow_none=True)
        if not isinstance(self.stop_token_ids, (tuple, list)):
            raise InvalidSamplingParamsError(f"stop_token_ids must be a sequence of ints, got {self.stop_token_ids!r}")
        for token_id in self.stop_token_ids:
            _check_int("stop_token_ids[...]", token_id, minimum=0)
        if not isinstance(self.ignore_eos, bool):
            raise InvalidSamplingParamsError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax at every step."""
        return self.temperature == 0.0 or self.top_k == 1
