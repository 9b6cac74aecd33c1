"""A sparse Mixture-of-Experts feed-forward block: Qwen3-MoE's and Mixtral's, as transformers computes them.

A router (a linear layer, ``gate``) scores every expert for every token; each token goes to its
``top_k`` experts, and its output is the routing-weighted sum of theirs. The experts' weights are
stacked as transformers 5 holds them in memory (``experts.gate_up_proj`` [experts, 2 * intermediate,
hidden], gate rows first, and ``experts.down_proj`` [experts, hidden, intermediate]), so HF's state
dict and a checkpoint in that layout load by name; a checkpoint with one tensor per expert (what
``save_pretrained`` writes and the hub holds: ``experts.N.gate_proj`` ..., Mixtral's
``block_sparse_moe.experts.N.w1`` ...) is written into those stacks' rows (``checkpoint_rows``).

The expert computation is batched by expert, not by token: the (token, choice) pairs are sorted by
expert id, each expert runs two matmuls over its contiguous group, and the weighted outputs are
added back into their tokens in one ``index_add_``. The Python loop runs over experts (at most
``num_experts`` iterations, and only over those that received tokens), whatever the batch size. A
single token (a one-sequence decode step) skips the grouping: its ``top_k`` experts run one after the
other, with the same bits. That is the torch path, the reference, which the CPU runs; on the triton
backend (CUDA, or triton's interpreter) the block runs the fused kernels instead
(``asyncllm.backends.triton._kernels.fused_moe``; ``SparseMoeBlock.fused``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.models._linear import Linear


@dataclass(frozen=True, slots=True)
class MoeSpec:
    """The expert layout of a MoE model, read off its HF config."""

    num_experts: int
    top_k: int
    intermediate_size: int
    """Each expert's MLP width (Qwen3-MoE's ``moe_intermediate_size``; Mixtral's ``intermediate_size``)."""
    norm_topk_prob: bool
    """Renormalise the top-k routing probabilities to sum to 1 (always for Mixtral; Qwen3-MoE's config says)."""
    sparse_layers: tuple[bool, ...]
    """Per layer, whether its MLP is the sparse block (Qwen3-MoE's ``mlp_only_layers`` and
    ``decoder_sparse_step`` make some dense); the others run the dense MLP of ``intermediate_size``."""
    weights_in_router_dtype: bool
    """Cast the routing weights back to the router logits' dtype before weighting (Qwen3-MoE); False keeps
    them in float32 and rounds the weighted expert outputs instead (Mixtral)."""
    checkpoint_style: str
    """How a per-expert checkpoint names its tensors: ``"qwen3_moe"`` (``mlp.experts.N.gate_proj``) or
    ``"mixtral"`` (``block_sparse_moe.experts.N.w1``/``w3``/``w2`` for gate/up/down)."""


def route(logits: torch.Tensor, top_k: int, normalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's routing: a float32 softmax over the experts, the ``top_k`` largest, renormalised if ``normalize``.

    Ties go as ``torch.topk`` breaks them, as in transformers (the same call on the same values).

    Returns:
        (weights [tokens, top_k] float32, expert ids [tokens, top_k] int64).
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def grouped_experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    weights: torch.Tensor,
    experts: torch.Tensor,
) -> torch.Tensor:
    """Each token's routing-weighted sum of its chosen experts' SwiGLU outputs, computed per expert group.

    Args:
        x: [tokens, hidden] inputs.
        gate_up: [experts, 2 * intermediate, hidden] stacked gate and up weights (gate rows first).
        down: [experts, hidden, intermediate] down weights.
        weights: [tokens, top_k] routing weights; the product with the expert output is rounded to
            ``x``'s dtype (float32 weights: HF Mixtral's order; weights in ``x``'s dtype: Qwen3-MoE's).
        experts: [tokens, top_k] expert ids.

    Returns:
        [tokens, hidden] in ``x``'s dtype.
    """
    if x.shape[0] == 1:
        return _one_token_experts(x, gate_up, down, weights, experts)
    return _experts_by_group(x, gate_up, down, weights, experts)


def _experts_by_group(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    """``grouped_experts`` for any batch: the pairs sorted by expert, two matmuls per expert group."""
    top_k = experts.shape[1]
    flat = experts.reshape(-1)
    order = torch.argsort(flat, stable=True)  # (token, choice) pairs grouped by expert, tokens in order
    token_of = order // top_k
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()
    grouped = x.index_select(0, token_of)
    outputs = torch.empty_like(grouped)
    intermediate = down.shape[-1]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = grouped[start : start + count]
        gate, up = F.linear(rows, gate_up[expert]).split((intermediate, intermediate), dim=-1)
        torch.mul(F.silu(gate), up, out=gate)  # in place over the gate half: one allocation less
        outputs[start : start + count] = F.linear(gate, down[expert])
        start += count
    weighted = (outputs * weights.reshape(-1).index_select(0, order)[:, None]).to(x.dtype)
    return torch.zeros_like(x).index_add_(0, token_of, weighted)


def _fused_experts_eager(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    """``grouped_experts`` in the fused Triton kernels (triton imported on first use)."""
    from asyncllm.backends.triton._kernels.fused_moe import fused_experts

    return fused_experts(x, gate_up, down, weights, experts)


# A compiled layer (``compile=True``) leaves the launcher to run eagerly: triton launches its kernels.
_fused_experts: Callable[..., torch.Tensor] = torch.compiler.disable(_fused_experts_eager)


def _one_token_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    """``grouped_experts`` for one token (a decode step of one sequence): its choices run one after the
    other, with none of the grouping's sort, gather and scatter. The same operations on the same rows
    as the grouped path, added in the same (ascending expert) order and in float32, as its
    ``index_add_`` adds half-precision rows: the same bits."""
    ids = experts[0].tolist()
    intermediate = down.shape[-1]
    total = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for choice in sorted(range(len(ids)), key=ids.__getitem__):  # stable: as the grouped path's sort
        expert = ids[choice]
        gate, up = F.linear(x, gate_up[expert]).split((intermediate, intermediate), dim=-1)
        torch.mul(F.silu(gate), up, out=gate)
        total += (F.linear(gate, down[expert]) * weights[0, choice : choice + 1]).to(x.dtype)
    return total.to(x.dtype)


class MoeExperts(nn.Module):
    """The stacked expert weights (HF's ``mlp.experts``)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class SparseMoeBlock(nn.Module):
    """Router and experts: each token's output is the weighted sum of its top-k experts' SwiGLU MLPs.

    Raises:
        NotImplementedError: The activation is not silu (every Qwen3-MoE and Mixtral checkpoint's).
    """

    def __init__(self, moe: MoeSpec, hidden_size: int, hidden_act: str) -> None:
        super().__init__()
        if hidden_act != "silu":
            raise NotImplementedError(f"hidden_act {hidden_act!r} is not supported in a MoE block (only silu)")
        self.top_k = moe.top_k
        self.norm_topk_prob = moe.norm_topk_prob
        self.weights_in_router_dtype = moe.weights_in_router_dtype
        self.intermediate_size = moe.intermediate_size
        self.gate = Linear(hidden_size, moe.num_experts, bias=False)
        self.experts = MoeExperts(moe.num_experts, hidden_size, moe.intermediate_size)
        self.gate_up_proj: Linear | None = None
        """Never set: the expert weights are stacked already (read by the dense MLP's callers)."""
        self.fused = False
        """Compute the experts with the fused Triton kernels (``backends.triton._kernels.fused_moe``);
        False: ``grouped_experts``, the torch reference. The model sets it with its attention backend
        (``DecoderForCausalLM.backend``: True on triton, which runs on CUDA or in triton's interpreter)."""

    def fuse(self) -> None:
        """Nothing to fuse: the experts' gate and up weights are one stacked tensor already."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        weights, experts = route(logits, self.top_k, self.norm_topk_prob)
        if self.weights_in_router_dtype:
            weights = weights.to(logits.dtype)
        if self.fused:
            return _fused_experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, experts)
        return grouped_experts(x, self.experts.gate_up_proj, self.experts.down_proj, weights, experts)

    def checkpoint_rows(self, ours: str, style: str) -> dict[str, tuple[str, int]]:
        """Where a per-expert checkpoint's tensors go in the stacks: HF name -> (our parameter, first row
        of the parameter viewed as 2-D over its last dimension).

        Args:
            ours: This block's parameter prefix (``model.layers.N.mlp``).
            style: ``MoeSpec.checkpoint_style``.
        """
        num_experts, double, _ = self.experts.gate_up_proj.shape
        hidden = self.experts.down_proj.shape[1]
        intermediate = double // 2
        if style == "mixtral":
            theirs = ours.removesuffix(".mlp") + ".block_sparse_moe"
            parts = (("w1", "gate_up_proj", 0), ("w3", "gate_up_proj", intermediate), ("w2", "down_proj", 0))
        else:
            theirs = ours
            parts = (
                ("gate_proj", "gate_up_proj", 0),
                ("up_proj", "gate_up_proj", intermediate),
                ("down_proj", "down_proj", 0),
            )
        rows: dict[str, tuple[str, int]] = {f"{theirs}.gate.weight": (f"{ours}.gate.weight", 0)}
        for expert in range(num_experts):
            for part, stack, offset in parts:
                per_expert = double if stack == "gate_up_proj" else hidden
                rows[f"{theirs}.experts.{expert}.{part}.weight"] = (
                    f"{ours}.experts.{stack}",
                    expert * per_expert + offset,
                )
        return rows
