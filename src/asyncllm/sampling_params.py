"""``SamplingParams``: how one request samples, validated when it is built."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any

import msgspec

from asyncllm.errors import InvalidRequestError, InvalidSamplingParamsError

MAX_N = 64
"""The most samples one request may ask for."""

MAX_SEED = 2**64 - 1
"""The largest seed: torch's generators take unsigned 64-bit seeds (sample i of n uses ``seed + i``)."""

GREEDY_BELOW_TEMPERATURE = 1e-5
"""Temperatures below this sample greedily, as 0 does. A draw at such a temperature differs from the
argmax only between logits closer than about 1e-4 (the odds against a token are ``exp(gap / T)``),
and dividing float32 logits by a temperature below about 1e-37 overflows to inf, which would make
every draw token 0. vLLM treats temperatures below the same value as greedy."""

MIN_REPETITION_PENALTY = 1e-6
"""The smallest ``repetition_penalty``: dividing float32 logits by a much smaller one overflows to inf."""


def utf8_size(field: str, text: str, error: type[InvalidRequestError], *, param: str) -> int:
    """The size of ``text`` in UTF-8 bytes.

    Python strings may hold lone surrogates (``"\\ud800"``), which no UTF-8 text can: a tokenizer,
    a hash or a JSON response would fail on them later, so they are refused here, at the call.

    Args:
        field: The field's name in the message (``"stop[2]"``).
        text: The text.
        error: The error to raise.
        param: The request field at fault, for ``error.param``.

    Raises:
        InvalidRequestError: ``error``, when ``text`` holds a lone surrogate.
    """
    try:
        return len(text.encode("utf-8"))
    except UnicodeEncodeError as exc:
        raise error(
            f"{field} is not valid UTF-8 text: it holds the lone surrogate {text[exc.start]!r} at index {exc.start}",
            param=param,
        ) from None


def _param(name: str) -> str:
    # "allowed_token_ids[...]" and "logit_bias key" are about the field before the bracket or space.
    return name.split("[", 1)[0].split(" ", 1)[0]


def _check_int(name: str, value: object, *, minimum: int, allow_none: bool = False) -> None:
    if value is None and allow_none:
        return
    # bool is an int subclass; True as max_tokens is a bug, not a request for one token.
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidSamplingParamsError(f"{name} must be an int, got {value!r}", param=_param(name))
    if value < minimum:
        raise InvalidSamplingParamsError(f"{name} must be >= {minimum}, got {value}", param=_param(name))


def _check_float(name: str, value: object, *, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidSamplingParamsError(f"{name} must be a number, got {value!r}", param=name)
    below = value <= low if low_open else value < low
    if below or value > high or value != value:  # value != value catches NaN
        bracket = "(" if low_open else "["
        raise InvalidSamplingParamsError(f"{name} must be in {bracket}{low}, {high}], got {value}", param=name)


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidSamplingParamsError(f"{name} must be a bool, got {value!r}", param=name)


def _as_tuple(name: str, value: object, item: str) -> tuple[object, ...]:
    # Lists are accepted for convenience (and from JSON) but stored as tuples: the params are immutable.
    if isinstance(value, (str, bytes)) or not isinstance(value, (tuple, list)):
        raise InvalidSamplingParamsError(f"{name} must be a sequence of {item}, got {value!r}", param=name)
    return tuple(value)


_STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "lark", "ebnf")


class StructuredOutput(msgspec.Struct, frozen=True, kw_only=True):
    """Constrains a request's output to a language: give exactly one of the fields.

    The engine compiles it into a grammar once (compiled grammars are cached, keyed by this value) and
    masks, at every step, the tokens that would leave the language. When the language allows the output
    to end, the model's end-of-sequence token becomes possible; once nothing else is, the request ends
    with finish_reason "stop". A request cut off by ``max_tokens`` (finish_reason "length") or by a
    ``stop`` string may hold an incomplete document.

    Attributes:
        json_schema: A JSON Schema (a dict, True for any value, or its JSON text; False, which allows
            nothing, is refused): the output is one JSON value that validates against it, written
            compactly (``", "`` and ``": "`` as separators, no other whitespace). ``$ref``/``$defs``,
            ``anyOf``/``oneOf``/``allOf``, enums, patterns, formats, bounds and ``additionalProperties``
            are supported; a keyword the grammar engine cannot enforce is refused rather than ignored.
        json_object: True for any JSON object (OpenAI's JSON mode).
        regex: A regular expression the whole output matches (Rust ``regex`` syntax, anchored).
        choice: The output is exactly one of these strings.
        lark: A context-free grammar in Lark syntax (llguidance's dialect: ``start`` is the top rule,
            terminals may be regexes, ``%json {...}`` embeds a JSON Schema).
        ebnf: A context-free grammar in GBNF (llama.cpp's EBNF; ``root`` is the top rule).
        lenient: With ``json_schema`` only: ignore the keywords the grammar engine cannot enforce
            (``dependencies``, unknown ``format`` values, ``if``/``then``/``else``, ...) and treat a
            ``oneOf`` whose branches may overlap as ``anyOf``, instead of refusing the schema. The
            output then follows every other keyword, and may break the ignored ones (False: refuse).

    Raises:
        InvalidSamplingParamsError: Not exactly one field is set, or a field has the wrong type. Whether
            the schema, regex or grammar compiles is checked by the engine, which raises
            ``StructuredOutputError`` (a subclass).
    """

    json_schema: dict[str, Any] | bool | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    lark: str | None = None
    ebnf: str | None = None
    lenient: bool = False

    def __post_init__(self) -> None:
        given = self._given()
        if len(given) != 1:
            raise InvalidSamplingParamsError(
                "structured_output must set exactly one of json_schema, json_object, regex, choice, lark, ebnf; "
                f"got {', '.join(given) if given else 'none'}",
                param="structured_output",
            )
        schema = self.json_schema
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError as exc:
                raise InvalidSamplingParamsError(
                    f"structured_output.json_schema is not valid JSON: {exc}", param="structured_output"
                ) from None
            msgspec.structs.force_setattr(self, "json_schema", schema)
        if self.json_schema is False:
            raise InvalidSamplingParamsError(
                "structured_output.json_schema is false: that schema allows no output", param="structured_output"
            )
        if self.json_schema is not None and not isinstance(self.json_schema, (dict, bool)):
            raise InvalidSamplingParamsError(
                f"structured_output.json_schema must be a JSON Schema (an object or a bool), got {schema!r}",
                param="structured_output",
            )
        if isinstance(self.json_schema, dict):
            # As JSON: the grammar engine reads it so, and the cache key must be that of the JSON.
            try:
                as_json = json.loads(json.dumps(self.json_schema, allow_nan=False))
            except (TypeError, ValueError) as exc:
                raise InvalidSamplingParamsError(
                    f"structured_output.json_schema is not JSON: {exc}", param="structured_output"
                ) from None
            msgspec.structs.force_setattr(self, "json_schema", as_json)
        _check_bool("structured_output.json_object", self.json_object)
        _check_bool("structured_output.lenient", self.lenient)
        if self.lenient and self.json_schema is None:
            raise InvalidSamplingParamsError(
                "structured_output.lenient applies to json_schema only", param="structured_output"
            )
        for name in ("regex", "lark", "ebnf"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, str) or not value:
                    raise InvalidSamplingParamsError(
                        f"structured_output.{name} must be a non-empty str, got {value!r}", param="structured_output"
                    )
                utf8_size(f"structured_output.{name}", value, InvalidSamplingParamsError, param="structured_output")
        if self.choice is not None:
            choice = _as_tuple("structured_output.choice", self.choice, "strings")
            if not choice or not all(isinstance(c, str) and c for c in choice):
                raise InvalidSamplingParamsError(
                    f"structured_output.choice must be a non-empty list of non-empty strings, got {self.choice!r}",
                    param="structured_output",
                )
            for index, string in enumerate(choice):
                assert isinstance(string, str)  # checked above
                utf8_size(
                    f"structured_output.choice[{index}]", string, InvalidSamplingParamsError, param="structured_output"
                )
            msgspec.structs.force_setattr(self, "choice", choice)

    @property
    def kind(self) -> str:
        """The field that is set (``"json_schema"``, ``"regex"``, ...)."""
        return self._given()[0]

    def _given(self) -> list[str]:
        # json_object's unset value is False; every other field's is None (json_schema=False is a
        # schema, refused in __post_init__, not an unset field that lets another kind pass).
        return [
            name
            for name in _STRUCTURED_KINDS
            if (self.json_object is not False if name == "json_object" else getattr(self, name) is not None)
        ]

    def cache_key(self) -> bytes:
        """The value as canonical JSON (sorted keys): equal constraints share one compiled grammar."""
        return msgspec.json.encode(msgspec.structs.asdict(self), order="sorted")


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True):
    """How to sample one request. Immutable; every field is checked at construction.

    The logits of a step go through these stages, in this order (as in vLLM): ``allowed_token_ids``,
    ``bad_words``, ``min_tokens`` and ``logit_bias``; then the penalties; then greedy argmax, or
    ``temperature``, ``min_p``, ``top_k``/``top_p`` and a random draw. ``logprobs`` and
    ``prompt_logprobs`` are computed from the model's raw logits, before all of that.

    Attributes:
        n: How many independent samples of the prompt to generate (1-64). The prompt's full KV
            blocks are computed once and shared; with a seed, sample i uses ``seed + i``.
        max_tokens: The most tokens to generate (>= 0). 0 computes the prompt alone (its
            ``prompt_logprobs``, if asked, as lm-evaluation-harness's loglikelihood needs) and generates
            nothing: the request finishes with finish_reason "length" in the step that completes its
            prompt, which may then be as long as ``max_model_len``.
        min_tokens: Generate at least this many tokens before EOS or a ``stop_token_ids`` id may be
            sampled (they are masked out until then), and before ``stop`` strings are looked for.
        temperature: 0 means greedy (argmax), and so does any temperature below 1e-5
            (``GREEDY_BELOW_TEMPERATURE``); higher flattens the distribution.
        top_k: Keep only the k most likely tokens; 0 or -1 disables the filter.
        top_p: Keep the smallest set of tokens whose probability reaches top_p (0 < top_p <= 1).
        min_p: Drop tokens whose probability is below ``min_p`` times the most likely token's (0 disables).
        repetition_penalty: As in HF transformers: the logit of every token already in the prompt or the
            output is divided by it when positive and multiplied by it when negative (1 disables); in
            [1e-6, 100].
        presence_penalty: As in the OpenAI API: subtracted once from the logit of every token already
            generated (prompt excluded); in [-2, 2].
        frequency_penalty: As in the OpenAI API: subtracted from a token's logit once per time it was
            generated (prompt excluded); in [-2, 2].
        logit_bias: Token id to a value in [-100, 100] added to its logit (+100 all but forces it).
        allowed_token_ids: Only these ids may be sampled (None: any).
        bad_words: Words never generated. Each is tokenized alone and after a space; a one-token word is
            masked out always, a longer one when the output so far ends with all but its last token.
        stop: Strings that end the request (finish_reason "stop", ``stop_reason`` the string); the text
            ends before the string unless ``include_stop_str_in_output``. While the end of the text could
            still become one of them, it is held back from the stream. Stop strings and bad words must
            be valid UTF-8 text (no lone surrogates).
        stop_token_ids: Token ids that end the request (finish_reason "stop"), besides EOS.
        include_stop_str_in_output: Keep the matched stop string at the end of the text.
        ignore_eos: Keep generating past the model's end-of-sequence token.
        seed: Seeds this request's own random generator, so its tokens do not depend on what else
            is in the batch; in [0, 2**64 - n] (sample i uses ``seed + i``, a 64-bit seed).
        logprobs: Return, for each generated token, its log-probability and rank, and the ``logprobs``
            most likely alternatives (0: the chosen token only; None: nothing).
        prompt_logprobs: The same for each prompt token after the first (None: nothing).
        skip_special_tokens: Leave special tokens (EOS, chat markers) out of the text.
        spaces_between_special_tokens: With ``skip_special_tokens=False``, put a space between a special
            token and the text around it (as HF's slow tokenizers and vLLM do).
        structured_output: Constrain the output to a JSON Schema, JSON, a regex, a choice or a grammar
            (a ``StructuredOutput``, or a mapping of its fields); see ``StructuredOutput``. The grammar's
            mask comes after ``allowed_token_ids``, bad words and ``logit_bias``; where they leave no token
            the grammar allows, the grammar's mask alone applies. ``logprobs`` stay those of the raw
            distribution. Not with ``ignore_eos``: the grammar ends the output with EOS.
        num_speculative_tokens: With an engine opened with ``speculative_method``, the most draft
            tokens this request may carry per step (0: this request never drafts; None: the engine's
            ``num_speculative_tokens``). Outputs follow the same distribution either way (greedy ones
            are the same tokens); only the speed differs. More than the engine's
            ``num_speculative_tokens`` is an error at the call.

    Raises:
        InvalidSamplingParamsError: A field is out of range or of the wrong type; the message
            names the field.
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: tuple[int, ...] | None = None
    bad_words: tuple[str, ...] = ()
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    structured_output: StructuredOutput | None = None
    num_speculative_tokens: int | None = None

    def __post_init__(self) -> None:
        _check_int("n", self.n, minimum=1)
        if self.n > MAX_N:
            raise InvalidSamplingParamsError(f"n must be <= {MAX_N}, got {self.n}", param="n")
        _check_int("max_tokens", self.max_tokens, minimum=0)
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_tokens:
            raise InvalidSamplingParamsError(
                f"min_tokens must be <= max_tokens, got min_tokens={self.min_tokens} > max_tokens={self.max_tokens}",
                param="min_tokens",
            )
        _check_float("temperature", self.temperature, low=0.0, high=100.0)
        _check_int("top_k", self.top_k, minimum=-1)
        _check_float("top_p", self.top_p, low=0.0, high=1.0, low_open=True)
        _check_float("min_p", self.min_p, low=0.0, high=1.0)
        _check_float("repetition_penalty", self.repetition_penalty, low=MIN_REPETITION_PENALTY, high=100.0)
        _check_float("presence_penalty", self.presence_penalty, low=-2.0, high=2.0)
        _check_float("frequency_penalty", self.frequency_penalty, low=-2.0, high=2.0)
        self._check_logit_bias()
        if self.allowed_token_ids is not None:
            allowed = _as_tuple("allowed_token_ids", self.allowed_token_ids, "token ids")
            if not allowed:
                raise InvalidSamplingParamsError(
                    "allowed_token_ids must not be empty (None allows every token)", param="allowed_token_ids"
                )
            for token_id in allowed:
                _check_int("allowed_token_ids[...]", token_id, minimum=0)
            msgspec.structs.force_setattr(self, "allowed_token_ids", allowed)
        for name in ("bad_words", "stop"):
            value = getattr(self, name)
            if isinstance(value, str):  # stop="###" means one string, not three characters
                value = (value,)
            strings = _as_tuple(name, value, "strings")
            for index, string in enumerate(strings):
                if not isinstance(string, str) or not string:
                    raise InvalidSamplingParamsError(f"{name} must hold non-empty strings, got {string!r}", param=name)
                utf8_size(f"{name}[{index}]", string, InvalidSamplingParamsError, param=name)
            msgspec.structs.force_setattr(self, name, strings)
        stop_ids = _as_tuple("stop_token_ids", self.stop_token_ids, "ints")
        for token_id in stop_ids:
            _check_int("stop_token_ids[...]", token_id, minimum=0)
        msgspec.structs.force_setattr(self, "stop_token_ids", stop_ids)
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens"):
            _check_bool(name, getattr(self, name))
        _check_bool("spaces_between_special_tokens", self.spaces_between_special_tokens)
        _check_int("seed", self.seed, minimum=0, allow_none=True)
        if self.seed is not None and self.seed > MAX_SEED - (self.n - 1):
            # Sample i uses seed + i, and every one must fit torch's 64-bit generator seed.
            raise InvalidSamplingParamsError(
                f"seed must be <= 2**64 - n = {MAX_SEED - (self.n - 1)} (a 64-bit seed; sample i of n uses seed + i), "
                f"got {self.seed}",
                param="seed",
            )
        _check_int("logprobs", self.logprobs, minimum=0, allow_none=True)
        _check_int("prompt_logprobs", self.prompt_logprobs, minimum=0, allow_none=True)
        _check_int("num_speculative_tokens", self.num_speculative_tokens, minimum=0, allow_none=True)
        self._check_structured_output()

    def _check_structured_output(self) -> None:
        spec: object = self.structured_output
        if spec is None:
            return
        if isinstance(spec, Mapping):
            unknown = sorted(str(key) for key in spec if key not in StructuredOutput.__struct_fields__)
            if unknown:
                raise InvalidSamplingParamsError(
                    f"unknown structured_output field(s): {', '.join(unknown)}", param="structured_output"
                )
            spec = StructuredOutput(**spec)
            msgspec.structs.force_setattr(self, "structured_output", spec)
        if not isinstance(spec, StructuredOutput):
            raise InvalidSamplingParamsError(
                f"structured_output must be a StructuredOutput or a mapping of its fields, got {spec!r}",
                param="structured_output",
            )
        if self.ignore_eos:
            raise InvalidSamplingParamsError(
                "ignore_eos cannot be combined with structured_output: the grammar ends the output with EOS",
                param="ignore_eos",
            )

    def _check_logit_bias(self) -> None:
        if self.logit_bias is None:
            return
        if not isinstance(self.logit_bias, dict):
            raise InvalidSamplingParamsError(
                f"logit_bias must be a dict of token id to bias, got {self.logit_bias!r}", param="logit_bias"
            )
        for token_id, bias in self.logit_bias.items():
            _check_int("logit_bias key", token_id, minimum=0)
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
                raise InvalidSamplingParamsError(
                    f"logit_bias[{token_id}] must be a finite number, got {bias!r}", param="logit_bias"
                )
            if not -100.0 <= bias <= 100.0:
                raise InvalidSamplingParamsError(
                    f"logit_bias[{token_id}] must be in [-100, 100], got {bias}", param="logit_bias"
                )

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax at every step (``temperature`` below
        ``GREEDY_BELOW_TEMPERATURE``, or ``top_k`` 1)."""
        return self.temperature < GREEDY_BELOW_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """True when a repetition, presence or frequency penalty is set."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
