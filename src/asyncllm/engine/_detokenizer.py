"""``IncrementalDetokenizer``: token ids in, text deltas out, correct across multi-byte characters.

Decoding token by token breaks characters that span tokens (byte-level BPE, and SentencePiece's
byte-fallback ``<0xE2>`` tokens). Instead we decode a short window twice: the tokens already
emitted (``prefix``) and the window including the new tokens; the delta is the difference. While
the window ends in U+FFFD (an incomplete UTF-8 sequence) nothing is emitted, so a character is
never split; the held bytes come out with the token that completes them, or at ``flush()``.

With ``skip_special_tokens=False`` and ``spaces_between_special_tokens=True`` (vLLM's defaults
for the latter) special tokens and the runs of text between them are decoded apart and joined
by spaces, as HF's slow tokenizers do; fast tokenizers ignore that option, so it is done here.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Protocol


class Tokenizer(Protocol):
    """The part of an HF tokenizer asyncllm uses."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


Decode = Callable[[list[int], bool], str]
"""``decode(ids, skip_special_tokens)``: the text of ``ids``."""

# The classes whose ``decode``/``_decode`` only forward to the Rust tokenizer when no clean-up is
# asked for (transformers 4.x names its fast class PreTrainedTokenizerFast, 5.x TokenizersBackend).
_FORWARDING_DECODE = {
    ("transformers.tokenization_utils_base", "PreTrainedTokenizerBase"),
}
_FORWARDING_PRIVATE_DECODE = {
    ("transformers.tokenization_utils_fast", "PreTrainedTokenizerFast"),
    ("transformers.tokenization_utils_tokenizers", "TokenizersBackend"),
}


def _defining_class(cls: type, name: str) -> tuple[str, str] | None:
    for klass in cls.__mro__:
        if name in vars(klass):
            return klass.__module__, klass.__name__
    return None


@functools.cache
def _decode_forwards(cls: type) -> bool:
    # Once per tokenizer class, not per request.
    return (
        _defining_class(cls, "decode") in _FORWARDING_DECODE
        and _defining_class(cls, "_decode") in _FORWARDING_PRIVATE_DECODE
    )


def decoder_for(tokenizer: Tokenizer) -> Decode:
    """The fastest exact ``decode`` of ``tokenizer``.

    An HF fast tokenizer's ``decode`` converts its input and checks types in Python before it calls
    the Rust tokenizer; that wrapper costs several times the decode itself, twice per token of
    every running request (``IncrementalDetokenizer.push``). Where the tokenizer's class is one whose
    decode only forwards (no subclass overrides it, no clean-up of spaces), the Rust tokenizer is
    called directly; any other tokenizer keeps its own ``decode``.
    """
    backend = getattr(tokenizer, "backend_tokenizer", None)
    forwards = getattr(tokenizer, "clean_up_tokenization_spaces", True) is False and _decode_forwards(type(tokenizer))
    if backend is not None and forwards:
        rust_decode: Decode = backend.decode
        return rust_decode
    return lambda ids, skip_special_tokens: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a request's generated ids into text deltas whose concatenation is ``decode(all ids)``.

    Args:
        tokenizer: The model's tokenizer.
        skip_special_tokens: Leave special tokens (EOS, chat markers) out of the text.
        spaces_between_special_tokens: When special tokens are kept, separate them from the text
            around them by spaces (needs the tokenizer's ``all_special_ids``).
    """

    def __init__(
        self, tokenizer: Tokenizer, skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> None:
        self._decode_ids = decoder_for(tokenizer)
        self._skip_special = skip_special_tokens
        special: frozenset[int] = frozenset()
        if not skip_special_tokens and spaces_between_special_tokens:
            special = frozenset(getattr(tokenizer, "all_special_ids", None) or ())
        self._spaced_ids = special
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # ids before this are already emitted as text

    def _decode(self, start: int, end: int | None = None) -> str:
        ids = self._ids[start:end]
        spaced = self._spaced_ids
        if not spaced or spaced.isdisjoint(ids):
            return self._decode_ids(ids, self._skip_special)
        parts: list[str] = []
        run: list[int] = []
        for token_id in ids:
            if token_id in spaced:
                if run:
                    parts.append(self._decode_ids(run, False))
                    run = []
                parts.append(self._decode_ids([token_id], False))
            else:
                run.append(token_id)
        if run:
            parts.append(self._decode_ids(run, False))
        return " ".join(part for part in parts if part)

    def defer(self, token_ids: list[int]) -> None:
        """Add generated ids without decoding them: the next ``push`` or ``flush`` returns their text.

        For a consumer that reads the text only at the end (``Engine.generate`` without stop
        strings): one decode of the whole output instead of two per step.
        """
        self._ids.extend(token_ids)

    def push(self, token_ids: list[int]) -> str:
        """Add generated ids; return the text they complete (possibly empty)."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        window_text = self._decode(self._prefix_offset)
        if len(window_text) <= len(prefix_text) or window_text.endswith("\ufffd"):
            return ""
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return window_text[len(prefix_text) :]

    def flush(self) -> str:
        """Return whatever text is still held back (called once, when the request ends)."""
        prefix_text = self._decode(self._prefix_offset, self._read_offset)
        window_text = self._decode(self._prefix_offset)
        self._prefix_offset = self._read_offset = len(self._ids)
        return window_text[len(prefix_text) :]
