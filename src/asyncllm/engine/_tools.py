"""Tool calling: checking tools, rendering them into a prompt, constraining and parsing the calls.

Not HTTP-specific: ``Engine.chat(..., tools=...)`` and the OpenAI app both go through ``ToolPlan``.

A model writes its calls in the format its chat template taught it (``ToolFormat``):
- ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks (Hermes, Qwen 2/2.5/3);
- ``llama3``: a bare JSON object ``{"name": ..., "parameters": {...}}``, optionally after
  ``<|python_tag|>`` (Llama 3.1-3.3), several separated by ``;``;
- ``generic``: for a template that cannot render tools (the default SmolLM2's). The definitions go
  into a system message and the calls are written as in ``hermes``; docs/structured-output.md
  ("Tool calling") states the format exactly.

``tool_choice="required"`` or a named function is enforced by a Lark grammar (llguidance's dialect,
``%json`` embedding each tool's schema), so the output is one or more calls whose arguments validate.
``"auto"`` leaves the text free and parses whatever calls it holds.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import re
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

from asyncllm.errors import InvalidToolsError, StructuredOutputError
from asyncllm.outputs import ToolCall
from asyncllm.sampling_params import SamplingParams, StructuredOutput

TOOL_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")
"""OpenAI's rule for a function's name."""

MAX_TOOLS = 128
"""The most tools one request may give (OpenAI's limit)."""

MAX_JSON_DEPTH = 64
"""The deepest nesting (objects and arrays) of a tool's schema or of a call's arguments in a history:
they are walked recursively when checked and rendered, and no real schema comes near it."""

JSON_WRITING = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""How the grammars have a call's JSON written (llguidance's ``x-guidance`` options)."""

LENIENT = {"lenient": True, "coerce_one_of": True}
"""The options for a function that is not ``strict``: what cannot be enforced is ignored, not refused."""

CALL_OPEN = "<tool_call>"
CALL_CLOSE = "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


class ToolFormat(enum.Enum):
    """How a model writes its tool calls (see the module docstring)."""

    HERMES = "hermes"
    LLAMA3 = "llama3"
    GENERIC = "generic"


@dataclasses.dataclass(frozen=True, slots=True)
class Function:
    """One tool, checked: its name, description, JSON Schema of its arguments, and whether that schema
    must be enforced whole (``strict``) or as far as the grammar engine can."""

    name: str
    description: str | None
    parameters: dict[str, Any]
    strict: bool = False

    def as_openai(self) -> dict[str, Any]:
        """The tool as OpenAI (and transformers' ``apply_chat_template(tools=...)``) spell it."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


def _tools_error(message: str, code: str, param: str = "tools") -> InvalidToolsError:
    return InvalidToolsError(message, param=param, code=code)


def too_deep(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether ``value`` nests objects and arrays more than ``limit`` levels deep (walked without recursing)."""
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, Mapping):
            children: Any = item.values()
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def check_tools(tools: Sequence[Mapping[str, Any]]) -> tuple[Function, ...]:
    """The tools of a request, checked.

    Each is ``{"type": "function", "function": {"name", "description"?, "parameters"}}``. A tool
    without ``parameters`` is refused, not read as "no arguments": a client that forgot the schema
    would otherwise get calls it cannot check. A function that takes nothing says so with
    ``{"type": "object", "properties": {}}``.

    Raises:
        InvalidToolsError: Not a list of such mappings, more than ``MAX_TOOLS``, a name that is not
            ``[a-zA-Z0-9_-]{1,64}`` or is given twice, a missing ``parameters`` schema, or one that
            is not a JSON Schema object, or one nested more than ``MAX_JSON_DEPTH`` levels deep.
    """
    if isinstance(tools, (str, bytes)) or not isinstance(tools, Sequence):
        raise _tools_error(f"tools must be a list of tools, got {type(tools).__name__}", "invalid_tool")
    if len(tools) > MAX_TOOLS:
        raise _tools_error(f"tools holds {len(tools)} tools, more than the {MAX_TOOLS} allowed", "too_many_tools")
    checked: list[Function] = []
    seen: set[str] = set()
    for index, tool in enumerate(tools):
        where = f"tools[{index}]"
        if not isinstance(tool, Mapping) or tool.get("type") != "function" or not isinstance(
            tool.get("function"), Mapping
        ):
            raise _tools_error(
                f'{where} must be {{"type": "function", "function": {{"name": ..., "parameters": {{...}}}}}}',
                "invalid_tool",
            )
        function = tool["function"]
        name = function.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise _tools_error(
                f"{where}.function.name must match [a-zA-Z0-9_-]{{1,64}}, got {name!r}", "invalid_tool_name"
            )
        if name in seen:
            raise _tools_error(f"{where}.function.name {name!r} is given twice; tool names must be unique",
                               "duplicate_tool_name")
        seen.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise _tools_error(f"{where}.function.description must be a string", "invalid_tool")
        if "parameters" not in function or function["parameters"] is None:
            raise _tools_error(
                f"{where} ({name!r}) has no parameters schema; give one, e.g. "
                '{"type": "object", "properties": {}} for a function that takes no arguments',
                "missing_parameters",
            )
        parameters = function["parameters"]
        if not isinstance(parameters, Mapping):
            raise _tools_error(
                f"{where}.function.parameters must be a JSON Schema object, got {type(parameters).__name__}",
                "invalid_tool",
            )
        if too_deep(parameters):
            raise _tools_error(
                f"{where}.function.parameters is nested more than {MAX_JSON_DEPTH} levels deep", "schema_too_deep"
            )
        strict = function.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise _tools_error(f"{where}.function.strict must be a bool", "invalid_tool")
        checked.append(Function(name, description, dict(parameters), strict is True))
    return tuple(checked)


def detect_format(tokenizer: Any) -> ToolFormat:
    """The tool-call format of a tokenizer's chat template.

    A template renders tools when its source reads ``tools`` and rendering a conversation with a
    dummy tool changes its output. Then ``<tool_call>`` in the source means ``hermes``, and
    ``<|python_tag|>`` or ``"parameters"`` means ``llama3``. Anything else (no template, a template
    that ignores tools, a format this module does not know) gets the ``generic`` prompt.
    """
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "tools" not in template:
        return ToolFormat.GENERIC
    probe = [{"role": "user", "content": "Hi"}]
    dummy = Function("probe_tool_x", "A probe.", {"type": "object", "properties": {}}).as_openai()
    try:
        plain = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
        with_tools = tokenizer.apply_chat_template(probe, tools=[dummy], add_generation_prompt=True, tokenize=False)
    except Exception:  # a template that fails on tools cannot render them
        return ToolFormat.GENERIC
    if plain == with_tools or "probe_tool_x" not in str(with_tools):
        return ToolFormat.GENERIC
    if CALL_OPEN in template:
        return ToolFormat.HERMES
    if PYTHON_TAG in template or "parameters" in template:
        return ToolFormat.LLAMA3
    return ToolFormat.GENERIC


# -- the generic prompt ------------------------------------------------------------------------------


def generic_system_prompt(functions: Sequence[Function], choice: str, name: str | None, parallel: bool) -> str:
    """The system text that teaches a model without a tool-aware template to call ``functions``."""
    lines = [
        "You can call the following functions. Each is given as a JSON object with its name, "
        "description and the JSON Schema of its arguments:",
        "<tools>",
        *(json.dumps(f.as_openai()["function"], ensure_ascii=False) for f in functions),
        "</tools>",
        "To call a function, answer with a <tool_call></tool_call> block holding a JSON object with the "
        "function's name and its arguments:",
        '<tool_call>{"name": "<function name>", "arguments": {<arguments as JSON>}}</tool_call>',
    ]
    if choice == "named":
        lines.append(f"You must call the function {name}.")
    elif choice == "required":
        lines.append("You must call at least one function.")
    else:
        lines.append("If no function helps, answer in plain text.")
    lines.append(
        "You may make several calls, one block each." if parallel else "Make at most one call."
    )
    return "\n".join(lines)


def _arguments_object(arguments: Any) -> Any:
    # History arguments arrive as JSON text (OpenAI); templates and the generic format want the object.
    if isinstance(arguments, str):
        try:
            value = json.loads(arguments)
        except (ValueError, RecursionError):  # the decoder recurses per level of nesting
            return arguments
        return arguments if too_deep(value) else value
    return arguments


def generic_messages(messages: Sequence[Mapping[str, Any]], system: str | None) -> list[dict[str, Any]]:
    """``messages`` rewritten for a template that knows only text: ``system`` merged into the first
    system message (or put first), assistant ``tool_calls`` written as ``<tool_call>`` blocks after
    the content, and each run of ``tool`` messages as one user message of ``<tool_response>`` blocks."""
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for message in messages:
        role = message["role"]
        if role == "assistant" and message.get("tool_calls"):
            blocks = []
            for call in message["tool_calls"]:
                function = call["function"]
                names[str(call.get("id"))] = function["name"]
                body = {"name": function["name"], "arguments": _arguments_object(function.get("arguments", {}))}
                blocks.append(CALL_OPEN + json.dumps(body, ensure_ascii=False) + CALL_CLOSE)
            text = "\n".join(([message["content"]] if message.get("content") else []) + blocks)
            out.append({"role": "assistant", "content": text})
        elif role == "tool":
            result: dict[str, Any] = {}
            name = names.get(str(message.get("tool_call_id")), message.get("name"))
            if name is not None:
                result["name"] = name
            result["content"] = message.get("content") or ""
            block = "<tool_response>" + json.dumps(result, ensure_ascii=False) + "</tool_response>"
            if out and out[-1].get("_tool_results"):
                out[-1]["content"] += "\n" + block
            else:
                out.append({"role": "user", "content": block, "_tool_results": True})
        else:
            out.append({k: v for k, v in message.items() if k in ("role", "content", "name")})
    for message in out:
        message.pop("_tool_results", None)
    if system is not None:
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0].get('content') or ''}\n\n{system}".lstrip()}
        else:
            out.insert(0, {"role": "system", "content": system})
    return out


def native_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` for a tool-aware template: tool-call arguments as objects (what HF templates expect)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        message = dict(message)
        if message.get("tool_calls"):
            message["tool_calls"] = [
                {
                    **call,
                    "function": {**call["function"], "arguments": _arguments_object(call["function"].get("arguments"))},
                }
                for call in message["tool_calls"]
            ]
        out.append(message)
    return out


# -- parsing -------------------------------------------------------------------------------------------


def new_call_id() -> str:
    """A fresh tool-call id: ``call_`` and 24 hex digits."""
    return "call_" + uuid.uuid4().hex[:24]


_BEFORE_CLOSE = re.compile(r'(?:[^"<]+|"(?:[^"\\]|\\.)*"|<(?!/tool_call>))*', re.DOTALL)
"""Text up to a ``</tool_call>`` that is not inside a JSON string (or up to an unclosed string)."""


def _find_close(text: str, start: int) -> int:
    """Where the ``</tool_call>`` that ends a block opened before ``start`` is, or -1.

    One inside a JSON string is an argument's text (code, markup), not the end of the block.
    """
    match = _BEFORE_CLOSE.match(text, start)
    end = match.end() if match is not None else start
    return end if text.startswith(CALL_CLOSE, end) else -1


_HEADER = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:\s*')
_DECODER = json.JSONDecoder()


def split_call(body: str) -> tuple[str, str] | None:
    """A call's name and its arguments' JSON text, from the JSON object that describes it, or None.

    The arguments are returned as written when the name comes first (so a stream that sent them
    piece by piece agrees with the whole), re-encoded otherwise. ``parameters`` is read like
    ``arguments`` (Llama 3), and arguments given as JSON text are unwrapped.
    """
    header = _HEADER.match(body)
    if header is not None:
        try:
            _, end = _DECODER.raw_decode(body, header.end())
            name = json.loads(header.group(1))
        except (ValueError, RecursionError):  # the decoder recurses per level of nesting
            return None
        rest = body[end:].strip()
        if rest == "}" and isinstance(name, str):
            raw = body[header.end() : end]
            value = json.loads(raw)
            if isinstance(value, dict):
                return name, raw
            if isinstance(value, str):
                unwrapped = _arguments_object(value)
                if isinstance(unwrapped, dict):
                    return name, value
            return None
    try:
        value = json.loads(body)
    except (ValueError, RecursionError):  # the decoder recurses per level of nesting
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    arguments = value.get("arguments", value.get("parameters"))
    arguments = _arguments_object(arguments)
    if not isinstance(arguments, dict):
        return None
    return value["name"], json.dumps(arguments, ensure_ascii=False)


def parse_tool_calls(text: str, fmt: ToolFormat) -> tuple[str, tuple[ToolCall, ...]]:
    """The text outside the calls (stripped) and the calls in a whole reply.

    A block that does not hold a valid call (bad JSON, no name, arguments that are not an object)
    is left in the text as written, markers included.
    """
    if fmt is ToolFormat.LLAMA3:
        return _parse_llama3(text)
    calls: list[ToolCall] = []
    outside: list[str] = []
    position = 0
    while True:
        start = text.find(CALL_OPEN, position)
        if start < 0:
            outside.append(text[position:])
            break
        outside.append(text[position:start])
        end = _find_close(text, start + len(CALL_OPEN))
        stop = len(text) if end < 0 else end + len(CALL_CLOSE)
        found = split_call(text[start + len(CALL_OPEN) : len(text) if end < 0 else end])
        if found is None:
            outside.append(text[start:stop])
        else:
            calls.append(ToolCall(new_call_id(), *found))
        position = stop
    content = "".join(outside).strip() if calls else text
    return content, tuple(calls)


def _parse_llama3(text: str) -> tuple[str, tuple[ToolCall, ...]]:
    body = text.strip()
    body = body.removeprefix(PYTHON_TAG).strip()
    if not body.startswith("{"):
        return text, ()
    calls: list[ToolCall] = []
    for piece in _split_objects(body):
        found = split_call(piece)
        if found is None:
            return text, ()
        calls.append(ToolCall(new_call_id(), *found))
    return "", tuple(calls)


def _split_objects(body: str) -> list[str]:
    # "{...}; {...}" -> each object's text; a trailing piece that is not one is kept to fail the parse.
    pieces: list[str] = []
    position = 0
    while position < len(body):
        try:
            _, end = _DECODER.raw_decode(body, position)
        except (ValueError, RecursionError):  # the decoder recurses per level of nesting
            return [*pieces, body[position:]]
        pieces.append(body[position:end])
        position = end
        rest = body[position:].lstrip()
        if rest.startswith(";"):
            rest = rest[1:].lstrip()
        position = len(body) - len(rest)
    return pieces


@dataclasses.dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of a streamed call: the first has ``id`` and ``name``, later ones argument text."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""


def _object_text(text: str) -> str | None:
    # The JSON object at the start of ``text`` as written, or None while it is not whole (or not one).
    try:
        value, end = _DECODER.raw_decode(text)
    except (ValueError, RecursionError):  # the decoder recurses per level of nesting
        return None
    return text[:end] if isinstance(value, dict) else None


def _marker_prefix_length(text: str, marker: str) -> int:
    # The longest end of ``text`` that is a beginning of ``marker`` (text held back until it is known).
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-length:]):
            return length
    return 0


class ToolCallParser:
    """Splits a streamed reply into content text and ``ToolCallDelta``s as it arrives.

    Text that could be the start of a ``<tool_call>`` marker is held back, as stop strings are;
    the markers themselves are never content. A call's id and name go out as soon as its JSON
    names the function (first), then its arguments piece by piece (a closing ``}`` and the
    whitespace before it held back until the end of the block shows whether they belong to the
    arguments). For ``llama3`` a reply that starts with ``{`` (or ``<|python_tag|>``) is held whole
    and parsed at the end.
    """

    def __init__(self, fmt: ToolFormat, new_id: Callable[[], str] = new_call_id) -> None:
        self.fmt = fmt
        self._new_id = new_id
        self._buffer = ""  # text not yet classified
        self._in_call = False
        self._call_index = -1  # index of the call being streamed (or the last one)
        self._header_sent = False
        self._args_sent = 0  # characters of the current block's arguments sent
        self._args_start = 0
        self._saw_text = False  # llama3: the reply is text, not calls
        self._after_call = False  # only whitespace has followed the last call so far
        self.num_calls = 0

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Take the next piece of the reply; return the content and call pieces it makes known."""
        self._buffer += text
        if self.fmt is ToolFormat.LLAMA3:
            return self._feed_llama3()
        content: list[str] = []
        deltas: list[ToolCallDelta] = []
        while True:
            if not self._in_call:
                start = self._buffer.find(CALL_OPEN)
                if start < 0:
                    keep = _marker_prefix_length(self._buffer, CALL_OPEN)
                    content.append(self._outside(self._buffer[: len(self._buffer) - keep]))
                    self._buffer = self._buffer[len(self._buffer) - keep :]
                    break
                content.append(self._outside(self._buffer[:start]))
                self._buffer = self._buffer[start + len(CALL_OPEN) :]
                self._in_call, self._header_sent, self._args_sent = True, False, 0
                continue
            end = _find_close(self._buffer, 0)
            body = self._buffer if end < 0 else self._buffer[:end]
            deltas.extend(self._stream_call(body, closed=end >= 0))
            if end < 0:
                break
            if not self._header_sent:  # the block held no call: it stays text
                content.append(CALL_OPEN + body + CALL_CLOSE)
            self._after_call = self._header_sent
            self._buffer = self._buffer[end + len(CALL_CLOSE) :]
            self._in_call = False
        return "".join(content), deltas

    def _outside(self, text: str) -> str:
        # Whitespace right after a call is not content (the newline between calls); once text has
        # followed, whitespace is part of it (a lone "\n\n" token between two sentences).
        if self._after_call:
            if not text.strip():
                return ""
            self._after_call = False
        return text

    def _stream_call(self, body: str, *, closed: bool) -> list[ToolCallDelta]:
        deltas: list[ToolCallDelta] = []
        if not self._header_sent:
            header = _HEADER.match(body)
            # Streamed piece by piece only when the value is an object (not yet known while whitespace
            # may still grow; arguments given as JSON text are unwrapped when the block is whole).
            if header is not None and body[header.end() : header.end() + 1] == "{":
                try:
                    name = json.loads(header.group(1))
                except ValueError:
                    name = None
                if isinstance(name, str):
                    self._open_call(name, deltas)
                    self._args_start = header.end()
            if closed and not self._header_sent:
                found = split_call(body)  # the name was not first: the whole block at once
                if found is not None:
                    self._open_call(found[0], deltas)
                    deltas.append(ToolCallDelta(self._call_index, arguments=found[1]))
                return deltas
        if not self._header_sent:
            return deltas
        args = body[self._args_start :]
        whole = _object_text(args)
        if closed:
            final = whole if whole is not None else args.rstrip().removesuffix("}").rstrip()
            piece = final[self._args_sent :]
            self._args_sent = len(final)
        else:
            # Once the arguments' object is whole, what follows it (more keys of the call) is not theirs.
            brace = args.rfind("}")
            limit = len(whole) if whole is not None else len(args[: brace if brace >= 0 else len(args)].rstrip())
            piece = args[self._args_sent : limit] if limit > self._args_sent else ""
            self._args_sent += len(piece)
        if piece:
            deltas.append(ToolCallDelta(self._call_index, arguments=piece))
        return deltas

    def _open_call(self, name: str, deltas: list[ToolCallDelta]) -> None:
        self._call_index += 1
        self.num_calls += 1
        self._header_sent = True
        deltas.append(ToolCallDelta(self._call_index, id=self._new_id(), name=name))

    def _feed_llama3(self) -> tuple[str, list[ToolCallDelta]]:
        if self._saw_text:
            text, self._buffer = self._buffer, ""
            return text, []
        stripped = self._buffer.lstrip()
        if not stripped or stripped.startswith(("{", PYTHON_TAG)) or PYTHON_TAG.startswith(stripped):
            return "", []  # may be calls: held until the end
        self._saw_text = True
        text, self._buffer = self._buffer, ""
        return text, []

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        """The reply has ended: what is still held back, as content or calls."""
        buffer, self._buffer = self._buffer, ""
        if self.fmt is ToolFormat.LLAMA3:
            if self._saw_text:
                return buffer, []
            content, calls = _parse_llama3(buffer)
            deltas: list[ToolCallDelta] = []
            for call in calls:
                self._call_index += 1
                self.num_calls += 1
                deltas += [
                    ToolCallDelta(self._call_index, id=call.id, name=call.name),
                    ToolCallDelta(self._call_index, arguments=call.arguments),
                ]
            return content, deltas
        if not self._in_call:
            return self._outside(buffer), []
        # A block cut off (max_tokens): its call if it parses, else its text.
        self._in_call = False
        if self._header_sent:
            whole = _object_text(buffer[self._args_start :])
            if whole is None:
                return "", []  # its name and part of its arguments went out already
            piece = whole[self._args_sent :]
            return "", [ToolCallDelta(self._call_index, arguments=piece)] if piece else []
        found = split_call(buffer)
        if found is None:
            return CALL_OPEN + buffer, []
        deltas = []
        self._open_call(found[0], deltas)
        deltas.append(ToolCallDelta(self._call_index, arguments=found[1]))
        return "", deltas


# -- the plan --------------------------------------------------------------------------------------


def _json_for_lark(schema: Mapping[str, Any]) -> str:
    return json.dumps(schema, ensure_ascii=True, separators=(",", ":"))


def _an_object(schema: dict[str, Any]) -> dict[str, Any]:
    # Arguments are an object: a schema that does not say so ({} is common for "no arguments") would
    # let the grammar force a call whose arguments are 5 or "x", which no parser reads as a call.
    return schema if "type" in schema else {**schema, "type": "object"}


def _rebase_refs(schema: Any, base: str) -> Any:
    """``schema`` with its local ``$ref``s (``#/$defs/X``, ``#``) made to point under ``base``.

    A tool's parameters are embedded in a larger schema (the call object), so a reference that was
    relative to their root (as pydantic writes them) would otherwise point at the wrong place.
    """
    if isinstance(schema, Mapping):
        return {
            key: base + value[1:] if key == "$ref" and isinstance(value, str) and value.startswith("#")
            else _rebase_refs(value, base)
            for key, value in schema.items()
        }
    if isinstance(schema, list):
        return [_rebase_refs(item, base) for item in schema]
    return schema


@dataclasses.dataclass(frozen=True, slots=True)
class ToolPlan:
    """How one chat request uses its tools, decided before its prompt is rendered.

    Attributes:
        functions: The tools, checked.
        choice: ``"none"``, ``"auto"``, ``"required"`` or ``"named"`` (then ``name`` is the function).
        name: The function ``tool_choice`` names, for ``"named"``.
        parallel: Whether the reply may hold several calls (``parallel_tool_calls``).
        format: How the model writes calls (its template's, or ``generic``).
        can_constrain: Whether the engine applies grammars; without, ``"auto"`` is parsed
            unconstrained and ``"required"``/named are refused.
    """

    functions: tuple[Function, ...]
    choice: str
    name: str | None
    parallel: bool
    format: ToolFormat
    can_constrain: bool = True

    @property
    def parses(self) -> bool:
        """Whether the reply is parsed for calls (not under ``tool_choice="none"``)."""
        return self.choice != "none"

    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools for ``apply_chat_template(tools=...)``: None for the generic format."""
        if self.format is ToolFormat.GENERIC:
            return None
        return [f.as_openai() for f in self.functions]

    def messages(self, messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The conversation as the template should see it (see ``generic_messages``)."""
        if self.format is ToolFormat.GENERIC:
            system = (
                generic_system_prompt(self.functions, self.choice, self.name, self.parallel) if self.parses else None
            )
            return generic_messages(messages, system)
        return native_messages(messages)

    def grammar(self) -> str | None:
        """The Lark grammar of the reply (llguidance's dialect), or None under ``"none"``.

        ``required`` and a named function: only calls, each one's arguments valid for its schema.
        ``auto``: free text, in which a call, once its opening marker (``<tool_call>``; for
        ``llama3`` a ``{`` first) is written, is forced to name a tool and match its schema (a lazy
        lexeme ends the free text at the marker).
        """
        if self.choice == "none" or (self.choice == "auto" and not self.can_constrain):
            return None
        functions = [f for f in self.functions if self.choice != "named" or f.name == self.name]
        key = "parameters" if self.format is ToolFormat.LLAMA3 else "arguments"
        # One %json rule per function, each with its own options: compact JSON, as structured_output's
        # schemas are written (free whitespace would let a weak model pad a call forever), and, unless
        # the function says "strict": true, keywords the grammar engine cannot enforce ignored (OpenAI's
        # best effort, as for a response_format without strict).
        rules = [
            f"fn_{i}: %json "
            + _json_for_lark(
                {
                    "type": "object",
                    "properties": {
                        "name": {"const": f.name},
                        key: _rebase_refs(_an_object(f.parameters), f"#/properties/{key}"),
                    },
                    "required": ["name", key],
                    "additionalProperties": False,
                    "x-guidance": JSON_WRITING if f.strict else {**JSON_WRITING, **LENIENT},
                }
            )
            for i, f in enumerate(functions)
        ]
        body = "\n".join([f"call_body: {' | '.join(f'fn_{i}' for i in range(len(functions)))}", *rules])
        forced = self.choice != "auto"
        if self.format is ToolFormat.LLAMA3:
            calls = 'call_body ("; " call_body)*' if self.parallel else "call_body"
            if forced:
                return f"start: {calls}\n{body}\n"
            # Text may not start with "{": a reply that does is a call.
            return f"start: TEXT | {calls}\nTEXT: /[^{{](.|\\n)*/\n{body}\n"
        separator = "\\n" if self.format is ToolFormat.HERMES else ""
        if forced:
            head = 'start: call ("\\n" call)*' if self.parallel else "start: call"
            call = f'call: "{CALL_OPEN}{separator}" call_body "{separator}{CALL_CLOSE}"'
            return f"{head}\n{call}\n{body}\n"
        head = "start: call* TEXT" if self.parallel else "start: call? TEXT"
        return (
            f"{head}\nTEXT: /(.|\\n)*/\n"
            f'call_head[lazy]: TEXT "{CALL_OPEN}"\n'
            f'call: call_head "{separator}" call_body "{separator}{CALL_CLOSE}"\n'
            f"{body}\n"
        ).replace(' "" ', " ")

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the grammar of the reply (see ``grammar``).

        Under ``"auto"`` a ``structured_output`` already in ``params`` wins (the reply follows it and
        is still parsed for calls).

        Raises:
            InvalidToolsError: ``"required"`` or a named function, and ``params`` already carries a
                ``structured_output`` (both cannot hold).
        """
        grammar = self.grammar()
        if grammar is None or (self.choice == "auto" and params.structured_output is not None):
            return params
        if not self.can_constrain:
            raise InvalidToolsError(
                f"tool_choice={self.choice if self.choice != 'named' else self.name!r} needs grammar-constrained "
                "decoding, which this engine's model runner does not do",
                param="tool_choice",
                code="unsupported_tool_choice",
            )
        if params.structured_output is not None:
            raise InvalidToolsError(
                f"tool_choice={self.choice if self.choice != 'named' else self.name!r} forces the reply into tool "
                "calls, so it cannot also follow a structured_output / response_format",
                param="tool_choice",
                code="unsupported_combination",
            )
        return msgspec.structs.replace(params, structured_output=StructuredOutput(lark=grammar))

    def parse(self, text: str) -> tuple[str, tuple[ToolCall, ...]]:
        """The content and the calls of a whole reply (the reply as is under ``"none"``)."""
        if not self.parses:
            return text, ()
        content, calls = parse_tool_calls(text, self.format)
        if not self.parallel:
            calls = calls[:1]
        return content, calls

    def parser(self) -> ToolCallParser:
        """An incremental parser for a streamed reply."""
        return ToolCallParser(self.format)


def plan_tools(
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: str | Mapping[str, Any] | None,
    parallel_tool_calls: bool | None,
    fmt: Callable[[], ToolFormat],
    can_constrain: bool = True,
) -> ToolPlan | None:
    """Check a chat's tool options and decide how to serve them; None when it has no tools.

    Args:
        tools: OpenAI tool definitions (see ``check_tools``), or None.
        tool_choice: ``"none"``, ``"auto"`` (the default with tools), ``"required"``, or
            ``{"type": "function", "function": {"name": ...}}``.
        parallel_tool_calls: False: at most one call (None: one call for a named function, else True).
        fmt: Gives the model's tool-call format (called only when there are tools).
        can_constrain: Whether the engine applies grammars (see ``ToolPlan.can_constrain``).

    Raises:
        InvalidToolsError: See ``check_tools``; ``tool_choice`` malformed, naming no given tool, or
            other than "none" without tools; ``parallel_tool_calls`` not a bool.
    """
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidToolsError(
            f"parallel_tool_calls must be a bool, got {parallel_tool_calls!r}",
            param="parallel_tool_calls",
            code="invalid_parallel_tool_calls",
        )
    functions = check_tools(tools) if tools else ()
    name: str | None = None
    if tool_choice is None:
        choice = "auto" if functions else "none"
    elif isinstance(tool_choice, str) and tool_choice in ("none", "auto", "required"):
        choice = tool_choice
    elif (
        isinstance(tool_choice, Mapping)
        and tool_choice.get("type") == "function"
        and isinstance(tool_choice.get("function"), Mapping)
        and isinstance(tool_choice["function"].get("name"), str)
    ):
        choice, name = "named", tool_choice["function"]["name"]
    else:
        raise InvalidToolsError(
            'tool_choice must be "none", "auto", "required" or {"type": "function", "function": {"name": ...}}, '
            f"got {tool_choice!r}",
            param="tool_choice",
            code="invalid_tool_choice",
        )
    if not functions:
        if choice != "none":
            raise InvalidToolsError(
                f"tool_choice={tool_choice!r} needs tools, and none were given", param="tool_choice",
                code="invalid_tool_choice",
            )
        return None
    if name is not None and all(f.name != name for f in functions):
        raise InvalidToolsError(
            f"tool_choice names the function {name!r}, which is not among the tools "
            f"({', '.join(f.name for f in functions)})",
            param="tool_choice",
            code="unknown_tool",
        )
    # A named function is asked for once: several calls of it, unasked, would let a weak model repeat
    # the call until max_tokens. Any other choice may call several tools unless told otherwise.
    parallel = choice != "named" if parallel_tool_calls is None else parallel_tool_calls
    return ToolPlan(functions, choice, name, parallel, fmt(), can_constrain)


def tools_error(exc: StructuredOutputError) -> StructuredOutputError:
    """``exc`` raised by a tool grammar, re-addressed to the ``tools`` field."""
    return StructuredOutputError(f"a tool's parameters schema cannot be enforced: {exc}", param="tools")
