"""The ranks of tensor parallelism beyond the device thread: their processes, and what reaches them each step.

With ``tensor_parallel_size=N`` the engine's device thread drives rank 0 and ranks 1..N-1 run in worker
processes (``asyncllm.worker._rank`` in a fresh interpreter), each owning its device. ``RankProcesses`` starts them
when the engine is entered and ends them when it is left; nothing here imports torch.

Each rank process has three pipes to the engine's process:

- **commands** (engine to rank): msgspec-encoded ``RankMessage``s, written by rank 0's runner on the
  device thread. A step is one ``StepMessage``: the scheduler's sequences for that step, their block
  tables sent as what changed since the rank last saw them (``TableSync``), so a decode step costs a
  few integers per sequence. A table that loses leading blocks to a sliding window says its new
  ``block_offset``; a hybrid model's second table (its sliding layers' pool) travels the same way.
  The rank decodes it, runs the same ``InputBatch`` as rank 0, and joins the step's collectives
  (``torch.distributed``: gloo on the CPU, NCCL on CUDA). Waiting for the next message is a blocking
  read: an idle rank uses no CPU and no collective times out while idle.
- **status** (rank to engine): reports (a failure's reason, counters at exit), and the rank's
  sentinel: the engine sees end-of-file there the moment the process exits, for whatever reason.
- **stdin** (engine to rank): the lifeline. The engine never writes to it; when the engine's process
  ends (a crash, SIGKILL), the rank reads end-of-file and exits, so no rank outlives its engine.

A rank that exits while the engine runs fails the engine (``WorkerDiedError`` on every stream): the
watcher (``watch``) notices the end-of-file at once, whether a step is running or not. A rank that
hangs is caught by ``step_timeout`` (rank 0's step waits on it in a collective).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection, wait
from types import TracebackType
from typing import Any

import anyio
import msgspec

from asyncllm.errors import WorkerDiedError
from asyncllm.executor._runner import SequenceInput
from asyncllm.sampling_params import SamplingParams

logger = logging.getLogger("asyncllm")

__all__ = [
    "AllocateMessage",
    "LogitsMessage",
    "RankConfig",
    "RankMessage",
    "RankProcesses",
    "RankReport",
    "SequenceDelta",
    "StepMessage",
    "StopMessage",
    "TableDelta",
    "TableMirror",
    "TableSync",
]

_BOOTSTRAP = """\
import sys
if sys.path and sys.path[0] == "":  # -c's entry for the working directory
    del sys.path[0]
from asyncllm.worker._rank import run
run()
"""
# What a rank process runs (``python -c``). Not ``-m``, which puts the working directory first on the
# child's path: a folder or file there named like a module the rank imports (an asyncllm checkout, a
# random.py) would shadow the engine's own, which the engine's process (a console script, a script run
# by its path) does not see. Only the engine's path, handed on as PYTHONPATH, is searched.

RANK_EXIT_GRACE = 10.0
"""Seconds a rank process has to exit after the engine asked it to stop (a clean close) before it is
killed; a dead engine's ranks are killed at once."""


class RankConfig(msgspec.Struct, frozen=True, kw_only=True, array_like=True, tag="config"):
    """A rank's first message: what to load and where the others are."""

    rank: int
    size: int
    model_path: str
    options: dict[str, Any]
    """The engine's options (``EngineOptions`` fields with JSON-able values)."""
    store_host: str
    store_port: int
    """The ``torch.distributed`` store rank 0 opened, where the ranks meet."""
    spec: dict[str, Any]
    """The model's ``DecoderSpec`` as builtins (``msgspec.to_builtins``), read off its config by rank 0:
    a rank builds its shard from it without importing transformers (seconds at start-up)."""


class TableDelta(msgspec.Struct, frozen=True, array_like=True):
    """A hybrid model's second block table (its sliding layers' pool) as the other ranks receive it; the
    fields mean what ``SequenceDelta``'s of the same names do."""

    block_offset: int
    kept_blocks: int
    new_blocks: list[int]


class SequenceDelta(msgspec.Struct, frozen=True, array_like=True):
    """One sequence of a step as the other ranks receive it."""

    request_id: int
    epoch: int
    start_position: int
    token_ids: list[int]
    sample: bool
    kept_blocks: int
    """Blocks of the table the rank holds from earlier steps that stay (from ``block_offset`` on: the
    rank drops those before it); 0: the table is ``new_blocks``."""
    new_blocks: list[int]
    block_offset: int = 0
    """The sequence index of the table's first block (``SequenceInput.block_offset``)."""
    sliding: TableDelta | None = None
    """The sliding layers' table (``SequenceInput.sliding_block_table``); None without one."""
    num_draft: int = 0
    """``SequenceInput.num_draft``: every rank gathers the logits of the draft's rows too (verification
    reads them on rank 0, and the vocabulary-parallel head's gather takes every rank)."""


class StepMessage(msgspec.Struct, frozen=True, array_like=True, tag="step"):
    """Run a step's forward; if it samples, gather the sampled rows' logits to rank 0 after it."""

    sequences: list[SequenceDelta]
    sent_at: float
    """``time.perf_counter()`` on rank 0 when sent (one monotonic clock for every process of the host)."""


class LogitsMessage(msgspec.Struct, frozen=True, array_like=True, tag="logits"):
    """Gather the logits of these rows of the last step's hidden states to rank 0 (prompt logprobs)."""

    rows: list[int]


class AllocateMessage(msgspec.Struct, frozen=True, array_like=True, tag="allocate"):
    """Replace the KV cache by one of ``num_blocks`` blocks (the rank's KV heads); ``sliding_blocks`` for
    a hybrid model's sliding layers (``RunnerInfo.sliding_group``), None: every layer has ``num_blocks``;
    ``prefault``: the serving cache (not the sizing probe's), faulted in where the options say."""

    num_blocks: int
    sliding_blocks: int | None = None
    prefault: bool = False


class StopMessage(msgspec.Struct, frozen=True, array_like=True, tag="stop"):
    """Report the counters and exit."""


RankMessage = RankConfig | StepMessage | LogitsMessage | AllocateMessage | StopMessage


class RankReport(msgspec.Struct, frozen=True, kw_only=True):
    """What a rank tells the engine: why it failed, or its counters when it stops."""

    failure: str | None = None
    steps: int = 0
    broadcast_seconds: float = 0.0
    """Summed over steps: from rank 0's send to the step decoded here (the broadcast's latency)."""
    collective_seconds: float = 0.0
    """Summed over steps: time in all-reduces and gathers, waiting for the other ranks included."""
    forward_seconds: float = 0.0
    """Summed over steps: the whole forward, its collectives included."""


_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)  # the other ranks never sample: any valid params


_Held = tuple[int, int, int, int, int]
"""What a rank holds of one table: (epoch, block offset, end (offset + blocks), first block, last block)."""


def _kept(held: _Held | None, epoch: int, offset: int, table: Sequence[int]) -> int:
    """How many blocks of the rank's copy ``held`` stay in ``table`` (which starts at sequence index ``offset``).

    Within an epoch a table only grows at its end and loses blocks at its start (a sliding window), so
    the copy's blocks from ``offset`` on are a prefix of it when its bounds say so: its end is within
    the table, and its first and last blocks are where the table has them (O(1) checks, as
    ``InputBatch`` makes).
    """
    if held is None or held[0] != epoch or not table:
        return 0
    _, held_offset, held_end, first, last = held
    if offset < held_offset or held_end <= offset or held_end > offset + len(table):
        return 0
    if table[held_end - offset - 1] != last or (offset == held_offset and table[0] != first):
        return 0
    return held_end - offset


def _held(epoch: int, offset: int, table: Sequence[int], stable_end: int | None) -> _Held | None:
    """What a rank holds of ``table`` after the step, as far as rank 0 may count on it: up to the sequence
    index ``stable_end`` when the step fed a draft (None: all of it); None when nothing is."""
    end = offset + len(table) if stable_end is None else min(offset + len(table), stable_end)
    if end <= offset:
        return None
    return (epoch, offset, end, table[0], table[end - offset - 1])


class TableSync:
    """Rank 0's record of the block tables the other ranks hold, so that a step sends only new blocks.

    Both sides forget a request absent from a step, as ``InputBatch`` does: a request that comes back
    (after a preemption, in a new epoch) is sent whole. A hybrid model's sliding tables are recorded
    the same way, apart. After a step that fed a draft, the blocks past the draft's newest real token
    may have been trimmed (``KVCacheManager.trim``: rejected tokens) and others allocated in their place
    before the next step, so only the blocks before them are recorded: the others are sent again.

    Args:
        block_size: Tokens per KV block (to tell the blocks a rejected draft cannot have trimmed).
    """

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._known: dict[int, _Held] = {}
        self._sliding: dict[int, _Held] = {}

    def deltas(self, sequences: Sequence[SequenceInput]) -> list[SequenceDelta]:
        """The step's sequences for the other ranks; records what they will hold afterwards."""
        known, sliding_known = self._known, self._sliding
        now: dict[int, _Held] = {}
        sliding_now: dict[int, _Held] = {}
        out = []
        for seq in sequences:
            rid, epoch, table, offset = seq.request_id, seq.epoch, seq.block_table, seq.block_offset
            # The sequence index past the last block that stays until the next step (see above).
            stable_end = None
            if seq.num_draft:
                real = seq.start_position + len(seq.token_ids) - seq.num_draft
                stable_end = -(-real // self.block_size)
            kept = _kept(known.get(rid), epoch, offset, table)
            held = _held(epoch, offset, table, stable_end)
            if held is not None:
                now[rid] = held
            sliding = None
            if seq.sliding_block_table is not None:
                s_table, s_offset = seq.sliding_block_table, seq.sliding_block_offset
                s_kept = _kept(sliding_known.get(rid), epoch, s_offset, s_table)
                sliding = TableDelta(s_offset, s_kept, list(s_table[s_kept:]))
                s_held = _held(epoch, s_offset, s_table, stable_end)
                if s_held is not None:
                    sliding_now[rid] = s_held
            out.append(
                SequenceDelta(
                    rid, epoch, seq.start_position, list(seq.token_ids), seq.sample, kept, list(table[kept:]),
                    offset, sliding, seq.num_draft,
                )
            )  # fmt: skip
        self._known, self._sliding = now, sliding_now
        return out


def _mirror(
    held: tuple[int, list[int]] | None, request_id: int, offset: int, kept: int, new_blocks: list[int]
) -> list[int]:
    """The table a rank rebuilds from its copy ``held`` ((offset, blocks)) and a delta.

    Raises:
        RuntimeError: The delta keeps blocks this rank does not hold.
    """
    table: list[int] = []
    if kept and held is not None and offset >= held[0]:
        table = held[1]
        del table[: offset - held[0]]
    if len(table) < kept:
        raise RuntimeError(f"request {request_id} keeps {kept} blocks, this rank holds {len(table)}")
    del table[kept:]  # after a draft: the blocks past its real tokens come again
    table.extend(new_blocks)
    return table


class TableMirror:
    """A rank's copy of the block tables, rebuilt from each step's ``SequenceDelta``s."""

    def __init__(self) -> None:
        self._tables: dict[int, tuple[int, list[int]]] = {}
        self._sliding: dict[int, tuple[int, list[int]]] = {}

    def sequences(self, deltas: Sequence[SequenceDelta]) -> list[SequenceInput]:
        """The step's sequences, with their whole block tables, as rank 0's runner saw them.

        Raises:
            RuntimeError: A delta keeps blocks this rank does not hold (rank 0 and this rank disagree).
        """
        tables: dict[int, tuple[int, list[int]]] = {}
        sliding_tables: dict[int, tuple[int, list[int]]] = {}
        out = []
        for delta in deltas:
            rid = delta.request_id
            table = _mirror(self._tables.get(rid), rid, delta.block_offset, delta.kept_blocks, delta.new_blocks)
            tables[rid] = (delta.block_offset, table)
            sliding_table = None
            sliding = delta.sliding
            if sliding is not None:
                held = self._sliding.get(rid)
                sliding_table = _mirror(held, rid, sliding.block_offset, sliding.kept_blocks, sliding.new_blocks)
                sliding_tables[rid] = (sliding.block_offset, sliding_table)
            out.append(
                SequenceInput(
                    request_id=rid,
                    token_ids=delta.token_ids,
                    start_position=delta.start_position,
                    block_table=table,
                    sample=delta.sample,
                    params=_PARAMS,
                    epoch=delta.epoch,
                    block_offset=delta.block_offset,
                    sliding_block_table=sliding_table,
                    sliding_block_offset=0 if sliding is None else sliding.block_offset,
                    num_draft=delta.num_draft,
                )
            )
        self._tables, self._sliding = tables, sliding_tables
        return out


_encoder = msgspec.msgpack.Encoder()
_message_decoder = msgspec.msgpack.Decoder(RankMessage)
_report_decoder = msgspec.msgpack.Decoder(RankReport)


def encode(message: RankMessage | RankReport) -> bytes:
    """A message or report as sent through a rank's pipes."""
    return _encoder.encode(message)


def decode_message(data: bytes) -> RankMessage:
    """A message read from the commands pipe."""
    return _message_decoder.decode(data)


class _Rank:
    def __init__(self, rank: int, process: subprocess.Popen[bytes], commands: Connection, status: Connection) -> None:
        self.rank = rank
        self.process = process
        self.commands = commands
        self.status = status
        self.failure: str | None = None
        self.report: RankReport | None = None
        self.exited = False


class RankProcesses:
    """Ranks 1..size-1 of a tensor-parallel engine as worker processes, started and ended with it.

    An async context manager: entering it starts the processes (each imports torch and waits for its
    ``RankConfig``); leaving it ends them: a rank asked to stop (``StopMessage``, by rank 0's runner
    when it closes) has ``RANK_EXIT_GRACE`` seconds to exit before it is killed, and every rank of a
    dead engine is killed at once. Either way they are reaped before ``__aexit__`` returns.

    Args:
        size: The ranks in all (``tensor_parallel_size``), rank 0 included.
        model_path: The model folder every rank loads its shard from.
        options: ``EngineOptions`` fields as JSON-able values (each rank builds its runner from them).
    """

    def __init__(self, size: int, model_path: os.PathLike[str] | str, options: dict[str, Any]) -> None:
        if size < 2:
            raise ValueError(f"RankProcesses needs at least 2 ranks, got {size}")
        self.size = size
        self.model_path = os.fspath(model_path)
        self.options = options
        self._ranks: list[_Rank] = []
        self._wake_read, self._wake_write = -1, -1
        self._closing = False
        self._graceful = True
        self._lock = threading.Lock()
        self._reading = threading.Lock()  # one reader at a time on a status pipe: the watcher, or _died
        self._failure: WorkerDiedError | None = None
        self.send_seconds = 0.0
        """Rank 0's time spent encoding and writing messages, summed (the broadcast's cost to rank 0)."""
        self.num_sent = 0
        self.reports: dict[int, RankReport] = {}
        """Each rank's counters, once it has stopped cleanly (``RankReport``)."""

    @property
    def pids(self) -> list[int]:
        """The rank processes' ids, rank 1 first."""
        return [rank.process.pid for rank in self._ranks]

    async def __aenter__(self) -> RankProcesses:
        _OPEN.add(self)
        self._wake_read, self._wake_write = os.pipe()
        try:
            for rank in range(1, self.size):
                self._ranks.append(await anyio.to_thread.run_sync(self._spawn, rank))
        except BaseException:
            await self._end(graceful=False)
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self._end(graceful=self._graceful and exc_type is None)

    def _spawn(self, rank: int) -> _Rank:
        commands_read, commands_write = os.pipe()
        status_read, status_write = os.pipe()
        env = dict(os.environ)
        # The engine's import path, as multiprocessing's spawn hands it on: the rank imports the same asyncllm.
        # An empty entry (the engine started by -c or interactively) is the working directory: said so.
        env["PYTHONPATH"] = os.pathsep.join(path or os.getcwd() for path in sys.path)
        try:
            process = subprocess.Popen(
                [sys.executable, "-c", _BOOTSTRAP, str(commands_read), str(status_write), str(rank)],
                stdin=subprocess.PIPE,
                pass_fds=(commands_read, status_write),
                env=env,
            )
        except BaseException:
            for fd in (commands_read, commands_write, status_read, status_write):
                os.close(fd)
            raise
        os.close(commands_read)
        os.close(status_write)
        return _Rank(rank, process, Connection(commands_write, readable=False), Connection(status_read, writable=False))

    # -- rank 0's side (the device thread) --------------------------------------------------------

    def start_group(self, host: str, port: int, spec: dict[str, Any]) -> None:
        """Send every rank its ``RankConfig``: the model, its spec, the options and rank 0's store address.

        Raises:
            WorkerDiedError: A rank has exited.
        """
        for rank in self._ranks:
            config = RankConfig(
                rank=rank.rank,
                size=self.size,
                model_path=self.model_path,
                options=self.options,
                store_host=host,
                store_port=port,
                spec=spec,
            )
            self._write(rank, encode(config))

    def send(self, message: RankMessage) -> None:
        """Encode ``message`` once and write it to every rank (rank 0's device thread only).

        Raises:
            WorkerDiedError: A rank has exited.
        """
        started = time.perf_counter()
        data = encode(message)
        for rank in self._ranks:
            self._write(rank, data)
        self.send_seconds += time.perf_counter() - started
        self.num_sent += 1

    def _write(self, rank: _Rank, data: bytes) -> None:
        try:
            rank.commands.send_bytes(data)
        except OSError as exc:  # a closed pipe: the rank is gone
            failure = self.explain(exc)
            if failure is exc:
                raise
            raise failure from exc

    def failure(self) -> WorkerDiedError | None:
        """The ``WorkerDiedError`` of a rank that has exited, or None while every rank runs (any thread)."""
        return self._check_exits()

    def explain(self, error: BaseException, wait_seconds: float = 2.0) -> BaseException:
        """The ``WorkerDiedError`` behind ``error`` (a collective or a pipe that failed on rank 0) when a
        rank has exited, else ``error``; waits up to ``wait_seconds`` for an exit to show."""
        deadline = time.monotonic() + wait_seconds
        while True:
            failure = self._check_exits()
            if failure is not None:
                return failure
            if time.monotonic() >= deadline:
                return error
            time.sleep(0.05)

    def _check_exits(self) -> WorkerDiedError | None:
        for rank in self._ranks:
            code = rank.process.poll()
            if code is not None:
                return self._died(rank, code)
        return self._failure

    def _died(self, rank: _Rank, code: int | None) -> WorkerDiedError:
        # The rank's exit may be seen (rank 0's device thread polling) before the watcher has read what the
        # rank sent just before it exited: its reason is in the pipe, ahead of the end-of-file.
        with self._reading:
            while not rank.exited and not rank.status.closed and rank.status.poll():
                self._read_report(rank)
        with self._lock:
            if self._failure is None:
                how = _describe_exit(code)
                reason = f": {rank.failure}" if rank.failure else ""
                self._failure = WorkerDiedError(
                    f"tensor-parallel rank {rank.rank} (pid {rank.process.pid}) {how}{reason}"
                )
            return self._failure

    # -- the engine's side (the event loop) ------------------------------------------------------

    def mark_closing(self, graceful: bool) -> None:
        """The engine is closing: ranks that exit from now on are expected to (not a failure).

        Args:
            graceful: The ranks were asked to stop and get ``RANK_EXIT_GRACE`` seconds; False kills
                them at once (a dead engine: they may be stuck in a collective).
        """
        self._closing = True
        self._graceful = graceful

    def stop_watching(self) -> None:
        """End ``watch`` (it returns without reporting)."""
        if self._wake_write >= 0:
            os.write(self._wake_write, b"x")

    async def watch(self, on_death: Callable[[WorkerDiedError], None]) -> None:
        """Wait until a rank exits (then call ``on_death`` with why, unless closing) or ``stop_watching``.

        The wait is a thread blocked on every rank's status pipe: a rank's exit shows as end-of-file
        there at once, however it ended. Reports read meanwhile (a failure's reason) are kept.
        """
        rank = await anyio.to_thread.run_sync(self._wait_for_exit)
        if rank is None or self._closing:
            return
        code = await anyio.to_thread.run_sync(_exit_code, rank.process)
        on_death(self._died(rank, code))

    def _wait_for_exit(self) -> _Rank | None:
        by_conn = {rank.status: rank for rank in self._ranks}
        sources: list[Any] = [*by_conn, self._wake_read]
        while True:
            for ready in wait(sources):
                if ready == self._wake_read:
                    return None
                rank = by_conn[ready]  # type: ignore[index]
                with self._reading:
                    alive = not rank.exited and self._read_report(rank)  # _died may have read it to the end
                if not alive:
                    return rank

    def _read_report(self, rank: _Rank) -> bool:
        """Read one report from ``rank``'s status pipe; False at end-of-file (the rank exited)."""
        try:
            report = _report_decoder.decode(rank.status.recv_bytes())
        except (EOFError, OSError):
            rank.exited = True
            return False
        except msgspec.DecodeError:
            return True
        if report.failure is not None:
            rank.failure = report.failure
        else:
            rank.report = report
            self.reports[rank.rank] = report
        return True

    async def _end(self, *, graceful: bool) -> None:
        self._closing = True
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(self._end_blocking, graceful)

    def _end_blocking(self, graceful: bool) -> None:
        # A rank asked to stop exits on its own; give it the grace, then kill what is left.
        deadline = time.monotonic() + (RANK_EXIT_GRACE if graceful else 0.0)
        for rank in self._ranks:
            rank.commands.close()
            try:
                rank.process.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                if graceful:
                    logger.warning("asyncllm: tensor-parallel rank %d did not stop in time; killing it", rank.rank)
                rank.process.kill()
                rank.process.wait()
            while not rank.exited and rank.status.poll():  # the counters it wrote before exiting
                self._read_report(rank)
            rank.status.close()
            if rank.process.stdin is not None:
                rank.process.stdin.close()
        for fd in (self._wake_read, self._wake_write):
            if fd >= 0:
                os.close(fd)
        self._wake_read = self._wake_write = -1
        _OPEN.discard(self)

    def _close_in_forked_child(self) -> None:
        # This process is a child forked from the engine's, with copies of the engine's ends of the ranks'
        # pipes. Kept open, the stdin copies would keep the ranks alive after the engine's process ends
        # (their lifeline's end-of-file never comes), and the commands copies would hide a closed pipe.
        for rank in self._ranks:
            with contextlib.suppress(OSError):
                rank.commands.close()
            with contextlib.suppress(OSError):
                rank.status.close()
            if rank.process.stdin is not None:
                with contextlib.suppress(OSError):
                    rank.process.stdin.close()
        for fd in (self._wake_read, self._wake_write):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._wake_read = self._wake_write = -1


_OPEN: weakref.WeakSet[RankProcesses] = weakref.WeakSet()
"""The ``RankProcesses`` entered and not yet ended in this process."""


def _close_inherited_pipes() -> None:
    for processes in list(_OPEN):
        processes._close_in_forked_child()
    _OPEN.clear()


# A child forked from the engine's process (multiprocessing's fork start method, Linux's default before
# Python 3.14; os.fork) inherits every descriptor, the ranks' pipes too: it closes its copies at once.
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_inherited_pipes)


def _describe_exit(code: int | None) -> str:
    if code is None:
        return "closed its pipe"
    if code < 0:
        try:
            return f"was killed by signal {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with status {code}"


def _exit_code(process: subprocess.Popen[bytes]) -> int | None:
    # The pipe's end-of-file comes as the process exits: its status follows within moments.
    try:
        return process.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        return None
