"""The CUDA-graph decode path: padded static inputs give the same hidden states as an eager step.

Without CUDA, ``DecodeGraphs(use_graphs=False)`` runs exactly the padded static-buffer path a graph
replays (padding rows, slot -1, shared block-table buffer), eagerly, with the triton kernels in the
interpreter. With CUDA the graphs are captured and replayed for real.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[gpu]')")

import torch

from asyncllm import SamplingParams
from asyncllm.executor._runner import SequenceInput
from asyncllm.testing.tiny_models import tiny_model_path
from asyncllm.worker._graphs import DecodeGraphs, capture_sizes
from asyncllm.worker._input_batch import step_inputs
from asyncllm.worker._model_runner import TorchModelRunner

GPU = torch.cuda.is_available()
BLOCK = 4


def test_capture_sizes() -> None:
    assert capture_sizes(1) == [1]
    assert capture_sizes(6) == [1, 2, 4, 6]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes(256)[-3:] == [240, 248, 256]


def _seq(rid: int, tokens: list[int], start: int, table: list[int]) -> SequenceInput:
    return SequenceInput(rid, tokens, start, table, True, SamplingParams())


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_padded_decode_matches_eager_forward(family: str, tiny_llama: Path, tiny_cache: Path) -> None:
    # qwen3_moe: the fused-MoE kernels read nothing back to the host, so MoE decodes replay graphs too;
    # its padding rows are routed like real ones, and their outputs dropped.
    model = tiny_llama if family == "llama" else tiny_model_path(tiny_cache, family)
    runner = TorchModelRunner(
        model, device="cuda" if GPU else "cpu", dtype="float32", block_size=BLOCK, kv_cache_blocks=24,
        attention_backend="triton", enforce_eager=True,
    )  # fmt: skip
    runner.load()
    assert runner.model is not None
    tables = [[3, 7, 1], [0, 5], [9, 2, 11, 4]]
    prompts = [[11, 12, 13, 14, 15, 16, 17, 18, 19], [40, 41, 42, 43, 44], [70 + i for i in range(13)]]
    with torch.inference_mode():
        prefill = [_seq(i, p, 0, t) for i, (p, t) in enumerate(zip(prompts, tables))]
        runner._forward(step_inputs(prefill, BLOCK))
        decode = [_seq(i, [100 + i], len(p), t) for i, (p, t) in enumerate(zip(prompts, tables))]
        step = step_inputs(decode, BLOCK)
        eager = runner._forward(step).clone()
        graphs = DecodeGraphs(
            runner.model, runner.kv_caches, block_size=BLOCK, max_seq_len=64, max_batch=4,
            device=runner.device, split_kv={4: 2}, use_graphs=GPU,
        )  # fmt: skip
        graphs.capture()
        before = [t.clone() for pair in runner.kv_caches for t in pair]
        assert graphs.fits(step) and not graphs.fits(step_inputs(prefill, BLOCK))
        # Padded from 3 rows to 4; the same slots are rewritten with the same K/V.
        padded = graphs.run(step)
        torch.testing.assert_close(padded, eager, atol=1e-5, rtol=1e-5)
        # The split-KV variant of the same size, then a smaller batch in the same buffers.
        torch.testing.assert_close(graphs.run(step, splits=8), eager, atol=1e-5, rtol=1e-5)
        one = graphs.run(step_inputs(decode[1:2], BLOCK))
        torch.testing.assert_close(one, eager[1:2], atol=1e-5, rtol=1e-5)
        # Padding rows (slot -1) wrote nothing: block 0, which request 1 owns, is intact, and the
        # real rows rewrote their slots with the same K/V.
        for old, new in zip(before, (t for pair in runner.kv_caches for t in pair)):
            torch.testing.assert_close(new, old, atol=1e-5, rtol=1e-5)
    runner.close()


def test_padded_decode_carries_longrope_flags(tiny_cache: Path) -> None:
    # A LongRoPE model's graphs take each row's long-frequency flag in their static inputs: the padded
    # path equals the eager step with the same flags, and the flags change the result.
    from asyncllm.testing.tiny_models import tiny_model_path

    model_dir = tiny_model_path(tiny_cache, "phi3", rope_scaling="longrope")
    runner = TorchModelRunner(
        model_dir, device="cuda" if GPU else "cpu", dtype="float32", block_size=BLOCK, kv_cache_blocks=16,
        attention_backend="triton", enforce_eager=True,
    )  # fmt: skip
    runner.load()
    assert runner.model is not None
    tables = [[3, 7], [0, 5]]
    prompts = [[11, 12, 13, 14, 15], [40, 41, 42]]
    longs = [True, False]

    def seq(rid: int, tokens: list[int], start: int, long: bool) -> SequenceInput:
        return SequenceInput(rid, tokens, start, tables[rid], True, SamplingParams(), long_rope=long)

    with torch.inference_mode():
        runner._forward(step_inputs([seq(i, p, 0, longs[i]) for i, p in enumerate(prompts)], BLOCK))
        decode = [seq(i, [100 + i], len(p), longs[i]) for i, p in enumerate(prompts)]
        step = step_inputs(decode, BLOCK)
        assert step.long_rope is not None and step.long_rope.tolist() == longs
        eager = runner._forward(step).clone()
        graphs = DecodeGraphs(
            runner.model, runner.kv_caches, block_size=BLOCK, max_seq_len=32, max_batch=4,
            device=runner.device, use_graphs=GPU,
        )  # fmt: skip
        graphs.capture()
        torch.testing.assert_close(graphs.run(step), eager, atol=1e-5, rtol=1e-5)
        short = step_inputs([seq(0, [100], len(prompts[0]), False)], BLOCK)
        assert short.long_rope is None
        assert not torch.allclose(graphs.run(short), eager[:1], atol=1e-3)
    runner.close()
