"""Tensor parallelism over real rank processes (gloo on the CPU, two ranks).

Each test that opens an engine with ``tensor_parallel_size=2`` starts a real worker process (it imports
torch and loads its shard: seconds), so the tests share engines where they can: one engine per model runs
chunked prefill, preemption and prefix-cache hits together and is compared token for token with
``tensor_parallel_size=1`` and with transformers' greedy output on the same weights.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import queue
import random
import signal
import socket
import struct
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import anyio
import pytest
import torch

from asyncllm import (
    DeviceStepTimeoutError,
    Engine,
    EngineDeadError,
    SamplingParams,
    UnsupportedModelError,
    WorkerDiedError,
)
from asyncllm.executor._ranks import RankProcesses, SequenceDelta, StopMessage, TableMirror, TableSync
from asyncllm.executor._runner import SequenceInput
from asyncllm.http._prometheus import render_metrics
from asyncllm.models import model_spec
from asyncllm.models._parallel import TensorParallel, kv_head_range, shard_range
from asyncllm.testing.parity import stream_all, transformers_greedy
from asyncllm.testing.tiny_models import tiny_model_path
from asyncllm.worker._model_runner import TorchModelRunner
from asyncllm.worker._parallel import open_group
from asyncllm.worker._weights import load_config

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc to find processes")

PROMPT_LENGTHS = (1, 5, 12, 20, 33, 48)
MAX_NEW_TOKENS = 12
# One engine exercises all three: prompts longer than 16 tokens prefill in chunks, 32 blocks of 4 tokens
# cannot hold every request at once (recompute preemption), and the second pass hits the prefix cache.
STRESS = {"block_size": 4, "kv_cache_blocks": 32, "max_model_len": 128, "max_num_batched_tokens": 16}

MODELS: dict[str, tuple[str, dict[str, Any], str]] = {
    # name: (family, build_tiny_model arguments, attention backend)
    "llama-gqa": ("llama", {}, "torch"),  # 4 query heads, 2 KV heads: 2 and 1 per rank; tied embeddings
    "llama-one-kv-head": ("llama", {"num_kv_heads": 1}, "torch"),  # the KV head replicated on both ranks
    "qwen2-odd-vocab": ("qwen2", {"vocab_size": 517}, "torch"),  # q/k/v biases; the last vocabulary shard padded
    "qwen3": ("qwen3", {}, "cpu"),  # per-head q/k norms, head_dim apart from hidden_size; the C kernels
}


def _model_dir(cache: Path, name: str) -> Path:
    family, kwargs, _ = MODELS[name]
    return tiny_model_path(cache, family, **kwargs)


def _prompts(vocab_size: int) -> list[list[int]]:
    rng = random.Random(27)
    return [[rng.randrange(3, vocab_size) for _ in range(n)] for n in PROMPT_LENGTHS]


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie, or no such process, is not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False
    return state not in ("Z", "X")


def _children() -> set[int]:
    """Live child processes of this process."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if int(fields[1]) == os.getpid() and fields[0] not in ("Z", "X"):
                found.add(int(entry.name))
    return found


async def _run_all(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    return await stream_all(engine, prompts, SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS))


# Every model on asyncio, one on trio too: each case starts a rank process (seconds), and what differs
# between the backends (the watcher's thread, the device thread's wake-ups) is the same for every model.
@pytest.mark.anyio
@pytest.mark.parametrize(
    ("anyio_backend", "name"), [*(("asyncio", name) for name in sorted(MODELS)), ("trio", "llama-gqa")]
)
async def test_two_ranks_match_one_and_transformers(tiny_cache: Path, name: str) -> None:
    model_dir = _model_dir(tiny_cache, name)
    backend = MODELS[name][2]
    before = _children()
    results: dict[int, tuple[list[list[int]], list[list[int]], Any, Any]] = {}
    for size in (1, 2):
        async with Engine.open(
            model_dir, device="cpu", attention_backend=backend, tensor_parallel_size=size, **STRESS
        ) as engine:
            assert engine._info is not None
            prompts = _prompts(engine._info.vocab_size)
            first = await _run_all(engine, prompts)
            hits = engine.statistics().prefix_cache_hits
            second = await _run_all(engine, prompts)  # the same prompts: their full blocks are cached
            stats = engine.statistics()
            assert stats.prefix_cache_hits > hits
            assert stats.num_preemptions > 0
            # Prompt logprobs take their own gathers (one message to the other ranks per chunk).
            scored = await engine.generate(
                prompts[3], SamplingParams(temperature=0.0, max_tokens=2, logprobs=3, prompt_logprobs=2)
            )
            # Pooling reads rank 0's final hidden states (whole on every rank after the last all-reduce).
            embedded = await engine.embed([prompts[2], prompts[4]], pooling="mean")
            if size == 2:
                assert "tensor-parallel over 2 ranks" in engine._info.description
                assert engine._ranks is not None and all(_alive(pid) for pid in engine._ranks.pids)
        results[size] = (first, second, scored, embedded)
    expected = transformers_greedy(model_dir, tuple(map(tuple, prompts)), MAX_NEW_TOKENS)
    one, two = results[1], results[2]
    assert one[0] == expected and one[1] == expected
    assert two[0] == expected and two[1] == expected
    assert two[2].token_ids == one[2].token_ids
    pairs = [*zip(two[2].prompt_logprobs[1:], one[2].prompt_logprobs[1:]), *zip(two[2].logprobs, one[2].logprobs)]
    assert len(pairs) == len(prompts[3]) - 1 + 2
    for got, want in pairs:
        assert got.token.token_id == want.token.token_id and got.token.rank == want.token.rank
        assert [t.token_id for t in got.top] == [t.token_id for t in want.top]
        assert got.token.logprob == pytest.approx(want.token.logprob, abs=1e-4)
    for got_vector, want_vector in zip(two[3], one[3]):
        assert got_vector.embedding == pytest.approx(want_vector.embedding, abs=1e-5)
    assert _children() == before  # the rank process is gone with its engine


# One case (a rank process starts): what differs between the backends is what the test above runs on trio.
@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_n_gram_speculation_over_two_ranks_gives_the_tokens_of_plain_decoding(tiny_cache: Path) -> None:
    # Drafts of several lengths next to plain rows in one step (the other ranks gather the logits of
    # every draft row with rank 0), 2-token blocks (a rejected draft's trimmed blocks come again).
    model_dir = _model_dir(tiny_cache, "llama-gqa")
    options = {"block_size": 2, "kv_cache_blocks": 96, "max_model_len": 96, "speculative_ngram_min": 1}
    prompts = [[5, 6, 7, 8, 9] * 4, [11, 12, 13] * 6, [20, 21, 22, 23] * 3 + [20]]
    async with Engine.open(
        model_dir, device="cpu", attention_backend="torch", tensor_parallel_size=2, speculative_method="ngram",
        **options,
    ) as engine:  # fmt: skip
        plain = await stream_all(
            engine, prompts, SamplingParams(temperature=0.0, max_tokens=32, num_speculative_tokens=0)
        )
        assert engine.statistics().spec_num_drafts == 0
        streams = [
            engine.stream(prompt, SamplingParams(temperature=0.0, max_tokens=32, num_speculative_tokens=drafts))
            for prompt, drafts in zip(prompts, (4, 0, 2))
        ]
        fast: list[list[int]] = [[] for _ in prompts]

        async def consume(index: int) -> None:
            async with streams[index] as stream:
                async for chunk in stream:
                    fast[index].extend(chunk.token_ids)

        async with anyio.create_task_group() as group:
            for index in range(len(prompts)):
                group.start_soon(consume, index)
        stats = engine.statistics()
    assert fast == plain == transformers_greedy(model_dir, tuple(map(tuple, prompts)), 32)
    assert stats.spec_accepted_tokens > 0 and stats.spec_draft_tokens > stats.spec_accepted_tokens
    assert stats.kv_blocks_free == stats.kv_blocks_total


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_hybrid_models_sliding_pool_frees_on_every_rank_token_exact(tiny_cache: Path) -> None:
    # Qwen2 with layer_types (its second layer slides, window 8): every rank holds both pools, and
    # each step tells the ranks both tables' changes. 15 whole-model blocks: the sliding pool gets
    # 2 * 4 + 2 * 2 = 12, the global one 2 * 15 - 12 = 18, 72 tokens, fewer than the two requests' 42
    # + 37 (preemption); the second pass hits the prefix cache.
    model_dir = tiny_model_path(tiny_cache, "qwen2", sliding_window=8)
    options = {"block_size": 4, "max_num_seqs": 2, "max_num_batched_tokens": 8, "kv_cache_blocks": 15}
    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW_TOKENS)
    async with Engine.open(
        model_dir, device="cpu", attention_backend="cpu", tensor_parallel_size=2, **options
    ) as engine:
        assert engine._info is not None and engine._info.sliding_group == (8, 12)
        assert "tensor-parallel over 2 ranks" in engine._info.description
        rng = random.Random(3)
        prompts = [[rng.randrange(3, engine._info.vocab_size) for _ in range(n)] for n in (30, 25)]
        first = await stream_all(engine, prompts, params)
        second: list[int] = []
        during = []  # the second pass alone, a snapshot per chunk streamed
        async with engine.stream(prompts[0], params) as stream:
            async for chunk in stream:
                second.extend(chunk.token_ids)
                during.append(engine.statistics())
        # The snapshot where the request held the most global blocks: its last while running.
        last = max(during, key=lambda snapshot: snapshot.kv_blocks_total - snapshot.kv_blocks_free)
        page = render_metrics(engine.metrics, last)
        stats = engine.statistics()
        assert engine._core is not None and engine._core.scheduler.kv_cache.sliding is not None
        freed = engine._core.scheduler.kv_cache.sliding.num_window_freed_blocks
    assert stats.num_preemptions > 0 and stats.prefix_cache_hits > 0 and freed > 0
    assert stats.kv_blocks_free == stats.kv_blocks_total == 18
    assert stats.kv_sliding_blocks_free == stats.kv_sliding_blocks_total == 12
    expected = transformers_greedy(model_dir, tuple(map(tuple, prompts)), MAX_NEW_TOKENS)
    assert first == expected and [second] == expected[:1]
    # While it decodes, the request holds the window's blocks in the sliding pool (window / block_size
    # + 1, and the step in flight's), all of its context in the global one; /metrics says both.
    sliding_held = last.kv_sliding_blocks_total - last.kv_sliding_blocks_free
    assert 3 <= sliding_held <= 4 and last.kv_blocks_total - last.kv_blocks_free >= 10
    assert last.kv_sliding_usage == sliding_held / 12
    assert f"asyncllm_kv_cache_sliding_blocks_free {last.kv_sliding_blocks_free}\n" in page
    assert "asyncllm_kv_cache_sliding_blocks_total 12\n" in page
    assert f"asyncllm_kv_cache_sliding_usage_ratio {last.kv_sliding_usage!r}\n" in page


@pytest.mark.anyio
async def test_a_rank_killed_mid_run_ends_every_stream_with_engine_dead(tiny_cache: Path) -> None:
    before = _children()
    engine = Engine.open(_model_dir(tiny_cache, "llama-gqa"), device="cpu", attention_backend="torch",
                         tensor_parallel_size=2, kv_cache_blocks=64)  # fmt: skip
    errors: list[BaseException] = []
    with pytest.raises(WorkerDiedError):  # leaving the block re-raises why the engine died
        async with engine:
            assert engine._ranks is not None
            (pid,) = engine._ranks.pids
            started = anyio.Event()

            async def consume(prompt: list[int]) -> None:
                try:
                    async with engine.stream(prompt, SamplingParams(max_tokens=500, ignore_eos=True)) as stream:
                        async for _ in stream:
                            started.set()
                except EngineDeadError as exc:
                    errors.append(exc)

            with anyio.fail_after(60):  # a bound on a hang, far above the moments it takes
                async with anyio.create_task_group() as group:
                    for index in range(4):
                        group.start_soon(consume, [10 + index] * (5 + index))
                    await started.wait()
                    os.kill(pid, signal.SIGKILL)
            with pytest.raises(EngineDeadError):
                engine.check_health()
    assert len(errors) == 4
    assert all(isinstance(error, WorkerDiedError) for error in errors)
    assert f"rank 1 (pid {pid}) was killed by signal SIGKILL" in str(errors[0])
    assert not _alive(pid)
    assert _children() == before


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the watcher alone; both backends: the test above
async def test_a_rank_killed_while_idle_fails_the_health_check(tiny_cache: Path) -> None:
    engine = Engine.open(_model_dir(tiny_cache, "llama-gqa"), device="cpu", attention_backend="torch",
                         tensor_parallel_size=2, kv_cache_blocks=64)  # fmt: skip
    with pytest.raises(WorkerDiedError):
        async with engine:
            await engine.generate([5, 6, 7], SamplingParams(max_tokens=2))
            assert engine._ranks is not None
            os.kill(engine._ranks.pids[0], signal.SIGKILL)
            with anyio.fail_after(60):  # the watcher notices the exit at once; the bound is for a hang
                while engine._core is not None and engine._core.dead is None:
                    await anyio.sleep(0.01)
            with pytest.raises(EngineDeadError):
                engine.check_health()
            with pytest.raises(EngineDeadError):
                await engine.generate([5, 6, 7], SamplingParams(max_tokens=2))
    # The engine died while its device thread was idle (not stuck): rank 0's runner is closed all the same
    # (its weights, KV cache, process group and store sockets released), not kept by the dead engine.
    assert engine._core is not None
    runner = engine._core.runner
    assert isinstance(runner, TorchModelRunner)
    assert runner.model is None and runner.collectives is None and not runner.kv_caches


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the rank's own signal handling; no backend in it
async def test_termination_signals_to_a_rank_leave_its_lifetime_to_the_engine(tiny_cache: Path) -> None:
    # systemd (KillMode=control-group), `kill -TERM -PGID` and supervisors that signal a process group send
    # SIGTERM to the ranks too, while the application drains its requests and then closes its engine.
    before = _children()
    engine = Engine.open(_model_dir(tiny_cache, "llama-gqa"), device="cpu", attention_backend="torch",
                         tensor_parallel_size=2, kv_cache_blocks=64)  # fmt: skip
    async with engine:
        assert engine._ranks is not None
        (pid,) = engine._ranks.pids
        for how in (signal.SIGTERM, signal.SIGHUP):
            os.kill(pid, how)  # pending before the rank's next step: a rank it ended could not join that step
        result = await engine.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
        assert len(result.token_ids) == 4
        engine.check_health()
    assert not _alive(pid)
    assert _children() == before


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # how the rank starts; no backend in it
async def test_ranks_import_the_engines_modules_whatever_the_working_directory(
    tiny_cache: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # `python -m` puts the working directory first on the child's path, ahead of the engine's own: a
    # folder or file there named like a module the rank imports (an asyncllm checkout, a random.py) was
    # imported in its place. The engine's process (a console script, `python /path/app.py`) had no such entry.
    shadow = tmp_path / "asyncllm"
    shadow.mkdir()
    (shadow / "__init__.py").write_text("raise ImportError('the working directory shadowed asyncllm')\n")
    monkeypatch.chdir(tmp_path)
    async with Engine.open(_model_dir(tiny_cache, "llama-gqa"), device="cpu", attention_backend="torch",
                           tensor_parallel_size=2, kv_cache_blocks=16) as engine:  # fmt: skip
        result = await engine.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert len(result.token_ids) == 2


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # the load's wait; no backend in it
async def test_with_the_wait_every_rank_meets_once_its_cache_is_resident(tiny_cache: Path) -> None:
    # kv_cache_prefault_wait: rank 0's load returns after the barrier every rank reaches once its own cache is
    # resident (a rank that skipped it would leave rank 0 waiting out the rendezvous timeout); then steps run.
    options = {"tensor_parallel_size": 2, "kv_cache_blocks": 64, "kv_cache_prefault_wait": True}
    async with Engine.open(_model_dir(tiny_cache, "llama-gqa"), device="cpu", attention_backend="torch",
                           **options) as engine:  # fmt: skip
        assert engine._core is not None
        runner = engine._core.runner
        assert isinstance(runner, TorchModelRunner) and runner._resident_waits == 1
        assert runner.kv_prefault is not None and runner.kv_prefault.completed
        result = await engine.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    assert len(result.token_ids) == 2


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # sizing at load; no backend in it
async def test_kv_cache_memory_in_bytes_is_what_the_ranks_caches_take_in_all_on_the_cpu(tiny_cache: Path) -> None:
    # The ranks share the host's memory: kv_cache_memory=B bytes is B of it in all, as with one rank, not B
    # per rank. llama-gqa's 2 KV heads are 1 per rank: a block's bytes on each rank are half of one rank's.
    model_dir = _model_dir(tiny_cache, "llama-gqa")
    spec = model_spec(load_config(model_dir))
    block_bytes = 2 * spec.num_layers * 16 * spec.num_kv_heads * spec.head_dim * 4  # float32, 16-token blocks
    async with Engine.open(model_dir, device="cpu", attention_backend="torch", tensor_parallel_size=2,
                           kv_cache_memory=40 * block_bytes, max_num_batched_tokens=64) as engine:  # fmt: skip
        assert engine._info is not None
        assert engine._info.num_kv_blocks == 40


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # each engine test above closes on both backends
async def test_open_and_close_cycles_leave_no_process_or_descriptor(tiny_cache: Path) -> None:
    model_dir = _model_dir(tiny_cache, "llama-one-kv-head")
    before = _children()
    descriptors: list[int] = []
    for _ in range(2):
        async with Engine.open(model_dir, device="cpu", attention_backend="torch", tensor_parallel_size=2,
                               kv_cache_blocks=32) as engine:  # fmt: skip
            assert engine._ranks is not None
            pids = engine._ranks.pids
            assert all(_alive(pid) for pid in pids)
            await engine.generate([7, 8, 9], SamplingParams(max_tokens=3))
        assert not any(_alive(pid) for pid in pids)
        assert _children() == before
        descriptors.append(len(os.listdir("/proc/self/fd")))
    assert descriptors[1] <= descriptors[0]  # the second cycle leaks no pipe or socket of the first


def _orphan_script(model_dir: Path, fork: bool) -> str:
    return textwrap.dedent(f"""
        import anyio, multiprocessing, sys, time
        from asyncllm import Engine

        async def main():
            async with Engine.open({str(model_dir)!r}, device="cpu", attention_backend="torch",
                                   tensor_parallel_size=2, kv_cache_blocks=16) as engine:
                children = []
                if {fork!r}:  # the application forks a worker (multiprocessing's default on Linux) that lives on
                    children.append(multiprocessing.get_context("fork").Process(target=time.sleep, args=(600,)))
                    children[0].start()
                print(*engine._ranks.pids, *(child.pid for child in children), flush=True)
                await anyio.sleep_forever()

        if __name__ == "__main__":
            try:
                anyio.run(main)
            except KeyboardInterrupt:
                print("interrupted", flush=True)
    """)


ORPHAN_CASES = ("SIGKILL", "SIGINT", "SIGKILL, a forked child alive")


@pytest.fixture(scope="module")
def orphan_engines(tiny_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """One engine process per case of the test below, all started at once: each imports torch and starts
    its rank (seconds), and they load side by side rather than one after the other."""
    model_dir = _model_dir(tiny_cache, "llama-one-kv-head")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    processes: dict[str, subprocess.Popen[str]] = {}
    try:
        for how in ORPHAN_CASES:
            script = tmp_path_factory.mktemp("orphan") / "engine.py"
            script.write_text(_orphan_script(model_dir, fork="forked" in how))
            processes[how] = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, env=env, text=True)
        yield processes
    finally:
        for process in processes.values():
            process.kill()
            process.wait()
            if process.stdout is not None:
                process.stdout.close()


@pytest.mark.parametrize("how", ORPHAN_CASES)
def test_no_rank_outlives_its_engines_process(orphan_engines: dict[str, Any], how: str) -> None:
    # SIGKILL: the engine's process cannot clean up; its ranks read end-of-file on their lifeline and
    # exit, also when a child the application forked (inheriting every descriptor) outlives it.
    # SIGINT (Ctrl-C): the engine closes as it leaves `async with` and stops its ranks.
    process: subprocess.Popen[str] = orphan_engines[how]
    forked: list[int] = []
    try:
        assert process.stdout is not None
        pid, *forked = map(int, process.stdout.readline().split())
        assert _alive(pid)
        process.send_signal(getattr(signal, how.split(",")[0]))
        process.wait(timeout=120)
        if how == "SIGINT":
            assert process.stdout.read().strip() == "interrupted"
            assert process.returncode == 0
        deadline = time.monotonic() + 60  # a bound on a hang: the rank exits within moments
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(pid)
        assert all(_alive(child) for child in forked)  # the forked child did outlive the engine
    finally:
        for child in forked:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        process.kill()
        process.wait()


@pytest.mark.anyio
async def test_unsupported_models_are_refused_before_any_process_starts(tiny_cache: Path) -> None:
    before = _children()
    with pytest.raises(UnsupportedModelError, match=r"supports LlamaForCausalLM.*Gemma2ForCausalLM"):
        async with Engine.open(tiny_model_path(tiny_cache, "gemma2"), device="cpu", tensor_parallel_size=2):
            pass
    with pytest.raises(UnsupportedModelError, match="4 attention heads do not divide over 3 ranks"):
        async with Engine.open(tiny_model_path(tiny_cache, "llama"), device="cpu", tensor_parallel_size=3):
            pass
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"needs CUDA devices 0\.\.1, and this machine has 0"):
            async with Engine.open(tiny_model_path(tiny_cache, "llama"), device="cuda", tensor_parallel_size=2):
                pass
    with pytest.raises(UnsupportedModelError, match="3 KV heads and 2 ranks"):
        async with Engine.open(tiny_model_path(tiny_cache, "llama", num_heads=6, num_kv_heads=3, hidden_size=48),
                               device="cpu", tensor_parallel_size=2):  # fmt: skip
            pass
    assert _children() == before


def test_options_that_do_not_combine_with_tensor_parallelism_are_refused_at_open() -> None:
    from asyncllm.testing import ByteTokenizer, ScriptedRunner

    with pytest.raises(ValueError, match="compile=True"):
        Engine.open("unused", tensor_parallel_size=2, compile=True)
    with pytest.raises(ValueError, match="custom runner"):
        Engine.open(runner=ScriptedRunner([1]), tokenizer=ByteTokenizer(), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        Engine.open("unused", tensor_parallel_size=0)


def _seq(request_id: int, table: list[int], epoch: int = 0) -> SequenceInput:
    return SequenceInput(request_id, [1], len(table) * 4 - 1, table, True, SamplingParams(), epoch=epoch)


def test_block_tables_reach_the_other_ranks_as_what_changed() -> None:
    sync, mirror = TableSync(4), TableMirror()

    def step(*sequences: SequenceInput) -> list[SequenceDelta]:
        deltas = sync.deltas(sequences)
        got = mirror.sequences(deltas)
        assert [s.block_table for s in got] == [s.block_table for s in sequences]
        return deltas

    assert [d.new_blocks for d in step(_seq(1, [4, 5]), _seq(2, [9]))] == [[4, 5], [9]]
    assert [(d.kept_blocks, d.new_blocks) for d in step(_seq(1, [4, 5, 6]), _seq(2, [9]))] == [(2, [6]), (1, [])]
    # Request 2 is absent from a step: both sides forget it, and it comes back whole.
    step(_seq(1, [4, 5, 6]))
    assert [(d.kept_blocks, d.new_blocks) for d in step(_seq(2, [9, 3]))] == [(0, [9, 3])]
    # A new epoch (a preemption) rewrites the table even when it starts alike.
    assert [(d.kept_blocks, d.new_blocks) for d in step(_seq(2, [9, 3, 8], epoch=1))] == [(0, [9, 3, 8])]


def test_tables_that_lose_leading_blocks_and_sliding_tables_reach_the_other_ranks() -> None:
    # A sliding window drops a table's leading blocks (block_offset grows); a hybrid model's sliding
    # layers have a second table that does. The ranks get both, as what changed.
    sync, mirror = TableSync(16), TableMirror()

    def seq(table: list[int], offset: int, sliding: list[int] | None = None, sliding_offset: int = 0) -> SequenceInput:
        return SequenceInput(
            1, [1], 0, table, True, SamplingParams(), block_offset=offset, sliding_block_table=sliding,
            sliding_block_offset=sliding_offset,
        )  # fmt: skip

    def step(sequence: SequenceInput) -> tuple[tuple[int, list[int]], tuple[int, list[int]] | None]:
        (delta,) = sync.deltas([sequence])
        (got,) = mirror.sequences([delta])
        assert (got.block_table, got.block_offset) == (sequence.block_table, sequence.block_offset)
        assert (got.sliding_block_table, got.sliding_block_offset) == (
            sequence.sliding_block_table,
            sequence.sliding_block_offset,
        )
        if sequence.sliding_block_table is None:
            return (delta.kept_blocks, delta.new_blocks), None
        assert delta.sliding is not None
        return (delta.kept_blocks, delta.new_blocks), (delta.sliding.kept_blocks, delta.sliding.new_blocks)

    # Every layer slides (Mistral): the ranks learn the offset, and keep what stays.
    assert step(seq([4, 5, 6], 0)) == ((0, [4, 5, 6]), None)
    assert step(seq([5, 6, 10], 1)) == ((2, [10]), None)
    sync, mirror = TableSync(16), TableMirror()
    assert step(seq([4, 5, 6], 0, [7, 8, 9], 0)) == ((0, [4, 5, 6]), (0, [7, 8, 9]))
    assert step(seq([4, 5, 6, 10], 0, [8, 9, 11], 1)) == ((3, [10]), (2, [11]))
    assert step(seq([5, 6, 10], 1, [9, 11], 2)) == ((3, []), (2, []))
    assert step(seq([6, 10, 3], 2, [11, 12], 3)) == ((2, [3]), (1, [12]))
    # Past every block the rank holds: sent whole.
    assert step(seq([6, 10, 3], 2, [13], 5)) == ((3, []), (0, [13]))


def test_blocks_a_rejected_draft_may_have_trimmed_reach_the_other_ranks_again() -> None:
    sync, mirror = TableSync(2), TableMirror()

    def step(seq: SequenceInput) -> SequenceDelta:
        [delta] = sync.deltas([seq])
        [got] = mirror.sequences([delta])
        assert got.block_table == seq.block_table and got.num_draft == seq.num_draft
        return delta

    def fed(table: list[int], start: int, num_draft: int) -> SequenceInput:
        tokens = list(range(1 + num_draft))
        return SequenceInput(1, tokens, start, table, True, SamplingParams(), num_draft=num_draft)

    # The newest token at position 3 and a draft at 4-7: blocks 2 and 3 hold draft tokens only.
    assert step(fed([4, 5, 6, 7], 3, 4)).new_blocks == [4, 5, 6, 7]
    # All of it rejected: blocks 6 and 7 were trimmed; the next draft got 9 and 7 (freed, then taken again).
    delta = step(fed([4, 5, 9, 7], 4, 4))
    assert (delta.kept_blocks, delta.new_blocks, delta.num_draft) == (2, [9, 7], 4)
    # Accepted up to position 8: the blocks of the newest real token (4) and before it stayed, the rest
    # come again; then, without a draft, the table grows as usual.
    assert step(fed([4, 5, 9, 7, 3], 9, 0)).kept_blocks == 3
    assert step(fed([4, 5, 9, 7, 3, 8], 10, 0)).kept_blocks == 5


def test_heads_split_evenly_or_kv_heads_replicate() -> None:
    ranks = [TensorParallel(rank, 4) for rank in range(4)]
    assert [shard_range(8, p) for p in ranks] == [(0, 2), (2, 4), (4, 6), (6, 8)]
    assert [kv_head_range(4, p) for p in ranks] == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert [kv_head_range(2, p) for p in ranks] == [(0, 1), (0, 1), (1, 2), (1, 2)]
    assert [kv_head_range(1, p) for p in ranks] == [(0, 1)] * 4
    with pytest.raises(ValueError, match="do not divide"):
        kv_head_range(3, ranks[0])


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # threads and pipes only
async def test_a_ranks_own_error_is_in_its_failure_whichever_thread_sees_the_exit_first() -> None:
    # Rank 0's device thread (polling the ranks while it meets them, explaining a failed collective) can
    # see a rank's exit before the watcher thread has read the report the rank sent just before exiting.
    # Here no watcher runs at all: that order, every time.
    async with RankProcesses(2, "unused", {}) as ranks:
        ranks.send(StopMessage())  # not a RankConfig: the rank reports why, and exits
        failure = await anyio.to_thread.run_sync(ranks.explain, RuntimeError("no rank exited"), 120.0)
    assert isinstance(failure, WorkerDiedError)
    assert "exited with status 1: RuntimeError: a rank's first message must be its RankConfig" in str(failure)


def _listening() -> set[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]]:
    """The (address, port) of every TCP socket this process listens on."""
    inodes = set()
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith("socket:["):
                inodes.add(target[len("socket:[") : -1])
    found: set[tuple[ipaddress.IPv4Address | ipaddress.IPv6Address, int]] = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(FileNotFoundError):
            for line in Path(table).read_text().splitlines()[1:]:
                fields = line.split()
                if fields[3] != "0A" or fields[9] not in inodes:  # 0A: LISTEN
                    continue
                host, port = fields[1].split(":")
                raw = bytes.fromhex(host)  # 32-bit words in host (little-endian) order
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
                found.add((ipaddress.ip_address(words), int(port, 16)))
    return found


def _network_interface() -> str | None:
    """A network interface of this host other than loopback that has an IPv4 address, if there is one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _, name in socket.if_nameindex():
            if name != "lo":
                with contextlib.suppress(OSError):  # SIOCGIFADDR: fails for an interface without an address
                    fcntl.ioctl(probe.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
                    return name
    return None


def test_the_ranks_meet_and_talk_on_the_loopback_interface_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every rank runs on this host. A port open on every interface (TCPStore's, whatever host it is given) or
    # on the network's (gloo's, at the address the host name resolves to, or GLOO_SOCKET_IFNAME's: often
    # set for other torch jobs) lets other hosts connect to the ranks' store (rendezvous addresses, keys)
    # and collectives for as long as the engine runs.
    network = _network_interface()
    if network is not None:
        monkeypatch.setenv("GLOO_SOCKET_IFNAME", network)
    before = _listening()
    ports: queue.Queue[int] = queue.Queue()
    cpu = torch.device("cpu")
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(open_group, rank=0, size=2, device=cpu, timeout=60.0,
                            announce=lambda host, port: ports.put(port))  # fmt: skip
        second = open_group(rank=1, size=2, device=cpu, timeout=60.0, store_port=ports.get(timeout=60))
        groups = [first.result(timeout=60), second]
    opened = _listening() - before
    assert len(opened) >= 2  # the store, and gloo's
    assert all(address.is_loopback for address, _ in opened), opened
    with ThreadPoolExecutor(1) as pool:  # and they work
        one, two = torch.ones(3), torch.full((3,), 2.0)
        pending = pool.submit(groups[0].all_reduce, one)
        groups[1].all_reduce(two)
        pending.result(timeout=60)
    assert one.tolist() == two.tolist() == [3.0, 3.0, 3.0]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])  # threads and pipes only
async def test_a_rank_the_engine_closes_before_configuring_it_exits_quietly() -> None:
    # The engine's open failed (or was cancelled) after the ranks started and before they were sent their
    # configuration: that is no failure of the rank's, to be logged with a traceback and reported.
    async with RankProcesses(2, "unused", {}) as ranks:
        (rank,) = ranks._ranks
    assert rank.process.returncode == 0
    assert rank.failure is None


@pytest.mark.anyio
async def test_rank_processes_need_two_ranks() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        RankProcesses(1, "unused", {})


def test_torch_is_not_needed_to_describe_a_step() -> None:
    # The messages and the table sync are plain msgspec structs: the engine's side imports no torch for them.
    code = "import sys, asyncllm.executor._ranks; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)})  # fmt: skip
    assert out.stdout.strip() == "False"


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_rank_that_hangs_ends_every_stream_after_step_timeout(tiny_cache: Path) -> None:
    # SIGSTOP: the rank is alive but never answers; rank 0 waits in a collective until step_timeout.
    # Starting the rank (seconds) is not bounded by step_timeout: only the steps are.
    before = _children()
    engine = Engine.open(_model_dir(tiny_cache, "llama-gqa"), device="cpu", attention_backend="torch",
                         tensor_parallel_size=2, kv_cache_blocks=64, step_timeout=5.0)  # fmt: skip
    errors: list[BaseException] = []
    with pytest.raises(DeviceStepTimeoutError):
        async with engine:
            assert engine._ranks is not None
            (pid,) = engine._ranks.pids
            started = anyio.Event()

            async def consume(prompt: list[int]) -> None:
                try:
                    async with engine.stream(prompt, SamplingParams(max_tokens=500, ignore_eos=True)) as stream:
                        async for _ in stream:
                            started.set()
                except EngineDeadError as exc:
                    errors.append(exc)

            with anyio.fail_after(60):  # a bound on a hang, far above step_timeout
                async with anyio.create_task_group() as group:
                    for index in range(2):
                        group.start_soon(consume, [10 + index] * 6)
                    await started.wait()
                    os.kill(pid, signal.SIGSTOP)  # leaving the engine kills it (SIGKILL ends a stopped process)
    assert len(errors) == 2 and all(isinstance(error, DeviceStepTimeoutError) for error in errors)
    assert not _alive(pid)
    assert _children() == before


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_rank_that_dies_while_starting_fails_the_open(tiny_cache: Path) -> None:
    # Killed as soon as it is spawned: rank 0 must not wait out the rendezvous' timeout for it.
    before = _children()
    engine = Engine.open(_model_dir(tiny_cache, "llama-gqa"), device="cpu", attention_backend="torch",
                         tensor_parallel_size=2, kv_cache_blocks=16)  # fmt: skip

    async def kill_once_spawned() -> None:
        while engine._ranks is None or not engine._ranks.pids:  # the rank exists once the engine sets this
            await anyio.sleep(0.005)
        os.kill(engine._ranks.pids[0], signal.SIGKILL)

    with anyio.fail_after(120):  # a bound on a hang (the rendezvous would wait 30 minutes)
        async with anyio.create_task_group() as group:
            group.start_soon(kill_once_spawned)
            with pytest.raises(WorkerDiedError, match="was killed by signal SIGKILL"):
                async with engine:
                    pass
    assert _children() == before
