"""Sizing the KV cache from memory: what is left after the weights and a measured activation peak.

``kv_cache_memory`` is either bytes (an int) or a fraction (a float in (0, 1]). On the CPU the
fraction is of the memory that remains once the weights are loaded and the largest step's
activations are accounted for. On CUDA it is the share of the whole device the engine may fill
(weights, activations and cache; vLLM's ``gpu_memory_utilization``), and ``plan_kv_blocks`` is the
whole plan, a pure function of the measured figures. The activation peak is measured, not guessed:
the runner runs one forward at ``max_num_batched_tokens`` (with speculative decoding, also the busiest
drafting step: its verification rows grow with the vocabulary) and reads the high-water mark (``VmHWM``
on the CPU, after resetting it through ``/proc/self/clear_refs``; ``torch.cuda.max_memory_allocated``
on CUDA).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import mmap
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("asyncllm")

DEFAULT_CPU_FRACTION = 0.25
"""On the CPU the cache shares memory with the application: a quarter of what is left by default."""
DEFAULT_CPU_CAP_BYTES = 4 << 30
"""... and at most 4 GiB unless asked for more."""
DEFAULT_CUDA_FRACTION = 0.9
"""On CUDA the device is the engine's: weights, activations and cache fill up to 90% of its memory; the
rest is headroom (CUDA graphs' pool, fragmentation, what other libraries allocate later)."""


def anonymous_mapping(nbytes: int) -> mmap.mmap:
    """A private, zero-filled anonymous mapping of ``nbytes``, backed by huge pages where the kernel can.

    For the large CPU buffers the forward streams every step (the KV cache, packed weights): the
    kernel faults pages in lazily (nothing is written up front; resident memory grows with use, or
    as ``Prefault`` touches it, which the serving KV cache gets) and unmapping returns them whatever
    state malloc's arenas are in. ``MADV_HUGEPAGE`` asks for
    2 MiB transparent huge pages (honoured when ``/sys/kernel/mm/transparent_hugepage/enabled``
    is ``madvise`` or ``always``): one TLB entry per 2 MiB instead of per 4 KiB, which a step that
    jumps between scattered KV blocks, and streams every weight, feels.
    """
    buffer = mmap.mmap(-1, max(1, nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    advice = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
    if advice is not None:
        with contextlib.suppress(OSError):  # a kernel built without transparent huge pages
            buffer.madvise(advice)
    return buffer


def mapped_tensor(count: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D CPU tensor of ``count`` elements over its own ``anonymous_mapping`` (zeros, huge pages where
    possible, resident as it is touched, unmapped when the tensor goes)."""
    import torch  # here, not at the top: the engine's core (scheduler, scripted runner) runs without torch

    if count == 0:  # a mapping of no bytes cannot be made (nor read)
        return torch.empty(0, dtype=dtype)
    size = count * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer(anonymous_mapping(size), dtype=dtype, count=count)


PAGE_BYTES = mmap.PAGESIZE
MADV_POPULATE_WRITE = 23
"""Linux 5.14's advice that faults a range in writable without writing to it (``madvise(2)``); not in Python's
``mmap`` module before 3.13."""
PREFAULT_ROUND_BYTES = 2 << 20
"""A prefault round faults in about this much of the widest tensor: one transparent huge page."""
PREFAULT_NICENESS = 10
"""The prefault thread's niceness: it yields the cores to the engine's and the application's threads. Not
``SCHED_IDLE``: a thread that gets no CPU while others are runnable, preempted while it holds the GIL (between
two ranges) or the address-space lock (inside one), would stall every thread that needs them."""
PREFAULT_QUIET_SECONDS = 0.2
"""The prefault faults a range only while no step runs and none ended this recently (the model runner's
``device_busy``, ``Prefault``'s ``busy``), and looks again after as long."""
PREFAULT_RESERVE_BYTES = 512 << 20
"""The prefault stops while less than this would be left of the memory available (``host_available_bytes``):
a cache planned too large for what is free now stays partly unfaulted rather than pushing out everything else."""
PREFAULT_CHECK_BYTES = 64 << 20
"""How much the prefault faults in between two looks at the memory available."""


def prefault_ranges(tensors: Sequence[torch.Tensor], rows_per_round: int) -> Iterator[tuple[int, int]]:
    """The page-aligned ``(address, length)`` ranges that fault in ``tensors``, in the order ``Prefault`` takes them.

    Round ``r`` covers rows ``[r * rows_per_round, (r + 1) * rows_per_round)`` of every tensor (row: an index
    of the first dimension), tensor by tensor, so rows become resident in ascending order across all of
    them: the order in which a KV cache's block pool hands out blocks it has never used. A range starts on
    the page holding its first byte and ends on the page boundary after its last, so neighbouring ranges
    may share a page (faulting a page in twice changes nothing); it never leaves the tensor's pages.
    """
    if rows_per_round < 1:
        raise ValueError(f"rows_per_round must be >= 1, got {rows_per_round}")
    tensors = [t for t in tensors if t.numel() > 0]
    rounds = max((-(-t.shape[0] // rows_per_round) for t in tensors), default=0)
    for index in range(rounds):
        for tensor in tensors:
            row_bytes = tensor.stride(0) * tensor.element_size()
            first = index * rows_per_round
            if first >= tensor.shape[0]:
                continue
            last = min(first + rows_per_round, tensor.shape[0])
            start = tensor.data_ptr() + first * row_bytes
            end = tensor.data_ptr() + last * row_bytes
            aligned = start - start % PAGE_BYTES
            yield aligned, -(-(end - aligned) // PAGE_BYTES) * PAGE_BYTES


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    """libc's ``madvise`` through ctypes, which releases the GIL for the call; None off Linux."""
    if not sys.platform.startswith("linux"):
        return None
    function = ctypes.CDLL(None, use_errno=True).madvise
    function.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
    function.restype = ctypes.c_int
    return function  # type: ignore[no-any-return]


class Prefault:
    """Faults in every page of some CPU tensors on a background thread, so that no step pays for it later.

    An anonymous mapping's pages cost nothing until first written; then the kernel zeroes each one (a 2 MiB
    huge page at once), and a virtual machine's host may have to back it first, which is far slower still.
    The KV cache's block pool hands out never-used blocks before it reuses any, so without this a serving
    engine keeps writing into fresh pages, on the device thread, in the middle of a step (one block can
    start a fresh huge page in every layer's keys and values at once). This thread pays that cost up front,
    at a lower priority, in the order blocks are handed out (``prefault_ranges``), and only while the
    engine is idle (``busy``): running beside steps it took a share of a core from them, which cost more
    than the fresh pages it spared them. A step that reaches a page first simply faults it in itself (under
    steady load from the start, every page it reaches).
    ``MADV_POPULATE_WRITE`` only makes pages resident: it never changes their contents, so the forward may
    write the same tensors meanwhile.

    Args:
        tensors: CPU tensors over anonymous mappings (``mapped_tensor``): rows in the first dimension.
        rows_per_round: Rows of each tensor per round (``prefault_ranges``).
        busy: Asked before each range; while it says True the thread waits ``PREFAULT_QUIET_SECONDS`` and asks
            again (None: never busy, and the thread keeps its creator's niceness: a load waits for it). The
            model runner's (``device_busy``) says whether a step runs or one ended in the last
            ``PREFAULT_QUIET_SECONDS``.

    The thread ends when every page is resident, at ``stop()``, when less than ``PREFAULT_RESERVE_BYTES`` of
    memory would be left (a warning), or at the first refusal (a kernel before 5.14 lacks the advice: logged
    at debug level; no memory left: a warning), which leaves the rest to be faulted in on use. ``stop()``
    returns once the thread has ended: within one round of one tensor.
    """

    def __init__(
        self, tensors: Sequence[torch.Tensor], rows_per_round: int, busy: Callable[[], bool] | None = None
    ) -> None:
        self._tensors = list(tensors)  # kept alive until the thread ends: their pages stay mapped
        self._busy = busy
        self._ranges = prefault_ranges(self._tensors, rows_per_round)
        self._stopping = threading.Event()
        self.completed = False
        """Every page was faulted in (False while running, after ``stop()`` or a refusal)."""
        self.faulted_bytes = 0
        """Bytes of ranges faulted in so far."""
        self._thread = threading.Thread(target=self._run, name="asyncllm-kv-prefault", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            madvise = _libc_madvise()
            if madvise is None:
                return
            # Only Linux gives each thread a niceness of its own, set through its id; elsewhere a thread id
            # is no process id (on macOS it could even be another process's), so nothing is reniced there.
            # Without ``busy`` a load is waiting for this thread: it keeps the caller's niceness.
            if self._busy is not None and sys.platform.startswith("linux"):
                with contextlib.suppress(OSError):
                    os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), PREFAULT_NICENESS)
            unchecked = PREFAULT_CHECK_BYTES  # look before the first range
            for address, length in self._ranges:
                while self._busy is not None and self._busy():
                    if self._stopping.wait(PREFAULT_QUIET_SECONDS):
                        return
                if self._stopping.is_set():
                    return
                unchecked += length
                if unchecked >= PREFAULT_CHECK_BYTES:
                    unchecked = 0
                    if host_available_bytes() - length < PREFAULT_RESERVE_BYTES:
                        logger.warning(
                            "prefaulting the KV cache stopped with %d MiB resident: less than %d MiB of memory would "
                            "be left (the rest is faulted in on use)",
                            self.faulted_bytes >> 20,
                            PREFAULT_RESERVE_BYTES >> 20,
                        )
                        return
                if madvise(address, length, MADV_POPULATE_WRITE) != 0:
                    code = ctypes.get_errno()
                    if code == errno.EINVAL:
                        logger.debug("this kernel lacks MADV_POPULATE_WRITE: KV pages are faulted in on use")
                    else:
                        logger.warning("prefaulting the KV cache stopped: %s", os.strerror(code))
                    return
                self.faulted_bytes += length
            self.completed = True
        finally:
            # The suspended generator holds the tensors too (stopped or refused part-way): both go, and so
            # does ``busy`` (a runner's method: it would keep the runner, and its weights, alive).
            self._tensors, self._ranges, self._busy = [], iter(()), None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the thread has ended (or ``timeout`` seconds); True when it has."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def stop(self) -> None:
        """End the thread after the range it is faulting in, and join it."""
        self._stopping.set()
        self._thread.join()


def _status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def host_available_bytes() -> int:
    """Memory the kernel could give this process now, in bytes: ``MemAvailable``, or less where the process's
    cgroup (a container) allows less (``cgroup_memory_headroom``): inside a container ``MemAvailable`` is
    the host's."""
    available = None
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    available = int(line.split()[1]) * 1024
                    break
    except OSError:
        pass
    if available is None:
        available = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    headroom = cgroup_memory_headroom()
    return available if headroom is None else min(available, headroom)


def cgroup_memory_headroom(
    cgroup_root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")
) -> int | None:
    """What this process's cgroup may still allocate, in bytes (its limit less its usage), or None when unlimited.

    Reads cgroup v2's ``memory.max`` and ``memory.current`` or v1's ``memory.limit_in_bytes`` and
    ``memory.usage_in_bytes``, in the process's own cgroup and each ancestor (the tightest wins, as the kernel
    applies them all). Usage counts the page cache the kernel could reclaim, so this errs low.

    Args:
        cgroup_root: Where the cgroup filesystem is mounted.
        membership: The ``/proc/<pid>/cgroup`` file that names the process's cgroups.
    """
    from asyncllm.worker._cpu_threads import cgroup_directories

    headrooms: list[int] = []
    for version, directory in cgroup_directories("memory", cgroup_root, membership):
        if version == 2:
            headrooms.extend(_headroom(directory / "memory.max", directory / "memory.current"))
        else:
            headrooms.extend(_headroom(directory / "memory.limit_in_bytes", directory / "memory.usage_in_bytes"))
    return max(0, min(headrooms)) if headrooms else None


_UNLIMITED_V1 = 1 << 60
"""cgroup v1 writes "no limit" as a page-rounded ``LONG_MAX``."""


def _headroom(limit_file: Path, usage_file: Path) -> list[int]:
    try:
        limit = limit_file.read_text().strip()
        if limit == "max" or int(limit) >= _UNLIMITED_V1:
            return []
        return [int(limit) - int(usage_file.read_text().strip())]
    except (OSError, ValueError):
        return []


def reset_peak_rss() -> bool:
    """Reset the process's resident high-water mark; False where the kernel does not allow it."""
    try:
        with open("/proc/self/clear_refs", "w") as clear_refs:
            clear_refs.write("5")
        return True
    except OSError:
        return False


def resident_bytes() -> int:
    """Current resident set size, in bytes (0 when unknown)."""
    kib = _status_kib("VmRSS")
    return 0 if kib is None else kib * 1024


def peak_resident_bytes() -> int:
    """Resident high-water mark since the last ``reset_peak_rss``, in bytes (0 when unknown)."""
    kib = _status_kib("VmHWM")
    return 0 if kib is None else kib * 1024


@dataclass(frozen=True, slots=True)
class KVCacheSizing:
    """How the KV cache was sized, for the start-up log line and ``RunnerInfo``."""

    budget_bytes: int
    available_bytes: int
    activation_peak_bytes: int
    bytes_per_block: int
    num_blocks: int


def check_kv_cache_memory(value: object) -> None:
    """Validate an ``Engine.open(kv_cache_memory=...)`` value.

    Raises:
        ValueError: Not None, a positive int of bytes, or a float fraction in (0, 1].
    """
    if value is None:
        return
    if isinstance(value, bool):
        raise ValueError(f"kv_cache_memory must be bytes (int) or a fraction (float), got {value!r}")
    if isinstance(value, int):
        if value < 1:
            raise ValueError(f"kv_cache_memory in bytes must be positive, got {value}")
        return
    if isinstance(value, float):
        if not 0.0 < value <= 1.0:
            raise ValueError(f"kv_cache_memory as a fraction must be in (0, 1], got {value}")
        return
    raise ValueError(f"kv_cache_memory must be bytes (int) or a fraction (float), got {value!r}")


def plan_kv_blocks(
    *,
    total_bytes: int,
    non_torch_bytes: int,
    weight_bytes: int,
    activation_peak_bytes: int,
    bytes_per_block: int,
    utilization: float = DEFAULT_CUDA_FRACTION,
) -> int:
    """The number of KV blocks a device holds: ``(utilization * total - non_torch - weights - activations) //
    bytes_per_block``.

    A pure function, so the plan is testable without the device. Each figure is counted once: the
    caller measures them after ``torch.cuda.empty_cache()`` (memory torch's allocator caches but no
    tensor holds would otherwise count as used), with the sizing probe's KV cache freed.

    Args:
        total_bytes: The device's memory (``torch.cuda.mem_get_info``'s total).
        non_torch_bytes: Memory in use that torch's allocator does not hold: other processes, the CUDA
            context, library workspaces (used memory minus ``torch.cuda.memory_reserved``).
        weight_bytes: What torch holds once the model is loaded (``torch.cuda.memory_allocated``).
        activation_peak_bytes: The extra memory of the largest step, measured.
        bytes_per_block: KV bytes of one block across all layers (keys and values).
        utilization: The share of ``total_bytes`` the engine may fill, in (0, 1].

    Returns:
        At least one block.

    Raises:
        ModelLoadError: The weights, the activation peak and the memory in use by others leave no room
            for one block within ``utilization`` of the device; the message gives each figure.
    """
    from asyncllm.errors import ModelLoadError

    usable = int(utilization * total_bytes)
    budget = usable - non_torch_bytes - weight_bytes - activation_peak_bytes
    if budget < bytes_per_block:
        gib = 1 << 30
        raise ModelLoadError(
            f"the model does not fit: weights {weight_bytes / gib:.1f} GiB + activation peak "
            f"{activation_peak_bytes / gib:.1f} GiB + memory in use outside torch {non_torch_bytes / gib:.1f} GiB "
            f"leave {max(0, budget) / gib:.2f} GiB of the {usable / gib:.1f} GiB usable "
            f"({utilization:.0%} of {total_bytes / gib:.1f} GiB), less than one KV block ({bytes_per_block} bytes); "
            "use a larger device, a smaller model or dtype, a smaller max_num_batched_tokens, or a larger "
            "kv_cache_memory fraction"
        )
    return budget // bytes_per_block


def cuda_memory(device: torch.device) -> tuple[int, int]:
    """The device's total memory and the memory in use outside torch's allocator, for ``plan_kv_blocks``.

    Empties torch's cache first: blocks torch caches but no tensor holds (a freed probe, freed
    load-time copies) would otherwise count as used, on top of the figures the plan subtracts itself.
    """
    import torch

    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    return total, max(0, total - free - torch.cuda.memory_reserved(device))


def size_kv_cache(
    kv_cache_memory: int | float | None,
    *,
    device_type: str,
    available_bytes: int,
    activation_peak_bytes: int,
    bytes_per_block: int,
    max_blocks: int | None = None,
) -> KVCacheSizing:
    """Decide the number of KV blocks from the memory available after the weights (the CPU's rule; CUDA's
    default and fractions are ``plan_kv_blocks``).

    Args:
        kv_cache_memory: Bytes, a fraction of what is left, or None for the device's default.
        device_type: "cpu" or "cuda".
        available_bytes: Memory free after the weights were loaded.
        activation_peak_bytes: Measured extra memory of the largest step.
        bytes_per_block: KV bytes of one block across all layers (keys and values).
        max_blocks: Never more blocks than this (what the engine could ever use).

    Returns:
        The sizing; at least one block.
    """
    left = max(0, available_bytes - activation_peak_bytes)
    if isinstance(kv_cache_memory, int):
        budget = kv_cache_memory
    elif isinstance(kv_cache_memory, float):
        budget = int(left * kv_cache_memory)
    elif device_type == "cuda":
        budget = int(left * DEFAULT_CUDA_FRACTION)
    else:
        budget = min(int(left * DEFAULT_CPU_FRACTION), DEFAULT_CPU_CAP_BYTES)
    num_blocks = max(1, budget // bytes_per_block)
    if max_blocks is not None:
        num_blocks = min(num_blocks, max_blocks)
    return KVCacheSizing(budget, available_bytes, activation_peak_bytes, bytes_per_block, num_blocks)


def split_hybrid_blocks(
    num_blocks: int,
    *,
    num_global_layers: int,
    num_sliding_layers: int,
    sliding_window: int,
    block_size: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
) -> tuple[int, int]:
    """Split the memory of ``num_blocks`` whole-model KV blocks between a hybrid model's two pools.

    The sliding layers' pool (``KVCacheManager.sliding``) needs no more blocks than its requests' windows:
    each of ``max_num_seqs`` requests holds the blocks of its window and its step, and two steps' chunks
    may be in flight (the engine schedules step N+1 while step N runs). The memory it does not need goes
    to the global layers' pool, so the window's saving becomes more tokens in the cache. Never more
    sliding blocks than global ones: a request holds no more blocks there than in the global pool.

    Args:
        num_blocks: Blocks of every layer that the memory holds (what the cache would have without the split).
        num_global_layers: Layers that attend to the whole context.
        num_sliding_layers: Layers that attend within ``sliding_window``.
        sliding_window: The sliding layers' window, in positions.
        block_size: Tokens per block.
        max_num_seqs: Requests in one step at most.
        max_num_batched_tokens: Tokens in one step at most.

    Returns:
        (global blocks, sliding blocks): global blocks of ``num_global_layers`` layers each, sliding
        blocks of ``num_sliding_layers`` layers each, together within the memory of ``num_blocks``.

    Raises:
        ValueError: A count is not positive.
    """
    if min(num_blocks, num_global_layers, num_sliding_layers, sliding_window, block_size, max_num_seqs) < 1:
        raise ValueError("every count of a hybrid split must be positive")
    per_request = -(-(sliding_window - 1) // block_size) + 2  # the window, the block it starts in, one to grow
    need = max_num_seqs * per_request + 2 * -(-max_num_batched_tokens // block_size)
    sliding = min(num_blocks, need)
    layers = num_global_layers + num_sliding_layers
    return (num_blocks * layers - sliding * num_sliding_layers) // num_global_layers, sliding
