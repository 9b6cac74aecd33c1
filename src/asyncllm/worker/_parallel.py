"""The ranks' process group: ``torch.distributed`` collectives (gloo on the CPU, NCCL on CUDA), timed.

The group is built from its own store and process-group objects rather than ``init_process_group``:
that call sets one default group per process, which an engine embedded in an application must not
take (the application may have its own, and two engines in one process must not share one).
"""

from __future__ import annotations

import datetime
import socket
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store, TCPStore  # torch.distributed re-exports them untyped

__all__ = ["ProcessGroupCollectives", "open_group", "rank_device"]

STORE_HOST = "127.0.0.1"
"""Where rank 0's store listens, and the address every rank's gloo connections use: every rank runs on
this host, and nothing of the ranks is reachable from another."""

NO_TIMEOUT = datetime.timedelta(days=365)
"""The collectives' timeout with ``step_timeout=None`` (gloo needs one)."""

RENDEZVOUS_TIMEOUT = datetime.timedelta(minutes=30)
"""How long a rank waits for the others to start (import torch, connect) and to load their shards. Far
above any start-up: a rank that dies meanwhile is noticed at once by the engine's watcher instead."""


class ProcessGroupCollectives:
    """``Collectives`` over a ``torch.distributed`` process group, with the time spent in them.

    Args:
        group: The process group (``ProcessGroupGloo`` or ``ProcessGroupNCCL``: their common base class
            lacks the collectives' low-level signatures).
        rank: This rank.
        size: The ranks in the group.
        store: The store the group met through (kept alive as long as the group).
    """

    def __init__(self, group: Any, rank: int, size: int, store: Store) -> None:
        self.group = group
        self.store = store
        self.rank = rank
        self.size = size
        self.seconds = 0.0
        """Time spent in collectives, waiting for the other ranks included (on CUDA: enqueueing them)."""
        self.calls = 0

    def barrier(self, name: str, abandon: Callable[[], BaseException | None] | None = None) -> None:
        """Wait until every rank has reached the barrier ``name`` (see ``store_barrier``)."""
        store_barrier(self.store, name, self.rank, self.size, abandon)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place."""
        started = time.perf_counter()
        self.group.allreduce([tensor]).wait()
        self.seconds += time.perf_counter() - started
        self.calls += 1

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``tensor`` on rank 0, in rank order; None elsewhere."""
        started = time.perf_counter()
        options = dist.GatherOptions()
        options.rootRank = 0
        parts: list[torch.Tensor] | None = None
        if self.rank == 0:
            parts = [torch.empty_like(tensor) for _ in range(self.size)]
            self.group.gather([parts], [tensor], options).wait()
        else:
            self.group.gather([], [tensor], options).wait()
        self.seconds += time.perf_counter() - started
        self.calls += 1
        return parts


def store_barrier(
    store: Store, name: str, rank: int, size: int, abandon: Callable[[], BaseException | None] | None = None
) -> None:
    """Wait until every rank has reached the barrier ``name``, through the store.

    Bounded by ``RENDEZVOUS_TIMEOUT``, not by the collectives' timeout: ranks that start or load their
    shards at different speeds must not time out. ``abandon`` is polled meanwhile (every 50 ms; this
    is start-up only): the error it returns (a rank that exited) is raised at once rather than waiting
    out the timeout for a rank that will never come.

    Raises:
        TimeoutError: Not every rank arrived within ``RENDEZVOUS_TIMEOUT``.
    """
    store.set(f"{name}/{rank}", "1")
    keys = [f"{name}/{other}" for other in range(size)]
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT.total_seconds()
    while not store.check(keys):
        failure = abandon() if abandon is not None else None
        if failure is not None:
            raise failure
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every rank reached {name!r} within {RENDEZVOUS_TIMEOUT}")
        time.sleep(0.05)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """The device of ``rank`` when rank 0 runs on ``device``: the CPU for every rank, or the CUDA device
    ``rank`` places after rank 0's."""
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def open_group(
    *,
    rank: int,
    size: int,
    device: torch.device,
    timeout: float | None,
    store_port: int | None = None,
    announce: Callable[[str, int], None] | None = None,
    abandon: Callable[[], BaseException | None] | None = None,
) -> ProcessGroupCollectives:
    """Join the ranks' process group (a rendezvous: returns once every rank has joined).

    Rank 0 opens the store on a free port and ``announce``s its address (``RankProcesses.start_group``);
    the other ranks connect to ``store_port``.

    Args:
        rank: This rank.
        size: The ranks in all.
        device: This rank's device: gloo on the CPU, NCCL on CUDA.
        timeout: Seconds a collective may wait for the other ranks (``step_timeout``); None: no bound.
            Meeting the others is bounded by ``RENDEZVOUS_TIMEOUT`` instead.
        store_port: The store's port (ranks other than 0).
        announce: Called by rank 0 with the store's host and port, before it waits for the others.
        abandon: Polled while waiting for the others to join: an error it returns is raised at once.

    Raises:
        RuntimeError: The rendezvous timed out, or NCCL is missing from this torch build.
    """
    wait = NO_TIMEOUT if timeout is None else datetime.timedelta(seconds=timeout)
    if rank == 0:
        # TCPStore binds the port it opens on every interface, whatever host it is given: it is handed a
        # socket bound to the loopback address instead (and closes it with the store).
        listener = socket.create_server((STORE_HOST, 0))
        port = listener.getsockname()[1]
        store = TCPStore(STORE_HOST, port, size, True, timeout=RENDEZVOUS_TIMEOUT, wait_for_workers=False,
                         master_listen_fd=listener.detach())  # fmt: skip
        if announce is not None:
            announce(STORE_HOST, store.port)
    else:
        if store_port is None:
            raise ValueError("a rank other than 0 needs the store's port")
        store = TCPStore(STORE_HOST, store_port, size, False, timeout=RENDEZVOUS_TIMEOUT)
    # Every rank is up before the group connects them: the group's own rendezvous cannot be abandoned.
    store_barrier(store, "joined", rank, size, abandon)
    group: Any
    if device.type == "cuda":
        nccl = getattr(dist, "ProcessGroupNCCL", None)
        if nccl is None:
            raise RuntimeError("tensor parallelism on CUDA needs NCCL, which this torch build lacks")
        options = nccl.Options()
        options._timeout = wait
        group = nccl(store, rank, size, options)
    else:
        # Gloo's own default binds the address the host name resolves to (or GLOO_SOCKET_IFNAME's).
        gloo = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # bound, but not in torch's stubs
        gloo._timeout = wait
        gloo._devices = [dist.ProcessGroupGloo.create_device(hostname=STORE_HOST)]
        group = dist.ProcessGroupGloo(store, rank, size, gloo)
    return ProcessGroupCollectives(group, rank, size, store)
