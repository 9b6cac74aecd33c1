"""Review of tool calling: schemas with references, adversarial streamed replies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from asyncllm.engine._tools import (
    ToolCallParser,
    ToolFormat,
    generic_messages,
    native_messages,
    parse_tool_calls,
    plan_tools,
)

# As pydantic writes a model with a nested one: the definitions at the top, referenced from the root.
UNIT_REF = {
    "type": "object",
    "$defs": {"Unit": {"enum": ["C", "F"]}},
    "properties": {"unit": {"$ref": "#/$defs/Unit"}, "next": {"anyOf": [{"$ref": "#"}, {"type": "null"}]}},
    "required": ["unit"],
    "additionalProperties": False,
}
REF_TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "set_unit", "parameters": UNIT_REF}},
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]


def _accepts(tokenizer: PreTrainedTokenizerFast, grammar: str, text: str) -> bool:
    import llguidance
    import llguidance.hf

    compiled = llguidance.LLMatcher.grammar_from_lark(grammar)
    lltokenizer = llguidance.hf.from_tokenizer(tokenizer)
    assert llguidance.LLMatcher.validate_grammar(compiled, lltokenizer) == ""
    matcher = llguidance.LLMatcher(lltokenizer, compiled)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return bool(matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting())


@pytest.mark.parametrize("fmt", list(ToolFormat))
@pytest.mark.parametrize("tools", [REF_TOOLS[:1], REF_TOOLS])
def test_a_schema_with_references_is_enforced(asyncllm_model_path: Path, fmt: ToolFormat, tools: Any) -> None:
    tokenizer: PreTrainedTokenizerFast = AutoTokenizer.from_pretrained(asyncllm_model_path)
    key = "parameters" if fmt is ToolFormat.LLAMA3 else "arguments"
    wrap = {
        ToolFormat.HERMES: lambda b: f"<tool_call>\n{b}\n</tool_call>",
        ToolFormat.GENERIC: lambda b: f"<tool_call>{b}</tool_call>",
        ToolFormat.LLAMA3: lambda b: b,
    }[fmt]
    plan = plan_tools(tools, "required", True, lambda: fmt)
    assert plan is not None
    grammar = plan.grammar()
    assert grammar is not None
    good = {"unit": "C", "next": {"unit": "F", "next": None}}
    assert _accepts(tokenizer, grammar, wrap(json.dumps({"name": "set_unit", key: good})))
    assert not _accepts(tokenizer, grammar, wrap(json.dumps({"name": "set_unit", key: {"unit": "K"}})))
    assert not _accepts(tokenizer, grammar, wrap(json.dumps({"name": "set_unit", key: {"unit": "C", "next": {}}})))


def _stream(fmt: ToolFormat, text: str, size: int) -> tuple[str, list[tuple[str, str]]]:
    """Feed ``text`` in pieces of ``size`` characters; reassemble content and calls as an OpenAI client does."""
    parser = ToolCallParser(fmt)
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    results = [parser.feed(text[i : i + size]) for i in range(0, len(text), size)] + [parser.finish()]
    for out, deltas in results:
        content.append(out)
        for delta in deltas:
            if delta.id is not None:
                calls[delta.index] = [delta.name or "", ""]
            calls[delta.index][1] += delta.arguments
    return "".join(content), [(name, args) for name, args in (calls[i] for i in sorted(calls))]


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
@pytest.mark.parametrize(
    "text",
    [
        # A call object with a key after its arguments (an unconstrained model may add one).
        '<tool_call>{"name": "f", "arguments": {"a":1}, "id": "x"}</tool_call>',
        '<tool_call>{"name": "f", "arguments": {"a": {"b": "}"}}, "id": "x"}</tool_call>',
    ],
)
def test_streamed_arguments_stop_at_their_object(text: str, size: int) -> None:
    _, whole = parse_tool_calls(text, ToolFormat.HERMES)
    _, streamed = _stream(ToolFormat.HERMES, text, size)
    assert [(name, json.loads(args)) for name, args in streamed] == [(c.name, json.loads(c.arguments)) for c in whole]


@pytest.mark.parametrize("size", [1, 3, 1000])
@pytest.mark.parametrize("fmt", [ToolFormat.HERMES, ToolFormat.GENERIC])
def test_a_closing_marker_inside_an_argument_is_text(fmt: ToolFormat, size: int) -> None:
    arguments = {"code": 'print("</tool_call>")\n', "note": 'a \\" and </tool_call> again'}
    call = json.dumps({"name": "run", "arguments": arguments})
    text = f"Running.\n<tool_call>{call}</tool_call>\n<tool_call>{call}</tool_call>"
    content, whole = parse_tool_calls(text, fmt)
    assert (content, [(c.name, json.loads(c.arguments)) for c in whole]) == ("Running.", [("run", arguments)] * 2)
    streamed_content, streamed = _stream(fmt, text, size)
    assert streamed_content.strip() == "Running."
    assert [(name, json.loads(args)) for name, args in streamed] == [("run", arguments)] * 2


def test_a_block_with_an_unclosed_string_stays_text() -> None:
    text = '<tool_call>{"name": "f", "arguments": {"a": "' + "x" * 200_000
    content, calls = parse_tool_calls(text + "</tool_call>", ToolFormat.HERMES)
    assert calls == () and content.endswith("</tool_call>")


def test_history_arguments_deeper_than_the_decoder_goes_stay_text() -> None:
    text = "[" * 100_000 + "]" * 100_000
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": text}}
    history = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]}]
    assert native_messages(history)[1]["tool_calls"][0]["function"]["arguments"] == text
    assert json.dumps(text)[1:-1] in generic_messages(history, None)[1]["content"]


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_a_reply_nested_deeper_than_the_decoder_goes_is_text(fmt: ToolFormat) -> None:
    # A free-form argument ({"type": "object"}) lets a looping model open arrays until max_tokens.
    key = "parameters" if fmt is ToolFormat.LLAMA3 else "arguments"
    body = f'{{"name": "f", "{key}": {{"a": ' + "[" * 5000 + "]" * 5000 + "}}"
    text = body if fmt is ToolFormat.LLAMA3 else f"<tool_call>{body}</tool_call>"
    assert parse_tool_calls(text, fmt) == (text, ())
    for size in (7, 1000, len(text)):
        _stream(fmt, text, size)  # does not raise


@pytest.mark.parametrize("fmt", [ToolFormat.HERMES, ToolFormat.GENERIC])
def test_whitespace_tokens_in_text_after_a_call_are_content(fmt: ToolFormat) -> None:
    call = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
    pieces = ["Checking.", "\n", call, "\n", "It", " ", "is", "\n\n", "noon."]
    parser = ToolCallParser(fmt)
    results = [parser.feed(piece) for piece in pieces] + [parser.finish()]
    content = "".join(out for out, _ in results)
    whole, calls = parse_tool_calls("".join(pieces), fmt)
    assert len(calls) == 1 and whole == "Checking.\n\nIt is\n\nnoon."
    assert content == "Checking.\nIt is\n\nnoon."  # the newline right after the call is not content


@pytest.mark.parametrize("choice", ["auto", "required"])
def test_a_tool_that_is_not_strict_is_enforced_as_far_as_possible(asyncllm_model_path: Path, choice: str) -> None:
    # OpenAPI-derived schemas carry formats llguidance does not know (a file upload's "binary").
    loose = {
        "type": "object",
        "properties": {"n": {"type": "integer"}, "data": {"type": "string", "format": "binary"}},
        "required": ["n"],
    }
    tools: list[dict[str, Any]] = [
        {"type": "function", "function": {"name": "count", "parameters": loose}},
        {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": REF_TOOLS[1]["function"]
                                          ["parameters"]}},
    ]
    tokenizer: PreTrainedTokenizerFast = AutoTokenizer.from_pretrained(asyncllm_model_path)
    plan = plan_tools(tools, choice, True, lambda: ToolFormat.GENERIC)
    assert plan is not None and plan.grammar() is not None
    grammar = plan.grammar() or ""
    assert _accepts(tokenizer, grammar, '<tool_call>{"name": "count", "arguments": {"n": 3}}</tool_call>')
    assert not _accepts(tokenizer, grammar, '<tool_call>{"name": "count", "arguments": {"n": "3"}}</tool_call>')
    assert _accepts(tokenizer, grammar, '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    # strict: the same schema is refused whole.
    tools[0]["function"]["strict"] = True
    strict = plan_tools(tools, choice, True, lambda: ToolFormat.GENERIC)
    assert strict is not None
    with pytest.raises(AssertionError):
        _accepts(tokenizer, strict.grammar() or "", "")


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_a_schema_that_does_not_say_object_still_forces_an_object(asyncllm_model_path: Path, fmt: ToolFormat) -> None:
    tokenizer: PreTrainedTokenizerFast = AutoTokenizer.from_pretrained(asyncllm_model_path)
    key = "parameters" if fmt is ToolFormat.LLAMA3 else "arguments"
    wrap = {
        ToolFormat.HERMES: lambda b: f"<tool_call>\n{b}\n</tool_call>",
        ToolFormat.GENERIC: lambda b: f"<tool_call>{b}</tool_call>",
        ToolFormat.LLAMA3: lambda b: b,
    }[fmt]
    plan = plan_tools([{"type": "function", "function": {"name": "ping", "parameters": {}}}], "required", True,
                      lambda: fmt)
    assert plan is not None
    for arguments, is_call in (({}, True), ({"x": 1}, True), (5, False), ("x", False), ([], False)):
        text = wrap(json.dumps({"name": "ping", key: arguments}))
        assert bool(parse_tool_calls(text, fmt)[1]) == is_call
        assert _accepts(tokenizer, plan.grammar() or "", text) == is_call  # the grammar forces only calls
