"""``SamplingParams`` checks every field at construction and names the field when it refuses one."""

from __future__ import annotations

from typing import Any

import msgspec
import pytest

from asyncllm import InvalidSamplingParamsError, SamplingParams
from asyncllm.engine._input_processor import InputProcessor
from asyncllm.testing import ByteTokenizer


def test_defaults_are_valid_and_match_vllm() -> None:
    params = SamplingParams()
    assert params.max_tokens == 16 and params.min_tokens == 0
    assert (params.temperature, params.top_k, params.top_p, params.min_p) == (1.0, 0, 1.0, 0.0)
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty) == (1.0, 0.0, 0.0)
    assert params.logit_bias is None and params.allowed_token_ids is None
    assert params.bad_words == params.stop == params.stop_token_ids == ()
    assert params.logprobs is None and params.prompt_logprobs is None
    assert params.skip_special_tokens and params.spaces_between_special_tokens
    assert not (params.include_stop_str_in_output or params.ignore_eos or params.greedy or params.has_penalties)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", -1),
        ("max_tokens", 1.5),
        ("max_tokens", True),
        ("min_tokens", -1),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", "hot"),
        ("top_k", -2),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("presence_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("frequency_penalty", 3),
        ("frequency_penalty", float("nan")),
        ("logit_bias", [(1, 2.0)]),
        ("allowed_token_ids", ()),
        ("allowed_token_ids", 5),
        ("allowed_token_ids", (1, -1)),
        ("bad_words", ("",)),
        ("bad_words", (1,)),
        ("stop", ("ok", "")),
        ("stop", 7),
        ("stop_token_ids", (1, "2")),
        ("stop_token_ids", "12"),
        ("include_stop_str_in_output", 1),
        ("ignore_eos", "yes"),
        ("seed", -1),
        ("logprobs", -1),
        ("logprobs", 2.0),
        ("prompt_logprobs", -3),
        ("skip_special_tokens", None),
        ("spaces_between_special_tokens", 0),
    ],
)
def test_bad_values_raise_naming_the_field(field: str, value: Any) -> None:
    with pytest.raises(InvalidSamplingParamsError, match=field):
        SamplingParams(**{field: value})


@pytest.mark.parametrize(
    ("bias", "message"),
    [
        ({-1: 1.0}, "logit_bias key"),
        ({"5": 1.0}, "logit_bias key"),
        ({5: 101.0}, r"logit_bias\[5\] must be in \[-100, 100\]"),
        ({5: float("inf")}, r"logit_bias\[5\] must be a finite number"),
        ({5: "up"}, r"logit_bias\[5\]"),
    ],
)
def test_logit_bias_is_checked_entry_by_entry(bias: dict[Any, Any], message: str) -> None:
    with pytest.raises(InvalidSamplingParamsError, match=message):
        SamplingParams(logit_bias=bias)


def test_min_tokens_may_not_exceed_max_tokens() -> None:
    with pytest.raises(InvalidSamplingParamsError, match="min_tokens must be <= max_tokens"):
        SamplingParams(max_tokens=4, min_tokens=5)
    assert SamplingParams(max_tokens=4, min_tokens=4).min_tokens == 4


def test_sequences_are_stored_as_tuples_and_a_lone_string_is_one_string() -> None:
    params = SamplingParams(
        stop="###",  # type: ignore[arg-type]
        bad_words=["bad", "worse"],  # type: ignore[arg-type]
        stop_token_ids=[3, 4],  # type: ignore[arg-type]
        allowed_token_ids=[7, 8],  # type: ignore[arg-type]
    )
    assert params.stop == ("###",)
    assert params.bad_words == ("bad", "worse")
    assert params.stop_token_ids == (3, 4)
    assert params.allowed_token_ids == (7, 8)


def test_params_are_immutable_and_round_trip_through_json() -> None:
    params = SamplingParams(
        temperature=0.5, logit_bias={5: -3.0}, stop=("a",), logprobs=2, repetition_penalty=1.2, seed=3
    )
    with pytest.raises(AttributeError):
        params.temperature = 1.0  # type: ignore[misc]
    decoded = msgspec.json.decode(msgspec.json.encode(params), type=SamplingParams)
    assert decoded == params
    with pytest.raises(msgspec.ValidationError, match="presence_penalty"):
        msgspec.json.decode(b'{"presence_penalty": 9}', type=SamplingParams)


def test_greedy_and_has_penalties() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(top_k=1).greedy
    assert not SamplingParams(top_k=2).greedy
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert SamplingParams(presence_penalty=-0.5).has_penalties
    assert SamplingParams(frequency_penalty=0.5).has_penalties


def _inputs() -> InputProcessor:
    return InputProcessor(ByteTokenizer(), vocab_size=257, max_model_len=512, eos_token_ids=frozenset({256}))


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (SamplingParams(stop_token_ids=(300,)), "stop_token_ids"),
        (SamplingParams(logit_bias={257: 1.0}), "logit_bias"),
        (SamplingParams(allowed_token_ids=(1, 999)), "allowed_token_ids"),
        (SamplingParams(logprobs=258), "logprobs"),
        (SamplingParams(prompt_logprobs=1000), "prompt_logprobs"),
    ],
)
def test_ids_beyond_the_vocabulary_are_refused_at_the_call(params: SamplingParams, field: str) -> None:
    with pytest.raises(InvalidSamplingParamsError, match=field):
        _inputs().process("hi", params)


def test_bad_words_are_tokenized_alone_and_after_a_space() -> None:
    request = _inputs().process("hi", SamplingParams(bad_words=("ab", " ab", "c")))
    assert request.bad_words_token_ids == ((97, 98), (32, 97, 98), (99,), (32, 99))
