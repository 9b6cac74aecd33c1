"""The Mixture-of-Experts feed-forward in two Triton kernels: grouped gate/up GEMM with SiLU-and-mul, then
the grouped down GEMM with the routing weight, over a block-aligned per-expert layout.

The numbers are ``asyncllm.models._moe.grouped_experts``' (the torch reference, which the CPU runs):
gate and up rounded to the dtype, SiLU rounded, its product with up rounded, the down projection
rounded, times the float32 routing weight, rounded; then each token's ``top_k`` outputs summed.

The layout (``align_by_expert``, torch ops). Each token's ``top_k`` choices make ``tokens * top_k``
(token, choice) *pairs*, numbered ``token * top_k + choice``. Sorted by expert, each expert's pairs
are padded to a multiple of ``block_m`` rows, so every block of ``block_m`` rows belongs to one
expert: ``pairs`` holds the pair at each row (-1 for padding), ``block_experts`` the expert of each
block. The number of blocks is the bound ``(pairs + min(experts, pairs) * (block_m - 1)) // block_m``,
known on the host from the shapes alone: the blocks past the used ones carry the expert
``num_experts`` and their programs return at once. Nothing is read back from the device, so the
whole layer is capturable in a CUDA graph.

The kernels. ``_gate_up_kernel`` runs one program per (block of rows, tile of ``BLOCK_N`` intermediate
columns): it gathers the block's token rows of ``x``, multiplies them by the expert's gate rows and
up rows (two accumulators, the same ``x`` tile), applies SiLU-and-mul in registers and writes the
activation at the block's rows of a [rows, intermediate] buffer, so the gate/up output never exists
in memory. ``_down_kernel`` runs one program per (block, tile of ``BLOCK_N`` hidden columns): the
block's activation rows (contiguous) times the expert's down weight, scaled by each pair's routing
weight, written at the pair's row of a [pairs, hidden] buffer. The sum over ``top_k`` is a torch
``sum`` over that buffer (one kernel, deterministic, no atomics; nothing for ``top_k`` 1).

The tile shape (``moe_config``) is one of two per dtype: 16-row blocks while the experts get few
rows each (decode: less padding), 64-row blocks once they get many (prefill: each weight tile
reused over more rows); tests/backends/triton/test_aot_compile_moe.py compiles each for sm_90a and
sm_80 and checks that none spills.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from asyncllm.backends.triton._kernels.paged_attention import dot_dtype, dot_precision

__all__ = [
    "ExpertLayout",
    "MoeConfig",
    "align_by_expert",
    "fused_experts",
    "max_blocks",
    "moe_config",
    "moe_configs",
    "warm_up",
]


class MoeConfig(NamedTuple):
    """The tile shape and warps of both kernels of one launch."""

    block_m: int
    """Rows per block: each expert's pairs are padded to a multiple of it."""
    block_n: int
    """Output columns per program."""
    block_k: int
    """Reduction columns per step of the inner loop."""
    num_warps: int


SMALL_BLOCK_M = 16
LARGE_BLOCK_M = 64
_LARGE_FROM_ROWS_PER_EXPERT = 32
"""Pairs per expert (on average) from which the 64-row blocks are used."""


def moe_config(num_pairs: int, num_experts: int, dtype: torch.dtype) -> MoeConfig:
    """The launch's tile shape: 16-row blocks while the experts average under 32 pairs, else 64.

    Two configurations per dtype, so a model compiles at most two variants of each kernel (``warm_up``
    compiles both at load). float32 halves the reduction tile (its operands are twice the bytes).
    """
    wide = dtype == torch.float32
    if num_pairs < _LARGE_FROM_ROWS_PER_EXPERT * num_experts:
        return MoeConfig(SMALL_BLOCK_M, 64, 64 if wide else 128, 4)
    return MoeConfig(LARGE_BLOCK_M, 64, 32 if wide else 64, 4)


def moe_configs(num_experts: int, dtype: torch.dtype) -> tuple[MoeConfig, ...]:
    """Every configuration ``moe_config`` picks for a model, whatever the batch."""
    few, many = 1, _LARGE_FROM_ROWS_PER_EXPERT * num_experts
    return tuple(sorted({moe_config(pairs, num_experts, dtype) for pairs in (few, many)}))


class ExpertLayout(NamedTuple):
    """The (token, choice) pairs sorted by expert, each expert's padded to whole blocks (see the module)."""

    pairs: torch.Tensor
    """[blocks * block_m] int32: the pair (``token * top_k + choice``) at each row; -1: padding."""
    block_experts: torch.Tensor
    """[blocks] int32: the expert each block of rows belongs to; ``num_experts``: an unused block."""
    block_m: int


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most blocks ``num_pairs`` pairs can need: each used expert (at most ``min(num_experts,
    num_pairs)`` of them) wastes at most ``block_m - 1`` rows of padding."""
    return (num_pairs + min(num_experts, num_pairs) * (block_m - 1)) // block_m


def align_by_expert(experts: torch.Tensor, num_experts: int, block_m: int) -> ExpertLayout:
    """Sort a batch's (token, choice) pairs by expert and pad each expert's run to whole ``block_m`` blocks.

    Torch ops only, with shapes that follow ``experts``' shape alone: no value is read back to the
    host (a CUDA graph can capture it). Pairs of one expert keep their order (a stable sort).

    Args:
        experts: [tokens, top_k] expert ids (any integer dtype), each in ``[0, num_experts)``.
        num_experts: The experts of the layer.
        block_m: Rows per block.

    Returns:
        The layout; its ``pairs`` has ``max_blocks(tokens * top_k, num_experts, block_m) * block_m`` rows.
    """
    flat = experts.reshape(-1).long()
    n = flat.numel()
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).index_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    sorted_experts = flat[order]
    group_starts = torch.cumsum(counts, 0) - counts
    # A pair's row: its expert's first padded row, plus its rank among the expert's pairs.
    rows = (padded_ends - padded)[sorted_experts] + torch.arange(n, device=device) - group_starts[sorted_experts]
    blocks = max_blocks(n, num_experts, block_m)
    pairs = torch.full((blocks * block_m,), -1, dtype=torch.int32, device=device)
    pairs[rows] = order.to(torch.int32)
    # Block b's expert: the first whose padded rows end past b * block_m (num_experts past them all).
    block_starts = torch.arange(blocks, device=device) * block_m
    block_experts = torch.searchsorted(padded_ends, block_starts, right=True, out_int32=True)
    return ExpertLayout(pairs, block_experts, block_m)


@triton.jit
def _gate_up_kernel(
    act_ptr,
    x_ptr,
    w_ptr,
    pairs_ptr,
    block_experts_ptr,
    stride_act,
    stride_x,
    stride_w_expert,
    stride_w_row,
    HIDDEN: tl.constexpr,
    INTERMEDIATE: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert >= NUM_EXPERTS:  # past the blocks this batch uses
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    valid = pair >= 0
    token = tl.where(valid, pair // TOP_K, 0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < INTERMEDIATE
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + token[:, None] * stride_x + offs_k[None, :]
    # The expert's gate rows are its first INTERMEDIATE rows, the up rows the next ones; loaded as
    # [BLOCK_K, BLOCK_N] tiles (the weight is [rows, hidden], so the tile is its transpose).
    gate_ptrs = w_ptr + expert.to(tl.int64) * stride_w_expert + cols[None, :] * stride_w_row + offs_k[:, None]
    up_ptrs = gate_ptrs + INTERMEDIATE * stride_w_row
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, HIDDEN, BLOCK_K):
        k_ok = offs_k < HIDDEN - k
        x = tl.load(x_ptrs + k, mask=valid[:, None] & k_ok[None, :], other=0.0).to(DOT_DTYPE)
        w_mask = k_ok[:, None] & col_ok[None, :]
        w_gate = tl.load(gate_ptrs + k, mask=w_mask, other=0.0).to(DOT_DTYPE)
        w_up = tl.load(up_ptrs + k, mask=w_mask, other=0.0).to(DOT_DTYPE)
        gate = tl.dot(x, w_gate, gate, input_precision=DOT_PRECISION)
        up = tl.dot(x, w_up, up, input_precision=DOT_PRECISION)
    # SiLU-and-mul, each step rounded to the dtype as the torch reference's separate ops round.
    out_ty = act_ptr.dtype.element_ty
    gate = gate.to(out_ty).to(tl.float32)
    up = up.to(out_ty).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(out_ty).to(tl.float32)
    # Padding rows are written too (zeros: their x rows loaded as zeros), so the down kernel reads
    # only finite values.
    act_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_act + cols[None, :]
    tl.store(act_ptrs, (silu * up).to(out_ty), mask=col_ok[None, :])


@triton.jit
def _down_kernel(
    out_ptr,
    act_ptr,
    w_ptr,
    pairs_ptr,
    block_experts_ptr,
    routing_ptr,
    stride_out,
    stride_act,
    stride_w_expert,
    stride_w_row,
    HIDDEN: tl.constexpr,
    INTERMEDIATE: tl.constexpr,
    NUM_EXPERTS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    expert = tl.load(block_experts_ptr + block)
    if expert >= NUM_EXPERTS:
        return
    rows = block * BLOCK_M + tl.arange(0, BLOCK_M)
    pair = tl.load(pairs_ptr + rows)
    valid = pair >= 0
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < HIDDEN
    offs_k = tl.arange(0, BLOCK_K)
    act_ptrs = act_ptr + rows.to(tl.int64)[:, None] * stride_act + offs_k[None, :]
    w_ptrs = w_ptr + expert.to(tl.int64) * stride_w_expert + cols[None, :] * stride_w_row + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, INTERMEDIATE, BLOCK_K):
        k_ok = offs_k < INTERMEDIATE - k
        a = tl.load(act_ptrs + k, mask=k_ok[None, :], other=0.0).to(DOT_DTYPE)
        w = tl.load(w_ptrs + k, mask=k_ok[:, None] & col_ok[None, :], other=0.0).to(DOT_DTYPE)
        acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    out_ty = out_ptr.dtype.element_ty
    routing = tl.load(routing_ptr + pair, mask=valid, other=0.0)
    # The projection rounded to the dtype, then times the float32 routing weight, rounded again.
    weighted = acc.to(out_ty).to(tl.float32) * routing[:, None]
    out_ptrs = out_ptr + pair.to(tl.int64)[:, None] * stride_out + cols[None, :]
    tl.store(out_ptrs, weighted.to(out_ty), mask=valid[:, None] & col_ok[None, :])


def _check(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
) -> None:
    if x.dim() != 2 or gate_up.dim() != 3 or down.dim() != 3:
        raise ValueError(
            f"x must be 2-D and the expert weights 3-D, not {x.dim()}-D, {gate_up.dim()}-D, {down.dim()}-D"
        )
    num_experts, double, hidden = gate_up.shape
    intermediate = double // 2
    if x.shape[1] != hidden or double % 2 or down.shape != (num_experts, hidden, intermediate):
        raise ValueError(
            f"x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} do not agree "
            "(want [tokens, hidden], [experts, 2 * intermediate, hidden], [experts, hidden, intermediate])"
        )
    if experts.dim() != 2 or experts.shape[0] != x.shape[0] or weights.shape != experts.shape:
        raise ValueError(
            f"weights {tuple(weights.shape)} and experts {tuple(experts.shape)} must both be [tokens, top_k]"
        )
    if gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(f"the expert weights ({gate_up.dtype}, {down.dtype}) must be in x's dtype ({x.dtype})")
    if x.stride(1) != 1 or not gate_up.is_contiguous() or not down.is_contiguous():
        raise ValueError("x's rows and the expert weights must be contiguous")


def fused_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
    *,
    config: MoeConfig | None = None,
) -> torch.Tensor:
    """Each token's routing-weighted sum of its chosen experts' SwiGLU outputs: the fused kernels.

    The same contract as ``asyncllm.models._moe.grouped_experts`` (the reference it is tested against).

    Args:
        x: [tokens, hidden] inputs (rows contiguous).
        gate_up: [experts, 2 * intermediate, hidden] stacked gate and up weights (gate rows first).
        down: [experts, hidden, intermediate] down weights.
        weights: [tokens, top_k] routing weights (any float dtype; used in float32).
        experts: [tokens, top_k] expert ids.
        config: Override of the tile shape (tests); None: ``moe_config``.

    Returns:
        [tokens, hidden] in ``x``'s dtype.

    Raises:
        ValueError: The shapes, dtypes or layouts do not agree.
    """
    _check(x, gate_up, down, weights, experts)
    tokens, hidden = x.shape
    num_experts, double, _ = gate_up.shape
    intermediate = double // 2
    top_k = experts.shape[1]
    num_pairs = tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    if config is None:
        config = moe_config(num_pairs, num_experts, x.dtype)
    layout = align_by_expert(experts, num_experts, config.block_m)
    rows = layout.pairs.numel()
    blocks = rows // config.block_m
    act = torch.empty(rows, intermediate, dtype=x.dtype, device=x.device)
    common = {
        "HIDDEN": hidden,
        "INTERMEDIATE": intermediate,
        "NUM_EXPERTS": num_experts,
        "BLOCK_M": config.block_m,
        "BLOCK_N": config.block_n,
        "BLOCK_K": config.block_k,
        "DOT_DTYPE": dot_dtype(x.dtype),
        "DOT_PRECISION": dot_precision(x.dtype),
        "num_warps": config.num_warps,
    }
    _gate_up_kernel[(blocks, triton.cdiv(intermediate, config.block_n))](
        act, x, gate_up, layout.pairs, layout.block_experts,
        act.stride(0), x.stride(0), gate_up.stride(0), gate_up.stride(1),
        TOP_K=top_k, **common,
    )  # fmt: skip
    routing = weights.reshape(-1).to(torch.float32)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    _down_kernel[(blocks, triton.cdiv(hidden, config.block_n))](
        out, act, down, layout.pairs, layout.block_experts, routing,
        out.stride(0), act.stride(0), down.stride(0), down.stride(1),
        **common,
    )  # fmt: skip
    if top_k == 1:
        return out
    return out.view(tokens, top_k, hidden).sum(dim=1)


def warm_up(
    *, num_experts: int, top_k: int, hidden: int, intermediate: int, dtype: torch.dtype, device: torch.device
) -> int:
    """Launch the kernels once in each configuration ``moe_config`` can pick, so that triton compiles
    (or loads from its cache) every variant before the first request.

    The variant depends on the model's shapes, the dtype and the configuration, not on the batch, so
    one small batch stands for each configuration.

    Returns:
        The number of configurations launched.
    """
    gate_up = torch.zeros(num_experts, 2 * intermediate, hidden, dtype=dtype, device=device)
    down = torch.zeros(num_experts, hidden, intermediate, dtype=dtype, device=device)
    configs = moe_configs(num_experts, dtype)
    for config in configs:
        x = torch.zeros(1, hidden, dtype=dtype, device=device)
        experts = torch.zeros(1, top_k, dtype=torch.int64, device=device)
        fused_experts(x, gate_up, down, torch.ones(1, top_k, device=device), experts, config=config)
    return len(configs)
