"""Tool calling: checking tools, the call formats, the grammars (compiled by llguidance against a real
tokenizer), whole and streamed parsing, rendering histories, and ``Engine.chat(tools=...)`` on a tiny
random model whose calls are forced by the grammar."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from asyncllm import Engine, InvalidToolsError, SamplingParams, ToolCall
from asyncllm.engine._tools import (
    ToolCallParser,
    ToolFormat,
    detect_format,
    parse_tool_calls,
    plan_tools,
)
from asyncllm.errors import ChatTemplateError, StructuredOutputError

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["C", "F"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "pattern": "^[A-Z]{3}$"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather.", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}

# A Hermes/Qwen-style template: tools into the system turn, calls as <tool_call> blocks, results as <tool_response>.
HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\nTools:\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}"
    "Call them in <tool_call></tool_call> tags.<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n{{ m.content or '' }}"
    "{% for c in m.tool_calls %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}"
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{% if tools %}Functions: {% for t in tools %}{{ t | tojson }}{% endfor %} "
    'Reply with {"name": function name, "parameters": arguments}.{% endif %}'
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|python_tag|>"
)

HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "21 C, sunny"},
    {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "tomorrow?"}]},
]


def _tokenizer(path: Path, template: str | None = None) -> PreTrainedTokenizerFast:
    tokenizer: PreTrainedTokenizerFast = AutoTokenizer.from_pretrained(path)
    if template is not None:
        tokenizer.chat_template = template
    return tokenizer


def _validate_call(call: ToolCall, allowed: set[str]) -> dict[str, Any]:
    assert call.id.startswith("call_") and len(call.id) == 29
    assert call.name in allowed
    arguments: dict[str, Any] = json.loads(call.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.name])
    return arguments


# -- checking --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("tools", "choice", "parallel", "param", "code"),
    [
        ([{"type": "function", "function": {"name": "f"}}], None, None, "tools", "missing_parameters"),
        ([{"type": "function", "function": {"name": "f", "parameters": None}}], None, None, "tools",
         "missing_parameters"),
        ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, None, "tools", "invalid_tool"),
        ([{"type": "function", "function": {"name": "bad name!", "parameters": {}}}], None, None, "tools",
         "invalid_tool_name"),
        ([{"type": "function", "function": {"name": "x" * 65, "parameters": {}}}], None, None, "tools",
         "invalid_tool_name"),
        ([TOOLS[0], TOOLS[0]], None, None, "tools", "duplicate_tool_name"),
        ([{"type": "retrieval"}], None, None, "tools", "invalid_tool"),
        (TOOLS, {"type": "function", "function": {"name": "missing"}}, None, "tool_choice", "unknown_tool"),
        (TOOLS, "sometimes", None, "tool_choice", "invalid_tool_choice"),
        (None, "required", None, "tool_choice", "invalid_tool_choice"),
        (TOOLS, "auto", "yes", "parallel_tool_calls", "invalid_parallel_tool_calls"),
    ],
)
def test_bad_tool_options_are_refused_naming_the_field(
    tools: Any, choice: Any, parallel: Any, param: str, code: str
) -> None:
    with pytest.raises(InvalidToolsError) as info:
        plan_tools(tools, choice, parallel, lambda: ToolFormat.GENERIC)
    assert (info.value.param, info.value.code) == (param, code)
    assert isinstance(info.value, ValueError)


def test_plan_defaults() -> None:
    assert plan_tools(None, None, None, lambda: ToolFormat.GENERIC) is None
    assert plan_tools([], "none", None, lambda: ToolFormat.GENERIC) is None
    plan = plan_tools(TOOLS, None, None, lambda: ToolFormat.HERMES)
    assert plan is not None and (plan.choice, plan.parallel, plan.format) == ("auto", True, ToolFormat.HERMES)
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, False, lambda: ToolFormat.GENERIC)
    assert named is not None and (named.choice, named.name, named.parallel) == ("named", "get_time", False)
    # Unset, a named function is called once; other choices may call several tools.
    get_time = {"type": "function", "function": {"name": "get_time"}}
    once = plan_tools(TOOLS, get_time, None, lambda: ToolFormat.GENERIC)
    several = plan_tools(TOOLS, get_time, True, lambda: ToolFormat.GENERIC)
    required = plan_tools(TOOLS, "required", None, lambda: ToolFormat.GENERIC)
    assert once is not None and several is not None and required is not None
    assert (once.parallel, several.parallel, required.parallel) == (False, True, True)


def test_format_detection(asyncllm_model_path: Path) -> None:
    assert detect_format(_tokenizer(asyncllm_model_path)) is ToolFormat.GENERIC  # its template ignores tools
    assert detect_format(_tokenizer(asyncllm_model_path, HERMES_TEMPLATE)) is ToolFormat.HERMES
    assert detect_format(_tokenizer(asyncllm_model_path, LLAMA3_TEMPLATE)) is ToolFormat.LLAMA3
    # Mentions tools but renders nothing of them: generic.
    ignoring = "{# tools are not rendered #}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert detect_format(_tokenizer(asyncllm_model_path, ignoring)) is ToolFormat.GENERIC


# -- parsing ---------------------------------------------------------------------------------------

PARSE_CASES: list[tuple[ToolFormat, str, str, list[tuple[str, dict[str, Any]]]]] = [
    (ToolFormat.HERMES, "Just text, <tool no call.", "Just text, <tool no call.", []),
    (
        ToolFormat.HERMES,
        "Let me check.\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>',
        "Let me check.",
        [("get_weather", {"city": "Paris", "unit": "C"})],
    ),
    (
        ToolFormat.GENERIC,
        '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>\n'
        '<tool_call>{"arguments": {"city": "Oslo", "unit": "F"}, "name": "get_weather"}</tool_call>',
        "",
        [("get_time", {"zone": "UTC"}), ("get_weather", {"city": "Oslo", "unit": "F"})],
    ),
    (  # arguments as JSON text, as some models write them
        ToolFormat.HERMES,
        '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"CET\\"}"}</tool_call>',
        "",
        [("get_time", {"zone": "CET"})],
    ),
    (  # a block that is not a call stays text, markers included
        ToolFormat.HERMES,
        "a <tool_call>not json</tool_call> b",
        "a <tool_call>not json</tool_call> b",
        [],
    ),
    (  # cut off by max_tokens after a complete object
        ToolFormat.GENERIC,
        '<tool_call>{"name": "get_time", "arguments": {"zone": "EST"}}',
        "",
        [("get_time", {"zone": "EST"})],
    ),
    (
        ToolFormat.LLAMA3,
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome", "unit": "C"}}',
        "",
        [("get_weather", {"city": "Rome", "unit": "C"})],
    ),
    (
        ToolFormat.LLAMA3,
        '{"name": "get_time", "parameters": {"zone": "PST"}}; {"name": "get_time", "parameters": {"zone": "JST"}}',
        "",
        [("get_time", {"zone": "PST"}), ("get_time", {"zone": "JST"})],
    ),
    (ToolFormat.LLAMA3, "It is sunny {maybe}.", "It is sunny {maybe}.", []),
    (ToolFormat.LLAMA3, '{"name": "get_time"', '{"name": "get_time"', []),
]


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), PARSE_CASES)
def test_parse_whole_replies(fmt: ToolFormat, text: str, content: str, calls: list[tuple[str, Any]]) -> None:
    parsed_content, parsed = parse_tool_calls(text, fmt)
    assert parsed_content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed] == calls


def _stream(fmt: ToolFormat, text: str, size: int) -> tuple[str, list[tuple[str, str]]]:
    """Feed ``text`` in pieces of ``size`` characters; reassemble as an OpenAI client does."""
    parser = ToolCallParser(fmt)
    content: list[str] = []
    calls: dict[int, list[str]] = {}
    pieces = [text[i : i + size] for i in range(0, len(text), size)]
    for piece in pieces:
        out, deltas = parser.feed(piece)
        content.append(out)
        for delta in deltas:
            if delta.id is not None:
                assert delta.index not in calls and delta.name is not None
                calls[delta.index] = [delta.name, ""]
            calls[delta.index][1] += delta.arguments
    out, deltas = parser.finish()
    content.append(out)
    for delta in deltas:
        if delta.id is not None:
            calls[delta.index] = [delta.name or "", ""]
        calls[delta.index][1] += delta.arguments
    assert "<tool_call>" not in "".join(content) or not calls
    return "".join(content), [(name, args) for name, args in (calls[i] for i in sorted(calls))]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
@pytest.mark.parametrize(("fmt", "text", "content", "calls"), PARSE_CASES)
def test_streamed_parse_reassembles_to_the_whole(
    fmt: ToolFormat, text: str, content: str, calls: list[tuple[str, Any]], size: int
) -> None:
    streamed_content, streamed = _stream(fmt, text, size)
    _, whole = parse_tool_calls(text, fmt)
    assert [(name, json.loads(args)) for name, args in streamed] == calls
    assert [args for _, args in streamed] == [c.arguments for c in whole]  # the same JSON text, piece by piece
    assert streamed_content.strip() == content.strip()


def test_streamed_text_holds_back_a_possible_marker_only() -> None:
    parser = ToolCallParser(ToolFormat.HERMES)
    assert parser.feed("Hello <tool") == ("Hello ", [])
    assert parser.feed("box> done") == ("<toolbox> done", [])
    assert parser.feed("<tool_call>") == ("", [])
    content, deltas = parser.feed('{"name": "get_time", "arguments": {"zone": "U')
    assert content == "" and [(d.name, d.arguments) for d in deltas] == [("get_time", ""), (None, '{"zone": "U')]
    content, deltas = parser.feed('TC"}}</tool_call>')
    assert [d.arguments for d in deltas] == ['TC"}']


# -- grammars --------------------------------------------------------------------------------------


def _matcher(tokenizer: PreTrainedTokenizerFast, grammar: str) -> Any:
    import llguidance
    import llguidance.hf

    compiled = llguidance.LLMatcher.grammar_from_lark(grammar)
    lltokenizer = llguidance.hf.from_tokenizer(tokenizer)
    assert llguidance.LLMatcher.validate_grammar(compiled, lltokenizer) == ""
    return llguidance.LLMatcher(lltokenizer, compiled)


def _accepts(tokenizer: PreTrainedTokenizerFast, grammar: str, text: str) -> bool:
    matcher = _matcher(tokenizer, grammar)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return bool(matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting())


@pytest.mark.parametrize("fmt", list(ToolFormat))
def test_grammars_accept_the_format_and_refuse_the_rest(asyncllm_model_path: Path, fmt: ToolFormat) -> None:
    tokenizer = _tokenizer(asyncllm_model_path)
    key = "parameters" if fmt is ToolFormat.LLAMA3 else "arguments"
    body = json.dumps({"name": "get_time", key: {"zone": "UTC"}})
    bad = json.dumps({"name": "get_time", key: {"zone": "utc"}})  # the pattern fails
    wrap = {
        ToolFormat.HERMES: lambda b: f"<tool_call>\n{b}\n</tool_call>",
        ToolFormat.GENERIC: lambda b: f"<tool_call>{b}</tool_call>",
        ToolFormat.LLAMA3: lambda b: b,
    }[fmt]
    join = "; " if fmt is ToolFormat.LLAMA3 else "\n"
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}, "auto"):
        for parallel in (True, False):
            plan = plan_tools(TOOLS, choice, parallel, lambda: fmt)
            assert plan is not None
            grammar = plan.grammar()
            assert grammar is not None
            assert _accepts(tokenizer, grammar, wrap(body))
            assert not _accepts(tokenizer, grammar, wrap(bad))
            assert _accepts(tokenizer, grammar, wrap(body) + join + wrap(body)) == (parallel and choice != "auto") or (
                choice == "auto"  # auto: text after a call is free
            )
            assert _accepts(tokenizer, grammar, "Plain text.") == (choice == "auto")
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, True, lambda: fmt)
    assert named is not None and named.grammar() is not None
    assert not _accepts(tokenizer, named.grammar() or "", wrap(body))  # only the named function
    assert plan_tools(TOOLS, "none", True, lambda: fmt).grammar() is None  # type: ignore[union-attr]


def test_a_forced_choice_and_a_structured_output_conflict() -> None:
    plan = plan_tools(TOOLS, "required", True, lambda: ToolFormat.GENERIC)
    assert plan is not None
    from asyncllm import StructuredOutput

    with pytest.raises(InvalidToolsError) as info:
        plan.constrain(SamplingParams(structured_output=StructuredOutput(json_object=True)))
    assert info.value.code == "unsupported_combination"
    auto = plan_tools(TOOLS, "auto", True, lambda: ToolFormat.GENERIC)
    assert auto is not None
    own = SamplingParams(structured_output=StructuredOutput(json_object=True))
    assert auto.constrain(own) is own  # the caller's constraint wins under auto


# -- the engine ------------------------------------------------------------------------------------


@pytest.fixture
async def hermes_engine(asyncllm_model_path: Path) -> AsyncIterator[Engine]:
    tokenizer = _tokenizer(asyncllm_model_path, HERMES_TEMPLATE)
    async with Engine.open(asyncllm_model_path, tokenizer=tokenizer, device="cpu", kv_cache_blocks=128) as engine:
        yield engine


@pytest.mark.anyio
async def test_history_renders_through_a_template_that_knows_tools(hermes_engine: Engine) -> None:
    plan = hermes_engine.tool_plan(TOOLS)
    text = hermes_engine.tokenizer.decode(hermes_engine.apply_chat_template(HISTORY, tools=plan))  # type: ignore[attr-defined]
    assert '"name": "get_weather"' in text and "Call them in <tool_call>" in text  # the template's own tool prompt
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>' in text
    assert "<tool_response>\n21 C, sunny\n</tool_response>" in text
    assert "And tomorrow?" in text and text.endswith("<|im_start|>assistant\n")


@pytest.mark.anyio
async def test_history_renders_through_the_generic_format(asyncllm_engine: Engine) -> None:
    plan = asyncllm_engine.tool_plan(TOOLS, "required", False)
    assert plan is not None and plan.format is ToolFormat.GENERIC
    text = asyncllm_engine.tokenizer.decode(asyncllm_engine.apply_chat_template(HISTORY, tools=plan))  # type: ignore[attr-defined]
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\nBe brief.\n\nYou can call the following functions.")
    assert '{"name": "get_time", "parameters": ' in system
    assert "You must call at least one function." in system and "Make at most one call." in system
    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}</tool_call>'
    assert f"<|im_start|>assistant\n{call}" in text
    assert '<|im_start|>user\n<tool_response>{"name": "get_weather", "content": "21 C, sunny"}</tool_response>' in text
    # Without tools this turn, a history with calls still renders (in the same format).
    bare = asyncllm_engine.tokenizer.decode(asyncllm_engine.apply_chat_template(HISTORY))  # type: ignore[attr-defined]
    assert "<tool_response>" in bare and "You can call" not in bare


@pytest.mark.anyio
async def test_malformed_tool_history_is_refused(asyncllm_engine: Engine) -> None:
    for message in (
        {"role": "assistant", "content": None},  # null content without calls
        {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f"}}]},  # no arguments
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]},
    ):
        with pytest.raises(ChatTemplateError):
            await asyncllm_engine.chat([{"role": "user", "content": "hi"}, message])


@pytest.mark.anyio
@pytest.mark.parametrize("engine_kind", ["generic", "hermes"])
async def test_required_and_named_calls_validate_on_a_random_model(
    asyncllm_engine: Engine, hermes_engine: Engine, engine_kind: str
) -> None:
    engine = asyncllm_engine if engine_kind == "generic" else hermes_engine
    messages = [{"role": "user", "content": "What is the weather?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    for seed in range(5):
        params = SamplingParams(max_tokens=160, temperature=1.0, seed=seed)
        one = await engine.chat(messages, params, tools=TOOLS, tool_choice="required", parallel_tool_calls=False)
        assert one.finish_reason == "stop" and len(one.tool_calls) == 1 and one.text == ""
        _validate_call(one.tool_calls[0], {"get_weather", "get_time"})
        single = await engine.chat(messages, params, tools=TOOLS, tool_choice=named, parallel_tool_calls=False)
        assert single.finish_reason == "stop" and len(single.tool_calls) == 1
        _validate_call(single.tool_calls[0], {"get_time"})
        # Parallel: a random model rarely chooses to stop between calls, so max_tokens may cut the
        # list; every whole call still validates.
        several = await engine.chat(messages, params, tools=TOOLS, tool_choice="required")
        assert several.tool_calls
        for call in several.tool_calls:
            _validate_call(call, {"get_weather", "get_time"})


@pytest.mark.anyio
async def test_auto_runs_under_its_lazy_grammar(asyncllm_engine: Engine) -> None:
    # A random model seldom writes a whole marker, so this checks that auto's grammar compiles and
    # runs with the engine, and that no reply holds a started call that does not parse; the grammar
    # itself (text free until the marker, then the call forced) is checked token by token above.
    messages = [{"role": "user", "content": "Time?"}]
    lt = asyncllm_engine.tokenizer.encode("<", add_special_tokens=False)  # type: ignore[call-arg]
    for seed in range(3):
        params = SamplingParams(max_tokens=60, temperature=1.0, seed=seed, logit_bias={lt[0]: 5.0})
        reply = await asyncllm_engine.chat(messages, params, tools=TOOLS, tool_choice="auto")
        assert "<tool_call>{" not in reply.text or reply.finish_reason == "length"
        for call in reply.tool_calls:
            _validate_call(call, {"get_weather", "get_time"})


@pytest.mark.anyio
async def test_none_and_no_tools_leave_the_reply_alone(asyncllm_engine: Engine) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    params = SamplingParams(max_tokens=8, temperature=0.0)
    plain = await asyncllm_engine.chat(messages, params)
    none = await asyncllm_engine.chat(messages, params, tools=TOOLS, tool_choice="none")
    assert plain.tool_calls == () and none.tool_calls == () and none.text == plain.text


@pytest.mark.anyio
async def test_tools_errors_at_the_call(asyncllm_engine: Engine) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(InvalidToolsError, match="no parameters schema"):
        await asyncllm_engine.chat(messages, tools=[{"type": "function", "function": {"name": "f"}}])
    bad = {"type": "object", "minProperties": "x"}
    bad_schema = [{"type": "function", "function": {"name": "f", "parameters": bad}}]
    with pytest.raises(StructuredOutputError) as info:
        await asyncllm_engine.chat(messages, SamplingParams(max_tokens=4), tools=bad_schema, tool_choice="required")
    assert info.value.param == "tools"
    ok = await asyncllm_engine.chat(messages, SamplingParams(max_tokens=4))  # the engine keeps serving
    assert ok.finish_reason == "length"
