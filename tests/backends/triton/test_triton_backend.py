"""The ``triton`` attention backend wired into the model: metadata, backend choice, engine parity.

On the CPU the kernels run in triton's interpreter (``TRITON_INTERPRET=1``, set by tests/conftest.py),
which is slow: the engine test keeps to two prompts and four tokens.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[gpu]')")

import anyio
import torch

from asyncllm import Engine, SamplingParams
from asyncllm.backends.triton._launchers import build_metadata
from asyncllm.executor._runner import SequenceInput
from asyncllm.testing.tiny_models import tiny_model_path
from asyncllm.worker._input_batch import step_inputs
from asyncllm.worker._model_runner import resolve_attention_backend

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")


def _seq(request_id: int, tokens: int, start: int, table: list[int]) -> SequenceInput:
    return SequenceInput(request_id, list(range(tokens)), start, table, True, SamplingParams())


def test_build_metadata_packs_the_batch() -> None:
    sequences = [_seq(0, 5, 0, [7]), _seq(1, 1, 16, [3, 9]), _seq(2, 3, 30, [1, 2, 4])]
    meta = build_metadata(step_inputs(sequences, 16), num_kv_heads=2, device=DEVICE, sliding_window=8)
    assert meta.query_start_loc.tolist() == [0, 5, 6, 9]
    assert meta.seq_lens.tolist() == [5, 17, 33]
    # Tables are 16 columns wide (zero past each row's blocks): the kernels' row stride stays a multiple of 16.
    assert meta.block_tables.tolist() == [row + [0] * (16 - len(row)) for row in ([7], [3, 9], [1, 2, 4])]
    assert meta.slot_mapping.tolist() == [7 * 16 + i for i in range(5)] + [9 * 16] + [2 * 16 + 14, 2 * 16 + 15, 4 * 16]
    assert all(t.dtype == torch.int32 for t in (meta.query_start_loc, meta.seq_lens, meta.block_tables))
    assert (meta.max_query_len, meta.max_seq_len, meta.sliding_window) == (5, 33, 8)
    assert meta.num_kv_splits == 1  # never split on the CPU unless asked


def test_backend_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu = torch.device("cpu")
    assert resolve_attention_backend("auto", cpu) == "torch"
    assert resolve_attention_backend("torch", cpu) == "torch"
    with pytest.raises(ValueError, match="attention_backend"):
        resolve_attention_backend("flash", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        resolve_attention_backend("triton", cpu)
    with pytest.raises(ValueError, match="attention_backend"):
        Engine.open(attention_backend="flash")


@pytest.fixture(scope="module")
def tiny_qwen3(tiny_cache: Path) -> Path:
    # head_dim 64 (a kernel size the model really uses), GQA 2, q/k RMSNorm.
    return tiny_model_path(tiny_cache, "qwen3", hidden_size=128, num_heads=4, num_kv_heads=2, head_dim=64)


async def _greedy(model: Path, backend: str, prompts: list[list[int]]) -> list[tuple[int, ...]]:
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    # block_size 4 so prompts span several blocks; max_num_batched_tokens 8 so the longer prompt is
    # prefilled in chunks with cached context and the batch mixes prefill and decode rows.
    async with Engine.open(
        model, device=str(DEVICE), dtype="float32", kv_cache_blocks=32, block_size=4, max_num_batched_tokens=8,
        attention_backend=backend,
    ) as engine:  # fmt: skip
        assert f"{backend} attention" in engine._info.description  # type: ignore[union-attr]
        out: list[tuple[int, ...]] = [() for _ in prompts]

        async def one(index: int) -> None:
            out[index] = (await engine.generate(prompts[index], params)).token_ids

        async with anyio.create_task_group() as tg:  # concurrent: steps mix prefill chunks and decodes
            for index in range(len(prompts)):
                tg.start_soon(one, index)
        return out


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("family", ["llama", "qwen3"])
async def test_engine_greedy_tokens_match_torch_backend(
    anyio_backend: str, family: str, tiny_llama: Path, tiny_qwen3: Path
) -> None:
    model = tiny_llama if family == "llama" else tiny_qwen3
    prompts = [[5, 17, 33, 2, 90, 41, 7, 8, 9, 10, 11], [300, 4, 4]]
    expected = await _greedy(model, "torch", prompts)
    assert await _greedy(model, "triton", prompts) == expected
