"""The seam between the engine and a grammar engine: a backend compiles, a compiled grammar makes matchers."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from asyncllm.sampling_params import StructuredOutput


class GrammarMatcher(Protocol):
    """One output's position in a grammar. Used on the device thread only."""

    @property
    def backend(self) -> GrammarBackend:
        """The backend that fills this matcher's bitmask."""
        ...

    def consume(self, token_ids: Sequence[int]) -> bool:
        """Advance over ``token_ids``; False (and the matcher in error) when the grammar refuses one."""
        ...

    def rollback(self, num_tokens: int) -> None:
        """Undo the last ``num_tokens`` consumed tokens."""
        ...

    def error(self) -> str | None:
        """Why the matcher stopped matching (a refused token, a resource limit), or None."""
        ...


class CompiledGrammar(Protocol):
    """A grammar compiled against one tokenizer; immutable and shared by every request that uses it."""

    @property
    def backend(self) -> GrammarBackend:
        """The backend that compiled it (it fills its matchers' bitmasks)."""
        ...

    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start."""
        ...


class GrammarBackend(Protocol):
    """A grammar engine bound to one tokenizer and vocabulary."""

    name: str

    def compile(self, spec: StructuredOutput) -> CompiledGrammar:
        """Compile ``spec``. Blocking (seconds at worst): the engine calls it in a worker thread.

        Raises:
            StructuredOutputError: The schema, regex or grammar is invalid, unsupported or too large.
        """
        ...

    def fill_bitmasks(self, matchers: Sequence[GrammarMatcher], bitmask: np.ndarray) -> None:
        """Write each matcher's allowed tokens into the rows of ``bitmask``, in one call for the batch.

        Args:
            matchers: This backend's matchers, one per row.
            bitmask: [len(matchers), ceil(vocab / 32)] int32, C-contiguous: bit ``t % 32`` of word
                ``t // 32`` is set when token ``t`` is allowed.
        """
        ...
