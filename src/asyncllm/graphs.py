"""CUDA graphs for decode-only steps, and pinned host-to-device copies.

A decode step of a small model is a few hundred short kernels; launched one by one from Python the
GPU idles between them. ``DecodeGraphs`` captures the model's forward pass (embeddings to final
norm, triton attention backend) once per batch size at start-up and replays it: one launch per step.

A graph replays fixed addresses and shapes, so every input lives in static device buffers sized for
the largest batch, and a step of ``n`` sequences runs the graph of the smallest captured size
``b >= n``. The ``b - n`` padding rows are one-token sequences at position 0 with slot -1, which
the KV-write kernel skips; they attend to one (finite) cache slot and their outputs are dropped.
All inputs of a step (token ids, positions, query offsets, sequence lengths, block tables, slots)
are written into one pinned host buffer and copied with a single non-blocking copy before the
replay. Block tables are as wide as the longest sequence the cache can hold.

Long contexts at small batch want the split-KV kernels (see ``kernels.split_kv_decode``), whose
grid is fixed at capture: small batch sizes get a second graph captured with splits, used when the
step's longest context asks for splitting.

On a machine without CUDA the same class runs the padded static-buffer path eagerly
(``use_graphs=False``), which is how the tests check the padding on the CPU.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import numpy as np
import torch

from asyncllm.input_batch import StepInputs
from asyncllm.layers.attention_triton import TritonAttentionMetadata
from asyncllm.models import DecoderForCausalLM

logger = logging.getLogger("asyncllm")

__all__ = ["DecodeGraphs", "capture_sizes", "to_device"]


def to_device(array: np.ndarray[Any, Any], device: torch.device) -> torch.Tensor:
    """Copy a host array to ``device``; on CUDA through pinned memory, without waiting for the copy.

    The pinned block comes from torch's caching host allocator, which keeps it alive until the copy
    on the current stream is done, so the caller may drop its array at once.
    """
    host = torch.from_numpy(np.ascontiguousarray(array))
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)


def capture_sizes(max_batch: int) -> list[int]:
    """The batch sizes that get a graph: 1, 2, 4, then every multiple of 8 up to ``max_batch``."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sorted({*sizes, max_batch})


class DecodeGraphs:
    """Captured forward passes for decode-only batches, replayed with padded static inputs.

    Args:
        model: The loaded model (triton attention backend).
        kv_caches: The per-layer (key, value) caches.
        block_size: Tokens per KV block.
        max_seq_len: The longest sequence a step can hold (sizes the block tables).
        max_batch: The largest decode batch (``max_num_seqs``).
        device: The CUDA device (or the CPU, eager only).
        split_kv: For batch sizes below this, also capture a split-KV graph with that many splits
            (a dict of batch size to splits; empty for none).
        use_graphs: Capture and replay CUDA graphs; False runs the same padded path eagerly.
    """

    def __init__(
        self,
        model: DecoderForCausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        *,
        block_size: int,
        max_seq_len: int,
        max_batch: int,
        device: torch.device,
        split_kv: dict[int, int] | None = None,
        use_graphs: bool = True,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_blocks = max(1, -(-max_seq_len // block_size))
        self.sizes = capture_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.device = device
        self.split_kv = dict(split_kv or {})
        self.use_graphs = use_graphs
        b, mb = self.max_batch, self.max_blocks
        # int32 layout: [query_start_loc (b+1) | seq_lens (b) | block_tables (b*mb) | slot_mapping (b)]
        self._seq_lens_at = b + 1
        self._tables_at = 2 * b + 1
        self._slots_at = self._tables_at + b * mb
        meta_len = self._slots_at + b
        pin = device.type == "cuda"
        self._host_meta = torch.zeros(meta_len, dtype=torch.int32, pin_memory=pin)
        self._host_ids = torch.zeros(2 * b, dtype=torch.int64, pin_memory=pin)
        self._meta = torch.zeros(meta_len, dtype=torch.int32, device=device)
        self._ids = torch.zeros(2 * b, dtype=torch.int64, device=device)
        self._fill_padding(0)
        self._meta.copy_(self._host_meta)
        self._copied: torch.cuda.Event | None = None
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _fill_padding(self, n: int) -> None:
        """Host buffers: rows from ``n`` on are 1-token sequences at position 0 writing nowhere."""
        b = self.max_batch
        meta = self._host_meta.numpy()
        meta[: b + 1] = np.arange(b + 1, dtype=np.int32)  # decode rows: one query each
        meta[self._seq_lens_at + n : self._tables_at] = 1
        meta[self._tables_at + n * self.max_blocks : self._slots_at] = 0
        meta[self._slots_at + n :] = -1
        ids = self._host_ids.numpy()
        ids[n:b] = 0
        ids[b + n :] = 0

    def _metadata(self, size: int, splits: int) -> TritonAttentionMetadata:
        meta = self._meta
        return TritonAttentionMetadata(
            slot_mapping=meta[self._slots_at : self._slots_at + size],
            query_start_loc=meta[: size + 1],
            seq_lens=meta[self._seq_lens_at : self._seq_lens_at + size],
            block_tables=meta[self._tables_at : self._slots_at].view(self.max_batch, self.max_blocks)[:size],
            block_size=self.block_size,
            max_query_len=1,
            max_seq_len=self.max_blocks * self.block_size,
            num_kv_splits=splits,
            sliding_window=self.model.spec.sliding_window,
        )

    def _forward(self, size: int, splits: int) -> torch.Tensor:
        ids = self._ids[:size]
        positions = self._ids[self.max_batch : self.max_batch + size]
        result: torch.Tensor = self.model(ids, positions, self.kv_caches, self._metadata(size, splits))
        return result

    def _variants(self) -> list[tuple[int, int]]:
        return [(b, s) for b in reversed(self.sizes) for s in sorted({1, self.split_kv.get(b, 1)})]

    def capture(self) -> None:
        """Capture every (batch size, splits) graph, largest first, into one shared memory pool."""
        if not self.use_graphs:
            return
        start = time.perf_counter()
        variants = self._variants()
        logger.info("capturing %d CUDA graphs for decode batches of 1..%d", len(variants), self.max_batch)
        pool = torch.cuda.graph_pool_handle()
        with torch.inference_mode():
            for size, splits in variants:
                self._forward(size, splits)  # warm-up: compiles the triton kernels outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool):
                    out = self._forward(size, splits)
                self._graphs[(size, splits)] = (graph, out)
        torch.cuda.synchronize(self.device)
        logger.info("captured %d CUDA graphs in %.1f s", len(variants), time.perf_counter() - start)

    def fits(self, step: StepInputs) -> bool:
        """Whether a step can run here: decode only, at most ``max_batch`` rows, tables that fit."""
        return (
            0 < step.num_seqs <= self.max_batch
            and step.max_query_len == 1
            and step.num_tokens == step.num_seqs
            and -(-step.max_seq_len // self.block_size) <= self.max_blocks
        )

    def run(self, step: StepInputs, splits: int = 1) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode-only step (``fits`` must hold).

        Args:
            step: The step's arrays (one token per sequence).
            splits: The split-KV parts the step would like (> 1 picks a split graph if captured).
        """
        n = step.num_seqs
        size = next(b for b in self.sizes if b >= n)
        splits = self.split_kv.get(size, 1) if splits > 1 else 1
        if self._copied is not None:
            self._copied.synchronize()  # the previous step's copy has read the pinned buffers
        self._fill_padding(n)
        b, mb = self.max_batch, self.max_blocks
        meta = self._host_meta.numpy()
        meta[self._seq_lens_at : self._seq_lens_at + n] = step.seq_lens
        tables = meta[self._tables_at : self._slots_at].reshape(b, mb)
        # Only the columns the step's longest context uses; the kernels read no block past a row's length.
        width = max(1, -(-step.max_seq_len // self.block_size))
        tables[:n, :width] = step.tables(None, width)
        tables[:n, width:] = 0
        meta[self._slots_at : self._slots_at + n] = step.slot_mapping
        ids = self._host_ids.numpy()
        ids[:n] = step.input_ids
        ids[b : b + n] = step.positions
        non_blocking = self.device.type == "cuda"
        self._meta.copy_(self._host_meta, non_blocking=non_blocking)
        self._ids.copy_(self._host_ids, non_blocking=non_blocking)
        if non_blocking:
            self._copied = torch.cuda.Event()
            self._copied.record()
        if not self.use_graphs:
            return self._forward(size, splits)[:n]
        graph, out = self._graphs[(size, splits)]
        graph.replay()
        return out[:n]
