"""``IncrementalDetokenizer``: token ids in, text deltas out, correct across multi-byte characters.

Decoding token by token breaks characters that span tokens (byte-level BPE, and SentencePiece's
byte-fallback ``<0xE2>`` tokens). Instead we decode a short window twice: the tokens already
emitted (``prefix``) and the window including the new tokens; the delta is the difference. While
the window ends in U+FFFD (an incomplete UTF-8 sequence) nothing is emitted, so a character is
never split; the held bytes come out with the token that completes them, or at ``flush()``.
"""

from __future__ import annotations

from typing import Protocol


class Tokenizer(Protocol):
    """The part of an HF tokenizer asyncllm uses."""

    def encode(self, text: str) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


class IncrementalDetokenizer:
    """Turns a request's generated ids into text deltas whose concatenation is ``decode(all ids)``.

    Args:
        tokenizer: The model's tokenizer.
        skip_special_tokens: Leave special tokens (EOS, chat markers) out of the text.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = []
        self._prefix_offset = 0  # start of the context window
        self._read_offset = 0  # ids before this are already emitted as text

    def _decode(self, start: int, end: int | None = None) -> str:
        return self._tokenizer.decode(self._ids[start:end], skip_special_tokens=self._skip_special)

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
