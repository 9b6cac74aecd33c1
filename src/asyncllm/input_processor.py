"""``InputProcessor``: prompt text or ids in, a validated ``Request`` out, or a clear error."""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from asyncllm.detokenizer import Tokenizer
from asyncllm.errors import InvalidPromptError, InvalidRequestError, InvalidSamplingParamsError, PromptTooLongError
from asyncllm.request import Request
from asyncllm.sampling_params import SamplingParams


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


class InputProcessor:
    """Tokenizes and checks prompts against the model's limits, before anything is scheduled.

    Args:
        tokenizer: The model's tokenizer.
        vocab_size: Token ids must be below this.
        max_model_len: Prompt plus generated tokens may not exceed this.
        eos_token_ids: Ids that end generation unless ``ignore_eos``.
    """

    def __init__(
        self, tokenizer: Tokenizer, *, vocab_size: int, max_model_len: int, eos_token_ids: frozenset[int]
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self._ids = itertools.count()

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """The prompt's token ids, checked.

        Raises:
            InvalidPromptError: The prompt is empty, of the wrong type, or has ids outside the vocabulary.
        """
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidPromptError("prompt is empty")
            return list(self.tokenizer.encode(prompt))
        if isinstance(prompt, (bytes, bytearray)) or not isinstance(prompt, Sequence):
            raise InvalidPromptError(f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}")
        ids: list[int] = list(prompt)  # type: ignore[arg-type]  # mypy keeps str after the narrowing
        if not ids:
            raise InvalidPromptError("prompt is empty")
        for token_id in ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < self.vocab_size:
                raise InvalidPromptError(
                    f"prompt token id {token_id!r} is outside the vocabulary [0, {self.vocab_size})"
                )
        return ids

    def process(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | Mapping[str, Any],
        *,
        cache_salt: str | None = None,
    ) -> Request:
        """Build the engine's request for ``prompt``.

        Args:
            prompt: Text or token ids.
            params: A ``SamplingParams``, or a mapping of its fields (unknown keys are rejected).
            cache_salt: See ``Engine.stream``.

        Raises:
            InvalidPromptError: See ``tokenize``.
            InvalidSamplingParamsError: ``params`` is invalid, has unknown keys, or names ids
                outside the vocabulary.
            PromptTooLongError: The prompt plus ``max_tokens`` exceeds ``max_model_len``.
        """
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequestError(f"cache_salt must be a str, got {type(cache_salt).__name__}")
        params = sampling_params_from(params)
        self.check_token_ids(params)
        prompt_ids = self.tokenize(prompt)
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise PromptTooLongError(
                f"prompt of {len(prompt_ids)} tokens plus max_tokens={params.max_tokens} is {total} tokens, "
                f"more than max_model_len={self.max_model_len}"
            )
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
            bad_words_token_ids=self.bad_words_token_ids(params),
        )
        if params.n > 1:
            self._add_samples(request)
        return request

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
                        f"{name} holds {token_id}, outside the vocabulary [0, {self.vocab_size})"
                    )
        for name in ("logprobs", "prompt_logprobs"):
            count = getattr(params, name)
            if count is not None and count > self.vocab_size:
                raise InvalidSamplingParamsError(f"{name}={count} is more than the vocabulary ({self.vocab_size})")

    def bad_words_token_ids(self, params: SamplingParams) -> tuple[tuple[int, ...], ...]:
        """``params.bad_words`` as token sequences: each word alone and after a space (as vLLM does),
        special tokens a tokenizer adds (BOS) left out, duplicates and out-of-vocabulary ones dropped."""
        if not params.bad_words:
            return ()
        special = frozenset(getattr(self.tokenizer, "all_special_ids", None) or ())
        sequences: dict[tuple[int, ...], None] = {}
        for word in params.bad_words:
            for variant in (word.lstrip(), " " + word.lstrip()):
                ids = tuple(t for t in self.tokenizer.encode(variant) if t not in special)
                if ids and all(t < self.vocab_size for t in ids):
                    sequences[ids] = None
        return tuple(sequences)
