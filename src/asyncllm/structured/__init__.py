"""Structured output: compiling a ``StructuredOutput`` into a grammar, and the matchers that mask tokens.

The grammar engine sits behind a seam (``GrammarBackend``); ``llguidance`` is the one shipped (see
docs/structured-output.md for the measurement behind the choice). Nothing here imports torch: the
sampler, on the device thread, turns the matchers' bitmasks into masked logits.
"""

from asyncllm.structured._compiler import GrammarCompiler
from asyncllm.structured._grammar import CompiledGrammar, GrammarBackend, GrammarMatcher

__all__ = ["CompiledGrammar", "GrammarBackend", "GrammarCompiler", "GrammarMatcher"]
