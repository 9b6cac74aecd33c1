"""``GrammarCompiler``: compiles structured-output specs off the event loop, once each (a bounded LRU)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator

import anyio

from asyncllm.errors import StructuredOutputError
from asyncllm.sampling_params import StructuredOutput
from asyncllm.structured._grammar import CompiledGrammar, GrammarBackend

COMPILE_THREADS = 2
"""Grammars compiled at once: a burst of large schemas takes two cores at most from the device thread,
and leaves anyio's shared worker threads (prompt tokenizing) alone."""


COMPILE_NICENESS = 10
"""How much a compiling thread lowers its CPU priority (Linux nice; other systems leave it): where cores
are fewer than the device's threads plus one, a compile then takes what the forward leaves, rather than a
core from it, so the other requests' inter-token latency stays level."""


@contextlib.contextmanager
def _low_priority() -> Iterator[None]:
    # Linux keeps a nice value per thread (setpriority on the thread id); restoring it needs a privilege
    # that an unprivileged process may lack, and then the worker thread stays nicer, which only makes
    # later off-loop work (tokenizing) yield to the device thread as well.
    thread = threading.get_native_id()
    try:
        before = os.getpriority(os.PRIO_PROCESS, thread)
        os.setpriority(os.PRIO_PROCESS, thread, before + COMPILE_NICENESS)
    except (AttributeError, OSError):  # not Linux, or not allowed: compile at the usual priority
        yield
        return
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, thread, before)


class GrammarCompiler:
    """Compiles ``StructuredOutput`` values with a backend and caches the results by value.

    Compiling runs in a worker thread (``compile_async``); the event loop only looks up the cache
    (``cached``). Concurrent requests for one uncompiled spec share a single compilation. Failures
    are cached too, so a bad schema sent again is refused without compiling it again.

    Args:
        make_backend: Builds the backend on first use, in a worker thread (reading a tokenizer's
            vocabulary takes a moment).
        cache_size: The most compiled grammars (and failures) kept; the least recently used go first.
    """

    def __init__(self, make_backend: Callable[[], GrammarBackend], *, cache_size: int = 256) -> None:
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._backend_lock = threading.Lock()
        self.cache_size = cache_size
        self._cache: OrderedDict[bytes, CompiledGrammar | StructuredOutputError] = OrderedDict()
        self._in_flight: dict[bytes, anyio.Event] = {}
        self._limiter: anyio.CapacityLimiter | None = None
        self.num_compiled = 0
        """Specs compiled (successfully or not) since the engine started."""
        self.num_cache_hits = 0
        self.compile_seconds = 0.0
        """Time spent compiling, summed (worker threads)."""

    def cached(self, spec: StructuredOutput) -> CompiledGrammar | None:
        """The compiled grammar of ``spec`` if it is cached (marking it recently used), else None.

        Raises:
            StructuredOutputError: ``spec`` failed to compile before.
        """
        key = spec.cache_key()
        entry = self._cache.get(key)
        if entry is None:
            return None
        self._cache.move_to_end(key)
        self.num_cache_hits += 1
        if isinstance(entry, StructuredOutputError):
            raise StructuredOutputError(str(entry), param=entry.param, code=entry.code)
        return entry

    async def compile_async(self, spec: StructuredOutput) -> CompiledGrammar:
        """The compiled grammar of ``spec``: from the cache, or compiled in a worker thread.

        Call it from the event loop. A cancellation while the thread compiles takes effect when
        it is done (the result is cached all the same).

        Raises:
            StructuredOutputError: ``spec`` cannot be compiled; the message says why.
        """
        key = spec.cache_key()
        while True:
            grammar = self.cached(spec)
            if grammar is not None:
                return grammar
            pending = self._in_flight.get(key)
            if pending is None:
                break
            await pending.wait()  # another request compiles the same spec: share its result
        done = self._in_flight[key] = anyio.Event()
        if self._limiter is None:  # made on first use, in the event loop's own library
            self._limiter = anyio.CapacityLimiter(COMPILE_THREADS)
        try:
            started = time.perf_counter()
            result = await anyio.to_thread.run_sync(self._compile, spec, limiter=self._limiter)
            # Counted here, on the event loop: compiles run in several threads at once.
            self.compile_seconds += time.perf_counter() - started
            self.num_compiled += 1
            self._store(key, result)
        finally:
            del self._in_flight[key]
            done.set()
        if isinstance(result, StructuredOutputError):
            raise StructuredOutputError(str(result), param=result.param, code=result.code)
        return result

    def _compile(self, spec: StructuredOutput) -> CompiledGrammar | StructuredOutputError:
        # Worker thread. Errors are returned, not raised, so they can be cached with the successes;
        # none may escape: on the core's path (a synchronous stream()) it would end the engine.
        try:
            with self._backend_lock:
                if self._backend is None:
                    self._backend = self._make_backend()
                backend = self._backend
        except Exception as exc:  # a tokenizer the grammar engine cannot read, a model without EOS
            return StructuredOutputError(
                f"this engine cannot apply structured_output: {exc}",
                param="structured_output",
                code="structured_output_unavailable",
            )
        try:
            with _low_priority():
                return backend.compile(spec)
        except StructuredOutputError as exc:
            return exc
        except Exception as exc:  # the grammar engine failed otherwise: this request fails, not the engine
            return StructuredOutputError(
                f"structured_output.{spec.kind} cannot be compiled: {exc!r}", param="structured_output"
            )

    def _store(self, key: bytes, entry: CompiledGrammar | StructuredOutputError) -> None:
        self._cache[key] = entry
        self._cache.move_to_end(key)
        while len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
