"""The KV cache sized from memory: bytes or a fraction of what the weights and activations leave."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from asyncllm import Engine, ModelLoadError
from asyncllm.executor._runner import SequenceInput
from asyncllm.sampling_params import SamplingParams
from asyncllm.testing.tiny_models import tiny_model_path
from asyncllm.worker import _memory
from asyncllm.worker._memory import (
    DEFAULT_CPU_CAP_BYTES,
    check_kv_cache_memory,
    cuda_memory,
    host_available_bytes,
    peak_resident_bytes,
    plan_kv_blocks,
    reset_peak_rss,
    resident_bytes,
    size_kv_cache,
)
from asyncllm.worker._model_runner import TorchModelRunner

# The tiny llama: 2 layers x (K and V) x 16 tokens x 2 KV heads x 16 dims x 4 bytes.
TINY_BYTES_PER_BLOCK = 2 * 2 * 16 * 2 * 16 * 4


def test_sizing_rules() -> None:
    common = {"available_bytes": 10 << 30, "activation_peak_bytes": 2 << 30, "bytes_per_block": 1 << 20}
    assert size_kv_cache(64 << 20, device_type="cpu", **common).num_blocks == 64
    assert size_kv_cache(0.5, device_type="cpu", **common).num_blocks == 4096  # half of the 8 GiB left
    assert size_kv_cache(None, device_type="cpu", **common).budget_bytes == min(2 << 30, DEFAULT_CPU_CAP_BYTES)
    assert size_kv_cache(0.5, device_type="cpu", max_blocks=100, **common).num_blocks == 100
    starved = {"available_bytes": 1 << 20, "activation_peak_bytes": 2 << 20, "bytes_per_block": 1 << 20}
    assert size_kv_cache(0.9, device_type="cpu", **starved).num_blocks == 1


# The plan on CUDA, by hand. Shapes: Llama-3-8B (32 layers, 8 KV heads of 128) and Llama-3-70B (80 layers,
# 8 KV heads of 128), bfloat16 (2 bytes), block size 16. One block holds K and V for 16 tokens in every layer:
#   8B:  2 * 32 * 16 * 8 * 128 * 2 = 2,097,152 bytes (2 MiB);   70B: 2 * 80 * 16 * 8 * 128 * 2 = 5,242,880 (5 MiB).
# Weights: 8,030,261,248 parameters * 2 = 16,060,522,496 bytes; 70,553,706,496 * 2 = 141,107,412,992 bytes.
# Measured figures assumed: 0.5 GiB outside torch (the CUDA context), a 1 GiB activation peak.
# Devices: an H200 as 141 GB = 141,000,000,000 bytes; a 24 GiB card = 25,769,803,776 bytes. Utilisation 0.9.
BLOCK_8B, BLOCK_70B = 2_097_152, 5_242_880
WEIGHTS_8B, WEIGHTS_70B = 16_060_522_496, 141_107_412_992
H200, CARD_24GB = 141_000_000_000, 24 << 30
MEASURED = {"non_torch_bytes": 512 << 20, "activation_peak_bytes": 1 << 30}


@pytest.mark.parametrize(
    ("total", "weights", "block", "expected"),
    [
        # 0.9 * 141e9 = 126,900,000,000; - 536,870,912 - 16,060,522,496 - 1,073,741,824 = 109,228,864,768
        # bytes for the cache; // 2,097,152 = 52,084 blocks (833,344 tokens).
        (H200, WEIGHTS_8B, BLOCK_8B, 52_084),
        # int(0.9 * 25,769,803,776) = 23,192,823,398; - 536,870,912 - 16,060,522,496 - 1,073,741,824
        # = 5,521,688,166; // 2,097,152 = 2,632 blocks (42,112 tokens).
        (CARD_24GB, WEIGHTS_8B, BLOCK_8B, 2_632),
    ],
)
def test_plan_on_cuda_shapes(total: int, weights: int, block: int, expected: int) -> None:
    plan = plan_kv_blocks(total_bytes=total, weight_bytes=weights, bytes_per_block=block, **MEASURED)
    assert plan == expected


@pytest.mark.parametrize("total", [H200, CARD_24GB])
def test_plan_refuses_a_model_that_does_not_fit(total: int) -> None:
    """70B in bfloat16 (141.1 GB of weights) fits neither device: 126.9 GB usable on the H200 at 0.9,
    23.2 GB on the 24 GiB card. The error names the figures."""
    with pytest.raises(ModelLoadError, match=r"does not fit: weights 131\.4 GiB"):
        plan_kv_blocks(total_bytes=total, weight_bytes=WEIGHTS_70B, bytes_per_block=BLOCK_70B, **MEASURED)


def test_plan_counts_each_figure_once() -> None:
    """Each input moves the plan by exactly its own bytes; utilisation scales the device alone."""
    base = {"total_bytes": H200, "weight_bytes": WEIGHTS_8B, "bytes_per_block": BLOCK_8B, **MEASURED}
    blocks = plan_kv_blocks(**base)
    for name in ("weight_bytes", "activation_peak_bytes", "non_torch_bytes"):
        assert plan_kv_blocks(**{**base, name: base[name] + 10 * BLOCK_8B}) == blocks - 10
    # 70,500,000,000 - 536,870,912 - 16,060,522,496 - 1,073,741,824 = 52,828,864,768 // 2,097,152 = 25,190
    assert plan_kv_blocks(**base, utilization=0.5) == 25_190


def test_cuda_memory_empties_the_cache_before_reading(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks torch caches after the probe are not "used": the cache is emptied before free memory is read."""
    calls: list[str] = []
    reserved = [30 << 30]  # 30 GiB reserved before empty_cache, 16 GiB after (the weights)

    def empty_cache() -> None:
        calls.append("empty_cache")
        reserved[0] = 16 << 30

    def mem_get_info(device: object = None) -> tuple[int, int]:
        calls.append("mem_get_info")
        return H200 - (1 << 30) - reserved[0], H200  # 1 GiB outside torch

    monkeypatch.setattr(torch.cuda, "empty_cache", empty_cache)
    monkeypatch.setattr(torch.cuda, "mem_get_info", mem_get_info)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved[0])
    assert cuda_memory(torch.device("cuda")) == (H200, 1 << 30)
    assert calls == ["empty_cache", "mem_get_info"]
    assert _memory.DEFAULT_CUDA_FRACTION == 0.9


@pytest.mark.parametrize("bad", [0, -5, 0.0, 1.5, "1GB", True])
def test_bad_kv_cache_memory_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="kv_cache_memory"):
        check_kv_cache_memory(bad)


def test_host_memory_probes() -> None:
    assert host_available_bytes() > 0
    if reset_peak_rss():
        assert peak_resident_bytes() > 0


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_engine_sizes_its_cache_from_memory(tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="asyncllm"):
        async with Engine.open(tiny_llama, device="cpu", kv_cache_memory=8 << 20) as engine:
            by_bytes = engine.statistics().kv_blocks_total
        async with Engine.open(tiny_llama, device="cpu", kv_cache_memory=0.0005) as engine:
            by_fraction = engine.statistics().kv_blocks_total
    assert by_bytes == (8 << 20) // TINY_BYTES_PER_BLOCK
    expected = 0.0005 * host_available_bytes() / TINY_BYTES_PER_BLOCK
    assert 0.5 * expected < by_fraction < 1.5 * expected
    assert any("max concurrency" in record.getMessage() for record in caplog.records)
    with pytest.raises(ValueError, match="kv_cache_memory"):
        Engine.open(tiny_llama, kv_cache_memory=2.0)


# A busy drafting step on a large vocabulary: 64 requests x (3 draft tokens + their newest) = 256 logit rows
# (max_num_batched_tokens), each row 40,000 float32 logits: 40,960,000 bytes per [rows, vocab] copy, above
# glibc's largest mmap threshold (32 MiB), so every copy is fresh resident memory that VmHWM sees.
SEQS, DRAFT, STEP_TOKENS, BIG_VOCAB = 64, 3, 256, 40_000
ROWS_BYTES = SEQS * (DRAFT + 1) * BIG_VOCAB * 4


def _drafting_step(runner: TorchModelRunner) -> int:
    """Run a full batch of drafting requests (random sampling with top_p); return its resident peak."""
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16)
    sequences = [
        SequenceInput(request_id=index, token_ids=[5] * (DRAFT + 1), start_position=1, block_table=[index],
                      sample=True, params=params, num_generated=1, prompt_token_ids=[5], num_draft=DRAFT)
        for index in range(SEQS)
    ]  # fmt: skip
    reset_peak_rss()
    baseline = resident_bytes()
    with torch.inference_mode():
        verified = runner._execute(sequences).result().verified
    assert verified is not None and len(verified) == SEQS
    return peak_resident_bytes() - baseline


def test_speculation_sizes_the_cache_for_its_verification_rows(tiny_cache: Path) -> None:
    """The sizing probe runs the busiest drafting step: its peak covers a real one, the same memory holds
    fewer KV blocks with speculation on (by at least one [rows, vocab] float32 copy), and a draft model's
    probe counts the distributions it keeps between steps."""
    if not reset_peak_rss():
        pytest.skip("the kernel does not let this process reset its resident high-water mark")
    model = tiny_model_path(tiny_cache, "llama", vocab_size=BIG_VOCAB)
    options = {"max_num_seqs": SEQS, "max_num_batched_tokens": STEP_TOKENS, "num_speculative_tokens": DRAFT}
    peaks: dict[str | None, int] = {}
    for method in (None, "ngram", "draft_model"):
        draft = {"speculative_model": str(model)} if method == "draft_model" else {}
        runner = TorchModelRunner(  # no prefault: its thread's pages would count in the step's peak
            model, device="cpu", kv_cache_memory=64 << 20, speculative_method=method, kv_cache_prefault=False,
            **options, **draft,
        )
        try:
            runner.load()
            assert runner.kv_sizing is not None
            peaks[method] = runner.kv_sizing.activation_peak_bytes
            if method == "ngram":
                step_peak = _drafting_step(runner)
        finally:
            runner.close()
    # The probe's peak covers the step's (loosely: the allocator's reuse differs from run to run).
    assert step_peak <= 1.25 * peaks["ngram"] + (8 << 20)
    assert peaks["ngram"] - peaks[None] >= ROWS_BYTES
    assert peaks["ngram"] < 20 * ROWS_BYTES  # a handful of copies, not a runaway reservation
    # A draft model's probe verifies the same rows (besides its proposals and the q they keep: small
    # [draft, vocab] tensors from the heap, whose pages the allocator may reuse, so the resident peak
    # cannot be relied on to show them; a clean-clone run measured the draft peak below the n-gram one).
    assert peaks["draft_model"] - peaks[None] >= ROWS_BYTES
    block = TINY_BYTES_PER_BLOCK
    common = {"device_type": "cpu", "available_bytes": 4 << 30, "bytes_per_block": block}
    plain = size_kv_cache(0.5, activation_peak_bytes=peaks[None], **common).num_blocks
    drafting = size_kv_cache(0.5, activation_peak_bytes=peaks["ngram"], **common).num_blocks
    assert plain - drafting >= 0.5 * ROWS_BYTES / block - 1
