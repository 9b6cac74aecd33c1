"""``InputProcessor``: prompt text or ids in, a validated ``Request`` out, or a clear error.

Everything here runs before a request is queued, in the caller's task, so every check is bounded
by a limit (``RequestLimits``) that is itself checked before the work it bounds: the prompt's size
in bytes before it is tokenized, the number and size of stop strings and bad words before the bad
words are tokenized, a prompt's length in ids before each id is looked at.

Tokenizing is the one costly step, and it holds the thread that runs it. The synchronous path
(``process``, behind ``Engine.stream``) tokenizes in the caller's thread, the event loop's, and
``max_prompt_bytes`` bounds how long that takes. The asynchronous path (``process_async``, behind
``Engine.open_stream``, ``Engine.generate`` and the HTTP app) runs the same checks, then tokenizes
a long prompt (or many bad words) in a worker thread, so the event loop keeps streaming other
requests meanwhile; short prompts are tokenized in place, where a thread hop would cost more than
the tokenizing. Hugging Face's fast tokenizers encode in Rust without holding the GIL, and encoding
with one tokenizer from several threads is safe once its truncation and padding settings are
settled (see ``_thread_limiter``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import itertools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import anyio
import anyio.lowlevel
import msgspec

from asyncllm.core._priority import SchedulingPolicy
from asyncllm.core._request import Request
from asyncllm.engine._detokenizer import Tokenizer
from asyncllm.engine._tools import (
    MAX_JSON_DEPTH,
    ToolFormat,
    ToolPlan,
    detect_format,
    generic_messages,
    native_messages,
    too_deep,
)
from asyncllm.errors import (
    ChatTemplateError,
    InvalidPromptError,
    InvalidRequestError,
    InvalidSamplingParamsError,
    PromptTooLongError,
    StructuredOutputError,
)
from asyncllm.executor._runner import Pooling
from asyncllm.sampling_params import SamplingParams, utf8_size
from asyncllm.structured import CompiledGrammar, GrammarCompiler

_POOLING_PARAMS = SamplingParams(max_tokens=1)
"""The parameters an embedding request carries: it samples nothing, so only their defaults matter."""

PROMPT_BYTES_PER_TOKEN = 16
"""With ``max_prompt_bytes=None`` a text prompt may hold this many UTF-8 bytes per token of
``max_model_len``: about four times what English, code or CJK text takes per token, so a prompt
refused for its size would not have fit in tokens either, in all but contrived cases."""

THREAD_MIN_CHARS = 8192
"""``process_async`` tokenizes a text prompt (or a conversation) this long or longer in a worker
thread: at about 2 MB/s that is 4 ms or more of tokenizing, well over the cost of the hop."""

THREAD_MIN_BAD_WORDS = 32
"""``process_async`` tokenizes this many bad words or more in a worker thread (each costs two
tokenizer calls of about 30 us)."""


@dataclasses.dataclass(frozen=True, slots=True)
class RequestLimits:
    """The engine's caps on what one request may ask for (``Engine.open``'s options of the same names).

    Attributes:
        max_logprobs: The most alternatives ``logprobs`` and ``prompt_logprobs`` may ask for (vLLM's default).
        max_prompt_bytes: The largest text prompt (or conversation), in UTF-8 bytes, checked before
            tokenizing; None: ``PROMPT_BYTES_PER_TOKEN`` times ``max_model_len``.
        max_stop: The most ``stop`` strings.
        max_stop_bytes: The most UTF-8 bytes of all ``stop`` strings together.
        max_bad_words: The most ``bad_words``.
        max_bad_words_bytes: The most UTF-8 bytes of all ``bad_words`` together.
        max_structured_output_bytes: The largest ``structured_output``, as canonical JSON.
        max_speculative_tokens: The most ``num_speculative_tokens`` a request may ask for: the engine's
            ``num_speculative_tokens`` with speculative decoding on, else 0.
    """

    max_logprobs: int = 20
    max_prompt_bytes: int | None = None
    max_stop: int = 64
    max_stop_bytes: int = 4096
    max_bad_words: int = 256
    max_bad_words_bytes: int = 8192
    max_structured_output_bytes: int = 1 << 20
    max_speculative_tokens: int = 0


def sampling_params_from(params: object) -> SamplingParams:
    """``params`` as a ``SamplingParams``: taken as is, or built from a mapping of its fields.

    Raises:
        InvalidSamplingParamsError: Neither, an unknown key, or an invalid value.
    """
    if isinstance(params, SamplingParams):
        return params
    if not isinstance(params, Mapping):
        raise InvalidSamplingParamsError(
            f"params must be a SamplingParams or a mapping of its fields, got {type(params).__name__}"
        )
    unknown = sorted(str(key) for key in params if key not in SamplingParams.__struct_fields__)
    if unknown:
        raise InvalidSamplingParamsError(f"unknown sampling option(s): {', '.join(unknown)}")
    try:
        return SamplingParams(**params)
    except TypeError as exc:  # e.g. a positional-only mistake msgspec reports as TypeError
        raise InvalidSamplingParamsError(str(exc)) from exc


def _raise_it(option: str) -> str:
    flag = option.replace("_", "-")
    return f"raise the limit with Engine.open({option}=...) or `asyncllm serve --{flag}`"


class InputProcessor:
    """Tokenizes and checks prompts against the model's limits and the engine's, before anything is scheduled.

    Args:
        tokenizer: The model's tokenizer.
        vocab_size: Token ids must be below this.
        max_model_len: Prompt plus generated tokens may not exceed this.
        eos_token_ids: Ids that end generation unless ``ignore_eos``.
        limits: The caps on one request.
        grammars: Compiles ``structured_output`` (None: the runner cannot apply grammars, and such
            requests are refused).
        scheduling_policy: The engine's; under ``"fcfs"`` a request's ``priority`` must be 0.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        *,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        limits: RequestLimits = RequestLimits(),
        grammars: GrammarCompiler | None = None,
        scheduling_policy: SchedulingPolicy = "fcfs",
    ) -> None:
        self.tokenizer = tokenizer
        self.scheduling_policy = scheduling_policy
        self.grammars = grammars
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.limits = limits
        self.max_prompt_bytes = (
            limits.max_prompt_bytes if limits.max_prompt_bytes is not None else PROMPT_BYTES_PER_TOKEN * max_model_len
        )
        self._ids = itertools.count()
        self._limiter: anyio.CapacityLimiter | None = None
        self._tool_format: ToolFormat | None = None

    # -- checks that cost nothing like tokenizing ------------------------------------------------

    def check(
        self, params: SamplingParams | Mapping[str, Any], cache_salt: str | None, priority: int = 0
    ) -> SamplingParams:
        """Everything about a request but its prompt: the parameters, the salt, the priority, the limits.

        Raises:
            InvalidSamplingParamsError: ``params`` is invalid, names ids outside the vocabulary, or
                asks for more than a limit allows.
            InvalidRequestError: ``cache_salt`` is empty or not valid text; ``priority`` is not an int,
                or not 0 under the FCFS policy.
        """
        self.check_priority(priority)
        if cache_salt is not None:
            if not isinstance(cache_salt, str):
                raise InvalidRequestError(
                    f"cache_salt must be a str, got {type(cache_salt).__name__}", param="cache_salt"
                )
            if not cache_salt:
                # An empty salt is nearly always a missing tenant id; it would silently form one
                # shared tenant of every caller that lost theirs.
                raise InvalidRequestError(
                    "cache_salt must be a non-empty str (or None for the shared cache)", param="cache_salt"
                )
            # The salt is hashed as UTF-8 with the first KV block, in the step loop: checked here instead.
            utf8_size("cache_salt", cache_salt, InvalidRequestError, param="cache_salt")
        params = sampling_params_from(params)
        self.check_limits(params)
        self.check_token_ids(params)
        return params

    def check_priority(self, priority: int) -> None:
        """Refuse a ``priority`` that is not an int, or that the FCFS policy would silently ignore.

        Raises:
            InvalidRequestError: As ``check`` raises (``param="priority"``).
        """
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise InvalidRequestError(f"priority must be an int, got {type(priority).__name__}", param="priority")
        if priority != 0 and self.scheduling_policy == "fcfs":
            # An ignored priority would fail silently: the caller believes the request goes first.
            raise InvalidRequestError(
                f"priority={priority} needs an engine opened with scheduling_policy='priority' "
                "(`asyncllm serve --scheduling-policy priority`); this one schedules first come, first served",
                param="priority",
            )

    def check_limits(self, params: SamplingParams) -> None:
        """Check ``params`` against ``limits``.

        Raises:
            InvalidSamplingParamsError: A limit is exceeded; the message names it and its option.
        """
        limits = self.limits
        spec = params.structured_output
        if spec is not None:
            if self.grammars is None:
                raise StructuredOutputError(
                    "this engine cannot apply structured_output: its model runner does not mask tokens by a grammar, "
                    "or its tokenizer is not a Hugging Face fast tokenizer",
                    param="structured_output",
                    code="structured_output_unavailable",
                )
            size = len(spec.cache_key())
            if size > limits.max_structured_output_bytes:
                raise StructuredOutputError(
                    f"structured_output is {size} bytes as JSON, more than this engine allows "
                    f"(max_structured_output_bytes={limits.max_structured_output_bytes}); "
                    + _raise_it("max_structured_output_bytes"),
                    param="structured_output",
                )
        drafts = params.num_speculative_tokens
        if drafts is not None and drafts > limits.max_speculative_tokens:
            raise InvalidSamplingParamsError(
                f"num_speculative_tokens={drafts} is more than this engine drafts "
                f"(num_speculative_tokens={limits.max_speculative_tokens}"
                + ("" if limits.max_speculative_tokens else ", speculative_method=None")
                + "); open the engine with speculative_method='ngram' and a larger num_speculative_tokens",
                param="num_speculative_tokens",
            )
        for name in ("logprobs", "prompt_logprobs"):
            count = getattr(params, name)
            if count is not None and count > limits.max_logprobs:
                raise InvalidSamplingParamsError(
                    f"{name}={count} is more than this engine allows (max_logprobs={limits.max_logprobs}); "
                    + _raise_it("max_logprobs"),
                    param=name,
                )
        for name, max_count, max_bytes in (
            ("stop", limits.max_stop, limits.max_stop_bytes),
            ("bad_words", limits.max_bad_words, limits.max_bad_words_bytes),
        ):
            strings: tuple[str, ...] = getattr(params, name)
            if len(strings) > max_count:
                raise InvalidSamplingParamsError(
                    f"{name} holds {len(strings)} strings, more than this engine allows (max_{name}={max_count}); "
                    + _raise_it(f"max_{name}"),
                    param=name,
                )
            size = sum(len(string.encode("utf-8")) for string in strings)  # valid UTF-8: SamplingParams checked
            if size > max_bytes:
                raise InvalidSamplingParamsError(
                    f"{name} holds {size} bytes of text, more than this engine allows "
                    f"(max_{name}_bytes={max_bytes}); " + _raise_it(f"max_{name}_bytes"),
                    param=name,
                )

    def check_token_ids(self, params: SamplingParams) -> None:
        """Check the token ids ``params`` names, and its logprob counts, against the vocabulary.

        Raises:
            InvalidSamplingParamsError: An id (or a logprobs count) is beyond the vocabulary.
        """
        named = [
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", tuple(params.logit_bias or ())),
            ("allowed_token_ids", params.allowed_token_ids or ()),
        ]
        for name, token_ids in named:
            for token_id in token_ids:
                if token_id >= self.vocab_size:
                    raise InvalidSamplingParamsError(
                        f"{name} holds {token_id}, outside the vocabulary [0, {self.vocab_size})", param=name
                    )
        for name in ("logprobs", "prompt_logprobs"):
            count = getattr(params, name)
            if count is not None and count > self.vocab_size:
                raise InvalidSamplingParamsError(
                    f"{name}={count} is more than the vocabulary ({self.vocab_size})", param=name
                )

    def check_text_size(self, field: str, text: str, error: type[InvalidRequestError], *, param: str) -> int:
        """The UTF-8 size of a prompt's ``text``, checked against ``max_prompt_bytes`` before any tokenizing.

        Raises:
            PromptTooLongError: ``text`` is larger than ``max_prompt_bytes``.
            InvalidRequestError: ``error``, when ``text`` is not valid UTF-8 text.
        """
        limit = self.max_prompt_bytes
        # A character is at least one byte: a text with more characters than the limit needs no encoding.
        size = len(text) if len(text) > limit else utf8_size(field, text, error, param=param)
        if size > limit:
            at_least = "at least " if len(text) > limit else ""
            raise PromptTooLongError(
                f"{field} is {at_least}{size} bytes of text, more than this engine allows "
                f"(max_prompt_bytes={limit}); shorten it, or " + _raise_it("max_prompt_bytes"),
                param=param,
            )
        return size

    def _check_length(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        total = num_prompt_tokens + params.max_tokens
        if total > self.max_model_len:
            raise PromptTooLongError(
                f"prompt of {num_prompt_tokens} tokens plus max_tokens={params.max_tokens} is {total} tokens, "
                f"more than max_model_len={self.max_model_len}",
                param="prompt",
            )

    # -- tokenizing ------------------------------------------------------------------------------

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """The prompt's token ids, checked.

        Raises:
            InvalidPromptError: The prompt is empty, of the wrong type, not valid UTF-8 text, has ids
                outside the vocabulary, or the tokenizer failed on it (the cause is chained).
            PromptTooLongError: A text prompt is larger than ``max_prompt_bytes``.
        """
        if isinstance(prompt, str):
            self._check_text_prompt(prompt)
            return self._encode(prompt)
        if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):
            raise InvalidPromptError(
                f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}", param="prompt"
            )
        ids: list[int] = list(prompt)  # type: ignore[arg-type]  # mypy keeps str after the narrowing
        if not ids:
            raise InvalidPromptError("prompt is empty", param="prompt")
        for token_id in ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int):
                raise InvalidPromptError(
                    f"prompt token ids must be ints, got {type(token_id).__name__} {token_id!r}", param="prompt"
                )
            if not 0 <= token_id < self.vocab_size:
                raise InvalidPromptError(
                    f"prompt token id {token_id!r} is outside the vocabulary [0, {self.vocab_size})", param="prompt"
                )
        return ids

    def _check_text_prompt(self, prompt: str) -> None:
        if not prompt:
            raise InvalidPromptError("prompt is empty", param="prompt")
        self.check_text_size("prompt", prompt, InvalidPromptError, param="prompt")

    def _encode(self, prompt: str) -> list[int]:
        try:
            encoded = list(self.tokenizer.encode(prompt))
        except Exception as exc:  # the tokenizer's own failure is this prompt's, not the engine's
            raise InvalidPromptError(
                f"the tokenizer failed on the prompt: {type(exc).__name__}: {exc}", param="prompt"
            ) from exc
        if not encoded:
            raise InvalidPromptError("prompt is made of no tokens (the tokenizer returned none)", param="prompt")
        return encoded

    def bad_words_token_ids(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """``params.bad_words`` as token sequences: each word alone and after a space (as vLLM does),
        special tokens a tokenizer adds (BOS) left out, duplicates and out-of-vocabulary ones dropped.

        Raises:
            InvalidSamplingParamsError: The tokenizer failed on a word (the cause is chained).
        """
        if not params.bad_words:
            return ()
        special = frozenset(getattr(self.tokenizer, "all_special_ids", None) or ())
        sequences: dict[tuple[int, ...], None] = {}
        for word in params.bad_words:
            for variant in (word.lstrip(), " " + word.lstrip()):
                try:
                    encoded = self.tokenizer.encode(variant)
                except Exception as exc:
                    raise InvalidSamplingParamsError(
                        f"the tokenizer failed on bad word {word!r}: {type(exc).__name__}: {exc}", param="bad_words"
                    ) from exc
                ids = tuple(t for t in encoded if t not in special)
                if ids and all(t < self.vocab_size for t in ids):
                    sequences[ids] = None
        return tuple(sequences)

    def _tokenize_all(
        self, prompt: str | Sequence[int], params: SamplingParams, *, text_checked: bool = False
    ) -> tuple[list[int], tuple[tuple[int, ...], ...]]:
        # The tokenizing half of a request: run in place, or in a worker thread by process_async
        # (which checks a text prompt's size first, in place: text_checked).
        if not isinstance(prompt, str) and isinstance(prompt, Sequence):
            self._check_length(len(prompt), params)  # before looking at each id of an overlong prompt
        prompt_ids = self._encode(prompt) if text_checked and isinstance(prompt, str) else self.tokenize(prompt)
        self._check_length(len(prompt_ids), params)
        return prompt_ids, self.bad_words_token_ids(params)

    def _heavy(self, prompt: str | Sequence[int], params: SamplingParams) -> bool:
        long_text = isinstance(prompt, str) and len(prompt) >= THREAD_MIN_CHARS
        return long_text or len(params.bad_words) >= THREAD_MIN_BAD_WORDS

    def _thread_limiter(self) -> anyio.CapacityLimiter:
        # Made on first use, in the engine's event loop. A few threads at most: a burst of long
        # prompts then takes a few cores from the device thread and the event loop, not all of them.
        if self._limiter is None:
            # transformers turns a fast tokenizer's truncation and padding off on its first encode
            # when its file had them on, a change that must not race another thread's encode: one
            # encode here, before any thread shares the tokenizer, settles that.
            with contextlib.suppress(Exception):
                self.tokenizer.encode("a")
            self._limiter = anyio.CapacityLimiter(min(4, max(1, (os.cpu_count() or 2) // 2)))
        return self._limiter

    # -- whole requests --------------------------------------------------------------------------

    def process(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | Mapping[str, Any],
        *,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> Request:
        """Build the engine's request for ``prompt``, tokenizing in the calling thread.

        Args:
            prompt: Text or token ids.
            params: A ``SamplingParams``, or a mapping of its fields (unknown keys are rejected).
            cache_salt: See ``Engine.stream``.
            priority: See ``Engine.stream``.

        Raises:
            InvalidPromptError: See ``tokenize``.
            InvalidSamplingParamsError: ``params`` is invalid, has unknown keys, names ids outside
                the vocabulary, or exceeds a limit.
            InvalidRequestError: ``cache_salt`` is not a str of valid text; a bad ``priority`` (see
                ``check_priority``).
            PromptTooLongError: The prompt plus ``max_tokens`` exceeds ``max_model_len``, or the
                prompt's text is larger than ``max_prompt_bytes``.
        """
        checked = self.check(params, cache_salt, priority)
        prompt_ids, bad_words = self._tokenize_all(prompt, checked)
        grammar = None
        if checked.structured_output is not None:
            assert self.grammars is not None  # check() refused it otherwise
            grammar = self.grammars.cached(checked.structured_output)  # else the core compiles it
        return self._build(prompt_ids, checked, cache_salt, bad_words, grammar, priority)

    async def process_async(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | Mapping[str, Any],
        *,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> Request:
        """``process``, with a long text prompt (``THREAD_MIN_CHARS`` or more) or many bad words
        (``THREAD_MIN_BAD_WORDS``) tokenized in a worker thread, so the event loop keeps running.

        The cheap checks run first, in place: a request they refuse costs no tokenizing. It always
        yields to the event loop once (a schedule point, not a cancellation point, as ``stream``
        is not one either), so admitting many requests in a row lets other streams run in between.
        A cancellation while the thread tokenizes takes effect when it is done.

        Raises:
            InvalidRequestError: As ``process`` raises.
        """
        await anyio.lowlevel.cancel_shielded_checkpoint()
        checked = self.check(params, cache_salt, priority)
        if self._heavy(prompt, checked):
            if isinstance(prompt, str):
                self._check_text_prompt(prompt)  # an oversized prompt is refused here, without a thread
            prompt_ids, bad_words = await anyio.to_thread.run_sync(
                functools.partial(self._tokenize_all, prompt, checked, text_checked=isinstance(prompt, str)),
                limiter=self._thread_limiter(),
            )
        else:
            prompt_ids, bad_words = self._tokenize_all(prompt, checked)
        grammar = None
        if checked.structured_output is not None:
            assert self.grammars is not None  # check() refused it otherwise
            grammar = await self.grammars.compile_async(checked.structured_output)
        return self._build(prompt_ids, checked, cache_salt, bad_words, grammar, priority)

    def _build(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        cache_salt: str | None,
        bad_words: tuple[tuple[int, ...], ...],
        grammar: CompiledGrammar | None = None,
        priority: int = 0,
    ) -> Request:
        stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= self.eos_token_ids
        request = Request(
            request_id=next(self._ids),
            prompt_token_ids=prompt_ids,
            params=params,
            stop_token_ids=stop_ids,
            max_total_tokens=self.max_model_len,
            cache_salt=cache_salt,
            priority=priority,
            bad_words_token_ids=bad_words,
            grammar=grammar,
        )
        if params.n > 1:
            self._add_samples(request)
        return request

    async def process_pooling_async(
        self, prompt: str | Sequence[int], pooling: Pooling, *, cache_salt: str | None = None, priority: int = 0
    ) -> Request:
        """An embedding request for ``prompt``: tokenized as ``process_async`` does (a long text in a
        worker thread), checked against ``max_model_len`` (the prompt alone: nothing is generated).

        Raises:
            InvalidPromptError: See ``tokenize``.
            InvalidRequestError: ``cache_salt`` is not a str of valid text; a bad ``priority``.
            PromptTooLongError: The prompt is longer than ``max_model_len`` tokens, or its text is larger
                than ``max_prompt_bytes``.
        """
        await anyio.lowlevel.cancel_shielded_checkpoint()
        params = self.check(_POOLING_PARAMS, cache_salt, priority)
        if not isinstance(prompt, str) and isinstance(prompt, Sequence):
            self._check_pooled_length(len(prompt))  # before looking at each id of an overlong prompt
        if isinstance(prompt, str) and len(prompt) >= THREAD_MIN_CHARS:
            self._check_text_prompt(prompt)
            prompt_ids = await anyio.to_thread.run_sync(self._encode, prompt, limiter=self._thread_limiter())
        else:
            prompt_ids = self.tokenize(prompt)
        self._check_pooled_length(len(prompt_ids))
        return Request(
            request_id=next(self._ids),
            prompt_token_ids=prompt_ids,
            params=params,
            stop_token_ids=frozenset(),
            max_total_tokens=self.max_model_len,
            cache_salt=cache_salt,
            priority=priority,
            pooling=pooling,
        )

    def _check_pooled_length(self, num_prompt_tokens: int) -> None:
        if num_prompt_tokens > self.max_model_len:
            raise PromptTooLongError(
                f"input of {num_prompt_tokens} tokens is longer than max_model_len={self.max_model_len}",
                param="prompt",
            )

    def _add_samples(self, first: Request) -> None:
        # Samples 1..n-1 are requests of their own (their own ids, stops and seeds) that start from
        # sample 0's prompt blocks; the scheduler holds them until sample 0 has computed the prompt.
        params = first.params
        first.params = msgspec.structs.replace(params, n=1)
        first.group.append(first)
        for index in range(1, params.n):
            sample_params = msgspec.structs.replace(
                params,
                n=1,
                seed=None if params.seed is None else params.seed + index,
                prompt_logprobs=None,  # reported once, with sample 0
            )
            sample = dataclasses.replace(
                first,
                request_id=next(self._ids),
                params=sample_params,
                sample_index=index,
                output_token_ids=[],
                block_hashes=[],
                group=first.group,
                forks=[],
            )
            first.group.append(sample)
            first.forks.append(sample)

    # -- conversations ---------------------------------------------------------------------------

    def tool_format(self) -> ToolFormat:
        """How this model writes tool calls, read from its chat template once (see ``detect_format``)."""
        if self._tool_format is None:
            self._tool_format = detect_format(self.tokenizer)
        return self._tool_format

    def _check_messages(
        self, messages: Sequence[Mapping[str, Any]], plan: ToolPlan | None = None
    ) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None, int]:
        # The shape, the text and the size of a conversation (its tools' definitions included).
        # Returns the messages as the template gets them, the tools for the template, and the size
        # in characters.
        apply = getattr(self.tokenizer, "apply_chat_template", None)
        if apply is None or not getattr(self.tokenizer, "chat_template", None):
            raise ChatTemplateError(
                "this model's tokenizer has no chat template; send a plain prompt instead", param="messages"
            )
        if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
            raise ChatTemplateError(
                "messages must be a non-empty list of {'role': ..., 'content': ...} mappings", param="messages"
            )
        normalized = [_normalize_message(index, message) for index, message in enumerate(messages)]
        tools = plan.template_tools() if plan is not None else None
        limit = self.max_prompt_bytes
        chars = size = 0
        strings = [(f"messages[{index}]", value) for index, m in enumerate(normalized) for value in _strings(m)]
        if plan is not None:
            strings += [("tools", value) for f in plan.functions for value in _strings(f.as_openai())]
        for field, value in strings:
            if size + len(value) > limit:  # a character is at least one byte: no need to encode the rest
                raise PromptTooLongError(
                    f"messages are more than {limit} bytes of text, more than this engine allows "
                    f"(max_prompt_bytes={limit}); shorten them, or " + _raise_it("max_prompt_bytes"),
                    param="messages",
                )
            chars += len(value)
            size += utf8_size(field, value, ChatTemplateError, param="messages")
        if size > limit:
            raise PromptTooLongError(
                f"messages are {size} bytes of text, more than this engine allows (max_prompt_bytes={limit}); "
                "shorten them, or " + _raise_it("max_prompt_bytes"),
                param="messages",
            )
        if plan is not None:
            rendered = plan.messages(normalized)
        elif any(m.get("tool_calls") or m["role"] == "tool" for m in normalized):
            # A history with calls, and no tools this turn: written as the model's format would.
            fmt = self.tool_format()
            rendered = generic_messages(normalized, None) if fmt is ToolFormat.GENERIC else native_messages(normalized)
        else:
            rendered = normalized
        return rendered, tools, chars

    def _render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        from jinja2 import TemplateError  # a dependency of transformers, whose tokenizers have chat templates

        apply = self.tokenizer.apply_chat_template  # type: ignore[attr-defined]  # checked by _check_messages
        extra: dict[str, Any] = {} if tools is None else {"tools": tools}
        try:
            encoded = apply(
                messages, add_generation_prompt=add_generation_prompt, tokenize=True, return_dict=True, **extra
            )
        except (TemplateError, ValueError, TypeError, KeyError) as exc:
            # Templates refuse some conversations on purpose (``raise_exception``), e.g. roles that do not alternate.
            raise ChatTemplateError(f"the chat template rejected the messages: {exc}", param="messages") from exc
        except Exception as exc:  # the tokenizer's own failure is this conversation's, not the engine's
            raise ChatTemplateError(
                f"rendering or tokenizing the messages failed: {type(exc).__name__}: {exc}", param="messages"
            ) from exc
        return list(encoded["input_ids"])

    def render_chat(self, messages: Sequence[Mapping[str, Any]], tools: ToolPlan | None = None) -> list[int]:
        """A conversation's prompt ids, through the model's chat template, the assistant's turn opened.

        Messages are ``{"role", "content"}`` mappings; content may be a str, a list of
        ``{"type": "text", "text": ...}`` parts (joined), or null on an assistant message that has
        ``tool_calls``; ``tool`` messages carry ``tool_call_id``. With ``tools`` (a ``ToolPlan``)
        the tools are rendered by the template, or by the generic prompt for a template that cannot.

        Raises:
            ChatTemplateError: No chat template, malformed messages or text that is not valid
                UTF-8, or the template rejected them.
            PromptTooLongError: The messages' text is larger than ``max_prompt_bytes``.
        """
        rendered, template_tools, _ = self._check_messages(messages, tools)
        return self._render(rendered, template_tools)

    async def render_chat_async(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: ToolPlan | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[int]:
        """``render_chat``, rendered and tokenized in a worker thread when the conversation holds
        ``THREAD_MIN_CHARS`` characters or more. Always a schedule point, as ``process_async``.
        ``add_generation_prompt=False`` leaves the assistant's turn unopened (``/tokenize`` asks so).

        Raises:
            ChatTemplateError: As ``render_chat`` raises.
            PromptTooLongError: As ``render_chat`` raises.
        """
        await anyio.lowlevel.cancel_shielded_checkpoint()
        rendered, template_tools, chars = self._check_messages(messages, tools)
        if chars >= THREAD_MIN_CHARS:
            return await anyio.to_thread.run_sync(
                self._render, rendered, template_tools, add_generation_prompt, limiter=self._thread_limiter()
            )
        return self._render(rendered, template_tools, add_generation_prompt)

    # -- tokenizer endpoints ---------------------------------------------------------------------

    async def encode_text_async(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """``text``'s token ids as the tokenizer gives them (no prompt checks beyond its size: it may be
        empty), tokenized in a worker thread when it holds ``THREAD_MIN_CHARS`` characters or more.

        Raises:
            PromptTooLongError: ``text`` is larger than ``max_prompt_bytes``.
            InvalidPromptError: ``text`` is not valid UTF-8 text, or the tokenizer failed on it.
        """
        await anyio.lowlevel.cancel_shielded_checkpoint()
        self.check_text_size("prompt", text, InvalidPromptError, param="prompt")
        encode = functools.partial(self._encode_text, text, add_special_tokens)
        if len(text) >= THREAD_MIN_CHARS:
            return await anyio.to_thread.run_sync(encode, limiter=self._thread_limiter())
        return encode()

    def _encode_text(self, text: str, add_special_tokens: bool) -> list[int]:
        try:
            if add_special_tokens or not _takes_add_special_tokens(self.tokenizer):
                # A tokenizer without the option adds no special tokens of its own.
                return list(self.tokenizer.encode(text))
            return list(self.tokenizer.encode(text, add_special_tokens=False))  # type: ignore[call-arg]
        except Exception as exc:  # the tokenizer's own failure is this text's, not the engine's
            raise InvalidPromptError(
                f"the tokenizer failed on the prompt: {type(exc).__name__}: {exc}", param="prompt"
            ) from exc

    async def decode_async(self, token_ids: Sequence[int], *, param: str = "tokens") -> str:
        """The text of ``token_ids`` (special tokens written out), checked against the vocabulary first,
        decoded in a worker thread when there are ``THREAD_MIN_CHARS`` or more.

        Raises:
            InvalidPromptError: An id is not an int in ``[0, vocab_size)`` (``param`` names the field).
        """
        await anyio.lowlevel.cancel_shielded_checkpoint()
        ids = list(token_ids)
        for token_id in ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < self.vocab_size:
                raise InvalidPromptError(
                    f"token id {token_id!r} is outside the vocabulary [0, {self.vocab_size})", param=param
                )
        decode = functools.partial(self.tokenizer.decode, ids, skip_special_tokens=False)
        if len(ids) >= THREAD_MIN_CHARS:
            return await anyio.to_thread.run_sync(decode, limiter=self._thread_limiter())
        return decode()


def _takes_add_special_tokens(tokenizer: Tokenizer) -> bool:
    try:
        parameters = inspect.signature(tokenizer.encode).parameters
    except (TypeError, ValueError):
        return False
    return "add_special_tokens" in parameters or any(p.kind is p.VAR_KEYWORD for p in parameters.values())


def _strings(value: Any) -> list[str]:
    # Every str in a JSON-like value (keys included): what a template may put into the prompt.
    if isinstance(value, str):
        return [value]
    if isinstance(value, Mapping):
        return [s for key, item in value.items() for s in (*_strings(key), *_strings(item))]
    if isinstance(value, (list, tuple)):
        return [s for item in value for s in _strings(item)]
    return []


def _normalize_message(index: int, message: object) -> dict[str, Any]:
    """One message, checked, with a content-part list joined into its text.

    Raises:
        ChatTemplateError: Not a mapping with a str ``role``; content that is not a str, a list of
            text parts, or null on an assistant message with ``tool_calls``; malformed ``tool_calls``.
    """
    where = f"messages[{index}]"
    if not isinstance(message, Mapping) or not isinstance(message.get("role"), str):
        raise ChatTemplateError(f"{where} must be a mapping with a str 'role': {message!r}", param="messages")
    result = dict(message)
    content = message.get("content")
    tool_calls = message.get("tool_calls")
    if isinstance(content, list):
        if not all(isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise ChatTemplateError(
                f"{where}.content: only parts of type 'text' (with a str 'text') are understood", param="messages"
            )
        result["content"] = "".join(p["text"] for p in content)
    elif content is None and message["role"] == "assistant" and tool_calls:
        result["content"] = None
    elif not isinstance(content, str):
        raise ChatTemplateError(
            f"{where} must have a str 'content' (null only on an assistant message with tool_calls): {message!r}",
            param="messages",
        )
    if tool_calls is not None:
        if message["role"] != "assistant" or not isinstance(tool_calls, list):
            raise ChatTemplateError(f"{where}.tool_calls must be a list, on an assistant message", param="messages")
        for call_index, call in enumerate(tool_calls):
            function = call.get("function") if isinstance(call, Mapping) else None
            if (
                not isinstance(function, Mapping)
                or not isinstance(function.get("name"), str)
                or not isinstance(function.get("arguments"), (str, Mapping))
                or too_deep(function["arguments"])
            ):
                raise ChatTemplateError(
                    f"{where}.tool_calls[{call_index}] must be "
                    '{"id": ..., "type": "function", "function": {"name": str, "arguments": JSON text}} '
                    f"(arguments nested at most {MAX_JSON_DEPTH} levels deep)",
                    param="messages",
                )
        if not tool_calls:
            result.pop("tool_calls")
    return result
