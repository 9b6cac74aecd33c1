"""The OpenAI wire format: request and response bodies as msgspec structs.

Requests are decoded leniently, as clients expect of an OpenAI-compatible server (``lenient_body``):
a top-level field this server does not know (``store``, ``metadata``, ``service_tier``, ...: newer SDKs
and frameworks send them) is ignored and its name logged once, and ``null`` stands for the default
wherever the OpenAI API allows it. Fields the OpenAI API defines but the engine cannot honour yet are
declared here and refused by the handlers with a "not supported yet" 400 when given a value that would
change the output. A few vLLM extensions (``top_k``, ``ignore_eos``, ...) are accepted too, because
clients of OpenAI-compatible servers send them.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

import msgspec

logger = logging.getLogger("asyncllm")

# -- requests ------------------------------------------------------------------------------------


class StreamOptions(msgspec.Struct, frozen=True):
    """``stream_options``: ``include_usage`` adds a last chunk carrying the usage;
    ``continuous_usage_stats`` (vLLM's, usage on every chunk) is not supported yet."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingRequest(msgspec.Struct, frozen=True, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Extensions, named as vLLM names them.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    cache_salt: str | None = None
    """Requests share prefix-cache entries only with requests of the same salt (per tenant)."""
    priority: int = 0
    """vLLM's: under ``--scheduling-policy priority`` lower values go first; elsewhere only 0."""
    prompt_logprobs: int | None = None
    """vLLM's: the log-probabilities of each prompt token and of this many alternatives."""
    num_speculative_tokens: int | None = None
    """The most draft tokens this request carries per step on an engine with speculative decoding
    (``SamplingParams.num_speculative_tokens``): fewer than the engine's, or 0 for none."""
    response_format: Any = None
    """``{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}``, checked by hand
    (``structured_output``) so that each mistake is a 400 naming it."""


class CompletionRequest(SamplingRequest, frozen=True, kw_only=True):
    """``POST /v1/completions``. ``prompt`` is a str, a list of str, a list of token ids or a
    list of lists of token ids (msgspec unions hold one array type, so it is checked by hand)."""

    prompt: str | list[Any]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None


class ContentPart(msgspec.Struct, frozen=True):
    """One part of a message's content; only ``{"type": "text", "text": ...}`` is understood."""

    type: str
    text: str | None = None


class ChatMessage(msgspec.Struct, frozen=True):
    """One message. Unknown keys are ignored here (unlike in the request itself), because
    clients echo back the assistant messages they received, with ``refusal: null`` and the like."""

    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[Any] | None = None
    tool_call_id: str | None = None


class ChatCompletionRequest(SamplingRequest, frozen=True, kw_only=True):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Checked by the engine's tool plan (InvalidToolsError names the field and a code).
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: list[Any] | None = None
    function_call: Any = None


_NULLABLE_OBJECTS = ("stream_options",)
"""Request fields whose own fields may be null too."""

MAX_LOGGED_UNKNOWN_FIELDS = 256
"""Unknown field names logged once each, up to this many (a client cannot grow the set without bound)."""

_logged_unknown: set[str] = set()


def lenient_body(document: object, kind: type[msgspec.Struct]) -> object:
    """``document`` (a decoded JSON body) ready to convert to ``kind``: nulls dropped (the field's
    default applies), unknown top-level fields dropped, each unknown name logged once.

    Anything but an object is returned as it is (converting it then fails with a 400).
    """
    if not isinstance(document, dict):
        return document
    known = set(kind.__struct_fields__)
    kept: dict[str, object] = {}
    for key, value in document.items():
        if key not in known:
            if key not in _logged_unknown and len(_logged_unknown) < MAX_LOGGED_UNKNOWN_FIELDS:
                _logged_unknown.add(key)
                logger.info("asyncllm http: ignoring the request field %r, which this server does not use", key)
            continue
        if value is None:
            continue
        if key in _NULLABLE_OBJECTS and isinstance(value, dict):
            value = {k: v for k, v in value.items() if v is not None}
        kept[key] = value
    return kept


# -- responses -----------------------------------------------------------------------------------


class PromptTokensDetails(msgspec.Struct, frozen=True):
    cached_tokens: int
    """Prompt tokens found in the prefix cache (a multiple of the KV block size)."""


class Usage(msgspec.Struct, frozen=True, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class PromptLogprob(msgspec.Struct, frozen=True):
    """vLLM's ``prompt_logprobs`` entry for one token at one prompt position."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[int, PromptLogprob] | None]
"""vLLM's ``prompt_logprobs``: per prompt position (None first), token id -> its logprob, the
prompt's token and the alternatives asked for."""


class CompletionLogprobs(msgspec.Struct, frozen=True):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(msgspec.Struct, frozen=True):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET
    """Only with the request's ``prompt_logprobs`` (left out otherwise)."""


class CompletionResponse(msgspec.Struct, frozen=True):
    """A whole completion, and (with ``usage`` None or only usage) each streamed chunk."""

    id: str
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    object: Literal["text_completion"] = "text_completion"


class ChatTopLogprob(msgspec.Struct, frozen=True):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatTokenLogprob(msgspec.Struct, frozen=True):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(msgspec.Struct, frozen=True):
    content: list[ChatTokenLogprob]


class ToolCallFunction(msgspec.Struct, frozen=True):
    name: str
    arguments: str


class ToolCallOut(msgspec.Struct, frozen=True):
    id: str
    function: ToolCallFunction
    type: Literal["function"] = "function"


class AssistantMessage(msgspec.Struct, frozen=True, omit_defaults=True):
    """The reply: ``content`` null when it is only tool calls; ``tool_calls`` left out when none."""

    content: str | None
    role: Literal["assistant"]  # no default: omit_defaults would leave it out
    tool_calls: list[ToolCallOut] | None = None


class DeltaFunction(msgspec.Struct, frozen=True, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class ToolCallDeltaOut(msgspec.Struct, frozen=True, omit_defaults=True):
    """A piece of a streamed call: ``id``, ``type`` and ``function.name`` first, then argument text."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunction | None = None


class ChatChoice(msgspec.Struct, frozen=True):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionResponse(msgspec.Struct, frozen=True):
    id: str
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    object: Literal["chat.completion"] = "chat.completion"
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET
    """Only with the request's ``prompt_logprobs`` (left out otherwise), as vLLM puts it."""


class ChatDelta(msgspec.Struct, frozen=True, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDeltaOut] | None = None


class ChatChunkChoice(msgspec.Struct, frozen=True):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatCompletionChunk(msgspec.Struct, frozen=True):
    id: str
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    prompt_logprobs: PromptLogprobs | msgspec.UnsetType = msgspec.UNSET
    """On the first chunk with output, with the request's ``prompt_logprobs``."""


class ModelCard(msgspec.Struct, frozen=True):
    id: str
    created: int
    max_model_len: int
    owned_by: str = "asyncllm"
    object: Literal["model"] = "model"


class ModelList(msgspec.Struct, frozen=True):
    data: list[ModelCard]
    object: Literal["list"] = "list"


class ErrorBody(msgspec.Struct, frozen=True):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(msgspec.Struct, frozen=True):
    """OpenAI's error object: ``{"error": {"message", "type", "param", "code"}}``."""

    error: ErrorBody


# -- tokenizer endpoints (vLLM's) ----------------------------------------------------------------


class TokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    """``POST /tokenize``: a ``prompt`` (text), or ``messages`` rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    """Default: True for a prompt, False for messages (the template writes its own), as vLLM."""
    add_generation_prompt: bool = True
    return_token_strs: bool = False
    # With messages: rendered as the chat request renders them, so the count is the chat prompt's.
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None


class TokenizeResponse(msgspec.Struct, frozen=True, omit_defaults=True):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(msgspec.Struct, frozen=True, kw_only=True):
    """``POST /detokenize``."""

    tokens: list[int]
    model: str | None = None


class DetokenizeResponse(msgspec.Struct, frozen=True):
    prompt: str
