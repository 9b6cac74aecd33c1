"""The kernel pool (``backends.cpu._pool``): the kernels on it compute the OpenMP kernels' bits, a helper that
stalls has its tasks taken over by the caller, and ``close`` joins its threads."""

from __future__ import annotations

import ctypes
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from asyncllm.backends.cpu import _attention as attention_cpu
from asyncllm.backends.cpu import _gemm as gemm_cpu
from asyncllm.backends.cpu import _native as native
from asyncllm.backends.cpu import _pool as kernel_pool
from asyncllm.backends.cpu._native import I32, I64, PTR
from asyncllm.testing.tiny_models import tiny_model_path
from asyncllm.worker._input_batch import step_inputs
from asyncllm.worker._model_runner import TorchModelRunner

pytestmark = pytest.mark.skipif(
    not (kernel_pool.available() and gemm_cpu.available()), reason="no kernel pool or panel GEMM here"
)


_EXITING = 0x4  # the kernel's PF_EXITING in a task's flags (``/proc/<pid>/task/<tid>/stat``, field 9)


def _helpers() -> int:
    """The process's live kernel pool helper threads, by name: a joined helper can stay listed for a while after
    ``pthread_join`` returns (the kernel releases its task after waking the joiner), flagged as exiting, so those
    are not counted."""
    count = 0
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/comm", encoding="utf-8") as comm:
                if comm.read().strip() != kernel_pool.HELPER_NAME:
                    continue
            with open(f"/proc/self/task/{task}/stat", encoding="utf-8") as stat:
                flags = int(stat.read().rsplit(")", 1)[1].split()[6])
        except OSError:
            continue  # a thread that just ended
        count += not flags & _EXITING
    return count


@pytest.fixture
def pool() -> kernel_pool.KernelPool:
    created = kernel_pool.KernelPool(1, max_tasks=2048, scratch_bytes=64 * 48 * 4, input_bytes=1 << 20, spin=30_000)
    yield created
    created.close()


@pytest.fixture(autouse=True)
def _two_threads() -> None:
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the pooled calls share their tasks out at torch's thread count
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("bfloat16", [False, True], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("rows", [1, 7, 33, 64])
def test_pooled_matmul_and_argmax_equal_openmp(pool: kernel_pool.KernelPool, bfloat16: bool, rows: int) -> None:
    if bfloat16 and not gemm_cpu.bfloat16_available():
        pytest.skip("no bfloat16 panels here")
    generator = torch.Generator().manual_seed(rows)
    out_features, in_features = 1000, 100  # a partial last panel
    weight = torch.randn(out_features, in_features, generator=generator)
    panels = gemm_cpu.PanelWeight(weight, bfloat16=bfloat16)
    x = torch.randn(rows, in_features, generator=generator)
    expected = panels.linear(x)
    out = torch.full((rows, out_features), float("nan"))
    shape = (out_features, in_features)
    args = (x.data_ptr(), in_features, rows, panels.buffer.data_ptr(), out.data_ptr(), out_features, *shape)
    for _ in range(20):  # the helper takes a share of the panels in some of them
        out.fill_(float("nan"))
        assert gemm_cpu.pooled_matmul_into(pool, *args, bfloat16=bfloat16)
        assert torch.equal(out, expected)
    valid = out_features - 5
    tokens = gemm_cpu.panel_argmax(x, panels.buffer, out_features, valid, in_features=in_features, pool=pool)
    assert torch.equal(tokens, expected[:, :valid].argmax(-1))


def test_more_rows_than_the_pool_takes_are_left_to_openmp(pool: kernel_pool.KernelPool) -> None:
    weight = torch.randn(96, 64)
    panels = gemm_cpu.PanelWeight(weight)
    x = torch.randn(300, 64)  # more than a pass of 256 rows
    out = torch.zeros(300, 96)
    args = (x.data_ptr(), 64, 300, panels.buffer.data_ptr(), out.data_ptr(), 96, 96, 64)
    assert not gemm_cpu.pooled_matmul_into(pool, *args, bfloat16=False)
    assert torch.equal(out, torch.zeros(300, 96))  # nothing computed: the caller runs the OpenMP GEMM
    tokens = gemm_cpu.panel_argmax(x, panels.buffer, 96, 96, pool=pool)  # falls back by itself
    assert torch.equal(tokens, panels.linear(x).argmax(-1))


def test_the_caller_takes_over_a_stalled_helpers_task(pool: kernel_pool.KernelPool) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(48 * 64, 64, generator=generator)
    panels = gemm_cpu.PanelWeight(weight)
    x = torch.randn(16, 64, generator=generator)
    expected = panels.linear(x)
    out = torch.empty_like(expected)
    args = (x.data_ptr(), 64, 16, panels.buffer.data_ptr(), out.data_ptr(), 48 * 64, 48 * 64, 64)
    pool.hold(True)  # a helper that starts a task now stalls in it, as if another process held its CPU
    try:
        for _ in range(10_000):  # until the helper has claimed and started a task (it usually does at once)
            out.fill_(float("nan"))
            assert gemm_cpu.pooled_matmul_into(pool, *args, bfloat16=False)
            assert torch.equal(out, expected)  # every call complete, the stalled task done by the caller
            if pool.stolen:
                break
        assert pool.stolen > 0
        for _ in range(3):  # later calls run without the stalled helper
            out.fill_(float("nan"))
            assert gemm_cpu.pooled_matmul_into(pool, *args, bfloat16=False)
            assert torch.equal(out, expected)
    finally:
        pool.hold(False)
    pool.quiesce()  # the helper finishes the task it stalled in and drops its result
    assert pool.helpers_inside == 0
    assert torch.equal(out, expected)


def test_close_joins_the_helpers() -> None:
    before = _helpers()
    pool = kernel_pool.KernelPool(3, max_tasks=16, scratch_bytes=1024, input_bytes=1024, spin=100)
    assert _helpers() == before + 3
    pool.close()
    assert _helpers() == before
    pool.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        _ = pool.handle


def test_every_pool_is_aligned_for_the_job_it_holds() -> None:
    """The pool holds its job, whose context is 64-byte aligned and may be copied with aligned vector stores: the
    pool must be 64-byte aligned wherever the heap places it (at 16, a pool crashed in its first job or not,
    depending on what the process had allocated before)."""
    libc = ctypes.CDLL(None)
    libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    libc.free.argtypes = [ctypes.c_void_p]
    held = []
    try:
        for size in (24, 40, 72, 136, 264, 520, 1032, 2056):  # the heap's state moves between pools
            held.append(libc.malloc(size))
            pool = kernel_pool.KernelPool(1, max_tasks=16, scratch_bytes=1024, input_bytes=1024, spin=100)
            try:
                assert pool.handle % 64 == 0
            finally:
                pool.close()
    finally:
        for address in held:
            libc.free(address)


def _decode_step(runner: TorchModelRunner) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """A decode step of 12 sequences on block-size-4 tables (ids, positions, attention metadata), and random keys
    and values in the runner's caches for its rows to attend to."""
    from asyncllm.executor._runner import SequenceInput
    from asyncllm.sampling_params import SamplingParams

    tables = [[4 * i + b for b in range(4)] for i in range(12)]
    sequences = [SequenceInput(i, [5 + i], 3 + i, tables[i], True, SamplingParams()) for i in range(12)]
    step = step_inputs(sequences, 4)
    meta = attention_cpu.build_metadata(step, sliding_window=None)
    for k_cache, v_cache in runner.kv_caches:
        k_cache.copy_(torch.randn_like(k_cache))
        v_cache.copy_(torch.randn_like(v_cache))
    return torch.from_numpy(step.input_ids.astype(np.int64)), torch.from_numpy(step.positions.astype(np.int64)), meta


def test_runner_runs_the_lean_forward_on_its_pool_and_joins_it(tiny_cache: Path) -> None:
    """The runner's pool: the decode-sized step's layer stack on it gives the OpenMP path's bits (matmuls,
    attention against a paged cache, SiLU), as the one C call and as the Python path, and ``close`` joins it."""
    if not attention_cpu.native_decode_available(16):
        pytest.skip("no C compiler")
    before = _helpers()
    runner = _loaded_pooled_runner(tiny_cache, packed_gemm="panels")
    try:
        model = runner.model
        assert model is not None and model.lean is not None and runner.kernel_pool is not None
        assert model.lean.pool is runner.kernel_pool
        assert _helpers() == before + torch.get_num_threads() - 1
        ids, positions, meta = _decode_step(runner)
        hidden = {}
        in_c = model.lean._c_max_tokens
        for pooled, c_call in ((True, True), (False, True), (True, False)):  # the one C call, and the Python path
            model.lean.pool = runner.kernel_pool if pooled else None
            model.lean._c_max_tokens = in_c if c_call else 0
            with torch.inference_mode():
                hidden[pooled, c_call] = model(ids, positions, runner.kv_caches, meta)
        model.lean._c_max_tokens = in_c
        assert in_c > 0 and hidden[True, True].abs().sum() > 0
        expected = hidden[True, True]
        assert torch.equal(expected, hidden[False, True]) and torch.equal(expected, hidden[True, False])
    finally:
        runner.close()
    assert runner.kernel_pool is None
    assert _helpers() == before  # the helper joined


_POOLED_SPY_SOURCE = r"""
#include <stdint.h>
typedef int (*pooled_fn)(void *, void *, char *, int64_t, int64_t, const float *, int64_t, const void *, float *,
                         int64_t, int64_t, int64_t, int64_t, int64_t);
/* Two spies with the pooled GEMM's signature: each counts its calls and forwards them to its target. */
static pooled_fn targets[2];
static int64_t counts[2];
void spy_set(int64_t which, void *target) { targets[which] = (pooled_fn)target; counts[which] = 0; }
int64_t spy_calls(int64_t which) { return counts[which]; }
#define SPY(which) \
    int spy_##which(void *pool, void *run, char *input, int64_t input_bytes, int64_t threads, const float *x, \
                    int64_t x_stride, const void *panels, float *out, int64_t out_stride, int64_t rows, \
                    int64_t out_features, int64_t in_features, int64_t bf16) { \
        ++counts[which]; \
        return targets[which](pool, run, input, input_bytes, threads, x, x_stride, panels, out, out_stride, rows, \
                              out_features, in_features, bf16); \
    }
SPY(0)
SPY(1)
"""


def test_bfloat16_panels_from_a_second_build_run_beside_the_native_float32_ones(
    tiny_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """AVX-512 without BF16 takes its bfloat16 panels from the AVX2 build (``bfloat16_build``), a second library
    beside the native one: every call on bfloat16 panels (packing, the OpenMP and pooled GEMMs, the lean forward's
    C call) must go to that library, since the builds' layouts differ. Simulated on any AVX2 machine by routing the
    bfloat16 panels to the AVX2 build: the C call's kernels come from the two libraries as they should, and its
    step, pooled or not, has the module path's bits."""
    from asyncllm.backends.cpu._lean_forward import LeanCpuForward

    if not (gemm_cpu.bfloat16_available() and attention_cpu.native_decode_available(16)):
        pytest.skip("no bfloat16 panels or cpu attention here")
    avx2 = gemm_cpu._avx2_library()
    assert avx2 is not None and avx2 is not gemm_cpu._library()
    monkeypatch.setattr(gemm_cpu, "_bfloat16_library", lambda: avx2)
    runner = _loaded_pooled_runner(tiny_cache, packed_gemm="panels", dtype="bfloat16")
    try:
        model = runner.model
        assert runner.bfloat16_weights and model is not None and model.lean is not None
        assert runner.kernel_pool is not None
        kernels = model.lean._kernels(runner.kv_caches[0][0].dtype)
        native_pooled = native.address(gemm_cpu._library().asyncllm_panel_matmul_pooled)
        assert kernels.gemm_pooled == native_pooled
        assert kernels.gemm_bf16_pooled == native.address(avx2.asyncllm_panel_matmul_pooled) != native_pooled
        assert kernels.gemm_bf16 == native.address(avx2.asyncllm_panel_matmul_bf16)
        # Which pooled GEMM the C call takes for each projection: spies that count and forward.
        spies = native.load("test_pooled_spy", _POOLED_SPY_SOURCE, {
            "spy_set": ([I64, PTR], None), "spy_calls": ([I64], I64), "spy_0": ([], I32), "spy_1": ([], I32),
        })  # fmt: skip
        assert spies is not None
        spies.spy_set(0, kernels.gemm_pooled)
        spies.spy_set(1, kernels.gemm_bf16_pooled)
        kernels.gemm_pooled, kernels.gemm_bf16_pooled = native.address(spies.spy_0), native.address(spies.spy_1)
        ids, positions, meta = _decode_step(runner)
        hidden = {}
        c_calls: list[bool] = []
        run_in_c = LeanCpuForward._run_in_c
        monkeypatch.setattr(LeanCpuForward, "_run_in_c", lambda *args: (c_calls.append(True), run_in_c(*args))[1])
        for pooled, lean in ((True, True), (False, True), (True, False)):  # the C call pooled or not, the modules
            model.lean.pool = runner.kernel_pool if pooled else None
            model.lean_forward = lean
            with torch.inference_mode():
                hidden[pooled, lean] = model(ids, positions, runner.kv_caches, meta)
        assert c_calls == [True, True] and hidden[True, True].abs().sum() > 0
        projections = 4 * len(runner.kv_caches)  # q/k/v, o, gate/up, down: all on bfloat16 panels
        assert (spies.spy_calls(0), spies.spy_calls(1)) == (0, projections)  # the pooled step's, once each
        assert torch.equal(hidden[True, True], hidden[False, True])
        assert torch.equal(hidden[True, True], hidden[True, False])
    finally:
        runner.close()


def _loaded_pooled_runner(tiny_cache: Path, **options: Any) -> TorchModelRunner:
    """A tiny llama's runner, loaded, with the pool at two threads whatever the host's CPUs (and ``options``)."""
    runner = TorchModelRunner(
        tiny_model_path(tiny_cache, "llama"),
        device="cpu",
        kv_cache_blocks=64,
        block_size=4,
        cpu_kernel_pool=True,
        num_threads=2,
        **options,
    )
    runner.load()
    return runner


def test_a_pooled_step_runs_the_heads_logits_on_the_pool_and_torch_alone(tiny_cache: Path) -> None:
    """From the forward to the sampled ids: torch's own ops on the device thread alone, the pool at torch's count,
    the sampled rows' logits on the pool (the OpenMP GEMM's bits); everything put back after the step, a failed
    one too; a prefill-sized step stays on OpenMP's threads."""
    from asyncllm.backends.cpu._lean_forward import POOL_MAX_TOKENS

    runner = _loaded_pooled_runner(tiny_cache)
    try:
        model, pool = runner.model, runner.kernel_pool
        assert model is not None and pool is not None and model.lm_head.panel_weight is not None
        rows = torch.randn(12, model.spec.hidden_size, generator=torch.Generator().manual_seed(3))
        with torch.inference_mode():
            expected = model.logits(rows)
            with runner._on_kernel_pool(POOL_MAX_TOKENS):
                assert torch.get_num_threads() == 1 and pool.threads == 2
                assert model.lm_head.pool is pool
                pooled = model.logits(rows)
                with runner._on_step_threads():  # the sampler's own passes: torch's count again
                    assert torch.get_num_threads() == 2
                assert torch.get_num_threads() == 1
        assert torch.equal(pooled, expected)
        assert torch.get_num_threads() == 2 and model.lm_head.pool is None
        with runner._on_step_threads():  # outside a pooled step: nothing changes
            assert torch.get_num_threads() == 2
        with pytest.raises(RuntimeError, match="a step that failed"), runner._on_kernel_pool(1):
            raise RuntimeError("a step that failed")
        assert torch.get_num_threads() == 2 and model.lm_head.pool is None
        with runner._on_kernel_pool(POOL_MAX_TOKENS + 1):
            assert torch.get_num_threads() == 2 and model.lm_head.pool is None
    finally:
        runner.close()


def test_a_decode_step_runs_its_layer_stack_on_the_pool_with_torch_alone(
    tiny_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The runner's step itself (not only the context): its lean forward runs with torch on the device thread
    alone and the pool at the step's count, and the step's thread count is back afterwards."""
    from asyncllm.backends.cpu._lean_forward import LeanCpuForward
    from asyncllm.executor._runner import SequenceInput
    from asyncllm.sampling_params import SamplingParams

    runner = _loaded_pooled_runner(tiny_cache)
    seen: list[tuple[int, int]] = []
    lean_call = LeanCpuForward.__call__

    def spy(self: LeanCpuForward, *args: object) -> torch.Tensor:
        assert self.pool is not None
        seen.append((torch.get_num_threads(), self.pool.threads))
        return lean_call(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(LeanCpuForward, "__call__", spy)
    try:
        tables = [[4 * i + b for b in range(4)] for i in range(6)]
        sequences = [SequenceInput(i, [5 + i], 3 + i, tables[i], True, SamplingParams()) for i in range(6)]
        with torch.inference_mode():
            runner._execute(sequences).result()
        assert seen == [(1, 2)]
        assert torch.get_num_threads() == 2
    finally:
        runner.close()


def test_the_pool_is_on_by_default_and_can_be_switched_off(tiny_cache: Path) -> None:
    from asyncllm.engine._options import EngineOptions

    with pytest.raises(ValueError, match="cpu_kernel_pool must be a bool"):
        EngineOptions.from_keywords(cpu_kernel_pool="no")
    assert EngineOptions.from_keywords().cpu_kernel_pool is True
    for keywords in ({}, {"cpu_kernel_pool": False}):
        runner = TorchModelRunner(
            tiny_model_path(tiny_cache, "llama"), device="cpu", kv_cache_blocks=64, block_size=4, **keywords
        )
        runner.load()
        try:
            assert runner.model is not None and runner.model.lean is not None
            on = not keywords and torch.get_num_threads() > 1  # a helper per thread beyond the device thread's
            assert (runner.kernel_pool is not None) is on
            assert runner.model.lean.pool is runner.kernel_pool
        finally:
            runner.close()


@pytest.mark.anyio
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
async def test_an_engine_on_the_pool_generates_the_same_tokens(tiny_cache: Path, dtype: str) -> None:
    """Through the whole step (the pool's thread count set per step, torch's own ops on the device thread alone
    meanwhile, the fused argmax on the pool): the same tokens as on OpenMP's threads, greedy and sampled."""
    import anyio

    from asyncllm import Engine, SamplingParams

    if dtype == "bfloat16" and not gemm_cpu.bfloat16_available():
        pytest.skip("no bfloat16 panels here")
    model = tiny_model_path(tiny_cache, "llama")
    prompts = [[3 + i, 7, 11 + 2 * i, 5] * (1 + i % 3) for i in range(12)]
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    sampled = SamplingParams(temperature=0.9, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True)
    outputs: dict[bool, dict[tuple[int, int], list[int]]] = {True: {}, False: {}}

    async def one(engine: Engine, results: dict[tuple[int, int], list[int]], index: int, which: int) -> None:
        completion = await engine.generate(prompts[index], sampled if which else greedy)
        results[index, which] = list(completion.token_ids)

    for pooled in (True, False):
        async with Engine.open(
            model, device="cpu", kv_cache_blocks=128, dtype=dtype, num_threads=2, cpu_kernel_pool=pooled
        ) as engine:
            async with anyio.create_task_group() as group:
                for index in range(len(prompts)):
                    for which in (0, 1):
                        group.start_soon(one, engine, outputs[pooled], index, which)
    assert outputs[True] == outputs[False]
    assert len({tuple(tokens) for tokens in outputs[True].values()}) > 1
