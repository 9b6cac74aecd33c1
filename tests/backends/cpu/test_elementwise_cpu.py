"""The CPU C kernels for RMSNorm (+ residual add), rotary and the KV write, against the torch paths they replace."""

from __future__ import annotations

import pytest
import torch

from asyncllm.backends.cpu import _elementwise as elementwise_cpu
from asyncllm.backends.torch._attention import write_kv
from asyncllm.models._norm import RMSNorm
from asyncllm.models._rotary import RotaryEmbedding, apply_rotary

pytestmark = pytest.mark.skipif(
    not elementwise_cpu.available(), reason="no C compiler: the cpu element-wise kernels are unavailable"
)


def _norm(hidden: int, seed: int) -> RMSNorm:
    torch.manual_seed(seed)
    norm = RMSNorm(hidden, 1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    return norm


@pytest.mark.parametrize("rows", [1, 3, 32, 300])  # 300 x 512 crosses the kernel's OpenMP threshold
@pytest.mark.parametrize("hidden", [512, 576, 100, 7])  # multiples of 64 and 16, a ragged tail, tiny
def test_rms_norm_matches_torch(rows: int, hidden: int) -> None:
    norm = _norm(hidden, rows + hidden)
    x = torch.randn(rows, hidden) * 3
    got = elementwise_cpu.rms_norm(x, norm.weight.detach(), norm.eps)
    # The mean square is summed in another order than torch's: the last bit may differ.
    torch.testing.assert_close(got, norm(x), rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("rows", [1, 32, 300])
def test_fused_residual_add_updates_the_stream_and_normalises_the_sum(rows: int) -> None:
    norm = _norm(512, rows)
    x = torch.randn(rows, 512)
    residual = torch.randn(rows, 512)
    expected_stream = residual + x  # HF's order: hidden = residual + hidden
    got = elementwise_cpu.rms_norm(x, norm.weight.detach(), norm.eps, residual=residual)
    assert torch.equal(residual, expected_stream)  # one float32 add: bit for bit
    torch.testing.assert_close(got, norm(expected_stream), rtol=2e-6, atol=2e-6)


def test_rms_norm_of_strided_rows() -> None:
    # Rows of a wider tensor (a view with a row stride): read in place, result contiguous.
    norm = _norm(64, 0)
    wide = torch.randn(5, 200)
    x = wide[:, 10:74]
    got = elementwise_cpu.rms_norm(x, norm.weight.detach(), norm.eps)
    assert got.is_contiguous()
    torch.testing.assert_close(got, norm(x.contiguous()), rtol=2e-6, atol=2e-6)


def test_rms_norm_rejects_what_it_cannot_read() -> None:
    weight = torch.ones(8)
    with pytest.raises(ValueError, match="float32"):
        elementwise_cpu.rms_norm(torch.ones(2, 8, dtype=torch.float64), weight, 1e-6)
    with pytest.raises(ValueError, match=r"\[rows, 8\]"):
        elementwise_cpu.rms_norm(torch.ones(2, 9), weight, 1e-6)
    with pytest.raises(ValueError, match=r"\[rows, 8\]"):
        elementwise_cpu.rms_norm(torch.ones(8, 2).t(), weight, 1e-6)  # rows not contiguous
    with pytest.raises(ValueError, match="rows"):
        elementwise_cpu.rms_norm(torch.ones(2, 8), weight, 1e-6, residual=torch.ones(3, 8))


@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 4, 64), (3, 1, 36), (2, 2, 128)])
def test_rotary_is_bit_for_bit_the_torch_path(tokens: int, heads: int, kv_heads: int, head_dim: int) -> None:
    torch.manual_seed(tokens * head_dim)
    rotary = RotaryEmbedding(head_dim, {"rope_type": "default", "rope_theta": 10000.0})
    # q and k as views into one fused projection output, as the model has them (strided tokens).
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim) * 4
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    cos, sin = rotary.cos_sin(torch.randint(0, 4096, (tokens,)), torch.float32)
    expected_q, expected_k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
    v_before = qkv[:, (heads + kv_heads) * head_dim :].clone()
    elementwise_cpu.rotary_(q, k, cos, sin)
    assert torch.equal(q, expected_q) and torch.equal(k, expected_k)
    assert torch.equal(qkv[:, (heads + kv_heads) * head_dim :], v_before)  # the values are untouched


def test_rotary_rejects_mismatched_shapes() -> None:
    q, k = torch.zeros(2, 4, 8), torch.zeros(2, 2, 8)
    with pytest.raises(ValueError, match="share tokens"):
        elementwise_cpu.rotary_(q, torch.zeros(3, 2, 8), torch.zeros(2, 8), torch.zeros(2, 8))
    with pytest.raises(ValueError, match="cos/sin"):
        elementwise_cpu.rotary_(q, k, torch.zeros(2, 4), torch.zeros(2, 4))
    with pytest.raises(ValueError, match="float32"):
        elementwise_cpu.rotary_(q.double(), k, torch.zeros(2, 8), torch.zeros(2, 8))


# (4, 64): rows of whole 64-byte lines (the streaming stores); (3, 20): 240-byte rows (the plain copy).
@pytest.mark.parametrize(("kv_heads", "head_dim"), [(4, 64), (3, 20)])
@pytest.mark.parametrize("tokens", [1, 7, 300])  # 300 x 256 floats cross the kernel's OpenMP threshold
def test_write_kv_equals_index_copy(kv_heads: int, head_dim: int, tokens: int) -> None:
    torch.manual_seed(tokens + head_dim)
    heads, row = 2 * kv_heads, kv_heads * head_dim
    # k and v as views into one fused projection output, as the model has them (strided tokens).
    qkv = torch.randn(tokens, heads * head_dim + 2 * row)
    k = qkv[:, heads * head_dim : heads * head_dim + row].view(tokens, kv_heads, head_dim)
    v = qkv[:, heads * head_dim + row :].view(tokens, kv_heads, head_dim)
    slots = torch.randperm(1000)[:tokens]
    k_cache, v_cache = torch.randn(1000, kv_heads, head_dim), torch.randn(1000, kv_heads, head_dim)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    write_kv(expected_k, expected_v, k, v, slots)
    elementwise_cpu.write_kv(k_cache, v_cache, k, v, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)


def test_write_kv_refuses_a_slot_outside_the_cache_and_writes_nothing() -> None:
    k_cache, v_cache = torch.zeros(16, 2, 16), torch.zeros(16, 2, 16)
    k, v = torch.ones(3, 2, 16), torch.ones(3, 2, 16)
    for bad in (16, -1):
        with pytest.raises(ValueError, match="outside the cache's 16 slots"):
            elementwise_cpu.write_kv(k_cache, v_cache, k, v, torch.tensor([0, bad, 2]))
        assert not k_cache.any() and not v_cache.any()


def test_write_kv_rejects_what_it_cannot_read() -> None:
    cache = torch.zeros(16, 2, 16)
    k = torch.ones(3, 2, 16)
    slots = torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="float32"):
        elementwise_cpu.write_kv(cache, cache.clone(), k.double(), k, slots)
    with pytest.raises(ValueError, match="contiguous"):
        elementwise_cpu.write_kv(cache, cache.clone(), torch.ones(3, 16, 2).transpose(1, 2), k, slots)
    with pytest.raises(ValueError, match="int64"):
        elementwise_cpu.write_kv(cache, cache.clone(), k, k, slots.int())
    with pytest.raises(ValueError, match="contiguous float32"):
        elementwise_cpu.write_kv(cache[:, :1], cache.clone()[:, :1], k[:, :1], k[:, :1], slots)
