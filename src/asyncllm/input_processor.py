"""``InputProcessor``: prompt text or ids in, a validated ``Request`` out, or a clear error."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from asyncllm.detokenizer import Tokenizer
from asyncllm.errors import InvalidPromptError, InvalidRequestError, InvalidSamplingParamsError, PromptTooLongError
from asyncllm.request import Request
from asyncllm.sampling_params import SamplingParams


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

    def process(self, prompt: str | Sequence[int], params: SamplingParams, *, cache_salt: str | None = None) -> Request:
        """Build the engine's request for ``prompt``.

        Raises:
            InvalidPromptError: See ``tokenize``.
            InvalidSamplingParamsError: ``params`` is not a SamplingParams, or names ids outside the vocabulary.
            PromptTooLongError: The prompt plus ``max_tokens`` exceeds ``max_model_len``.
        """
        if cache_salt is not None and not isinstance(cache_salt, str):
            raise InvalidRequestError(f"cache_salt must be a str, got {type(cache_salt).__name__}")
        if not isinstance(params, SamplingParams):
            raise InvalidSamplingParamsError(f"params must be a SamplingParams, got {type(params).__name__}")
        for token_id in params.stop_token_ids:
            if token_id >= self.vocab_size:
                raise InvalidSamplingParamsError(
                    f"stop_token_ids holds {token_id}, outside the vocabulary [0, {self.vocab_size})"
                )
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
        return Request(
            request_id=next(self._ids),
            prompt_token_ids=prompt_ids,
            params=params,
            stop_token_ids=stop_ids,
            max_total_tokens=self.max_model_len,
            cache_salt=cache_salt,
        )
