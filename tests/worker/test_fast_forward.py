"""The fast CPU forward: fused projections, the cpu attention backend, ``compile=True``.

Each speed-up must leave the numbers alone: the cpu attention matches the torch reference on
ragged mixed batches, fused projections give the same hidden states, and greedy outputs stay
token for token those of transformers with every combination.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from functools import cache
from pathlib import Path
from types import ModuleType

import anyio
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

from asyncllm import Engine, SamplingParams
from asyncllm.backends import resolve_attention_backend
from asyncllm.backends.cpu import _attention as attention_cpu
from asyncllm.backends.torch._attention import SHORT_CHUNK_TOKENS, paged_attention, write_kv
from asyncllm.backends.torch._attention import build_metadata as _attention_metadata
from asyncllm.executor._runner import SequenceInput, StepBatch
from asyncllm.testing.tiny_models import tiny_model_path
from asyncllm.worker._input_batch import step_inputs
from asyncllm.worker._model_runner import TorchModelRunner

needs_kernel = pytest.mark.skipif(
    not attention_cpu.native_decode_available(64), reason="no C compiler: the cpu attention kernel is unavailable"
)

PROMPTS = ([5, 17, 42, 99, 7, 300, 12, 8, 64, 1, 250], [77, 3, 19])
MAX_NEW_TOKENS = 8


# -- the cpu attention backend against the reference ------------------------------------------------


def _ragged_batch(rng: random.Random, block_size: int, num_blocks: int) -> list[SequenceInput]:
    """Decodes and prefill chunks (fresh and with history), contexts on and beside block boundaries."""
    free = list(range(num_blocks))
    rng.shuffle(free)
    shapes = [
        (0, 1),  # a one-token prompt: a decode-shaped first step
        (block_size - 1, 1),  # decode filling a block's last slot
        (block_size, 1),  # decode opening a new block
        (3 * block_size + 5, 1),
        (rng.randint(1, 6 * block_size), 1),
        (0, block_size),  # fresh prefill of exactly one block
        (0, 2 * block_size + 3),
        (block_size + 1, 7),  # chunked prefill with cached history
        (2 * block_size, block_size),
        (rng.randint(1, 40), rng.randint(2, 20)),
        (block_size + 3, SHORT_CHUNK_TOKENS + 2),  # with history, too long to be attended as decodes
    ]
    rng.shuffle(shapes)
    sequences = []
    for request_id, (start, num_new) in enumerate(shapes):
        blocks = -(-(start + num_new) // block_size)
        table = [free.pop() for _ in range(blocks)]
        sequences.append(SequenceInput(request_id, [3] * num_new, start, table, True, SamplingParams()))
    return sequences


@needs_kernel
@pytest.mark.parametrize("sliding_window", [None, 5, 19])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 4, 64), (4, 4, 16), (6, 2, 24), (3, 1, 36)])
@pytest.mark.parametrize("seed", [0, 1])
def test_cpu_attention_matches_reference(
    seed: int, heads: int, kv_heads: int, head_dim: int, sliding_window: int | None
) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    block_size, num_blocks = 4, 256
    sequences = _ragged_batch(rng, block_size, num_blocks)
    step = step_inputs(sequences, block_size)
    tokens = step.num_tokens
    q = torch.randn(tokens, heads, head_dim)
    k = torch.randn(tokens, kv_heads, head_dim)
    v = torch.randn(tokens, kv_heads, head_dim)
    k_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim)
    v_cache = torch.randn(num_blocks * block_size, kv_heads, head_dim)
    reference_meta = _attention_metadata(step, sliding_window, torch.device("cpu"))
    write_kv(k_cache, v_cache, k, v, reference_meta.slot_mapping)
    expected = paged_attention(q, k_cache, v_cache, reference_meta, head_dim**-0.5)

    meta = attention_cpu.build_metadata(step, sliding_window=sliding_window)
    # Short chunks with history (a speculative draft's shape) are attended as one decode per token.
    short = [s for s in sequences if 1 < len(s.token_ids) <= SHORT_CHUNK_TOKENS and s.start_position > 0]
    assert short
    assert meta.decode_rows.numel() == sum(len(s.token_ids) == 1 for s in sequences) + sum(
        len(s.token_ids) for s in short
    )
    assert any(c.kv_slots is None for c in meta.prefills) and any(c.kv_slots is not None for c in meta.prefills)
    got = attention_cpu.paged_attention(q, k, v, k_cache, v_cache, meta, head_dim**-0.5)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)


@needs_kernel
@pytest.mark.parametrize("query_scale", [1.0, 30.0])
def test_cpu_attention_long_contexts_many_sequences(query_scale: float) -> None:
    # Batches above and below the kernel's split threshold (sequences vs sequences x KV heads). Scaled-up
    # queries give peaked softmaxes whose maximum moves from block to block: the online softmax's
    # rescaling of what it accumulated must be exact, and exponentials far below the maximum vanish.
    torch.manual_seed(0)
    block_size, heads, kv_heads, head_dim = 16, 8, 4, 64
    for batch in (1, 3, 40):
        rng = random.Random(batch)
        blocks = list(range(batch * 40))
        rng.shuffle(blocks)
        sequences = [
            SequenceInput(i, [3], (length := rng.randint(1, 600)) - 1, blocks[i * 40 : i * 40 + -(-length // 16)], True,
                          SamplingParams())
            for i in range(batch)
        ]  # fmt: skip
        step = step_inputs(sequences, block_size)
        q = torch.randn(step.num_tokens, heads, head_dim) * query_scale
        k_cache = torch.randn(len(blocks) * block_size, kv_heads, head_dim)
        v_cache = torch.randn(len(blocks) * block_size, kv_heads, head_dim)
        reference_meta = _attention_metadata(step, None, torch.device("cpu"))
        expected = paged_attention(q, k_cache, v_cache, reference_meta, 0.125)
        meta = attention_cpu.build_metadata(step, sliding_window=None)
        got = attention_cpu.paged_attention(q, q[:, :kv_heads], q[:, :kv_heads], k_cache, v_cache, meta, 0.125)
        torch.testing.assert_close(got, expected, atol=1e-5 * query_scale, rtol=0)


def test_cpu_kernel_needs_a_head_dim_divisible_by_four() -> None:
    assert not attention_cpu.native_decode_available(18)  # its vectors are 4, 8 or 16 floats wide


def test_attention_backend_resolution() -> None:
    cpu = torch.device("cpu")
    assert resolve_attention_backend("auto", cpu) == "torch"
    assert resolve_attention_backend("auto", cpu, cpu_kernel=True) == "cpu"
    assert resolve_attention_backend("cpu", cpu) == "cpu"
    with pytest.raises(ValueError, match="attention_backend"):
        resolve_attention_backend("cpu", torch.device("cuda"))


# -- fused projections -------------------------------------------------------------------------------


def _run(runner: TorchModelRunner, sequences: list[SequenceInput]) -> torch.Tensor:
    with torch.inference_mode():
        return runner._forward(step_inputs(sequences, runner.block_size))


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_fused_projections_same_hidden_states(tiny_cache: Path, family: str) -> None:
    # qwen2 has q/k/v biases, qwen3 q/k norms and a decoupled head_dim: both go through the fusion.
    model_dir = tiny_model_path(tiny_cache, family)
    runners = {}
    for fused in (False, True):
        runner = TorchModelRunner(model_dir, device="cpu", kv_cache_blocks=16, fuse_projections=fused)
        runner.load()
        runners[fused] = runner
    fused_model = runners[True].model
    assert fused_model is not None
    names = set(fused_model.state_dict())
    assert "model.layers.0.self_attn.qkv_proj.weight" in names and "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any(n.endswith((".q_proj.weight", ".gate_proj.weight", ".up_proj.weight")) for n in names)
    sequences = [
        SequenceInput(0, [5, 6, 7, 8, 9], 0, [0, 1], True, SamplingParams()),
        SequenceInput(1, [11, 12], 0, [2], True, SamplingParams()),
    ]
    hidden = {fused: _run(runner, sequences) for fused, runner in runners.items()}
    torch.testing.assert_close(hidden[True], hidden[False], atol=1e-5, rtol=1e-5)


# -- greedy outputs, end to end ------------------------------------------------------------------------


@cache
def _hf_greedy(model_dir: Path) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    outputs = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW_TOKENS, do_sample=False
            )
            outputs.append(out[0, len(prompt) :].tolist())
    return outputs


def _greedy_with_runner(runner: TorchModelRunner, prompts: Sequence[Sequence[int]]) -> list[list[int]]:
    """Greedy decoding of ``prompts`` in one batch straight through ``execute`` (prefill, then decodes)."""
    runner.load()
    try:
        tables = [list(range(i * 8, i * 8 + 8)) for i in range(len(prompts))]
        params = SamplingParams(temperature=0.0)
        sequences = [SequenceInput(i, list(p), 0, tables[i], True, params) for i, p in enumerate(prompts)]
        outputs: list[list[int]] = [[] for _ in prompts]
        for _ in range(MAX_NEW_TOKENS):
            sampled = runner.execute(StepBatch(sequences, [])).sampled_token_ids
            for out, token in zip(outputs, sampled):
                out.append(token)
            sequences = [
                SequenceInput(i, [outputs[i][-1]], len(prompts[i]) + len(outputs[i]) - 1, tables[i], True, params)
                for i in range(len(prompts))
            ]
        return outputs
    finally:
        runner.close()


@needs_kernel
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_eager_fast_path_matches_transformers(tiny_cache: Path, family: str) -> None:
    model_dir = tiny_model_path(tiny_cache, family)
    runner = TorchModelRunner(model_dir, device="cpu", kv_cache_blocks=32)  # the defaults: eager, fast
    assert _greedy_with_runner(runner, PROMPTS) == _hf_greedy(model_dir)
    assert runner.attention_backend == "cpu" and runner.switches.fuse_projections and not runner.options.compile


def test_fused_projections_with_reference_attention_match_transformers(tiny_cache: Path) -> None:
    model_dir = tiny_model_path(tiny_cache, "qwen2")
    runner = TorchModelRunner(model_dir, device="cpu", kv_cache_blocks=32, attention_backend="torch")
    assert _greedy_with_runner(runner, PROMPTS) == _hf_greedy(model_dir)
    assert runner.attention_backend == "torch"


def test_auto_falls_back_to_torch_attention_without_the_kernel(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(attention_cpu, "native_decode_available", lambda head_dim: False)
    runner = TorchModelRunner(tiny_llama, device="cpu", kv_cache_blocks=32)
    assert _greedy_with_runner(runner, PROMPTS) == _hf_greedy(tiny_llama)
    assert runner.attention_backend == "torch"


# torch.compile of the tiny model: about 30 s with a cold inductor cache on 2 busy cores, 6 s warm.
@needs_kernel
def test_compiled_matches_eager_and_transformers(tiny_cache: Path) -> None:
    model_dir = tiny_model_path(tiny_cache, "llama")
    expected = _hf_greedy(model_dir)
    eager = TorchModelRunner(model_dir, device="cpu", kv_cache_blocks=32)
    compiled = TorchModelRunner(model_dir, device="cpu", kv_cache_blocks=32, compile=True)
    assert _greedy_with_runner(eager, PROMPTS) == expected
    assert _greedy_with_runner(compiled, PROMPTS) == expected
    assert compiled.attention_backend == "cpu" and compiled.compile_seconds > 0
    # the compiled graphs call the packed weights (the asyncllm::packed_linear operator)
    assert compiled.num_packed_layers == eager.num_packed_layers > 0


def test_metadata_of_decode_only_and_prefill_only_steps() -> None:
    only_prefill = [SequenceInput(0, [1, 2, 3], 0, [0], True, SamplingParams())]
    meta = attention_cpu.build_metadata(step_inputs(only_prefill, 4), sliding_window=None)
    assert meta.decode_rows.numel() == 0 and meta.decode_seq_lens.numel() == 0 and len(meta.prefills) == 1
    only_decode = [SequenceInput(0, [1], 6, [3, 1], True, SamplingParams())]
    meta = attention_cpu.build_metadata(step_inputs(only_decode, 4), sliding_window=None)
    assert meta.decode_block_tables.tolist() == [[3, 1]] and meta.decode_seq_lens.tolist() == [7]
    assert meta.prefills == ()


# -- the engine switch ---------------------------------------------------------------------------------


async def _engine_greedy(engine: Engine) -> list[list[int]]:
    results: list[list[int]] = [[] for _ in PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)

    async def one(index: int) -> None:
        results[index] = list((await engine.generate(list(PROMPTS[index]), params)).token_ids)

    async with anyio.create_task_group() as tg:
        for index in range(len(PROMPTS)):
            tg.start_soon(one, index)
    return results


@needs_kernel
@pytest.mark.anyio
async def test_engine_default_cpu_path_matches_transformers(tiny_llama: Path) -> None:
    async with Engine.open(tiny_llama, device="cpu", kv_cache_blocks=64) as engine:
        got = await _engine_greedy(engine)
        description = engine._info.description if engine._info else ""
    assert got == _hf_greedy(tiny_llama)
    assert "cpu attention" in description and "eager" in description


@needs_kernel
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_engine_compile_matches_transformers(tiny_llama: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("INFO", logger="asyncllm"):
        async with Engine.open(tiny_llama, device="cpu", kv_cache_blocks=64, compile=True) as engine:
            got = await _engine_greedy(engine)
            description = engine._info.description if engine._info else ""
    assert got == _hf_greedy(tiny_llama)
    assert "compiled" in description
    assert any("compiling" in r.getMessage() and "(once; cached" in r.getMessage() for r in caplog.records)


def test_engine_options_of_the_fast_path() -> None:
    Engine.open(attention_backend="cpu", compile=True)  # accepted (nothing starts before `async with`)
    with pytest.raises(ValueError, match="compile"):
        Engine.open(compile="yes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="attention_backend"):
        Engine.open(attention_backend="flash")
    with pytest.raises(ValueError, match="num_threads"):
        Engine.open(num_threads=0)


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_engine_num_threads_reaches_the_runner(tiny_llama: Path) -> None:
    async with Engine.open(tiny_llama, device="cpu", kv_cache_blocks=16, num_threads=1) as engine:
        description = engine._info.description if engine._info else ""
    assert "1 threads" in description


def test_thread_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    from asyncllm.worker._cpu_threads import configure_cpu_threads
    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(16)))
        assert configure_cpu_threads(None) == 15 == torch.get_num_threads()  # one core left to the loop
        monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3})
        assert configure_cpu_threads(None) == 4 == torch.get_num_threads()  # few cores: all of them
        assert configure_cpu_threads(2) == 2 == torch.get_num_threads()
        monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0})
        assert configure_cpu_threads(None) == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "4")
        assert configure_cpu_threads(None) == torch.get_num_threads() == 1  # the env's choice is left alone
    finally:
        torch.set_num_threads(before)


def test_forward_benchmark_quick(
    tiny_llama: Path,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    load_benchmark: Callable[[str], ModuleType],
) -> None:
    import json

    module = load_benchmark("forward")
    out_json = tmp_path / "forward.json"
    variants = "eager,+fused,+attention,+lean"
    argv = ["--quick", "--model", str(tiny_llama), "--variants", variants, "--json", str(out_json)]
    assert module.main(argv) == 0
    out = capsys.readouterr().out
    assert "| eager ms | +fused ms | +attention ms | +lean ms |" in out and "| decode b4 ctx64 " in out
    results = json.loads(out_json.read_text())["results"]
    assert all(all(ms > 0 for ms in step["ms_per_step"].values()) for step in results.values())


def _count_prefill_kernel_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The head sizes the attention asks its prefill kernel for, call by call, from now on."""
    calls: list[int] = []
    kernel = attention_cpu._prefill_kernel

    def counting(dim: int, kv_dtype: torch.dtype = torch.float32) -> object:
        calls.append(dim)
        return kernel(dim, kv_dtype)

    monkeypatch.setattr(attention_cpu, "_prefill_kernel", counting)
    return calls


@needs_kernel
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 4, 64), (6, 2, 24), (3, 1, 36)])
def test_cpu_prefill_kernel_matches_causal_sdpa(
    heads: int, kv_heads: int, head_dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Fresh prompts of lengths on and beside the kernel's 4/8/16-query tiles, in one step, with keys and
    # values as strided views into a fused projection (as the model passes them) and peaked softmaxes.
    torch.manual_seed(head_dim)
    lengths = [1, 3, 15, 16, 17, 100, 300]
    tokens = sum(lengths)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim) * 3
    q = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    block_size, free = 16, list(range(64))
    sequences = []
    for request_id, length in enumerate(lengths):
        table = [free.pop() for _ in range(-(-length // block_size))]
        sequences.append(SequenceInput(request_id, [3] * length, 0, table, True, SamplingParams()))
    meta = attention_cpu.build_metadata(step_inputs(sequences, block_size), sliding_window=None)
    calls = _count_prefill_kernel_calls(monkeypatch)
    k_cache, v_cache = (torch.zeros(64 * block_size, kv_heads, head_dim) for _ in range(2))
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)  # the one-token prompt is decode-shaped: it reads these
    got = attention_cpu.paged_attention(q, k, v, k_cache, v_cache, meta, head_dim**-0.5)
    assert calls == [head_dim]  # one call for every longer prompt of the step
    start = 0
    for length in lengths:
        rows = slice(start, start + length)
        expected = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1), k[rows].transpose(0, 1), v[rows].transpose(0, 1),
            is_causal=True, scale=head_dim**-0.5, enable_gqa=True,
        ).transpose(0, 1)  # fmt: skip
        torch.testing.assert_close(got[rows], expected, atol=5e-5, rtol=1e-5)
        start += length


@needs_kernel
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(8, 4, 64), (9, 3, 64), (6, 2, 24)])
def test_cpu_prefill_kernel_reads_cached_history(
    heads: int, kv_heads: int, head_dim: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Chunks after cached history (prefix hits, later chunks of a chunked prefill), beside fresh prompts and a
    # decode, in one step: histories on and off the tile and block boundaries, shuffled block tables. Each
    # chunk's output equals SDPA over its whole context with the causal offset.
    torch.manual_seed(heads + head_dim)
    block_size = 16
    cases = [(0, 17), (26, 34), (16, 5), (33, 1), (7, 40), (100, 64), (0, 3)]  # (history, new tokens)
    free = list(range(128))
    random.Random(head_dim).shuffle(free)
    k_cache, v_cache = (torch.randn(128 * block_size, kv_heads, head_dim) for _ in range(2))
    tokens = sum(new for _, new in cases)
    q = torch.randn(tokens, heads, head_dim) * 3
    k, v = torch.randn(tokens, kv_heads, head_dim), torch.randn(tokens, kv_heads, head_dim)
    sequences = []
    for request_id, (history, new) in enumerate(cases):
        table = [free.pop() for _ in range(-(-(history + new) // block_size))]
        sequences.append(SequenceInput(request_id, [3] * new, history, table, True, SamplingParams()))
    meta = attention_cpu.build_metadata(step_inputs(sequences, block_size), sliding_window=None)
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    calls = _count_prefill_kernel_calls(monkeypatch)
    monkeypatch.setattr(attention_cpu, "reference_sdpa", None)  # no chunk may fall back to SDPA
    got = attention_cpu.paged_attention(q, k, v, k_cache, v_cache, meta, head_dim**-0.5)
    assert calls == [head_dim]
    start = 0
    for seq, (history, new) in zip(sequences, cases, strict=True):
        rows = slice(start, start + new)
        positions = torch.arange(history + new)
        slots = torch.tensor(seq.block_table)[positions // block_size] * block_size + positions % block_size
        keys, values = k_cache[slots].transpose(0, 1), v_cache[slots].transpose(0, 1)
        mask = positions[None, :] <= (history + torch.arange(new))[:, None]
        expected = F.scaled_dot_product_attention(
            q[rows].transpose(0, 1), keys, values, attn_mask=mask, scale=head_dim**-0.5, enable_gqa=True
        ).transpose(0, 1)
        torch.testing.assert_close(got[rows], expected, atol=5e-5, rtol=1e-5)
        start += new


@needs_kernel
def test_cpu_attention_rejects_what_its_kernels_cannot_read() -> None:
    sequences = [SequenceInput(0, [3], 4, [0], True, SamplingParams())]
    meta = attention_cpu.build_metadata(step_inputs(sequences, 16), sliding_window=None)
    q, kv = torch.randn(1, 8, 64), torch.randn(1, 4, 64)
    cache = torch.randn(16, 4, 64)
    with pytest.raises(ValueError, match="float32"):
        attention_cpu.paged_attention(q.bfloat16(), kv, kv, cache, cache, meta, 0.125)
    with pytest.raises(ValueError, match="contiguous"):
        strided = torch.randn(16, 64, 4).transpose(1, 2)
        attention_cpu.paged_attention(q, kv, kv, strided, strided, meta, 0.125)
    with pytest.raises(ValueError, match="do not agree"):
        attention_cpu.paged_attention(torch.randn(1, 8, 32), kv, kv, cache, cache, meta, 0.125)
