"""``DeviceWorker``: the one thread that owns the device.

Torch state that matters for speed and safety (the CUDA stream, weights, KV tensors) lives on
exactly one long-lived thread. The event loop hands it calls and awaits their results without
blocking: the thread finishes a call, stores the outcome, and schedules the awaiting task's wake-up
on the loop (``call_soon_threadsafe`` on asyncio, ``run_sync_soon`` on trio) without waiting for
the loop to run it. (anyio's ``BlockingPortal`` waits until the loop has run the callback, which
would stall the device thread for as long as the loop is busy with its own work.)
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import queue
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import anyio

from asyncllm.errors import DeviceStepTimeoutError

logger = logging.getLogger("asyncllm")

T = TypeVar("T")

LoopCallback = Callable[[Callable[[], object]], object]
"""Schedules a callback on the event loop's thread, from any thread, and returns without waiting."""


def loop_callback() -> LoopCallback:
    """The running event loop's thread-safe, non-waiting scheduler (call from the loop's thread)."""
    try:
        return asyncio.get_running_loop().call_soon_threadsafe
    except RuntimeError:  # not asyncio: anyio's other backend
        import trio

        callback: LoopCallback = trio.lowlevel.current_trio_token().run_sync_soon
        return callback


class DeviceCall(Generic[T]):
    """A call submitted to the device thread; ``await call.wait()`` gives its result."""

    def __init__(self, fn: Callable[[], T]) -> None:
        self._fn = fn
        self._done = anyio.Event()
        self._result: T | None = None
        self._error: BaseException | None = None
        self._settled = False  # the outcome is stored once: a call failed from outside keeps that failure
        self._settle = threading.Lock()
        self.submitted_at = anyio.current_time()
        """When the call was queued, on the event loop's clock."""

    def _fail(self, error: BaseException, wake: LoopCallback) -> None:
        with self._settle:
            if self._settled:
                return
            self._error, self._settled = error, True
        with contextlib.suppress(RuntimeError):
            wake(self._done.set)

    def _run(self, wake: LoopCallback) -> None:
        result: T | None = None
        error: BaseException | None = None
        try:
            result = self._fn()
        except BaseException as exc:  # handed to the awaiting task, which decides what it means
            error = exc
        with self._settle:
            if self._settled:  # failed from outside while it ran (``DeviceWorker.fail``): nobody waits
                return
            self._result, self._error, self._settled = result, error, True
        # The loop is gone only if the engine's task group died around a running call: nobody waits.
        with contextlib.suppress(RuntimeError):  # trio's RunFinishedError is one too
            wake(self._done.set)

    async def wait(self, timeout: float | None = None) -> T:
        """The call's return value, or its exception re-raised.

        Shielded, so a cancelled caller never abandons a running step; ``timeout`` is the one bound.
        It counts from the later of the submission and this wait's start: calls run one at a time,
        and one queued behind a running call (a step scheduled ahead) is awaited only once the call
        before it has returned, so its own time is not charged with its predecessor's.

        Args:
            timeout: Seconds after which the call counts as hung; None waits forever.

        Raises:
            DeviceStepTimeoutError: The call had not returned within ``timeout`` seconds.
        """
        deadline = math.inf if timeout is None else max(self.submitted_at, anyio.current_time()) + timeout
        with anyio.CancelScope(shield=True, deadline=deadline):
            await self._done.wait()
        if not self._done.is_set():
            raise DeviceStepTimeoutError(
                f"a device call did not return within {timeout} s (step_timeout); the device thread is stuck"
            )
        if self._error is not None:
            raise self._error
        return self._result  # type: ignore[return-value]


_STOP = object()


class DeviceWorker:
    """Runs submitted callables one at a time, in order, on a dedicated thread.

    Create it on the event loop's thread (it captures the loop's ``loop_callback``).

    Args:
        name: The thread's name (shows in debuggers and ``threading.enumerate()``).
    """

    def __init__(self, name: str = "asyncllm-device") -> None:
        self._wake = loop_callback()
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._exited = anyio.Event()
        self.abandoned = False
        """True once a call timed out or was failed from outside: the thread is left to finish (or not) on
        its own."""
        self.stuck = False
        """True once a call timed out (``abandon``): the thread may never be free again."""
        self._pending: weakref.WeakSet[DeviceCall[Any]] = weakref.WeakSet()
        self._discarded: weakref.WeakSet[DeviceCall[Any]] = weakref.WeakSet()
        self._running: DeviceCall[Any] | None = None
        self._lock = threading.Lock()  # a call is either taken by the thread or discarded, never both
        self.busy_seconds = 0.0
        """Seconds the thread spent running calls (model steps, load, close)."""
        # (seconds of finished waits, start of the current wait or None), replaced in one assignment
        # so that the loop thread never reads half an update.
        self._idle: tuple[float, float | None] = (0.0, None)
        self._thread.start()

    @property
    def idle_seconds(self) -> float:
        """Seconds the thread waited for its next call, after the first one, the current wait included.

        The current wait counts up to now, so two snapshots taken around a busy period (a benchmark
        run) do not also count an idle gap that began before the first of them.
        """
        done, since = self._idle
        return done + (time.perf_counter() - since if since is not None else 0.0)

    def _main(self) -> None:
        ran_once = False
        try:
            while True:
                waited_from = time.perf_counter()
                if ran_once:  # waiting before the first call (the load) is not idleness
                    self._idle = (self._idle[0], waited_from)
                call = self._queue.get()
                started = time.perf_counter()
                if ran_once:
                    self._idle = (self._idle[0] + started - waited_from, None)
                if call is _STOP:
                    break
                with self._lock:
                    if call in self._discarded:
                        continue
                    self._running = call
                call._run(self._wake)
                self._running = None
                self.busy_seconds += time.perf_counter() - started
                ran_once = True
        finally:
            with contextlib.suppress(RuntimeError):
                self._wake(self._exited.set)

    def submit(self, fn: Callable[[], T]) -> DeviceCall[T]:
        """Queue ``fn`` to run on the device thread; returns at once."""
        call = DeviceCall(fn)
        self._pending.add(call)
        self._queue.put(call)
        return call

    async def run(self, fn: Callable[[], T]) -> T:
        """Run ``fn`` on the device thread and return its result."""
        return await self.submit(fn).wait()

    def abandon(self) -> None:
        """Give up on the thread after a call hung: it ends by itself if the call ever returns.

        A thread cannot be interrupted, so it is left behind (a daemon) rather than waited for.
        """
        self.stuck = True
        if not self.abandoned:
            self.abandoned = True
            self.discard_queued(DeviceStepTimeoutError("the device thread was abandoned after a call hung"))
            self._queue.put(_STOP)
            logger.warning("asyncllm: the device thread is stuck in a call; it is left behind as a daemon thread")

    def fail(self, error: BaseException) -> None:
        """Fail the running call and every queued one with ``error`` now, and abandon the thread.

        For a failure noticed outside the thread (a tensor-parallel rank died): the running call may
        be stuck in a collective with the dead rank, so its caller gets ``error`` without waiting for
        it; the thread ends by itself if the call ever returns.
        """
        with self._lock:
            calls = [c for c in self._pending if not c._done.is_set()]
            self._discarded.update(calls)
        for call in calls:
            call._fail(error, self._wake)
        if not self.abandoned:
            self.abandoned = True
            self._queue.put(_STOP)
            logger.warning("asyncllm: the device thread is left behind (%s)", error)

    def discard_queued(self, error: BaseException) -> None:
        """Fail every call not started yet with ``error`` instead of running it (the engine died:
        a step queued behind the failed one would compute on tokens that will never come)."""
        with self._lock:
            queued = [c for c in self._pending if not c._done.is_set() and c is not self._running]
            self._discarded.update(queued)
        for call in queued:
            call._fail(error, self._wake)

    async def stop(self, timeout: float | None = None) -> None:
        """Let queued calls finish, end the thread and wait until it has exited (shielded).

        Args:
            timeout: Seconds to wait for the thread; past them it is abandoned (left behind as a
                daemon, logged). None waits forever. An abandoned worker is not waited for.
        """
        if self.abandoned:
            return
        self._queue.put(_STOP)
        with anyio.CancelScope(shield=True), anyio.move_on_after(math.inf if timeout is None else timeout):
            await self._exited.wait()
        if not self._exited.is_set():
            self.abandon()
            return
        # The thread's last act was the wake-up above, so this join returns at once.
        self._thread.join()

    async def wait_exited(self, timeout: float | None) -> bool:
        """Wait (shielded) up to ``timeout`` seconds (None: forever) for the thread to end; whether it has.

        For a thread abandoned by ``fail`` rather than stuck: it ends as soon as its call returns.
        """
        with anyio.CancelScope(shield=True), anyio.move_on_after(math.inf if timeout is None else timeout):
            await self._exited.wait()
        return self._exited.is_set()

    @property
    def thread(self) -> threading.Thread:
        """The device thread."""
        return self._thread
