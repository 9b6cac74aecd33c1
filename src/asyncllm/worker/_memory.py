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
"""On CUDA the device is the engine's: weights, activations and cache fill up to 90% of its memory; the
rest is headroom (CUDA graphs' pool, fragmentation, what other libraries allocate later)."""


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
