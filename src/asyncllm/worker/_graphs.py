"""CUDA graphs for decode-only steps, and pinned host-to-device copies.

A decode step of a small model is a few hundred short kernels; launched one by one from Python the
GPU idles between them. ``DecodeGraphs`` captures the model's forward pass (embeddings to final
norm, on an attention backend that ``captures_graphs``: triton) once per batch size at start-up and
replays it: one launch per step.

A graph replays fixed addresses and shapes, so every input lives in static device buffers sized for
the largest batch, and a step of ``n`` sequences runs the graph of the smallest captured size
``b >= n``. The ``b - n`` padding rows are one-token sequences at position 0 with slot -1, which
the KV-write kernel skips; they attend to one (finite) cache slot and their outputs are dropped.
The token ids and positions live here (and, for a LongRoPE model, which rows' sequences rotate by
its long frequencies); the attention metadata (query offsets, sequence lengths,
block tables, slots) in buffers the model's own backend builds (``AttentionBackend.graph_inputs``),
the same object that builds every eager step's metadata. A hybrid model whose sliding layers have a
pool of their own (``RunnerInfo.sliding_group``) has a second set of metadata buffers, for the sliding
tables and slots, which those layers read; the sequence lengths are the same. Each is staged on the host (pinned, from
torch's caching host allocator, so no step waits for the previous step's copy to have read it) and
copied with non-blocking copies before the replay; of the block tables only the used prefix travels
(the step's rows by the blocks its longest context uses). Block tables are as wide as the longest
sequence the cache can hold. Placeholder ids (async scheduling) are gathered into the static ids on
the device from the previous step's samples, before the replay.

Capture runs on the runner's stream (the device thread's current stream), where the warm-up ran and
where every replay is issued, rather than on a side stream of torch's.

Long contexts at small batch want the split-KV kernels (see ``kernels.split_kv_decode``), whose
grid is fixed at capture: small batch sizes get a second graph captured with splits, used when the
step's longest context asks for splitting.

On a machine without CUDA the same class runs the padded static-buffer path eagerly
(``use_graphs=False``), which is how the tests check the padding on the CPU.
"""

from __future__ import annotations

import logging
import time

import numpy as np
import torch

from asyncllm.models import DecoderForCausalLM
from asyncllm.worker._device_ops import DeviceOps, device_ops
from asyncllm.worker._input_batch import StepInputs

logger = logging.getLogger("asyncllm")

__all__ = ["DecodeGraphs", "capture_sizes"]


def capture_sizes(max_batch: int) -> list[int]:
    """The batch sizes that get a graph: 1, 2, 4, then every multiple of 8 up to ``max_batch``."""
    sizes = [b for b in (1, 2, 4) if b < max_batch] + list(range(8, max_batch, 8))
    return sorted({*sizes, max_batch})


class DecodeGraphs:
    """Captured forward passes for decode-only batches, replayed with padded static inputs.

    Args:
        model: The loaded model; its attention backend must be one that ``captures_graphs`` (triton).
        kv_caches: The per-layer (key, value) caches.
        block_size: Tokens per KV block.
        max_seq_len: The longest sequence a step can hold (sizes the block tables).
        max_batch: The largest decode batch (``max_num_seqs``).
        device: The CUDA device (or the CPU, eager only).
        split_kv: For batch sizes below this, also capture a split-KV graph with that many splits
            (a dict of batch size to splits; empty for none).
        use_graphs: Capture and replay CUDA graphs; False runs the same padded path eagerly.
        ops: Host-to-device copies (``DeviceOps``); default ``device_ops(device)``.
        sliding_group: The model's sliding layers read tables of their own (a hybrid model's sliding
            pool): each ``run`` then takes the step's sliding arrays too, in buffers of their own.
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
        ops: DeviceOps | None = None,
        sliding_group: bool = False,
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
        self.ops = ops if ops is not None else device_ops(device)
        b = self.max_batch
        self._meta = model.backend.graph_inputs(
            max_batch=b, max_blocks=self.max_blocks, block_size=block_size, device=device
        )
        # The sliding layers' tables hold as many columns: zeros before their offset, then the window's blocks.
        self._sliding_meta = None if not sliding_group else model.backend.graph_inputs(
            max_batch=b, max_blocks=self.max_blocks, block_size=block_size, device=device
        )
        # Ids, positions and (LongRoPE) the long-frequency flags of the rows, one section of b each.
        self._long_rope = model.rotary.long_inv_freq is not None
        self._ids = torch.zeros((3 if self._long_rope else 2) * b, dtype=torch.int64, device=device)
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def _forward(self, size: int, splits: int) -> torch.Tensor:
        b = self.max_batch
        ids = self._ids[:size]
        positions = self._ids[b : b + size]
        long_rope = self._ids[2 * b : 2 * b + size] != 0 if self._long_rope else None
        meta = self._meta.metadata(size, splits)
        sliding = None if self._sliding_meta is None else self._sliding_meta.metadata(size, splits)
        result: torch.Tensor = self.model(
            ids, positions, self.kv_caches, meta, long_rope=long_rope, sliding_meta=sliding
        )
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
        # The runner's stream: the warm-up runs on it, and so does every replay.
        stream = torch.cuda.current_stream(self.device)
        with torch.inference_mode():
            for size, splits in variants:
                self._forward(size, splits)  # warm-up: compiles the triton kernels outside the capture
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
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

    def run(
        self,
        step: StepInputs,
        splits: int = 1,
        fill: tuple[torch.Tensor, torch.Tensor] | None = None,
        *,
        sliding_step: StepInputs | None = None,
    ) -> torch.Tensor:
        """Hidden states [n, hidden] of a decode-only step (``fits`` must hold).

        Args:
            step: The step's arrays (one token per sequence).
            splits: The split-KV parts the step would like (> 1 picks a split graph if captured).
            fill: Placeholder ids taken on the device: (rows of the step's ids, the ids they take).
            sliding_step: With ``sliding_group``, the same step over the sliding layers' tables.

        Raises:
            ValueError: ``sliding_step`` is missing with ``sliding_group`` (or given without it).
        """
        if (sliding_step is None) != (self._sliding_meta is None):
            raise ValueError("a step of graphs with a sliding group needs its sliding tables (and only then)")
        n = step.num_seqs
        size = next(b for b in self.sizes if b >= n)
        splits = self.split_kv.get(size, 1) if splits > 1 else 1
        non_blocking = self.device.type == "cuda"
        self._meta.fill(step)
        self._meta.upload(non_blocking)
        if self._sliding_meta is not None and sliding_step is not None:
            self._sliding_meta.fill(sliding_step)
            self._sliding_meta.upload(non_blocking)
        # Ids, positions (and LongRoPE flags) of the graph's rows (padding rows: token 0 at position 0,
        # short), in one copy.
        sections = 3 if self._long_rope else 2
        ids = np.zeros(sections * size, dtype=np.int64)
        ids[:n] = step.input_ids
        ids[size : size + n] = step.positions
        if self._long_rope and step.long_rope is not None:
            ids[2 * size : 2 * size + n] = step.long_rope
        staged = self.ops.to_device(ids)
        b = self.max_batch
        self._ids[:size].copy_(staged[:size])
        self._ids[b : b + size].copy_(staged[size : 2 * size])
        if self._long_rope:
            self._ids[2 * b : 2 * b + size].copy_(staged[2 * size :])
        if fill is not None:
            self._ids[fill[0]] = fill[1]
        if not self.use_graphs:
            return self._forward(size, splits)[:n]
        graph, out = self._graphs[(size, splits)]
        graph.replay()
        return out[:n]
