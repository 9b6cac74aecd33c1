"""The llguidance backend: JSON Schema, regex, choice, Lark and GBNF grammars over an HF tokenizer."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from typing import Any

import llguidance
import llguidance.gbnf_to_lark
import llguidance.hf
import numpy as np

from asyncllm.errors import StructuredOutputError
from asyncllm.sampling_params import StructuredOutput

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
"""Compact JSON, as OpenAI's structured outputs write it: free whitespace would let a weak model pad
the output with spaces until ``max_tokens``."""


class LLGuidanceBackend:
    """Compiles ``StructuredOutput`` values with llguidance for one tokenizer.

    Args:
        tokenizer: A Hugging Face fast tokenizer (llguidance reads its vocabulary).
        vocab_size: The width of the model's logits (ids past the tokenizer's vocabulary are never allowed).
        eos_token_ids: The model's end-of-sequence ids: all of them are allowed where the grammar may end.
    """

    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int]) -> None:
        eos = sorted(eos_token_ids)
        if not eos:
            raise ValueError("structured output needs the model's end-of-sequence token id")
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos)
        self._executor: llguidance.LLExecutor | None = None

    def compile(self, spec: StructuredOutput) -> LLGuidanceGrammar:
        """Compile ``spec`` (blocking; llguidance releases the GIL while it builds the grammar).

        Raises:
            StructuredOutputError: llguidance refuses the grammar; its message says why.
        """
        grammar = _grammar_text(spec)
        template = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if template.is_error():
            raise StructuredOutputError(
                f"structured_output.{spec.kind} cannot be compiled: {_first_line(template.get_error())}",
                param="structured_output",
            )
        return LLGuidanceGrammar(self, template)

    def fill_bitmasks(self, matchers: Sequence[Any], bitmask: np.ndarray) -> None:
        """Every row's mask, computed in parallel by llguidance's thread pool (GIL released)."""
        if self._executor is None:
            self._executor = llguidance.LLExecutor()
        rows = [(matcher.inner, row) for row, matcher in enumerate(matchers)]
        self._executor.unsafe_compute_mask_ptr(rows, bitmask.ctypes.data, bitmask.shape[1] * 4, bitmask.shape[0])


class LLGuidanceGrammar:
    """A compiled grammar: matchers are deep copies of a template built once."""

    def __init__(self, backend: LLGuidanceBackend, template: llguidance.LLMatcher) -> None:
        self.backend = backend
        self._template = template

    def matcher(self) -> LLGuidanceMatcher:
        """A fresh matcher at the grammar's start."""
        return LLGuidanceMatcher(self.backend, self._template.deep_copy())


class LLGuidanceMatcher:
    """One output's llguidance matcher."""

    def __init__(self, backend: LLGuidanceBackend, inner: llguidance.LLMatcher) -> None:
        self.backend = backend
        self.inner = inner

    def consume(self, token_ids: Sequence[int]) -> bool:
        """Advance over ``token_ids``; False when one is refused (the matcher is then in error)."""
        return bool(self.inner.consume_tokens(list(token_ids)))

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` tokens (a full reset when the matcher cannot step back)."""
        if not self.inner.rollback(num_tokens):
            raise RuntimeError(f"llguidance could not roll back {num_tokens} tokens: {self.inner.get_error()}")

    def error(self) -> str | None:
        """llguidance's error, first line, or None."""
        return _first_line(self.inner.get_error()) if self.inner.is_error() else None


def _grammar_text(spec: StructuredOutput) -> str:
    """``spec`` as an llguidance grammar (Lark text, or its JSON form for schemas)."""
    if spec.json_schema is not None:
        schema = spec.json_schema
        if schema is True:
            schema = {}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
        except ValueError as exc:
            raise StructuredOutputError(f"structured_output.json_schema: {exc}", param="structured_output") from None
    if spec.json_object:
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)  # type: ignore[arg-type]
    if spec.regex is not None:
        return llguidance.LLMatcher.grammar_from_regex(spec.regex)
    if spec.choice is not None:
        # Each choice as a quoted literal of the Lark grammar: exact text, no regex meaning.
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in spec.choice))
    if spec.lark is not None:
        return llguidance.LLMatcher.grammar_from_lark(spec.lark)
    assert spec.ebnf is not None
    try:
        return llguidance.LLMatcher.grammar_from_lark(llguidance.gbnf_to_lark.gbnf_to_lark(spec.ebnf))
    except llguidance.gbnf_to_lark.GbnfToLarkError as exc:
        raise StructuredOutputError(
            f"structured_output.ebnf cannot be parsed: {_first_line(str(exc))}", param="structured_output"
        ) from None


def _first_line(message: str) -> str:
    # llguidance appends its parser state to errors; the first lines say what is wrong.
    message = re.split(r"\n<state>", message, maxsplit=1)[0]
    return message.strip()
