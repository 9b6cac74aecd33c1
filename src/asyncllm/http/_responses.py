"""``POST /v1/responses``: a minimal OpenAI Responses API over the engine's chat path.

Stateless: the conversation is the request's ``input`` (and ``instructions``), rendered with the
model's chat template as ``/v1/chat/completions`` renders ``messages``; nothing is stored, so
``previous_response_id`` (and ``conversation``) are refused rather than silently forgotten. What
would change the output and is not implemented (tools, reasoning, images and files, logprobs,
background runs) is a 400 naming the field; other unknown fields are ignored (``lenient_body``).

The request is checked and admitted (``engine.open_stream``) before a byte of the response goes
out, so a bad one is a plain 4xx. The reply is one ``response`` object, or OpenAI's semantic
server-sent events (``event: response.created`` ... ``event: response.completed``; no ``[DONE]``).
The engine stream is consumed under ``Exchange.until_disconnect``, so a client that goes away
aborts the request and frees its KV blocks, as on the other endpoints.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from asyncllm.engine._stream import RequestStream
from asyncllm.errors import InvalidRequestError, PromptTooLongError, StructuredOutputError
from asyncllm.http._app import Exchange, HTTPError
from asyncllm.http._completions import aborted, each_chunk, reply_room, schema_error, structured_output
from asyncllm.outputs import StreamChunk
from asyncllm.sampling_params import SamplingParams, StructuredOutput

if TYPE_CHECKING:
    from asyncllm.http._app import OpenAIApp

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
"""Input roles and the chat role each is rendered as: ``developer`` is OpenAI's newer name for
``system``, which chat templates know (many reject a role they do not)."""

_TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}
"""The content parts read as text, and the key of each part's text."""
_ASSISTANT_PARTS = {"output_text", "refusal"}  # what only the model says; earlier output sent back


# -- the wire format -----------------------------------------------------------------------------


class ResponsesRequest(msgspec.Struct, frozen=True, kw_only=True):
    """``POST /v1/responses``. ``input`` is a string or a list of message items (checked by hand,
    so that each mistake is a 400 naming its place)."""

    input: str | list[Any]
    model: str | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    priority: int = 0
    """vLLM's extension, as on completions."""
    num_speculative_tokens: int | None = None
    """The per-request draft length on an engine with speculative decoding, as on completions."""
    # Accepted and ignored: nothing is stored (``store: true`` keeps nothing).
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    # Refused unless neutral: each would change the output, and none is implemented.
    previous_response_id: str | None = None
    conversation: Any = None
    prompt: Any = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    text: Any = None
    reasoning: Any = None
    include: list[Any] | None = None
    top_logprobs: int | None = None
    truncation: str | None = None
    background: bool | None = None


class OutputText(msgspec.Struct, frozen=True):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    type: Literal["output_text"] = "output_text"


class OutputMessage(msgspec.Struct, frozen=True):
    id: str
    status: str  # "in_progress", "completed" or "incomplete"
    content: list[OutputText]
    role: Literal["assistant"] = "assistant"
    type: Literal["message"] = "message"


class InputTokensDetails(msgspec.Struct, frozen=True):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct, frozen=True):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, frozen=True):
    input_tokens: int
    output_tokens: int
    total_tokens: int
    input_tokens_details: InputTokensDetails = msgspec.field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = msgspec.field(default_factory=OutputTokensDetails)


class IncompleteDetails(msgspec.Struct, frozen=True):
    reason: str


class ResponseError(msgspec.Struct, frozen=True):
    code: str
    message: str


class ResponseObject(msgspec.Struct, frozen=True, kw_only=True):
    """OpenAI's ``response`` object, with every field the official client's model requires."""

    id: str
    created_at: int
    model: str
    status: str  # "in_progress", "completed", "incomplete" or "failed"
    output: list[OutputMessage]
    instructions: str | None
    max_output_tokens: int | None
    temperature: float | None
    top_p: float | None
    text: dict[str, Any]
    metadata: dict[str, str]
    store: bool
    user: str | None
    usage: ResponseUsage | None = None
    incomplete_details: IncompleteDetails | None = None
    error: ResponseError | None = None
    completed_at: int | None = None
    object: Literal["response"] = "response"
    parallel_tool_calls: bool = True
    tool_choice: str = "auto"
    tools: list[Any] = msgspec.field(default_factory=list)
    previous_response_id: None = None
    reasoning: None = None
    background: bool = False
    truncation: str = "disabled"


# -- request checks ------------------------------------------------------------------------------


def _unsupported(param: str, what: str) -> HTTPError:
    return HTTPError(400, f"{what} is not supported by this server", param=param, code="unsupported_parameter")


def _invalid(param: str, message: str) -> HTTPError:
    return HTTPError(400, message, param=param, code="invalid_request")


def _refuse_unsupported(body: ResponsesRequest) -> None:
    """Raise a 400 for the first field that asks for what this server does not do."""
    if body.previous_response_id is not None:
        raise HTTPError(
            400,
            "previous_response_id is not supported: this server stores no responses; "
            "send the whole conversation as `input` instead",
            param="previous_response_id",
            code="unsupported_parameter",
        )
    if body.conversation is not None:
        raise _unsupported("conversation", "`conversation` (stored conversations)")
    if body.prompt is not None:
        raise _unsupported("prompt", "`prompt` (stored prompt templates)")
    if body.tools:
        raise _unsupported("tools", "`tools` on /v1/responses (use /v1/chat/completions for function tools)")
    if body.tool_choice is not None and body.tool_choice not in ("auto", "none"):
        raise _unsupported("tool_choice", "`tool_choice` other than auto or none")
    reasoning = body.reasoning
    if reasoning is not None and (
        not isinstance(reasoning, dict)
        or any(value is not None and (key, value) != ("effort", "none") for key, value in reasoning.items())
    ):
        raise _unsupported("reasoning", "`reasoning`")
    if body.include:
        raise _unsupported("include", "`include`")
    if body.top_logprobs:
        raise _unsupported("top_logprobs", "`top_logprobs`")
    if body.truncation not in (None, "disabled"):
        raise _unsupported("truncation", f"truncation={body.truncation!r}")
    if body.background:
        raise _unsupported("background", "`background: true`")


def _text_format(text: Any) -> tuple[dict[str, Any], StructuredOutput | None]:
    """The ``text`` config to echo, and the constraint its ``format`` asks for.

    ``text.format`` ``{"type": "json_schema", "name", "schema", "strict"}`` and ``{"type":
    "json_object"}`` map onto chat's ``response_format`` (``SamplingParams.structured_output``).

    Raises:
        HTTPError: 400 with ``param`` ``text``, ``text.format`` or ``text.verbosity``.
    """
    if text is None:
        return {"format": {"type": "text"}}, None
    if not isinstance(text, dict):
        raise _invalid("text", 'text must be an object such as {"format": {"type": "text"}}')
    if text.get("verbosity") not in (None, "medium"):
        raise _unsupported("text.verbosity", f"text.verbosity={text['verbosity']!r}")
    spec = text.get("format")
    if spec is None:
        return {"format": {"type": "text"}}, None
    if not isinstance(spec, dict) or not isinstance(spec.get("type"), str):
        raise _invalid("text.format", 'text.format must be {"type": "text" | "json_object" | "json_schema", ...}')
    kind = spec["type"]
    if kind == "json_schema":
        fields = {k: v for k, v in spec.items() if k != "type" and v is not None}
        response_format: dict[str, Any] = {"type": "json_schema", "json_schema": fields}
    elif kind in ("text", "json_object"):
        response_format = {"type": kind}
    else:
        raise _unsupported("text.format", f"text.format of type {kind!r}")
    try:
        constraint = structured_output(response_format)
    except HTTPError as exc:  # worded for chat's response_format; say where the field is here
        message = (
            str(exc).replace("response_format.json_schema", "text.format").replace("response_format", "text.format")
        )
        raise HTTPError(400, message, param="text.format", code=exc.body.error.code) from None
    return {"format": spec}, constraint


def _text_of(content: Any, param: str, role: str) -> str:
    """A message item's content as one string (its text parts joined)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise _invalid(param, f"{param} must be a string or a list of content parts")
    texts = []
    for index, part in enumerate(content):
        where = f"{param}[{index}]"
        kind = part.get("type") if isinstance(part, dict) and isinstance(part.get("type"), str) else None
        if kind in ("input_image", "input_file", "input_audio"):
            raise _unsupported(where, f"content of type {kind!r} (this server reads text only)")
        if kind not in _TEXT_PARTS or not isinstance(part.get(_TEXT_PARTS[kind]), str):
            raise _invalid(
                where, f'{where} must be {{"type": "input_text" or "output_text", "text": ...}} or a refusal part'
            )
        if role != "assistant" and kind in _ASSISTANT_PARTS:
            raise _invalid(where, f"{where}: {kind} parts belong to assistant messages")
        texts.append(part[_TEXT_PARTS[kind]])
    return "".join(texts)


def chat_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The conversation ``body`` describes, as the engine's chat takes it: ``instructions`` first (as
    a system message), then ``input`` (a string is one user message).

    Raises:
        HTTPError: 400 naming the item at fault (``input[2].content[0]``, ...).
    """
    messages: list[dict[str, Any]] = []
    if body.instructions is not None:
        messages.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        messages.append({"role": "user", "content": body.input})
        return messages
    if not body.input:
        raise _invalid("input", "input must be a non-empty string or list of messages")
    for index, item in enumerate(body.input):
        where = f"input[{index}]"
        if not isinstance(item, dict):
            raise _invalid(where, f'{where} must be a message: {{"role": ..., "content": ...}}')
        kind = item.get("type")
        if kind not in (None, "message"):  # None: unset, as clients that serialise every field send it
            raise _unsupported(where, f"input items of type {kind!r}")
        role = item.get("role")
        if not isinstance(role, str) or role not in _ROLES:  # a list or an object cannot be looked up
            raise _invalid(f"{where}.role", f"{where}.role must be user, assistant, system or developer, got {role!r}")
        messages.append({"role": _ROLES[role], "content": _text_of(item.get("content"), f"{where}.content", role)})
    return messages


# -- the handler ---------------------------------------------------------------------------------


class _Events:
    """The numbered server-sent events of one streamed response."""

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange
        self.number = 0

    async def send(self, kind: str, **fields: Any) -> None:
        await self.exchange.event({"type": kind, "sequence_number": self.number, **fields}, name=kind)
        self.number += 1


class ResponsesHandler:
    """``POST /v1/responses`` of one ``OpenAIApp``."""

    def __init__(self, app: OpenAIApp) -> None:
        self.app = app
        self.engine = app.engine

    async def _prompt(self, messages: list[dict[str, Any]]) -> list[int]:
        try:
            return await self.engine.encode_chat(messages)  # a long conversation renders in a worker thread
        except InvalidRequestError as exc:  # the engine names chat's `messages`; here the field is `input`
            code = getattr(exc, "code", None)
            code = code if isinstance(code, str) else "invalid_request"
            raise HTTPError(400, str(exc), param="input", code=code) from exc

    async def create(self, exchange: Exchange) -> None:
        """``POST /v1/responses``."""
        body = await exchange.json(ResponsesRequest)
        self.app.check_model(body.model)
        _refuse_unsupported(body)
        text_config, constraint = _text_format(body.text)
        if body.max_output_tokens is not None and body.max_output_tokens < 1:
            raise _invalid("max_output_tokens", f"max_output_tokens must be >= 1, got {body.max_output_tokens}")
        prompt_ids = await self._prompt(chat_messages(body))
        room = reply_room(self.engine, len(prompt_ids), "input")
        max_tokens = room if body.max_output_tokens is None else body.max_output_tokens  # default: as chat's
        if max_tokens > room:  # checked here, where the engine's message would name max_tokens and the prompt
            raise PromptTooLongError(
                f"input of {len(prompt_ids)} tokens plus max_output_tokens={max_tokens} is "
                f"{len(prompt_ids) + max_tokens} tokens, more than max_model_len={self.engine.max_model_len}",
                param="max_output_tokens",
            )
        sampling: dict[str, Any] = {"max_tokens": max_tokens, "structured_output": constraint}
        if body.temperature is not None:
            sampling["temperature"] = body.temperature
        if body.top_p is not None:
            sampling["top_p"] = body.top_p
        if body.num_speculative_tokens is not None:
            sampling["num_speculative_tokens"] = body.num_speculative_tokens
        params = SamplingParams(**sampling)
        try:
            stream = await self.engine.open_stream(prompt_ids, params, priority=body.priority)
        except StructuredOutputError as exc:
            raise schema_error(exc, "text.format") from exc
        except PromptTooLongError as exc:
            raise HTTPError(400, str(exc), param="input", code="invalid_request") from exc
        reply = _Reply(body, self.app.model_name, text_config, stream)
        if body.stream:
            await self._stream(exchange, stream, reply)
            return

        async def collect(_: int, chunk: StreamChunk) -> None:
            reply.add(chunk)

        await exchange.until_disconnect(lambda: each_chunk([stream], collect))
        await exchange.respond_json(200, reply.response(reply.final_status()))

    async def _stream(self, exchange: Exchange, stream: RequestStream, reply: _Reply) -> None:
        events = _Events(exchange)
        where = {"item_id": reply.message_id, "output_index": 0}

        async def fail(error: HTTPError) -> None:
            # The stream has started: a failure is its last events (the precise code, then the
            # response in its failed state, whose error code is one OpenAI's clients know).
            body = error.body.error
            await events.send("error", code=body.code, message=body.message, param=body.param)
            failed = ResponseError("server_error", f"{body.code}: {body.message}")
            await events.send("response.failed", response=reply.response("failed", failed))
            await exchange.end_events(done=False)

        # The app answers every error once the stream has started this way: the engine's failures
        # raised below, and a shutdown that cancels the request.
        exchange.end_events_with_error = fail

        async def run() -> None:
            async with stream:  # closed whatever happens, which aborts the request if it has not ended
                await exchange.start_events()
                await events.send("response.created", response=reply.response("in_progress"))
                await events.send("response.in_progress", response=reply.response("in_progress"))
                await events.send("response.output_item.added", output_index=0, item=reply.message("in_progress"))
                await events.send("response.content_part.added", **where, content_index=0, part=OutputText(""))
                async for chunk in stream:
                    reply.add(chunk)
                    if chunk.text:
                        await events.send(
                            "response.output_text.delta", **where, content_index=0, delta=chunk.text, logprobs=[]
                        )

        await exchange.until_disconnect(run)
        text = reply.text()
        status = reply.final_status()
        await events.send("response.output_text.done", **where, content_index=0, text=text, logprobs=[])
        await events.send("response.content_part.done", **where, content_index=0, part=OutputText(text))
        await events.send("response.output_item.done", output_index=0, item=reply.message(_item_status(status)))
        await events.send(f"response.{status}", response=reply.response(status))
        await exchange.end_events(done=False)


def _item_status(status: str) -> str:
    return "completed" if status == "completed" else "incomplete"


class _Reply:
    """What one response said so far, and the ``response`` objects that tell it."""

    def __init__(self, body: ResponsesRequest, model: str, text_config: dict[str, Any], stream: RequestStream) -> None:
        self.body = body
        self.model = model
        self.text_config = text_config
        self.stream = stream
        self.input_tokens = len(stream.prompt_token_ids)
        self.id = f"resp_{uuid.uuid4().hex}"
        self.message_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.parts: list[str] = []
        self.output_tokens = 0
        self.finish_reason: str | None = None

    def add(self, chunk: StreamChunk) -> None:
        """Count ``chunk`` in.

        Raises:
            HTTPError: 503 when the engine aborted the request (it is shutting down).
        """
        if chunk.finish_reason == "abort":
            raise aborted()
        self.parts.append(chunk.text)
        self.output_tokens += len(chunk.token_ids)
        if chunk.finished:
            self.finish_reason = chunk.finish_reason

    def text(self) -> str:
        return "".join(self.parts)

    def final_status(self) -> str:
        # "length" is max_output_tokens or the end of the context: OpenAI names both max_output_tokens.
        return "incomplete" if self.finish_reason == "length" else "completed"

    def message(self, status: str) -> OutputMessage:
        """The output message at ``status`` (``in_progress``: no content part yet)."""
        return OutputMessage(self.message_id, status, [] if status == "in_progress" else [OutputText(self.text())])

    def _usage(self) -> ResponseUsage:
        cached = InputTokensDetails(self.stream.num_cached_tokens or 0)
        return ResponseUsage(self.input_tokens, self.output_tokens, self.input_tokens + self.output_tokens, cached)

    def response(self, status: str, error: ResponseError | None = None) -> ResponseObject:
        """The ``response`` object at ``status`` (``in_progress``: no output or usage yet)."""
        body = self.body
        done = status != "in_progress"
        output = [self.message(_item_status(status))] if done else []
        return ResponseObject(
            id=self.id,
            created_at=self.created_at,
            model=self.model,
            status=status,
            output=output,
            instructions=body.instructions,
            max_output_tokens=body.max_output_tokens,
            temperature=body.temperature,
            top_p=body.top_p,
            text=self.text_config,
            metadata=body.metadata or {},
            store=False,  # nothing is kept, whatever `store` asked
            user=body.user,
            usage=self._usage() if done else None,
            incomplete_details=IncompleteDetails("max_output_tokens") if status == "incomplete" else None,
            error=error,
            completed_at=int(time.time()) if status == "completed" else None,
        )
