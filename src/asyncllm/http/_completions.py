"""``POST /v1/completions`` and ``POST /v1/chat/completions``: OpenAI bodies in, engine streams out.

Every request is validated up to the engine's own checks (``engine.open_stream()`` raises at the
call) before a byte of the response is sent, so a bad request is always a clean 4xx. The app's own
limits (``max_choices``, ``max_completion_logprobs``, ``max_top_logprobs``) are checked first, before
any prompt is tokenized; prompts are admitted with ``open_stream`` and conversations rendered with
``encode_chat``, which tokenize long ones in a worker thread, off the event loop. Then the response
is either one JSON body or server-sent events; either way the engine streams are consumed under
``Exchange.until_disconnect``, so a client that goes away cancels the consumer, which closes the
streams, which aborts the requests and frees their KV blocks at the next step.
"""

from __future__ import annotations

import contextlib
import math
import re
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import anyio
import msgspec
from anyio.streams.memory import MemoryObjectSendStream

from asyncllm.engine._detokenizer import IncrementalDetokenizer
from asyncllm.engine._stream import RequestStream
from asyncllm.engine._tools import ToolCallDelta, ToolPlan
from asyncllm.errors import PromptTooLongError, StructuredOutputError
from asyncllm.http._app import Exchange, HTTPError
from asyncllm.http._protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    DeltaFunction,
    PromptLogprob,
    PromptLogprobs,
    PromptTokensDetails,
    SamplingRequest,
    ToolCallDeltaOut,
    ToolCallFunction,
    ToolCallOut,
    Usage,
)
from asyncllm.outputs import Logprobs, StreamChunk
from asyncllm.sampling_params import SamplingParams, StructuredOutput

if TYPE_CHECKING:
    from asyncllm.engine._engine import Engine
    from asyncllm.http._app import OpenAIApp
_COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions

# A request field at its neutral value asks for nothing, so it is fine even where unsupported.
_NEUTRAL: dict[str, Any] = {
    "n": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "min_p": 0.0,
    "min_tokens": 0,
    "stop": (),
    "stop_token_ids": (),
    "logit_bias": {},
    "ignore_eos": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False,
    "bad_words": (),
}

OnChunk = Callable[[int, StreamChunk], Awaitable[None]]
_Item = tuple[int, StreamChunk | None, Exception | None]  # (stream index, chunk, or the error it ended with)


def _over_limit(what: str, limit: str, value: int, param: str) -> HTTPError:
    flag = limit.replace("_", "-")
    return HTTPError(
        400,
        f"{what}, more than this server allows ({limit}={value}); "
        f"raise the limit with create_app({limit}=...) or `asyncllm serve --{flag}`",
        param=param,
        code="invalid_request",
    )


def _unsupported(param: str, what: str | None = None) -> HTTPError:
    return HTTPError(
        400, f"{what or f'`{param}`'} is not supported yet by this server", param=param, code="unsupported_parameter"
    )


def sampling_params(body: SamplingRequest, *, max_tokens: int, **extra: Any) -> SamplingParams:
    """The engine's ``SamplingParams`` for an OpenAI request body.

    Each request field maps to the ``SamplingParams`` field of the same name when it has one;
    a field the engine does not have yet, given a non-neutral value, is a 400 "not supported yet".

    Raises:
        HTTPError: 400 for an unsupported field.
        InvalidSamplingParamsError: A value is out of range (a 400 too, via ``error_for``).
    """
    if body.stream_options is not None and body.stream_options.continuous_usage_stats:
        raise _unsupported("stream_options", "`stream_options.continuous_usage_stats`")
    requested: dict[str, Any] = {
        "temperature": body.temperature,
        "top_p": body.top_p,
        "top_k": body.top_k,
        "min_p": body.min_p,
        "seed": body.seed,
        "n": body.n,
        "presence_penalty": body.presence_penalty,
        "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty,
        "min_tokens": body.min_tokens,
        "ignore_eos": body.ignore_eos,
        "skip_special_tokens": body.skip_special_tokens,
        "spaces_between_special_tokens": body.spaces_between_special_tokens,
        "include_stop_str_in_output": body.include_stop_str_in_output,
        "allowed_token_ids": tuple(body.allowed_token_ids) if body.allowed_token_ids is not None else None,
        "bad_words": tuple(body.bad_words) if body.bad_words is not None else None,
        "stop": (body.stop,) if isinstance(body.stop, str) else tuple(body.stop) if body.stop is not None else None,
        "stop_token_ids": tuple(body.stop_token_ids) if body.stop_token_ids is not None else None,
        "logit_bias": _logit_bias(body.logit_bias),
        "num_speculative_tokens": body.num_speculative_tokens,
        **extra,
    }
    fields = SamplingParams.__struct_fields__
    kwargs: dict[str, Any] = {"max_tokens": max_tokens}
    for name, value in requested.items():
        if value is None or (name in _NEUTRAL and value == _NEUTRAL[name]):
            continue
        if name not in fields:
            raise _unsupported(name, "n > 1" if name == "n" else None)
        kwargs[name] = value
    return SamplingParams(**kwargs)


def _params(
    body: CompletionRequest, *, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None
) -> SamplingParams:
    return sampling_params(
        body,
        max_tokens=max_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        structured_output=structured_output(body.response_format),
    )


def _delta_out(delta: ToolCallDelta) -> ToolCallDeltaOut:
    if delta.id is not None:
        return ToolCallDeltaOut(delta.index, delta.id, "function", DeltaFunction(name=delta.name, arguments=""))
    return ToolCallDeltaOut(delta.index, function=DeltaFunction(arguments=delta.arguments))


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    if bias is None:
        return None
    try:
        return {int(token): value for token, value in bias.items()}
    except ValueError:
        raise HTTPError(400, "logit_bias keys must be token ids", param="logit_bias", code="invalid_value") from None


def _is_ids(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def _prompts(prompt: str | list[Any]) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(p, str) for p in prompt):
        return list(prompt)
    if prompt and _is_ids(prompt):
        return [list(prompt)]
    if prompt and all(_is_ids(p) for p in prompt):
        return [list(p) for p in prompt]
    raise HTTPError(
        400,
        "prompt must be a non-empty string, list of strings, list of token ids or list of lists of token ids",
        param="prompt",
        code="invalid_value",
    )


CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool", "function"})
"""The message roles OpenAI's API allows."""


def chat_messages(messages: Sequence[ChatMessage]) -> list[dict[str, Any]]:
    """OpenAI's messages as the engine's chat takes them.

    Raises:
        HTTPError: 400 for no messages, a role OpenAI does not have (``param`` ``messages[i].role``),
            no content on a message other than an assistant's, or content parts other than text.
    """
    if not messages:
        raise HTTPError(400, "messages must not be empty", param="messages", code="invalid_value")
    for index, message in enumerate(messages):
        if message.role not in CHAT_ROLES:
            raise HTTPError(
                400,
                f"messages[{index}].role is {message.role!r}; use one of {', '.join(sorted(CHAT_ROLES))}",
                param=f"messages[{index}].role",
                code="invalid_value",
            )
    return [_message(i, m) for i, m in enumerate(messages)]


def _message(index: int, message: ChatMessage) -> dict[str, Any]:
    # OpenAI's message as the engine's chat takes it (content parts joined; tool fields kept).
    content = message.content
    text: str | None
    if content is None:
        if message.role != "assistant":  # only an assistant's message (a tool call, a refusal) may have none
            raise HTTPError(
                400, f"messages[{index}].content is required for role {message.role!r}",
                param=f"messages[{index}].content", code="invalid_value",
            )
        text = None if message.tool_calls else ""
    elif isinstance(content, str):
        text = content
    else:
        for part in content:
            if part.type != "text" or part.text is None:
                raise _unsupported(f"messages[{index}].content", f"content of type {part.type!r}")
        text = "".join(part.text or "" for part in content)
    result: dict[str, Any] = {"role": message.role, "content": text}
    if message.name is not None:
        result["name"] = message.name
    if message.tool_calls:
        result["tool_calls"] = message.tool_calls
    if message.tool_call_id is not None:
        result["tool_call_id"] = message.tool_call_id
    return result


_SCHEMA_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def _response_format_error(message: str, code: str = "invalid_response_format") -> HTTPError:
    return HTTPError(400, message, param="response_format", code=code)


def structured_output(response_format: Any) -> StructuredOutput | None:
    """The engine's ``StructuredOutput`` for OpenAI's ``response_format`` (None for text or none).

    Raises:
        HTTPError: 400 with ``param="response_format"``: a malformed value
            (``invalid_response_format``), a type this server does not know
            (``unsupported_response_format``), a json_schema without a ``schema`` (``missing_schema``),
            or a schema that is not a JSON Schema object (``invalid_schema``). Whether the schema
            compiles is checked by the engine (``StructuredOutputError``, see ``schema_error``).
    """
    if response_format is None:
        return None
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise _response_format_error(
            'response_format must be {"type": "text"}, {"type": "json_object"} or '
            '{"type": "json_schema", "json_schema": {"name": ..., "schema": {...}}}'
        )
    kind = response_format["type"]
    extra = sorted(set(response_format) - ({"type", "json_schema"} if kind == "json_schema" else {"type"}))
    if kind in ("text", "json_object", "json_schema") and extra:
        raise _response_format_error(f"response_format of type {kind!r} has unknown field(s): {', '.join(extra)}")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput(json_object=True)
    if kind != "json_schema":
        raise _response_format_error(
            f"response_format type {kind!r} is not supported; use text, json_object or json_schema",
            "unsupported_response_format",
        )
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise _response_format_error('response_format.json_schema must be {"name": ..., "schema": {...}}')
    unknown = sorted(set(spec) - {"name", "schema", "strict", "description"})
    if unknown:
        raise _response_format_error(f"response_format.json_schema has unknown field(s): {', '.join(unknown)}")
    name = spec.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        raise _response_format_error(f"response_format.json_schema.name must match [a-zA-Z0-9_-]{{1,64}}, got {name!r}")
    if spec.get("strict") is not None and not isinstance(spec["strict"], bool):
        raise _response_format_error("response_format.json_schema.strict must be a bool")
    if spec.get("description") is not None and not isinstance(spec["description"], str):
        raise _response_format_error("response_format.json_schema.description must be a string")
    if spec.get("schema") is None:
        raise _response_format_error("response_format.json_schema has no schema", "missing_schema")
    schema = spec["schema"]
    if not isinstance(schema, (dict, bool)):
        raise _response_format_error(
            f"response_format.json_schema.schema must be a JSON Schema object, got {type(schema).__name__}",
            "invalid_schema",
        )
    # strict: the schema is enforced whole or refused. Otherwise OpenAI promises best effort: keywords the
    # grammar engine cannot enforce are ignored rather than refused (StructuredOutput.lenient).
    return StructuredOutput(json_schema=schema, lenient=spec.get("strict") is not True)


def reply_room(engine: Engine, prompt_tokens: int, param: str) -> int:
    """The most tokens a reply to a prompt of ``prompt_tokens`` can have within ``max_model_len``
    (the chat endpoints' default length).

    Raises:
        PromptTooLongError: There is no room for one token; ``param`` names the conversation's field.
    """
    room = engine.max_model_len - prompt_tokens
    if room < 1:
        raise PromptTooLongError(
            f"{prompt_tokens} tokens of {param} leave no room to reply within max_model_len={engine.max_model_len}",
            param=param,
        )
    return room


def schema_error(exc: StructuredOutputError, param: str) -> HTTPError:
    """A schema (or grammar) the engine could not compile, as a 400 on ``param``."""
    unsupported = exc.code == "structured_output_unavailable"  # the runner or tokenizer masks nothing
    code = "unsupported_response_format" if unsupported else "invalid_schema"
    return HTTPError(400, str(exc), param=param, code=code)


async def each_chunk(streams: Sequence[RequestStream], on_chunk: OnChunk) -> None:
    """Feed every chunk of ``streams`` to ``on_chunk(stream index, chunk)`` until all have ended.

    Each stream is closed on the way out, whatever the way (an error, a cancellation), which
    aborts its request if it has not finished. The first error is re-raised as is.
    """
    if len(streams) == 1:
        async with streams[0] as stream:
            async for chunk in stream:
                await on_chunk(0, chunk)
        return
    # Several prompts: one pump per stream into a channel. It is unbounded on purpose: a pump
    # only forwards what its stream already buffered, the same bounded-by-output memory.
    send, receive = anyio.create_memory_object_stream[_Item](math.inf)

    async def pump(index: int, stream: RequestStream, out: MemoryObjectSendStream[_Item]) -> None:
        with out:
            async with stream:
                try:
                    async for chunk in stream:
                        out.send_nowait((index, chunk, None))
                except anyio.BrokenResourceError:
                    return  # the consumer is gone; leaving `async with stream` aborts the request
                except Exception as exc:
                    with contextlib.suppress(anyio.BrokenResourceError):
                        out.send_nowait((index, None, exc))

    error: Exception | None = None
    async with anyio.create_task_group() as task_group:
        with send:
            for index, stream in enumerate(streams):
                task_group.start_soon(pump, index, stream, send.clone())
        with receive:
            try:
                async for index, item, exc in receive:
                    if exc is not None:
                        raise exc
                    if item is not None:
                        await on_chunk(index, item)
            except Exception as exc:
                error = exc  # raised in the task group it would come out wrapped in an ExceptionGroup
                task_group.cancel_scope.cancel()
    if error is not None:
        raise error


def aborted() -> HTTPError:
    """The 503 for a stream the engine aborted (it is shutting down)."""
    return HTTPError(503, "the request was aborted: the engine is shutting down", type="server_error", code="aborted")


def completion_logprobs(
    segments: Sequence[tuple[Sequence[Any], int]], offset: int
) -> tuple[CompletionLogprobs, int]:
    """The legacy completions ``logprobs`` object for ``segments``, each a chunk's logprob entries
    (``asyncllm.outputs.Logprobs``) and the length of the text that chunk added, the first starting at
    character ``offset`` of the choice's text; and the offset after the last segment's text.

    Each token starts where the tokens before it in its chunk end, capped at its chunk's end, and each
    chunk starts where the text before it ends: a token's own text is not always in the choice's text
    (a character split across tokens decodes alone to U+FFFD, a stop string cuts the text), so summing
    the tokens' texts alone would run past it.
    """
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    offsets: list[int] = []
    for entries, text_length in segments:
        end = offset + text_length
        running = offset
        for entry in entries:
            tokens.append(entry.token.text)
            token_logprobs.append(entry.token.logprob)
            top = {alt.text: alt.logprob for alt in entry.top}
            top.setdefault(entry.token.text, entry.token.logprob)  # the chosen token is always listed
            top_logprobs.append(top)
            offsets.append(min(running, end))
            running += len(entry.token.text)
        offset = end
    return CompletionLogprobs(tokens, token_logprobs, top_logprobs, offsets), offset


def prompt_logprobs_out(entries: Sequence[Logprobs | None]) -> PromptLogprobs:
    """vLLM's ``prompt_logprobs`` for the engine's: per position, the prompt's token then its alternatives."""
    out: PromptLogprobs = []
    for entry in entries:
        if entry is None:
            out.append(None)
            continue
        ranked = {entry.token.token_id: PromptLogprob(entry.token.logprob, entry.token.rank, entry.token.text)}
        for alt in entry.top:
            ranked.setdefault(alt.token_id, PromptLogprob(alt.logprob, alt.rank, alt.text))
        out.append(ranked)
    return out


def echo_offsets(tokenizer: Any, token_ids: Sequence[int], text: str) -> list[int]:
    """Where each prompt token starts in the echoed ``text``, as ``text_offset`` must say.

    Summing each token's own text would run ahead of ``text`` wherever a token's text is not there: a
    character split across tokens (each decodes alone to U+FFFD), or a BOS the tokenizer added to a
    text prompt (the echo is the prompt as sent). The ids are decoded incrementally instead, and a token
    starts where the text decoded before it ends; for a text prompt, the decoded text's lead over the
    prompt (the added special tokens' text) is taken off.
    """
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special_tokens=False, spaces_between_special_tokens=False)
    offsets: list[int] = []
    decoded = 0
    for token_id in token_ids:
        offsets.append(decoded)
        decoded += len(detokenizer.push([token_id]))
    decoded += len(detokenizer.flush())
    lead = max(0, decoded - len(text))
    return [min(max(offset - lead, 0), len(text)) for offset in offsets]


def echo_logprobs(
    entries: Sequence[Logprobs | None], offsets: Sequence[int], first_token: str, num_top: int, end: int
) -> tuple[CompletionLogprobs, int]:
    """The legacy ``logprobs`` of an echoed prompt, from its ``prompt_logprobs`` (None first: nothing
    predicts the first token, whose text is ``first_token``), each position's alternatives cut to
    ``num_top``, its tokens starting at ``offsets`` (see ``echo_offsets``); and ``end``, the offset
    after the echoed text, where the generated tokens start."""
    num_prompt_tokens = len(offsets)
    tokens, text_offset = [first_token], [offsets[0]]
    token_logprobs: list[float | None] = [None]
    top_logprobs: list[dict[str, float] | None] = [None]
    if len(entries) != num_prompt_tokens:
        raise HTTPError(500, "the engine returned no logprobs for the prompt", type="server_error",
                        code="internal_error")
    for entry in entries[1:]:
        if entry is None:  # not computed (cannot happen for a prompt_logprobs request)
            raise HTTPError(500, "the engine returned no logprobs for a prompt token", type="server_error",
                            code="internal_error")
        top = {alt.text: alt.logprob for alt in entry.top[:num_top]}
        top.setdefault(entry.token.text, entry.token.logprob)
        tokens.append(entry.token.text)
        token_logprobs.append(entry.token.logprob)
        top_logprobs.append(top)
        text_offset.append(offsets[len(text_offset)])
    return CompletionLogprobs(tokens, token_logprobs, top_logprobs, text_offset), end


def _cut(entry: Logprobs, num_top: int) -> Logprobs:
    # The engine computed as many alternatives as the most any field asked for; each field shows its own.
    return entry if len(entry.top) <= num_top else msgspec.structs.replace(entry, top=entry.top[:num_top])


def _joined(first: CompletionLogprobs, second: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(
        first.tokens + second.tokens,
        first.token_logprobs + second.token_logprobs,
        first.top_logprobs + second.top_logprobs,
        first.text_offset + second.text_offset,
    )


class _Echo(msgspec.Struct, frozen=True):
    """What each choice of one prompt starts with under ``echo``."""

    text: str
    logprobs: CompletionLogprobs | None
    end_offset: int  # where the generated tokens' text_offset starts


def chat_logprobs(entries: Sequence[Any]) -> ChatLogprobs:
    """The chat ``logprobs`` object for ``entries`` (``asyncllm.outputs.Logprobs``)."""
    return ChatLogprobs(
        [
            ChatTokenLogprob(
                entry.token.text,
                entry.token.logprob,
                list(entry.token.text.encode()),
                [ChatTopLogprob(alt.text, alt.logprob, list(alt.text.encode())) for alt in entry.top],
            )
            for entry in entries
        ]
    )


class _Choices:
    """What a request's chunks said so far, per choice (``stream index * n + chunk.index``)."""

    def __init__(self, num_choices: int, n: int) -> None:
        self.n = n
        self.texts: dict[int, list[str]] = {i: [] for i in range(num_choices)}
        # Per choice, each chunk's logprob entries and the length of its text (see completion_logprobs).
        self.logprobs: dict[int, list[tuple[Sequence[Any], int]]] = {i: [] for i in range(num_choices)}
        self.offsets: dict[int, int] = dict.fromkeys(range(num_choices), 0)
        self.reasons: dict[int, str | None] = dict.fromkeys(range(num_choices))
        self.generated = 0

    def add(self, stream_index: int, chunk: StreamChunk, *, keep: bool) -> tuple[int, Sequence[Any]]:
        """Count ``chunk`` in (and keep its text and logprobs when ``keep``); return its choice index
        and its logprob entries.

        Raises:
            HTTPError: 503 when the engine aborted the request (it is shutting down).
        """
        if chunk.finish_reason == "abort":
            raise aborted()
        index = stream_index * self.n + chunk.index
        self.generated += len(chunk.token_ids)
        entries: Sequence[Any] = getattr(chunk, "logprobs", None) or ()
        if keep:
            self.texts[index].append(chunk.text)
            self.logprobs[index].append((entries, len(chunk.text)))
        if chunk.finished:
            self.reasons[index] = chunk.finish_reason
        return index, entries

    def usage(self, prompt_tokens: int, streams: Sequence[RequestStream]) -> Usage:
        cached = sum(stream.num_cached_tokens or 0 for stream in streams)
        return Usage(prompt_tokens, self.generated, prompt_tokens + self.generated, PromptTokensDetails(cached))


class CompletionHandlers:
    """The two generating endpoints of one ``OpenAIApp``."""

    def __init__(self, app: OpenAIApp) -> None:
        self.app = app
        self.engine = app.engine

    def _check_choices(self, num_prompts: int, n: int) -> None:
        if num_prompts * n > self.app.max_choices:
            what = f"n={n}" if num_prompts == 1 else f"{num_prompts} prompts times n={n}"
            raise _over_limit(
                f"this request asks for {num_prompts * n} choices ({what})",
                "max_choices",
                self.app.max_choices,
                "n" if n > self.app.max_choices else "prompt",
            )

    async def _open(
        self,
        prompts: Sequence[str | list[int]],
        params: SamplingParams,
        cache_salt: str | None,
        priority: int,
        constraint_from: str = "response_format",
    ) -> list[RequestStream]:
        # open_stream tokenizes long prompts in a worker thread and is a checkpoint, so admitting
        # many prompts lets the other requests' streams run in between.
        streams: list[RequestStream] = []
        try:
            for prompt in prompts:
                streams.append(
                    await self.engine.open_stream(prompt, params, cache_salt=cache_salt, priority=priority)
                )
        except StructuredOutputError as exc:
            for stream in streams:
                await stream.aclose()
            raise schema_error(exc, constraint_from) from exc
        except BaseException:
            for stream in streams:
                await stream.aclose()
            raise
        return streams

    # -- /v1/completions -------------------------------------------------------------------------

    async def completions(self, exchange: Exchange) -> None:
        """``POST /v1/completions``."""
        body = await exchange.json(CompletionRequest)
        self.app.check_model(body.model)
        if body.suffix:
            raise _unsupported("suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise _unsupported("best_of")
        if body.n < 1:
            raise HTTPError(400, f"n must be >= 1, got {body.n}", param="n", code="invalid_value")
        prompts = _prompts(body.prompt)
        self._check_choices(len(prompts), body.n)
        for name, value in (("logprobs", body.logprobs), ("prompt_logprobs", body.prompt_logprobs)):
            if value is not None and value > self.app.max_completion_logprobs:
                raise _over_limit(
                    f"{name}={value} asks for more alternatives per token",
                    "max_completion_logprobs",
                    self.app.max_completion_logprobs,
                    name,
                )
        max_tokens = _COMPLETIONS_DEFAULT_MAX_TOKENS if body.max_tokens is None else body.max_tokens
        # max_tokens=0 computes the prompt alone and generates nothing (finish_reason "length"): with echo
        # and logprobs, OpenAI's way to score a prompt (lm-evaluation-harness's loglikelihood).
        want_logprobs = body.logprobs is not None
        engine_prompt_logprobs = body.prompt_logprobs
        if body.echo and body.logprobs is not None:
            engine_prompt_logprobs = max(body.logprobs, body.prompt_logprobs or 0)
        params = _params(
            body,
            max_tokens=max_tokens,
            logprobs=body.logprobs,
            prompt_logprobs=engine_prompt_logprobs,
        )
        streams = await self._open(prompts, params, body.cache_salt, body.priority)
        request_id, created, model = f"cmpl-{uuid.uuid4().hex}", int(time.time()), self.app.model_name
        prompt_tokens = sum(len(s.prompt_token_ids) for s in streams)
        choices = _Choices(len(prompts) * body.n, body.n)
        prompt_entries: dict[int, tuple[Logprobs | None, ...]] = {}  # stream index -> its prompt's logprobs
        prompt_texts: list[str] = []
        if body.echo:
            try:  # token ids are decoded (long ones in a worker thread); their streams are open already
                for prompt in prompts:
                    prompt_texts.append(prompt if isinstance(prompt, str) else await self.engine.detokenize(prompt))
            except BaseException:
                for stream in streams:
                    await stream.aclose()
                raise

        echoes: dict[int, _Echo] = {}

        def echo(stream_index: int) -> _Echo:  # built once per prompt, shared by its n choices
            found = echoes.get(stream_index)
            if found is not None:
                return found
            echoed = _Echo(prompt_texts[stream_index], None, 0)
            if want_logprobs:
                first_id = streams[stream_index].prompt_token_ids[0]
                first = self.engine.tokenizer.decode([first_id], skip_special_tokens=False)
                entries = prompt_entries.get(stream_index, ())
                text = prompt_texts[stream_index]
                offsets = echo_offsets(self.engine.tokenizer, streams[stream_index].prompt_token_ids, text)
                logprobs, end = echo_logprobs(entries, offsets, first, body.logprobs or 0, len(text))
                echoed = _Echo(text, logprobs, end)
            echoes[stream_index] = echoed
            return echoed

        def vllm_prompt_logprobs(stream_index: int) -> PromptLogprobs | msgspec.UnsetType:
            if body.prompt_logprobs is None:
                return msgspec.UNSET
            entries = prompt_entries.get(stream_index, ())
            return prompt_logprobs_out([None if e is None else _cut(e, body.prompt_logprobs) for e in entries])

        def engine_chunk(stream_index: int, chunk: StreamChunk) -> StreamChunk:
            if chunk.prompt_logprobs is not None:
                prompt_entries[stream_index] = chunk.prompt_logprobs
            return chunk

        def response(items: list[CompletionChoice], usage: Usage | None = None) -> CompletionResponse:
            return CompletionResponse(request_id, created, model, items, usage)

        if body.stream:
            await exchange.start_events()
            started: set[int] = set()

            async def send_chunk(stream_index: int, raw: StreamChunk) -> None:
                chunk = engine_chunk(stream_index, raw)
                index, entries = choices.add(stream_index, chunk, keep=False)
                extra: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET
                if index not in started and chunk.finish_reason != "abort":
                    # A choice's first event: its echoed prompt (OpenAI's), its prompt_logprobs (vLLM's).
                    started.add(index)
                    extra = vllm_prompt_logprobs(stream_index)
                    if body.echo:
                        echoed = echo(stream_index)
                        choices.offsets[index] = echoed.end_offset
                        await exchange.event(
                            response([CompletionChoice(index, echoed.text, echoed.logprobs, None, extra)])
                        )
                        extra = msgspec.UNSET
                logprobs = None
                if want_logprobs:
                    logprobs, choices.offsets[index] = completion_logprobs(
                        [(entries, len(chunk.text))], choices.offsets[index]
                    )
                if chunk.text or chunk.finished or entries or extra is not msgspec.UNSET:
                    item = CompletionChoice(index, chunk.text, logprobs, chunk.finish_reason, extra)
                    await exchange.event(response([item]))

            await exchange.until_disconnect(lambda: each_chunk(streams, send_chunk))
            if body.stream_options is not None and body.stream_options.include_usage:
                await exchange.event(response([], choices.usage(prompt_tokens, streams)))
            await exchange.end_events()
            return

        async def collect(stream_index: int, chunk: StreamChunk) -> None:
            choices.add(stream_index, engine_chunk(stream_index, chunk), keep=True)

        await exchange.until_disconnect(lambda: each_chunk(streams, collect))
        items = []
        for i, parts in choices.texts.items():
            stream_index = i // body.n
            text = "".join(parts)
            logprobs = None
            if body.echo:
                echoed = echo(stream_index)
                text = echoed.text + text
                if echoed.logprobs is not None:
                    generated, _ = completion_logprobs(choices.logprobs[i], echoed.end_offset)
                    logprobs = _joined(echoed.logprobs, generated)
            elif want_logprobs:
                logprobs = completion_logprobs(choices.logprobs[i], 0)[0]
            extra = vllm_prompt_logprobs(stream_index)
            items.append(CompletionChoice(i, text, logprobs, choices.reasons[i], extra))
        await exchange.respond_json(200, response(items, choices.usage(prompt_tokens, streams)))

    # -- /v1/chat/completions --------------------------------------------------------------------

    async def _chat_prompt(self, body: ChatCompletionRequest) -> tuple[list[int], ToolPlan | None]:
        if body.functions or body.function_call is not None:
            raise _unsupported("functions", "the legacy `functions`/`function_call` (use `tools`/`tool_choice`)")
        messages = chat_messages(body.messages)
        plan = self.engine.tool_plan(body.tools, body.tool_choice, body.parallel_tool_calls)
        # A long conversation is rendered in a worker thread.
        return await self.engine.encode_chat(messages, tools=plan), plan

    async def chat_completions(self, exchange: Exchange) -> None:
        """``POST /v1/chat/completions``."""
        body = await exchange.json(ChatCompletionRequest)
        self.app.check_model(body.model)
        if body.n < 1:
            raise HTTPError(400, f"n must be >= 1, got {body.n}", param="n", code="invalid_value")
        if body.top_logprobs is not None and not body.logprobs:
            raise HTTPError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        for name, value in (("top_logprobs", body.top_logprobs), ("prompt_logprobs", body.prompt_logprobs)):
            if value is not None and value > self.app.max_top_logprobs:
                raise _over_limit(
                    f"{name}={value} asks for more alternatives per token",
                    "max_top_logprobs",
                    self.app.max_top_logprobs,
                    name,
                )
        for name, value in (("max_completion_tokens", body.max_completion_tokens), ("max_tokens", body.max_tokens)):
            # OpenAI's chat wants a reply: 0 (the legacy completions' prompt-only request) is refused there.
            if value is not None and not isinstance(value, bool) and value < 1:
                raise HTTPError(400, f"{name} must be >= 1, got {value}", param=name, code="integer_below_min_value")
        self._check_choices(1, body.n)
        structured = structured_output(body.response_format)  # a malformed one is refused before rendering
        prompt_ids, plan = await self._chat_prompt(body)
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if max_tokens is None:  # OpenAI's default: as long as the context allows
            max_tokens = reply_room(self.engine, len(prompt_ids), "messages")
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        base = sampling_params(
            body,
            max_tokens=max_tokens,
            logprobs=logprobs,
            prompt_logprobs=body.prompt_logprobs,
            structured_output=structured,
        )
        params = plan.constrain(base) if plan is not None else base
        source = "response_format" if params is base else "tools"
        (stream,) = await self._open([prompt_ids], params, body.cache_salt, body.priority, source)
        parsers = {i: plan.parser() for i in range(body.n)} if plan is not None and plan.parses else {}
        single = plan is not None and not plan.parallel
        request_id, created, model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), self.app.model_name
        prompt_tokens = len(stream.prompt_token_ids)
        choices = _Choices(body.n, body.n)
        prompt_entries: list[tuple[Logprobs | None, ...]] = []

        def vllm_prompt_logprobs() -> PromptLogprobs | msgspec.UnsetType:
            if body.prompt_logprobs is None or not prompt_entries:
                return msgspec.UNSET
            return prompt_logprobs_out(prompt_entries[0])

        def chunk_of(items: list[ChatChunkChoice], usage: Usage | None = None) -> ChatCompletionChunk:
            return ChatCompletionChunk(request_id, created, model, items, usage)

        if body.stream:
            await exchange.start_events()
            for index in range(body.n):
                await exchange.event(chunk_of([ChatChunkChoice(index, ChatDelta(role="assistant", content=""))]))

            async def send_chunk(stream_index: int, chunk: StreamChunk) -> None:
                index, entries = choices.add(stream_index, chunk, keep=False)
                extra: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET
                if chunk.prompt_logprobs is not None:  # sample 0's first chunk: vLLM's prompt_logprobs
                    prompt_entries.append(chunk.prompt_logprobs)
                    extra = vllm_prompt_logprobs()
                text, calls = chunk.text, []
                reason: str | None = chunk.finish_reason
                parser = parsers.get(index)
                if parser is not None:
                    text, deltas = parser.feed(chunk.text)
                    if chunk.finished:
                        rest, more = parser.finish()
                        text, deltas = text + rest, deltas + more
                    calls = [_delta_out(d) for d in deltas if not (single and d.index > 0)]
                    reason = "tool_calls" if reason == "stop" and parser.num_calls else reason
                if text or calls or chunk.finished or entries or extra is not msgspec.UNSET:
                    delta = ChatDelta(content=text or None, tool_calls=calls or None)
                    logprobs = chat_logprobs(entries) if body.logprobs else None
                    item = ChatChunkChoice(index, delta, logprobs, reason)
                    await exchange.event(
                        ChatCompletionChunk(request_id, created, model, [item], prompt_logprobs=extra)
                    )

            await exchange.until_disconnect(lambda: each_chunk([stream], send_chunk))
            if body.stream_options is not None and body.stream_options.include_usage:
                await exchange.event(chunk_of([], choices.usage(prompt_tokens, [stream])))
            await exchange.end_events()
            return

        async def collect(stream_index: int, chunk: StreamChunk) -> None:
            choices.add(stream_index, chunk, keep=True)
            if chunk.prompt_logprobs is not None:
                prompt_entries.append(chunk.prompt_logprobs)

        await exchange.until_disconnect(lambda: each_chunk([stream], collect))
        items = []
        for i, parts in choices.texts.items():
            text = "".join(parts)
            reason: str | None = choices.reasons[i]
            message = AssistantMessage(text, "assistant")
            if plan is not None:
                content, calls = plan.parse(text)
                if calls:
                    out = [ToolCallOut(c.id, ToolCallFunction(c.name, c.arguments)) for c in calls]
                    message = AssistantMessage(content or None, "assistant", tool_calls=out)
                    reason = "tool_calls" if reason == "stop" else reason
            entries = None
            if body.logprobs:
                entries = chat_logprobs([entry for segment, _ in choices.logprobs[i] for entry in segment])
            items.append(ChatChoice(i, message, entries, reason))
        usage = choices.usage(prompt_tokens, [stream])
        response = ChatCompletionResponse(
            request_id, created, model, items, usage, prompt_logprobs=vllm_prompt_logprobs()
        )
        await exchange.respond_json(200, response)
