"""Gemma 2 and 3 with a sliding group: the sliding layers' KV blocks leave with the window, token-exact.

A hybrid model's sliding layers keep their KV in a pool of their own
(``RunnerInfo.sliding_group``), sized for the requests' windows, and its blocks go back to that pool
as positions leave the window; the global layers keep every block. The tests run requests longer
than the whole sliding pool holds, so they complete only if its blocks are freed and reused, and
compare every token with transformers (greedy, float32), with chunked prefill, prefix-cache hits and
preemption, on the torch and cpu backends, and on triton (in the interpreter: a narrower gemma2, its
attention soft-capped in the kernels, fewer tokens) with its decode steps run from the CUDA graphs'
static buffers of both tables.
"""

from __future__ import annotations

import random
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from asyncllm import Engine, SamplingParams
from asyncllm.executor._runner import StepBatch
from asyncllm.testing.parity import stream_all, transformers_greedy
from asyncllm.testing.tiny_models import tiny_model_path
from asyncllm.worker._memory import split_hybrid_blocks

pytestmark = pytest.mark.anyio

MODELS = {"gemma2": {"num_layers": 4}, "gemma3": {"num_layers": 6}}
MAX_NEW_TOKENS = 40
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
# Two requests of a step, chunks of 8, blocks of 4, a window of 8 (the tiny configs'): the sliding pool
# gets 2 * (ceil(7 / 4) + 2) + 2 * 2 = 12 blocks, 48 tokens, less than one request's 75.
BACKENDS = ("torch", "cpu")
OPTIONS = {"block_size": 4, "max_num_seqs": 2, "max_num_batched_tokens": 8, "kv_cache_blocks": 40}


@cache
def _model_dir(cache_root: str, family: str) -> Path:
    return tiny_model_path(cache_root, family, **MODELS[family])


def _prompts(vocab_size: int, lengths: tuple[int, ...], seed: int = 7) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.choice(range(3, vocab_size)) for _ in range(n)] for n in lengths]


def test_the_split_turns_the_window_into_global_blocks() -> None:
    # 40 blocks of 6 layers (5 sliding): the sliding pool needs 12, so the global layers get
    # (40 * 6 - 12 * 5) / 1 = 180 blocks, 4.5 times the tokens.
    split = split_hybrid_blocks(
        40, num_global_layers=1, num_sliding_layers=5, sliding_window=8, block_size=4, max_num_seqs=2,
        max_num_batched_tokens=8,
    )  # fmt: skip
    assert split == (180, 12)
    # Never more sliding blocks than global ones: a small cache stays as it was.
    assert split_hybrid_blocks(
        10, num_global_layers=1, num_sliding_layers=5, sliding_window=8, block_size=4, max_num_seqs=2,
        max_num_batched_tokens=8,
    ) == (10, 10)  # fmt: skip
    with pytest.raises(ValueError, match="positive"):
        split_hybrid_blocks(
            10, num_global_layers=0, num_sliding_layers=5, sliding_window=8, block_size=4, max_num_seqs=2,
            max_num_batched_tokens=8,
        )  # fmt: skip


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", sorted(MODELS))
async def test_sliding_blocks_leave_with_the_window_token_exact(tiny_cache: Path, family: str, backend: str) -> None:
    model_dir = _model_dir(str(tiny_cache), family)
    async with Engine.open(model_dir, device="cpu", attention_backend=backend, **OPTIONS) as engine:
        info = engine._info
        assert info is not None and info.sliding_group is not None
        window, sliding_blocks = info.sliding_group
        num_layers = MODELS[family]["num_layers"]
        num_sliding = num_layers // 2 if family == "gemma2" else num_layers - 1
        assert (window, sliding_blocks) == (8, 12)
        assert info.num_kv_blocks == (40 * num_layers - 12 * num_sliding) // (num_layers - num_sliding)
        prompts = _prompts(info.vocab_size, (35, 30, 13))
        got = await stream_all(engine, prompts, GREEDY)
        # A conversation's next turn: its prompt is the last one and its answer (75 tokens, 18 of them
        # computed in full blocks) and more. The hit must hold in both groups: every block in the global
        # pool, those of the window at position 72 in the sliding pool, freed when the turn ended.
        turn = _prompts(info.vocab_size, (35,), seed=11)
        (answer,) = await stream_all(engine, turn, GREEDY)
        follow_up = [[*turn[0], *answer, 5, 6]]
        before = engine.statistics().prefix_cache_hits
        got_follow_up = await stream_all(engine, follow_up, GREEDY)
        stats = engine.statistics()
        assert engine._core is not None
        kv = engine._core.scheduler.kv_cache
        assert kv.sliding is not None
        freed = kv.sliding.num_window_freed_blocks
        sliding_free = kv.sliding.num_free_blocks
    # 75 tokens are 19 blocks: more than the sliding pool's 12, so they were freed and reused.
    assert freed >= 19 - 12
    assert stats.prefix_cache_hits - before == 72
    assert sliding_free == sliding_blocks and stats.kv_blocks_free == stats.kv_blocks_total
    assert got == transformers_greedy(model_dir, tuple(map(tuple, prompts)), MAX_NEW_TOKENS)
    assert [answer] == transformers_greedy(model_dir, tuple(map(tuple, turn)), MAX_NEW_TOKENS)
    assert got_follow_up == transformers_greedy(model_dir, tuple(map(tuple, follow_up)), MAX_NEW_TOKENS)


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize("backend", BACKENDS)
async def test_preemption_with_a_sliding_group_is_token_exact(tiny_cache: Path, backend: str) -> None:
    # 22 whole-model blocks: the sliding pool gets its need, 4 * (ceil(7 / 4) + 2) + 2 * 2 = 20 blocks,
    # the global one (22 * 6 - 20 * 5) / 1 = 32, 128 tokens, fewer than four requests' 264: requests are
    # preempted and recomputed.
    model_dir = _model_dir(str(tiny_cache), "gemma3")
    options = {**OPTIONS, "kv_cache_blocks": 22, "max_num_seqs": 4, "enable_prefix_caching": False}
    async with Engine.open(model_dir, device="cpu", attention_backend=backend, **options) as engine:
        assert engine._info is not None and engine._info.sliding_group is not None
        prompts = _prompts(engine._info.vocab_size, (20, 25, 30, 9), seed=3)
        got = await stream_all(engine, prompts, GREEDY)
        stats = engine.statistics()
    assert stats.num_preemptions > 0
    assert got == transformers_greedy(model_dir, tuple(map(tuple, prompts)), MAX_NEW_TOKENS)


# The triton test runs in the interpreter (seconds a step): narrower models, and few steps. gemma2 (2 of 4
# layers sliding) soft-caps its scores in the kernels; gemma3 (5 of 6 sliding) does not.
NARROW = {"hidden_size": 32, "num_heads": 2, "num_kv_heads": 1, "intermediate_size": 64}


@pytest.mark.parametrize("anyio_backend", ["asyncio"])
@pytest.mark.parametrize(("family", "num_layers", "softcap"), [("gemma2", 4, 1.5), ("gemma3", 6, None)])
async def test_triton_frees_the_sliding_group_token_exact_eagerly_and_from_graph_buffers(
    tiny_cache: Path, monkeypatch: pytest.MonkeyPatch, family: str, num_layers: int, softcap: float | None
) -> None:
    # Its kernels take each group's table (the sliding layers' metadata is the sliding pool's); decode
    # steps run from the CUDA graphs' static buffers (both tables), eagerly here, as without CUDA they can.
    # gemma2 soft-caps its attention scores: every layer runs the kernels' soft-capped variants.
    pytest.importorskip("triton")
    from asyncllm.backends.triton._kernels import paged_attention as paged_module
    from asyncllm.backends.triton._kernels import split_kv_decode as split_module
    from asyncllm.worker._graphs import DecodeGraphs
    from asyncllm.worker._model_runner import TorchModelRunner

    softcaps: list[float | None] = []  # the soft-cap of every attention-kernel launch

    def recording(kernel: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> Any:
            softcaps.append(kwargs.get("softcap"))
            return kernel(*args, **kwargs)

        return launch

    for module, name in ((paged_module, "paged_attention"), (split_module, "split_kv_attention")):
        monkeypatch.setattr(module, name, recording(getattr(module, name)))
    model_dir = tiny_model_path(tiny_cache, family, num_layers=num_layers, **NARROW)
    # 12 whole-model blocks: the sliding pool gets 12 (2 * 4 + 2 * 2), the global one 12 too (gemma2:
    # (12 * 4 - 12 * 2) / 2; gemma3: 12 * 6 - 12 * 5), 48 tokens, fewer than the two requests' 30 + 22: one
    # is preempted and recomputed.
    options = {**OPTIONS, "kv_cache_blocks": 12}
    held: list[tuple[int, int, int]] = []  # (tokens fed, sliding blocks held, global blocks) of every sequence fed
    async with Engine.open(model_dir, device="cpu", attention_backend="triton", **options) as engine:
        assert engine._core is not None
        info, runner = engine._info, engine._core.runner
        assert info is not None and info.sliding_group == (8, 12) and info.num_kv_blocks == 12
        assert isinstance(runner, TorchModelRunner) and runner.model is not None
        assert runner.attention_backend == "triton"
        runner.graphs = DecodeGraphs(
            runner.model, runner.kv_caches, block_size=4, max_seq_len=64, max_batch=2, device=runner.device,
            use_graphs=False, sliding_group=True,
        )  # fmt: skip
        launch = runner.launch

        def recording(batch: StepBatch, after: Any = None) -> Any:
            for seq in batch.sequences:
                held.append((len(seq.token_ids), len(seq.sliding_block_table or ()), len(seq.block_table)))
            return launch(batch, after)

        runner.launch = recording  # type: ignore[method-assign]
        replays: list[int] = []
        run = runner.graphs.run

        def replaying(step: Any, *args: Any, **kwargs: Any) -> Any:
            assert kwargs["sliding_step"] is not None
            replays.append(step.num_seqs)
            return run(step, *args, **kwargs)

        runner.graphs.run = replaying  # type: ignore[method-assign]
        prompts = _prompts(info.vocab_size, (20, 12), seed=5)
        params = SamplingParams(temperature=0.0, max_tokens=10)
        got = await stream_all(engine, prompts, params)
        preemptions = engine.statistics().num_preemptions
        # The first conversation's next turn: a prefix-cache hit in both pools.
        follow_up = [[*prompts[0], *got[0], 5, 6]]
        got_follow_up = await stream_all(engine, follow_up, SamplingParams(temperature=0.0, max_tokens=3))
        stats = engine.statistics()
        assert engine._core.scheduler.kv_cache.sliding is not None
        freed = engine._core.scheduler.kv_cache.sliding.num_window_freed_blocks
    assert preemptions > 0 and stats.prefix_cache_hits > 0 and freed > 0 and 2 in replays
    assert softcaps and (set(softcaps) == {softcap} if softcap else not any(softcaps))
    # A decoding sequence holds window / block_size + 1 sliding blocks at most, mostly, while its global
    # table grows to 8; a chunk's step holds the chunk's blocks besides, and the window's edge moves only
    # with confirmed tokens (the engine schedules a step while the one before runs): at most the 4 a
    # request is given in the split and a chunk's 2.
    decodes = sorted(sliding for fed, sliding, _ in held if fed == 1)
    assert decodes[len(decodes) // 2] <= 8 // 4 + 1 and max(sliding for _, sliding, _ in held) <= 4 + 2
    assert max(blocks for _, _, blocks in held) >= 8
    assert stats.kv_blocks_free == stats.kv_blocks_total == 12
    assert stats.kv_sliding_blocks_free == stats.kv_sliding_blocks_total == 12
    assert got == transformers_greedy(model_dir, tuple(map(tuple, prompts)), 10)
    assert got_follow_up == transformers_greedy(model_dir, tuple(map(tuple, follow_up)), 3)
