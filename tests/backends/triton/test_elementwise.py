"""The small kernels against their torch references: KV-cache write, RMSNorm (+ residual), rotary.

Outputs and untouched cache slots start as NaN, so a row or slot written by mistake (or not written)
shows. On the CPU the kernels run in triton's interpreter; bf16 there is rounded by truncation (the
interpreter's conversion), hence a tolerance of two bf16 ulps.
"""

from __future__ import annotations

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[gpu]')")

import torch

from asyncllm.backends.torch._attention import write_kv
from asyncllm.backends.triton._kernels.reshape_and_cache import reshape_and_cache
from asyncllm.backends.triton._kernels.rms_norm import rms_norm
from asyncllm.backends.triton._kernels.rotary import rotary_embedding_
from asyncllm.models._norm import RMSNorm
from asyncllm.models._rotary import RotaryEmbedding, apply_rotary

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")
TOKENS = 777 if GPU else 7
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]
TOLERANCE = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 1e-3, "rtol": 1e-3},
    torch.bfloat16: {"atol": 1e-2, "rtol": 2e-2},
}


def _randn(*shape: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("kv_heads", "head_dim"), [(2, 64), (1, 80), (3, 128)])
def test_reshape_and_cache_writes_exactly_the_mapped_slots(kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    slots_total = 4 * TOKENS + 16
    k = _randn(TOKENS, kv_heads, head_dim, dtype=dtype, seed=1)
    v = _randn(TOKENS, kv_heads, head_dim, dtype=dtype, seed=2)
    slots = torch.randperm(slots_total, generator=torch.Generator().manual_seed(3))[:TOKENS]
    padded = slots.clone()
    padded[TOKENS // 2] = -1  # a padding row: written nowhere
    keep = padded >= 0
    expected_k = torch.full((slots_total, kv_heads, head_dim), float("nan"), dtype=dtype)
    expected_v = expected_k.clone()
    write_kv(expected_k, expected_v, k[keep], v[keep], slots[keep])
    k_cache = torch.full_like(expected_k, float("nan"), device=DEVICE)
    v_cache = k_cache.clone()
    reshape_and_cache(k.to(DEVICE), v.to(DEVICE), k_cache, v_cache, padded.to(DEVICE, torch.int32))
    # Bit-exact copies; NaN where nothing was written (equal_nan compares those too).
    torch.testing.assert_close(k_cache.cpu(), expected_k, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache.cpu(), expected_v, atol=0, rtol=0, equal_nan=True)


def test_reshape_and_cache_rejects_mismatched_shapes() -> None:
    k = torch.zeros(3, 2, 64, device=DEVICE)
    cache = torch.zeros(16, 2, 80, device=DEVICE)
    with pytest.raises(ValueError, match="do not fit"):
        reshape_and_cache(k, k, cache, cache, torch.arange(3, device=DEVICE))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("hidden", [64, 80, 576])
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm_matches_layer(hidden: int, dtype: torch.dtype, with_residual: bool) -> None:
    layer = RMSNorm(hidden, 1e-6)
    layer.weight.data = _randn(hidden, dtype=torch.float32, seed=4)
    layer = layer.to(dtype)
    x = _randn(TOKENS, hidden, dtype=dtype, seed=5) * 3
    residual = _randn(TOKENS, hidden, dtype=dtype, seed=6)
    summed = x + residual
    expected = layer(summed if with_residual else x)
    res_dev = residual.to(DEVICE) if with_residual else None
    out = rms_norm(x.to(DEVICE), layer.weight.to(DEVICE), 1e-6, residual=res_dev)
    assert out.shape == x.shape and out.dtype == dtype
    torch.testing.assert_close(out.cpu(), expected, **TOLERANCE[dtype])
    if res_dev is not None:
        torch.testing.assert_close(res_dev.cpu(), summed, **TOLERANCE[dtype])


def test_rms_norm_of_per_head_rows() -> None:
    # Qwen3's q/k norm: a [tokens, heads, head_dim] tensor normalised per head.
    layer = RMSNorm(64, 1e-6)
    layer.weight.data = _randn(64, dtype=torch.float32, seed=7)
    q = _randn(TOKENS, 4, 64, dtype=torch.float32, seed=8)
    out = rms_norm(q.to(DEVICE), layer.weight.to(DEVICE), 1e-6)
    torch.testing.assert_close(out.cpu(), layer(q), **TOLERANCE[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 64), (6, 1, 80), (8, 8, 128)])
def test_rotary_matches_apply_rotary(heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> None:
    rope = RotaryEmbedding(head_dim, {"rope_type": "default", "rope_theta": 1_000_000.0})
    positions = torch.randint(0, 4096, (TOKENS,), generator=torch.Generator().manual_seed(9))
    cos, sin = rope.cos_sin(positions, dtype)
    q = _randn(TOKENS, heads, head_dim, dtype=dtype, seed=10)
    k = _randn(TOKENS, kv_heads, head_dim, dtype=dtype, seed=11)
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    q_dev, k_dev = q.to(DEVICE), k.to(DEVICE)
    rotary_embedding_(q_dev, k_dev, cos.to(DEVICE), sin.to(DEVICE))
    torch.testing.assert_close(q_dev.cpu(), expected_q, **TOLERANCE[dtype])
    torch.testing.assert_close(k_dev.cpu(), expected_k, **TOLERANCE[dtype])


def test_rotary_on_strided_views() -> None:
    # q and k as views into one fused qkv projection (rows strided, heads contiguous).
    heads, kv_heads, head_dim = 4, 2, 64
    qkv = _randn(TOKENS, (heads + 2 * kv_heads) * head_dim, dtype=torch.float32, seed=12).to(DEVICE)
    q = qkv[:, : heads * head_dim].view(TOKENS, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(TOKENS, kv_heads, head_dim)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    rope = RotaryEmbedding(head_dim, {"rope_type": "default", "rope_theta": 10_000.0})
    cos, sin = rope.cos_sin(torch.arange(TOKENS), torch.float32)
    expected_q, expected_k = apply_rotary(q.cpu(), cos, sin), apply_rotary(k.cpu(), cos, sin)
    rotary_embedding_(q, k, cos.to(DEVICE), sin.to(DEVICE))
    torch.testing.assert_close(q.cpu(), expected_q)
    torch.testing.assert_close(k.cpu(), expected_k)
    torch.testing.assert_close(qkv[:, (heads + kv_heads) * head_dim :], v_before, atol=0, rtol=0)
