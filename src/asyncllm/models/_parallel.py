"""Megatron-style tensor parallelism: which part of each weight a rank holds, and the two sharded layers.

A model split over ``size`` ranks keeps every activation between layers whole (``[tokens, hidden]`` on
every rank) and splits the matmuls around it:

- **column-parallel** (q/k/v, gate/up): each rank holds a slice of the output rows, so it computes its
  own heads and its own slice of the MLP's intermediate activations, with no communication;
- **row-parallel** (o_proj, down_proj): each rank holds the matching slice of the input columns and
  computes a partial sum of the full output; one all-reduce adds them (``RowParallelLinear``);
- **vocabulary-parallel** embedding and LM head: each rank holds a contiguous slice of the vocabulary
  rows. A token's embedding comes from the one rank that holds its row (the others contribute zeros, and
  an all-reduce adds them: the sum is exact). The LM head gives each rank the logits of its slice, and
  rank 0 gathers them before it samples (``VocabParallelEmbedding``, ``gather_logits``).

Norms, rotary, residual adds and the per-head q/k norms are replicated: every rank computes them on
the same whole activations. Attention is per head, so each rank attends with its own heads over its
own KV cache, which holds only its KV heads. With fewer KV heads than ranks (GQA), each KV head is
replicated on ``size / num_kv_heads`` ranks: the rank's query heads all belong to that one KV head's
group, so its cache still holds the one head it needs.

Nothing here imports ``torch.distributed``: the collectives arrive as a ``Collectives`` object, so the
model code runs the same whichever transport (gloo, NCCL) carries them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from asyncllm.models._linear import Linear

__all__ = [
    "Collectives",
    "RowParallelLinear",
    "TensorParallel",
    "VocabParallelEmbedding",
    "kv_head_range",
    "shard_range",
]


class Collectives(Protocol):
    """The two collective operations a sharded forward needs, over every rank of the model."""

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Replace ``tensor`` on every rank by the sum of every rank's ``tensor`` (in place)."""
        ...

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``tensor`` (all of one shape), in rank order, on rank 0; None on the others."""
        ...


@dataclass(frozen=True, slots=True, eq=False)
class TensorParallel:
    """Where one rank sits in a tensor-parallel model, and how it talks to the others.

    Attributes:
        rank: This rank, 0 to ``size - 1``; rank 0 samples.
        size: The number of ranks the model is split over.
        collectives: The all-reduce and gather between the ranks (None only for a model built to
            be loaded and never run, such as a test of its shapes).
    """

    rank: int
    size: int
    collectives: Collectives | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {self.rank}")

    @property
    def sharded(self) -> bool:
        """More than one rank: the layers communicate."""
        return self.size > 1

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` over the ranks, in place (nothing with one rank)."""
        if self.size > 1:
            if self.collectives is None:
                raise RuntimeError("this sharded model was built without collectives; it cannot run")
            self.collectives.all_reduce(tensor)

    def gather(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's ``tensor`` on rank 0 (``[tensor]`` with one rank); None on the others."""
        if self.size == 1:
            return [tensor]
        if self.collectives is None:
            raise RuntimeError("this sharded model was built without collectives; it cannot run")
        return self.collectives.gather(tensor)


SINGLE = TensorParallel(0, 1)
"""One rank: every layer whole, no communication."""


def shard_range(total: int, parallel: TensorParallel) -> tuple[int, int]:
    """This rank's [start, stop) of ``total`` items split evenly (``total`` must divide by the size)."""
    if total % parallel.size:
        raise ValueError(f"{total} does not split evenly over {parallel.size} ranks")
    part = total // parallel.size
    return parallel.rank * part, (parallel.rank + 1) * part


def kv_head_range(num_kv_heads: int, parallel: TensorParallel) -> tuple[int, int]:
    """This rank's [first, stop) KV heads: an even share, or with fewer KV heads than ranks the one head
    its query heads attend with (each head then replicated on ``size / num_kv_heads`` ranks)."""
    if num_kv_heads >= parallel.size:
        return shard_range(num_kv_heads, parallel)
    if parallel.size % num_kv_heads:
        raise ValueError(f"{parallel.size} ranks do not divide into the {num_kv_heads} KV heads' groups")
    head = parallel.rank * num_kv_heads // parallel.size
    return head, head + 1


def vocab_rows(vocab_size: int, parallel: TensorParallel) -> tuple[int, int]:
    """This rank's [start, stop) of the vocabulary rows: ``ceil(vocab / size)`` per rank, the last one
    padded (rows past the vocabulary are zero and their logits dropped), so every shard has one shape."""
    rows = -(-vocab_size // parallel.size)
    return parallel.rank * rows, (parallel.rank + 1) * rows


class RowParallelLinear(Linear):
    """A ``Linear`` holding a slice of the input columns: its output is a partial sum, completed by an
    all-reduce over the ranks (o_proj and down_proj). With one rank, a plain ``Linear``.

    Args:
        in_features: This rank's input columns.
        out_features: The whole output.
        parallel: The rank's place; its ``all_reduce`` runs after every matmul.
    """

    def __init__(
        self, in_features: int, out_features: int, *, bias: bool = False, parallel: TensorParallel = SINGLE
    ) -> None:
        if bias and parallel.sharded:  # every rank would add it: the sum would count it size times
            raise NotImplementedError("a row-parallel layer with a bias is not supported")
        super().__init__(in_features, out_features, bias=bias)
        self.parallel = parallel

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = super().forward(x)
        self.parallel.all_reduce(out)
        return out


class VocabParallelEmbedding(nn.Embedding):
    """An embedding holding one rank's slice of the vocabulary rows (``vocab_rows``).

    Each token is looked up by the rank that holds its row; the others give zeros, and the
    all-reduce adds the one real row to zeros, so the result is exactly the unsharded embedding.

    Args:
        vocab_size: The whole vocabulary.
        hidden_size: The embedding width.
        parallel: The rank's place.
    """

    def __init__(self, vocab_size: int, hidden_size: int, *, parallel: TensorParallel = SINGLE) -> None:
        start, stop = vocab_rows(vocab_size, parallel) if parallel.sharded else (0, vocab_size)
        super().__init__(stop - start, hidden_size)
        self.parallel = parallel
        self.vocab_size = vocab_size
        self.first_row = start
        self.valid_rows = max(0, min(stop, vocab_size) - start)
        """Rows of this shard inside the vocabulary; the rest (the last rank's padding) stay zero."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if not self.parallel.sharded:
            return super().forward(input_ids)
        local = input_ids - self.first_row
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        self.parallel.all_reduce(out)
        return out


def gather_logits(local: torch.Tensor, vocab_size: int, parallel: TensorParallel) -> torch.Tensor:
    """The whole vocabulary's logits on rank 0 from every rank's slice ([rows, vocab]); on the other ranks
    their own slice, unchanged (they only contribute)."""
    if not parallel.sharded:
        return local
    parts = parallel.gather(local.contiguous())
    if parts is None:
        return local
    return torch.cat(parts, dim=-1)[..., :vocab_size]
