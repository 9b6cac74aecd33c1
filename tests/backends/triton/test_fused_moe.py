"""The fused-MoE kernels against the torch grouped path (``models._moe.grouped_experts``), and their layout.

On the CPU the kernels run in triton's interpreter, where bf16 is rounded by truncation (the
interpreter's conversion) at each of the kernels' five roundings, hence the looser bf16 tolerance.
Each shape runs in both tile configurations (16- and 64-row blocks), whichever ``moe_config`` would
pick for it, so both are checked at every size.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[gpu]')")

import torch
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import native_specialize_impl

from asyncllm.backends.triton._kernels import fused_moe
from asyncllm.backends.triton._kernels.fused_moe import (
    MoeConfig,
    align_by_expert,
    fused_experts,
    max_blocks,
    moe_config,
    moe_configs,
)
from asyncllm.backends.triton._kernels.variants import CompileKey, MoeShape, moe_expected_signature, moe_keys
from asyncllm.models._moe import SparseMoeBlock, grouped_experts, route

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 3e-2},
}
SMALL, LARGE = MoeConfig(16, 64, 128, 4), MoeConfig(64, 64, 32, 4)
# (experts, top_k, tokens): one expert; one token; tokens not a multiple of any block (7, 17, 33);
# top-8 of 8 (every expert chosen by every token) and of 10.
SHAPES = [(1, 1, 3), (4, 1, 1), (4, 2, 1), (8, 2, 7), (6, 2, 17), (8, 8, 5), (10, 8, 33)]
# Not multiples of the tiles: the hidden (reduction) and intermediate (column) masks are exercised.
HIDDEN, INTERMEDIATE = 80, 40


def _problem(
    experts: int, top_k: int, tokens: int, dtype: torch.dtype, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=generator).to(dtype)
    gate_up = (torch.randn(experts, 2 * INTERMEDIATE, HIDDEN, generator=generator) / HIDDEN**0.5).to(dtype)
    down = (torch.randn(experts, HIDDEN, INTERMEDIATE, generator=generator) / INTERMEDIATE**0.5).to(dtype)
    weights, ids = route(torch.randn(tokens, experts, generator=generator), top_k, True)
    return x, gate_up, down, weights, ids


@pytest.mark.parametrize(("experts", "top_k", "tokens"), SHAPES)
def test_layout_places_every_pair_once_in_blocks_of_one_expert(experts: int, top_k: int, tokens: int) -> None:
    _, _, _, _, ids = _problem(experts, top_k, tokens, torch.float32)
    for block_m in (16, 64):
        layout = align_by_expert(ids, experts, block_m)
        pairs, block_experts = layout.pairs, layout.block_experts
        num_pairs = tokens * top_k
        assert pairs.dtype == block_experts.dtype == torch.int32
        assert pairs.numel() == max_blocks(num_pairs, experts, block_m) * block_m
        assert sorted(pairs[pairs >= 0].tolist()) == list(range(num_pairs))
        assert set(pairs[pairs < 0].tolist()) <= {-1}
        flat = ids.reshape(-1)
        for block, expert in enumerate(block_experts.tolist()):
            rows = pairs[block * block_m : (block + 1) * block_m]
            real = rows[rows >= 0]
            if expert == experts:  # past the used blocks: nothing there
                assert real.numel() == 0
                continue
            assert real.numel() > 0 and bool((flat[real.long()] == expert).all())
            assert torch.equal(real, real.sort().values)  # an expert's pairs keep their order
            assert bool((rows[: real.numel()] >= 0).all())  # padding only at the end of an expert's run
        used = block_experts[block_experts < experts]
        assert torch.equal(used, used.sort().values)


def test_layout_reads_nothing_back_to_the_host() -> None:
    # fullgraph tracing fails on a host read (.item(), .tolist(), bincount's size) or a shape that
    # depends on values; what traces here is what a CUDA graph can capture.
    traced = torch.compile(align_by_expert, fullgraph=True, backend="eager", dynamic=False)
    _, _, _, _, ids = _problem(8, 2, 7, torch.float32)
    got, want = traced(ids, 8, 16), align_by_expert(ids, 8, 16)
    assert torch.equal(got.pairs, want.pairs) and torch.equal(got.block_experts, want.block_experts)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("experts", "top_k", "tokens"), SHAPES)
def test_fused_experts_match_the_grouped_path(experts: int, top_k: int, tokens: int, dtype: torch.dtype) -> None:
    x, gate_up, down, weights, ids = _problem(experts, top_k, tokens, dtype, seed=experts + 10 * top_k + tokens)
    # Mixtral's routing weights stay float32; Qwen3-MoE's are cast to the dtype first.
    for routing in (weights, weights.to(dtype)):
        expected = grouped_experts(x, gate_up, down, routing, ids)
        for config in (SMALL, LARGE):
            got = fused_experts(
                x.to(DEVICE), gate_up.to(DEVICE), down.to(DEVICE), routing.to(DEVICE), ids.to(DEVICE), config=config
            )
            assert got.dtype == dtype and got.shape == x.shape
            torch.testing.assert_close(got.cpu(), expected, **TOLERANCE[dtype])


def test_an_expert_without_tokens_and_a_token_choosing_one_expert_twice() -> None:
    x, gate_up, down, _, _ = _problem(4, 2, 5, torch.float32)
    ids = torch.tensor([[2, 2], [2, 0], [0, 2], [2, 2], [0, 0]])  # experts 1 and 3 idle
    weights = torch.rand(5, 2, generator=torch.Generator().manual_seed(3))
    expected = grouped_experts(x, gate_up, down, weights, ids)
    got = fused_experts(*(t.to(DEVICE) for t in (x, gate_up, down, weights, ids)), config=SMALL)
    torch.testing.assert_close(got.cpu(), expected, **TOLERANCE[torch.float32])


def test_config_by_pairs_per_expert() -> None:
    assert moe_config(8, 128, torch.bfloat16).block_m == 16  # decode: 1 token, top-8 of 128
    assert moe_config(31 * 8, 8, torch.bfloat16).block_m == 16
    assert moe_config(32 * 8, 8, torch.bfloat16).block_m == 64
    assert moe_config(4096 * 8, 128, torch.bfloat16).block_m == 64
    assert moe_config(32 * 8, 8, torch.float32).block_k < moe_config(32 * 8, 8, torch.bfloat16).block_k
    assert len(moe_configs(128, torch.bfloat16)) == 2


def test_rejects_mismatched_shapes() -> None:
    x, gate_up, down, weights, ids = _problem(4, 2, 3, torch.float32)
    with pytest.raises(ValueError, match="do not agree"):
        fused_experts(x[:, :-1], gate_up, down, weights, ids)
    with pytest.raises(ValueError, match="do not agree"):
        fused_experts(x, gate_up, down[:, :, :-1], weights, ids)
    with pytest.raises(ValueError, match="top_k"):
        fused_experts(x, gate_up, down, weights[:, :1], ids)
    with pytest.raises(ValueError, match="dtype"):
        fused_experts(x, gate_up.half(), down, weights, ids)
    with pytest.raises(ValueError, match="contiguous"):
        fused_experts(x, gate_up.transpose(1, 2).contiguous().transpose(1, 2), down, weights, ids)


def test_no_tokens() -> None:
    x, gate_up, down, weights, ids = _problem(4, 2, 0, torch.float32)
    assert fused_experts(x, gate_up, down, weights, ids).shape == (0, HIDDEN)


class _Recorder:
    """Stands in for a triton kernel: records each launch's compile key and triton's specialisation."""

    def __init__(self, name: str, kernel: Any, launches: list[tuple[CompileKey, tuple[Any, ...]]]) -> None:
        self.name, self.launches, self.arg_names = name, launches, list(kernel.arg_names)

    def __getitem__(self, grid: object) -> Any:
        def launch(*args: Any, num_warps: int = 4, **constexprs: Any) -> None:
            names = [n for n in self.arg_names if n not in constexprs]
            signature = tuple(
                native_specialize_impl(BaseBackend, arg, False, True, True) for _, arg in zip(names, args, strict=True)
            )
            plain = {k: str(v) if k == "DOT_DTYPE" else v for k, v in constexprs.items()}
            self.launches.append((CompileKey(self.name, tuple(sorted(plain.items())), num_warps), signature))

        return launch


def _record(monkeypatch: pytest.MonkeyPatch) -> list[tuple[CompileKey, tuple[Any, ...]]]:
    launches: list[tuple[CompileKey, tuple[Any, ...]]] = []
    for name, attr in (("moe_gate_up", "_gate_up_kernel"), ("moe_down", "_down_kernel")):
        monkeypatch.setattr(fused_moe, attr, _Recorder(name, getattr(fused_moe, attr), launches))
    return launches


def test_launches_are_the_listed_keys_at_every_batch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Batches of 1 to 300 tokens, both routing-weight dtypes: every launch is one of ``moe_keys`` with
    ``moe_expected_signature``: nothing about a batch compiles a new variant mid-serving."""
    launches = _record(monkeypatch)
    shape = MoeShape(num_experts=8, top_k=2, hidden_size=64, intermediate_size=48, dtype=torch.float16)
    gate_up = torch.zeros(8, 96, 64, dtype=torch.float16)
    down = torch.zeros(8, 64, 48, dtype=torch.float16)
    for tokens in (1, 2, 3, 16, 17, 127, 128, 300):
        for routing_dtype in (torch.float32, torch.float16):
            ids = torch.randint(0, 8, (tokens, 2), generator=torch.Generator().manual_seed(tokens))
            x = torch.zeros(tokens, 64, dtype=torch.float16)
            fused_experts(x, gate_up, down, torch.ones(tokens, 2, dtype=routing_dtype), ids)
    keys = set(moe_keys(shape))
    assert {key for key, _ in launches} == keys and len(keys) == 4
    for key, signature in launches:
        assert signature == moe_expected_signature(key.kernel, shape), key


def test_warm_up_launches_every_key(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncllm.backends.triton._backend import TritonAttentionBackend

    launches = _record(monkeypatch)
    backend = TritonAttentionBackend(device=torch.device("cpu"), num_kv_heads=2)
    # float16: the interpreter widens bf16 tiles to float32 for its dot, a key of its own.
    count = backend.warm_up_moe(num_experts=128, top_k=8, hidden_size=64, intermediate_size=48, dtype=torch.float16)
    assert count == 2
    shape = MoeShape(num_experts=128, top_k=8, hidden_size=64, intermediate_size=48, dtype=torch.float16)
    assert {key for key, _ in launches} == set(moe_keys(shape))


def test_the_triton_backend_picks_the_fused_path(tiny_cache: Path) -> None:
    # Setting the model's backend sets every MoE block's path: fused on triton, torch elsewhere.
    from transformers import AutoConfig

    from asyncllm.backends.torch._backend import TorchAttentionBackend
    from asyncllm.backends.triton._backend import TritonAttentionBackend
    from asyncllm.models import build_model
    from asyncllm.testing.tiny_models import tiny_model_path

    config = AutoConfig.from_pretrained(tiny_model_path(tiny_cache, "mixtral"))
    with torch.device("meta"):
        model = build_model(config)
    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    assert blocks and not any(block.fused for block in blocks)
    model.backend = TritonAttentionBackend(device=torch.device("cpu"), num_kv_heads=2)
    assert all(block.fused for block in blocks)
    model.backend = TorchAttentionBackend()
    assert not any(block.fused for block in blocks)
