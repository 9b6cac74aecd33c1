"""Sizing the KV cache from memory: what is left after the weights and a measured activation peak.

``kv_cache_memory`` is either bytes (an int) or a fraction (a float in (0, 1]) of the memory that
remains once the weights are loaded and the largest step's activations are accounted for. The
activation peak is measured, not guessed: the runner runs one forward at ``max_num_batched_tokens``
and reads the high-water mark (``VmHWM`` on the CPU, after resetting it through
``/proc/self/clear_refs``; ``torch.cuda.max_memory_allocated`` on CUDA).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("asyncllm")

DEFAULT_CPU_FRACTION = 0.25
"""On the CPU the cache shares memory with the application: a quarter of what is left by default."""
DEFAULT_CPU_CAP_BYTES = 4 << 30
"""... and at most 4 GiB unless asked for more."""
DEFAULT_CUDA_FRACTION = 0.9
"""On CUDA the device is the engine's: 90% of what is left."""


def anonymous_mapping(nbytes: int) -> mmap.mmap:
    """A private, zero-filled anonymous mapping of ``nbytes``, backed by huge pages where the kernel can.

    For the large CPU buffers the forward streams every step (the KV cache, packed weights): the
    kernel faults pages in lazily (nothing is written up front; resident memory grows with use)
    and unmapping returns them whatever state malloc's arenas are in. ``MADV_HUGEPAGE`` asks for
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
    """Memory the kernel could give this process now (``MemAvailable``), in bytes."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import os

    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


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


def size_kv_cache(
    kv_cache_memory: int | float | None,
    *,
    device_type: str,
    available_bytes: int,
    activation_peak_bytes: int,
    bytes_per_block: int,
    max_blocks: int | None = None,
) -> KVCacheSizing:
    """Decide the number of KV blocks.

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
