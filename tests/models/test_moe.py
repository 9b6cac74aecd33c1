"""Mixture of Experts (Qwen3-MoE, Mixtral) token for token against transformers, and the expert computation.

The tiny models (``asyncllm.testing.tiny_models``: 4 experts, top-2; Qwen3-MoE with a dense last
layer) must give transformers' greedy float32 tokens on the torch and cpu attention backends, in one
batch, through chunked prefill, through recompute preemption, and from the prefix cache: that table
runs with the other families' in test_families.py. The grouped
expert computation must equal a plain per-token loop, and the routing must pick HF's experts and
weights on random logits, ties included.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

from asyncllm import Engine, SamplingParams
from asyncllm.errors import ModelLoadError
from asyncllm.models import SUPPORTED_ARCHITECTURES, _moe, build_model
from asyncllm.models._moe import SparseMoeBlock, grouped_experts, route
from asyncllm.testing.parity import stream_all, transformers_greedy
from asyncllm.testing.tiny_models import tiny_model_path
from asyncllm.worker._weights import CheckpointTensor, checkpoint_tensors, load_config, load_model

pytestmark = pytest.mark.anyio

FAMILIES = ("qwen3_moe", "mixtral")
MAX_NEW_TOKENS = 8


def _model_dir(cache_root: str, family: str) -> Path:
    return tiny_model_path(cache_root, family)


@pytest.mark.parametrize("architecture", ["Qwen3MoeForCausalLM", "MixtralForCausalLM"])
def test_moe_architectures_are_supported(architecture: str) -> None:
    assert architecture in SUPPORTED_ARCHITECTURES


def test_moe_layers_and_fast_paths(tiny_cache: Path) -> None:
    # The CPU fast paths (lean forward, fused norms, greedy head) assume a dense Llama MLP.
    for family, sparse in (("qwen3_moe", [True, False]), ("mixtral", [True, True])):
        config = AutoConfig.from_pretrained(_model_dir(str(tiny_cache), family))
        with torch.device("meta"):
            model = build_model(config)
        assert model.spec.llama_layer is False, family
        assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers] == sparse, family


def _naive_experts(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights: torch.Tensor, experts: torch.Tensor
) -> torch.Tensor:
    # One token and one choice at a time, in float64: the definition the grouped computation must meet.
    intermediate = down.shape[-1]
    out = torch.zeros(x.shape, dtype=torch.float64)
    for token in range(x.shape[0]):
        for choice in range(experts.shape[1]):
            expert = int(experts[token, choice])
            h = gate_up[expert].double() @ x[token].double()
            act = F.silu(h[:intermediate]) * h[intermediate:]
            out[token] += float(weights[token, choice]) * (down[expert].double() @ act)
    return out


@pytest.mark.parametrize("tokens", [1, 2, 7, 33])
def test_grouped_experts_equal_a_per_token_loop(tokens: int) -> None:
    generator = torch.Generator().manual_seed(tokens)
    num_experts, top_k, hidden, intermediate = 6, 2, 16, 12
    x = torch.randn(tokens, hidden, generator=generator)
    gate_up = torch.randn(num_experts, 2 * intermediate, hidden, generator=generator) / 4
    down = torch.randn(num_experts, hidden, intermediate, generator=generator) / 4
    weights, experts = route(torch.randn(tokens, num_experts, generator=generator), top_k, True)
    got = grouped_experts(x, gate_up, down, weights, experts)
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got.double(), _naive_experts(x, gate_up, down, weights, experts), rtol=1e-5, atol=1e-5)


ONE_TOKEN_DTYPES = [
    (torch.float32, torch.float32),
    (torch.bfloat16, torch.float32),  # Mixtral: float32 routing weights
    (torch.bfloat16, torch.bfloat16),  # Qwen3-MoE: rounded to the dtype
    (torch.float16, torch.float16),
]


@pytest.mark.parametrize(("dtype", "routing_dtype"), ONE_TOKEN_DTYPES)
def test_one_token_path_is_the_grouped_path_bit_for_bit(dtype: torch.dtype, routing_dtype: torch.dtype) -> None:
    # A one-token step skips the sort, gather and scatter; the tokens must not change (HF parity).
    generator = torch.Generator().manual_seed(5)
    num_experts, top_k, hidden, intermediate = 8, 4, 32, 24
    gate_up = (torch.randn(num_experts, 2 * intermediate, hidden, generator=generator) / 4).to(dtype)
    down = (torch.randn(num_experts, hidden, intermediate, generator=generator) / 4).to(dtype)
    for seed in range(20):
        x = torch.randn(1, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)
        weights, experts = route(torch.randn(1, num_experts, generator=generator), top_k, True)
        weights = weights.to(routing_dtype)
        one = _moe._one_token_experts(x, gate_up, down, weights, experts)
        assert torch.equal(one, _moe._experts_by_group(x, gate_up, down, weights, experts))
        assert torch.equal(grouped_experts(x, gate_up, down, weights, experts), one)


def test_grouped_experts_skip_experts_without_tokens() -> None:
    # Every token on one expert: the others get no rows and are never run.
    x = torch.randn(5, 8)
    gate_up, down = torch.randn(3, 8, 8), torch.randn(3, 8, 4)
    experts = torch.full((5, 1), 2)
    weights = torch.ones(5, 1)
    got = grouped_experts(x, gate_up, down, weights, experts)
    torch.testing.assert_close(got.double(), _naive_experts(x, gate_up, down, weights, experts), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("ties", [False, True])
def test_routing_matches_transformers(normalize: bool, ties: bool) -> None:
    num_experts, top_k, hidden, tokens = 8, 2, 16, 64
    config = Qwen3MoeConfig(
        hidden_size=hidden, num_experts=num_experts, num_experts_per_tok=top_k, norm_topk_prob=normalize
    )
    qwen = Qwen3MoeTopKRouter(config)
    mixtral = MixtralTopKRouter(
        MixtralConfig(hidden_size=hidden, num_local_experts=num_experts, num_experts_per_tok=top_k)
    )
    generator = torch.Generator().manual_seed(int(normalize) + 2 * int(ties))
    weight = torch.randn(num_experts, hidden, generator=generator)
    if ties:  # duplicated router rows: equal logits, so topk's tie-breaking decides
        weight[1], weight[5], weight[6] = weight[0], weight[0], weight[3]
    x = torch.randn(tokens, hidden, generator=generator)
    if ties:
        x[:4] = 0.0  # all experts equal
    with torch.no_grad():
        qwen.weight.copy_(weight)
        mixtral.weight.copy_(weight)
        logits = F.linear(x, weight)
        _, qwen_weights, qwen_experts = qwen(x)
        _, mixtral_weights, mixtral_experts = mixtral(x)
    ours_weights, ours_experts = route(logits, top_k, normalize)
    assert torch.equal(ours_experts, qwen_experts)
    assert torch.equal(ours_weights.to(logits.dtype), qwen_weights)
    ours_weights, ours_experts = route(logits, top_k, True)  # Mixtral always renormalises
    assert torch.equal(ours_experts, mixtral_experts)
    assert torch.equal(ours_weights, mixtral_weights)


def _as_checkpoint(tensors: dict[str, torch.Tensor]) -> list[CheckpointTensor]:
    return [
        (name, tuple(t.shape), lambda start, stop, t=t: t[start:stop].clone() if t.dim() else t.reshape(1))
        for name, t in tensors.items()
    ]


@pytest.mark.parametrize("family", FAMILIES)
def test_per_expert_and_stacked_checkpoints_load_the_same(tiny_cache: Path, family: str) -> None:
    model_dir = _model_dir(str(tiny_cache), family)
    config = load_config(model_dir)
    cpu = torch.device("cpu")
    per_expert = load_model(
        config, checkpoint_tensors(model_dir), device=cpu, dtype=torch.float32, fuse_projections=True
    )
    # transformers 5's in-memory layout: the experts stacked (``experts.gate_up_proj``), under ``mlp.``.
    stacked = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).state_dict()
    assert any(name.endswith("experts.gate_up_proj") for name in stacked)
    loaded = load_model(config, _as_checkpoint(stacked), device=cpu, dtype=torch.float32, fuse_projections=True)
    for (name, ours), (other, theirs) in zip(per_expert.named_parameters(), loaded.named_parameters(), strict=True):
        assert name == other and torch.equal(ours, theirs), name


def test_a_missing_expert_is_a_load_error(tiny_cache: Path) -> None:
    model_dir = _model_dir(str(tiny_cache), "mixtral")
    tensors = [t for t in checkpoint_tensors(model_dir) if ".experts.3.w2." not in t[0]]
    with pytest.raises(ModelLoadError, match="does not fill"):
        load_model(
            load_config(model_dir), tensors, device=torch.device("cpu"), dtype=torch.float32, fuse_projections=True
        )


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("family", FAMILIES)
async def test_triton_backend_fused_experts_match_transformers(
    anyio_backend: str, tiny_cache: Path, family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The triton backend runs the experts in the fused kernels (in triton's interpreter on the CPU,
    # hence few prompts and tokens): greedy float32 tokens as transformers', through chunked prefill
    # (8 tokens a step: steps mix prefill chunks and decodes), and the first tokens again from the
    # prefix cache (a short second pass: the interpreter's attention is most of the test's time).
    pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[gpu]')")
    from asyncllm.backends.triton._kernels import fused_moe

    calls = 0
    kernel = fused_moe.fused_experts

    def counting(*args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal calls
        calls += 1
        return kernel(*args, **kwargs)

    monkeypatch.setattr(fused_moe, "fused_experts", counting)
    model_dir = _model_dir(str(tiny_cache), family)
    prompts = [[5, 17, 33, 2, 90, 41, 7, 8, 9, 10, 11], [300, 4, 4], [7]]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    expected = transformers_greedy(model_dir, tuple(map(tuple, prompts)), MAX_NEW_TOKENS)
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the interpreter only off CUDA
    async with Engine.open(
        model_dir, device=device, dtype="float32", attention_backend="triton", block_size=4,
        max_num_batched_tokens=8, kv_cache_blocks=32,
    ) as engine:  # fmt: skip
        assert "triton attention" in engine._info.description  # type: ignore[union-attr]
        first = await stream_all(engine, prompts, params)
        hits_before = engine.statistics().prefix_cache_hits
        second = await stream_all(engine, prompts, SamplingParams(temperature=0.0, max_tokens=3))
        assert engine.statistics().prefix_cache_hits > hits_before
    assert first == expected and second == [tokens[:3] for tokens in expected]
    assert calls > 0
