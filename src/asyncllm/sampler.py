"""Batched sampling: one pass over the whole batch, per-request parameters as tensors.

A seeded request draws from its own ``torch.Generator``, so its tokens do not depend on which
other requests share the batch; unseeded requests share the runner's generator.
"""

from __future__ import annotations

import torch

from asyncllm.sampling_params import SamplingParams


class Sampler:
    """Turns a [batch, vocab] float32 logits tensor into one token id per row.

    Args:
        device: Where generators and noise live.
        seed: Seed of the generator shared by unseeded requests (None: nondeterministic).
    """

    def __init__(self, device: torch.device, seed: int | None = None) -> None:
        self.device = device
        self._shared = torch.Generator(device=device)
        if seed is None:
            self._shared.seed()
        else:
            self._shared.manual_seed(seed)
        self._seeded: dict[int, torch.Generator] = {}

    def forget(self, request_ids: list[int]) -> None:
        """Drop the generators of finished requests."""
        for request_id in request_ids:
            self._seeded.pop(request_id, None)

    def sample(self, logits: torch.Tensor, request_ids: list[int], params: list[SamplingParams]) -> torch.Tensor:
        """Sample one token per row.

        Args:
            logits: [batch, vocab] float32 logits.
            request_ids: The request of each row (keys the seeded generators).
            params: The sampling parameters of each row.

        Returns:
            [batch] int64 token ids.
        """
        greedy_ids = logits.argmax(dim=-1)
        if all(p.greedy for p in params):
            return greedy_ids
        temperatures = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], device=logits.device)
        scaled = logits / temperatures[:, None]
        scaled = self._filter_top_k_top_p(scaled, params)
        probs = torch.softmax(scaled, dim=-1)
        sampled = (probs / self._exponential_noise(probs, request_ids, params)).argmax(dim=-1)
        is_greedy = torch.tensor([p.greedy for p in params], device=logits.device)
        return torch.where(is_greedy, greedy_ids, sampled)

    def _filter_top_k_top_p(self, logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        use_top_k = any(p.top_k > 0 for p in params)
        use_top_p = any(p.top_p < 1.0 for p in params)
        if not (use_top_k or use_top_p):
            return logits
        vocab = logits.shape[-1]
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
        if use_top_k:
            top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], device=logits.device)
            ranks = torch.arange(vocab, device=logits.device)
            drop |= ranks[None, :] >= top_k[:, None]
        if use_top_p:
            top_p = torch.tensor([p.top_p for p in params], device=logits.device)
            probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), dim=-1)
            # Drop a token when the tokens ranked above it already reach top_p; the first always stays.
            mass_before = probs.cumsum(dim=-1) - probs
            drop |= mass_before >= top_p[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        return torch.empty_like(logits).scatter_(-1, order, sorted_logits)

    def _exponential_noise(
        self, probs: torch.Tensor, request_ids: list[int], params: list[SamplingParams]
    ) -> torch.Tensor:
        # argmax(p / E) with E ~ Exp(1) draws from p (the exponential race), one vectorised pass.
        noise = torch.empty_like(probs).exponential_(generator=self._shared)
        for row, (request_id, p) in enumerate(zip(request_ids, params)):
            if p.seed is None or p.greedy:
                continue
            generator = self._seeded.get(request_id)
            if generator is None:
                generator = torch.Generator(device=probs.device)
                generator.manual_seed(p.seed)
                self._seeded[request_id] = generator
            noise[row].exponential_(generator=generator)
        return noise
