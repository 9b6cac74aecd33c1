"""The ``triton`` attention backend: the Triton kernels (``_kernels``) through their launchers (``_launchers``).

Importing it does not import triton; the kernels are imported on their first call.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch
from torch import Tensor

from asyncllm.backends._base import AttentionBackend, KVCache
from asyncllm.backends.triton import _launchers as attention_triton
from asyncllm.backends.triton._launchers import StaticDecodeMetadata, TritonAttentionMetadata
from asyncllm.worker._input_batch import StepInputs

__all__ = ["TritonAttentionBackend"]

logger = logging.getLogger("asyncllm")


class TritonAttentionBackend(AttentionBackend[TritonAttentionMetadata]):
    """Four small integer tensors of metadata per step; KV write, attention, rotary, the residual-add
    RMSNorm and the Mixture-of-Experts feed-forward as Triton kernels; static metadata for CUDA graphs.

    Args:
        device: Where the kernels run (CUDA; the CPU only in triton's interpreter).
        num_kv_heads: The model's KV heads (the split-KV decision).
        sliding_window: The model's sliding window, or None.
        softcap: The model's attention soft-cap (gemma2), or None: its kernel variants are the ones
            ``warm_up`` compiles (each ``attend`` still takes the layer's own).
    """

    name = "triton"
    rotates_in_kernel = True
    fuses_norms = True
    captures_graphs = True
    runs_fused_moe = True

    def __init__(
        self,
        *,
        device: torch.device,
        num_kv_heads: int,
        sliding_window: int | None = None,
        softcap: float | None = None,
    ) -> None:
        self.device = device
        self.num_kv_heads = num_kv_heads
        self.sliding_window = sliding_window
        self.softcap = softcap

    def build_metadata(self, step: StepInputs) -> TritonAttentionMetadata:
        """The step's metadata, copied to the device without waiting (``backends.triton._launchers.build_metadata``)."""
        return attention_triton.build_metadata(
            step, num_kv_heads=self.num_kv_heads, device=self.device, sliding_window=self.sliding_window
        )

    def write_kv(self, kv_cache: KVCache, k: Tensor, v: Tensor, meta: TritonAttentionMetadata) -> None:
        """The reshape-and-cache kernel (it skips slot -1: the graphs' padding rows)."""
        attention_triton.write_kv(*kv_cache, k, v, meta.slot_mapping)

    def attend(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        kv_cache: KVCache,
        meta: TritonAttentionMetadata,
        scale: float,
        *,
        sliding: bool = True,
        softcap: float | None = None,
    ) -> Tensor:
        """The paged-attention kernel, or the split-KV kernels where the metadata asks for splits; with
        ``softcap``, their soft-capped variants (a constexpr: models without one run kernels without it).

        Raises:
            ValueError: ``softcap`` is not a positive finite number.
        """
        if not sliding and meta.sliding_window is not None:
            meta = dataclasses.replace(meta, sliding_window=None)  # the kernels derive the window from it
        return attention_triton.paged_attention(q, *kv_cache, meta, scale, softcap)

    def rotary_(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> None:
        """The rotary kernel, in place."""
        attention_triton.apply_rotary_(q, k, cos, sin)

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float, residual: Tensor | None) -> Tensor:
        """The RMSNorm kernel (``kernels.rms_norm``)."""
        from asyncllm.backends.triton._kernels import rms_norm  # triton: imported on first use
        return rms_norm.rms_norm(x, weight, eps, residual=residual)

    def warm_up(
        self,
        *,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        num_sms: int | None = None,
        global_layers: bool = False,
    ) -> int:
        """Compile every attention-kernel variant the model's steps can reach, before the first request.

        Triton compiles a variant on its first launch, which would stall a step mid-serving for
        seconds; the variants depend only on the model's shapes and these limits
        (``_kernels.variants.reachable_keys``), so all of them are launched once here on a tiny batch.
        Logs the count and the time.

        Args:
            num_heads: The model's query heads.
            head_dim: The model's head size.
            dtype: The KV cache's dtype.
            block_size: Tokens per KV block.
            max_model_len: The longest context.
            max_num_seqs: The largest batch.
            num_sms: The device's multiprocessors (the split-KV counts); None: the device's own on
                CUDA, no split elsewhere.
            global_layers: With a sliding window, some layers attend without it (a hybrid model's
                global layers): their variants (no window) are compiled too.

        Returns:
            The number of variants.
        """
        from asyncllm.backends.triton._kernels import variants  # triton: imported on first use

        if num_sms is None and self.device.type == "cuda":
            num_sms = attention_triton._num_sms(self.device)
        shape = variants.AttentionShape(
            num_heads, self.num_kv_heads, head_dim, dtype, block_size, self.sliding_window, self.softcap
        )
        shapes = [shape]
        if global_layers and self.sliding_window is not None:
            shapes.append(dataclasses.replace(shape, sliding_window=None))
        start = time.perf_counter()
        count = 0
        for each in shapes:
            keys = variants.reachable_keys(
                each, max_model_len=max_model_len, max_num_seqs=max_num_seqs, num_sms=num_sms
            )
            variants.warm_up(each, sorted(set(keys.values())), self.device)
            count += len(keys)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info(
            "triton attention: %d kernel variants compiled or loaded from triton's cache in %.1f s",
            count,
            time.perf_counter() - start,
        )
        return count

    def warm_up_moe(self, *, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                    dtype: torch.dtype) -> int:  # fmt: skip
        """Compile the fused-MoE kernels' variants (two per dtype: ``_kernels.fused_moe.moe_config``) before
        the first request, as ``warm_up`` does for attention. Logs the count and the time.

        Args:
            num_experts: The model's experts per MoE layer.
            top_k: Experts per token.
            hidden_size: The model's hidden size.
            intermediate_size: Each expert's MLP width.
            dtype: The weights' dtype.

        Returns:
            The number of configurations launched.
        """
        from asyncllm.backends.triton._kernels import fused_moe  # triton: imported on first use

        start = time.perf_counter()
        count = fused_moe.warm_up(num_experts=num_experts, top_k=top_k, hidden=hidden_size,
                                  intermediate=intermediate_size, dtype=dtype, device=self.device)  # fmt: skip
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        logger.info("triton fused MoE: %d kernel configurations compiled or loaded in %.1f s", count,
                    time.perf_counter() - start)  # fmt: skip
        return count

    def kv_splits(self, num_seqs: int, max_seq_len: int) -> int:
        """Split only where the batch alone would leave the GPU idle (never off CUDA)."""
        return attention_triton.decode_kv_splits(num_seqs, self.num_kv_heads, max_seq_len, self.device)

    def graph_inputs(
        self, *, max_batch: int, max_blocks: int, block_size: int, device: torch.device
    ) -> StaticDecodeMetadata:
        """Static metadata buffers for the CUDA graphs (``backends.triton._launchers.StaticDecodeMetadata``)."""
        return StaticDecodeMetadata(
            max_batch=max_batch,
            max_blocks=max_blocks,
            block_size=block_size,
            device=device,
            sliding_window=self.sliding_window,
        )
