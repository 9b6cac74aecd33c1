"""A tensor-parallel rank's process: ``run()`` with ``COMMANDS_FD STATUS_FD RANK`` as its arguments.

Started by ``asyncllm.executor._ranks.RankProcesses`` (a fresh interpreter that imports this module from the
engine's path alone, and calls ``run``). It reads its ``RankConfig`` from the commands
pipe, joins the ranks' process group, loads its shard of the model, then follows rank 0: each message
is a step's forward (``StepMessage``), a gather of logits for prompt logprobs (``LogitsMessage``), a KV
cache allocation (``AllocateMessage``) or the end (``StopMessage``). It never samples.

It ends with its engine whatever happens there: a thread reads the process's stdin, which only the
engine's process holds open, and exits the process at end-of-file (the engine's process is gone, even
by SIGKILL); end-of-file on the commands pipe ends it too. SIGINT, SIGTERM and SIGHUP are ignored: a
Ctrl-C in a terminal, a hang-up, ``kill -TERM -PGID`` and systemd's stop (every process of the unit's
cgroup) reach the ranks along with the engine's process, and the engine, not each rank, decides how its
ranks stop (an application draining its requests on SIGTERM still needs them). The engine kills a rank
with SIGKILL when it must.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import NoReturn

import msgspec

logger = logging.getLogger("asyncllm")


def _exit_with_parent() -> None:
    # stdin is the engine's lifeline: it is never written to, and reads end-of-file once the engine's
    # process has exited (or closed it). Exit at once: the process group's peers are gone or going.
    try:
        while os.read(0, 1 << 12):  # the raw descriptor: sys.stdin's lock must stay free for shutdown
            pass
    finally:
        os._exit(0)


def serve(commands: Connection, status: Connection) -> None:
    """Follow rank 0 until ``StopMessage`` (then report the counters) or the commands pipe closes."""
    from asyncllm.engine._options import EngineOptions
    from asyncllm.executor._ranks import (
        AllocateMessage,
        LogitsMessage,
        RankConfig,
        RankReport,
        StepMessage,
        StopMessage,
        TableMirror,
        decode_message,
        encode,
    )
    from asyncllm.models import DecoderSpec
    from asyncllm.worker._model_runner import TorchModelRunner

    try:
        config = decode_message(commands.recv_bytes())
    except EOFError:  # the engine gave up before configuring its ranks (its open failed): nothing to report
        return
    if not isinstance(config, RankConfig):
        raise RuntimeError(f"a rank's first message must be its RankConfig, got {type(config).__name__}")
    spec = msgspec.convert(config.spec, DecoderSpec)
    options = EngineOptions(**config.options)
    runner = TorchModelRunner(
        Path(config.model_path), options, rank=config.rank, store_port=config.store_port, spec=spec
    )
    runner.load_rank()
    tables = TableMirror()
    steps, broadcast, forward = 0, 0.0, 0.0
    while True:
        try:
            message = decode_message(commands.recv_bytes())
        except EOFError:
            return
        if isinstance(message, StepMessage):
            sequences = tables.sequences(message.sequences)
            started = time.perf_counter()
            if steps:  # the first step (rank 0's memory probe) was sent while this rank still loaded
                broadcast += started - message.sent_at
            runner.forward_step(sequences)
            forward += time.perf_counter() - started
            steps += 1
        elif isinstance(message, LogitsMessage):
            runner.gather_logits(message.rows)
        elif isinstance(message, AllocateMessage):
            runner.allocate(message.num_blocks, message.sliding_blocks, prefault=message.prefault)
        elif isinstance(message, StopMessage):
            collectives = runner.collectives
            report = RankReport(
                steps=steps,
                broadcast_seconds=broadcast,
                collective_seconds=0.0 if collectives is None else collectives.seconds,
                forward_seconds=forward,
            )
            status.send_bytes(encode(report))
            runner.close()
            return
        else:
            raise RuntimeError(f"unexpected message {type(message).__name__}")


def main(argv: list[str]) -> int:
    """The process's entry: serve, and report a failure's reason on the status pipe before exiting."""
    for ignored in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):  # the engine's to act on, not the rank's
        signal.signal(ignored, signal.SIG_IGN)
    threading.Thread(target=_exit_with_parent, name="asyncllm-lifeline", daemon=True).start()
    commands = Connection(int(argv[1]), writable=False)
    status = Connection(int(argv[2]), readable=False)
    logging.basicConfig(level=logging.WARNING, format=f"asyncllm rank {argv[3]}: %(levelname)s %(message)s")
    try:
        serve(commands, status)
    except BaseException as exc:
        from asyncllm.executor._ranks import RankReport, encode

        logger.exception("tensor-parallel rank %s failed", argv[3])
        with contextlib.suppress(OSError):
            status.send_bytes(encode(RankReport(failure=f"{type(exc).__name__}: {exc}")))
        return 1
    return 0


def run() -> NoReturn:
    """Run ``main`` on the process's arguments and exit with its status, skipping the interpreter's shutdown."""
    code = main(sys.argv)
    # Nothing is left to finalize (the report is sent, the model dropped): skipping the interpreter's
    # shutdown (torch's and gloo's destructors, seconds on a busy host) lets the engine close at once.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run()
