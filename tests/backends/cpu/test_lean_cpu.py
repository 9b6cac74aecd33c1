"""The lean CPU forward (``asyncllm.backends.cpu._lean_forward``): the module forward's bits, with less Python.

The lean path calls the same kernels in the same order as ``DecoderLayer.forward_fused_norms``, so
its hidden states and the keys and values it writes must equal the modules' exactly: on every
family (qwen2's q/k/v bias and qwen3's q/k norms included), on every kind of step (decodes, fresh
prompts, chunks with cached history, sliding windows) and on both GEMMs (the panels up to
``PANEL_MAX_ROWS`` rows, MKL's packed layout above). Greedy outputs against transformers then
follow from the parity tests, which run the default path: this one.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from asyncllm.backends.cpu import _attention as attention_cpu
from asyncllm.backends.cpu import _elementwise as elementwise_cpu
from asyncllm.backends.cpu import _gemm as gemm_cpu
from asyncllm.backends.cpu._lean_forward import LeanCpuForward
from asyncllm.executor._runner import SequenceInput
from asyncllm.models._linear import PANEL_MAX_ROWS, format_available
from asyncllm.sampling_params import SamplingParams
from asyncllm.testing.tiny_models import tiny_model_path
from asyncllm.worker._input_batch import step_inputs
from asyncllm.worker._model_runner import TorchModelRunner

BLOCK_SIZE = 4
NUM_BLOCKS = 256

pytestmark = pytest.mark.skipif(
    not (elementwise_cpu.available() and attention_cpu.native_decode_available(16)),
    reason="no C compiler: the cpu kernels are unavailable",
)


def _runner(model_dir: Path, packed_gemm: bool | str = True, dtype: str = "float32") -> TorchModelRunner:
    runner = TorchModelRunner(
        model_dir,
        device="cpu",
        kv_cache_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        packed_gemm=packed_gemm,
        dtype=dtype,
    )
    runner.load()
    return runner


def _step(shapes: list[tuple[int, int]], seed: int) -> list[SequenceInput]:
    """Sequences of (cached tokens, new tokens) on shuffled blocks, random token ids."""
    rng = random.Random(seed)
    free = list(range(NUM_BLOCKS))
    rng.shuffle(free)
    sequences = []
    for request_id, (start, num_new) in enumerate(shapes):
        table = [free.pop() for _ in range(-(-(start + num_new) // BLOCK_SIZE))]
        ids = [rng.randrange(3, 500) for _ in range(num_new)]
        sequences.append(SequenceInput(request_id, ids, start, table, True, SamplingParams()))
    return sequences


SMALL = [(0, 1), (9, 1), (12, 1), (0, 11), (5, 6), (31, 1)]  # 21 rows: the panels
LARGE = [(0, 70), (13, 1), (8, 9), (0, 3), (40, 1)]  # 84 rows: MKL's packed GEMM where both exist
DECODES = [(9, 1), (12, 1), (31, 1), (3, 1), (6, 1)]  # decode rows only: a window cuts no prompt chunk
HISTORY = [(20, 18), (13, 21), (9, 1), (0, 5)]  # 45 rows: prompt chunks after cached history (over 17 tokens)


@pytest.mark.parametrize("sliding_window", [None, 5, 64])
@pytest.mark.parametrize("shapes", [SMALL, LARGE, DECODES, HISTORY], ids=["small", "large", "decodes", "history"])
@pytest.mark.parametrize("packed_format", ["both", "panels", "mkl", "bfloat16 panels"])
@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_lean_forward_equals_the_modules(
    tiny_cache: Path,
    family: str,
    packed_format: str,
    shapes: list[tuple[int, int]],
    sliding_window: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Same bits as the modules, on the Python path and on the one C call (``_run_in_c``), which takes the
    families without q/k/v bias or q/k norms, on the panels, where no window cuts a prompt chunk (a window of 5
    cuts every chunk here, one of 64 only LARGE's 70-token prompt)."""
    bfloat16 = packed_format == "bfloat16 panels"  # dtype="bfloat16": bfloat16 weights on bfloat16 panels
    if not (gemm_cpu.bfloat16_available() if bfloat16 else format_available(packed_format)):  # type: ignore[arg-type]
        pytest.skip(f"the {packed_format} GEMM does not run here")
    model_dir = tiny_model_path(tiny_cache, family)
    runner = _runner(model_dir, "panels", "bfloat16") if bfloat16 else _runner(model_dir, packed_format)
    assert runner.bfloat16_weights == bfloat16
    model = runner.model
    assert model is not None and model.lean is not None
    step = step_inputs(_step(shapes, seed=len(shapes)), BLOCK_SIZE)
    assert (step.num_tokens > PANEL_MAX_ROWS) == (shapes is LARGE)
    meta = attention_cpu.build_metadata(step, sliding_window=sliding_window)
    ids = torch.from_numpy(step.input_ids.astype(np.int64))
    positions = torch.from_numpy(step.positions.astype(np.int64))
    results = {}
    c_calls: list[int] = []
    run_in_c = LeanCpuForward._run_in_c
    monkeypatch.setattr(LeanCpuForward, "_run_in_c", lambda *args: (c_calls.append(1), run_in_c(*args))[1])
    for lean in (False, True):
        for k_cache, v_cache in runner.kv_caches:  # each path writes this step's keys and values afresh
            k_cache.zero_()
            v_cache.zero_()
        model.lean_forward = lean
        with torch.inference_mode():
            hidden = model(ids, positions, runner.kv_caches, meta)
        results[lean] = (hidden, [(k.clone(), v.clone()) for k, v in runner.kv_caches])
    in_c = family in ("llama", "mistral") and packed_format != "mkl"
    uncut = sliding_window is None or shapes is DECODES or (sliding_window == 64 and shapes is not LARGE)
    in_c = in_c and not (packed_format == "both" and shapes is LARGE) and uncut
    assert c_calls == ([1] if in_c else [])
    (lean_hidden, lean_caches), (module_hidden, module_caches) = results[True], results[False]
    assert torch.equal(lean_hidden, module_hidden)
    assert lean_hidden.abs().sum() > 0
    for (lean_k, lean_v), (module_k, module_v) in zip(lean_caches, module_caches, strict=True):
        assert torch.equal(lean_k, module_k) and torch.equal(lean_v, module_v)
        assert lean_k.abs().sum() > 0


def test_lean_forward_runs_by_default(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The default runner's steps take the lean path (so the parity tests against transformers run it).
    calls = []
    original = LeanCpuForward.__call__

    def counting(self: LeanCpuForward, *args: object) -> torch.Tensor:
        calls.append(1)
        return original(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(LeanCpuForward, "__call__", counting)
    runner = _runner(tiny_llama)
    runner._forward(step_inputs(_step(SMALL, seed=0), BLOCK_SIZE))
    assert calls == [1]


def test_lean_forward_not_built_without_packed_weights(tiny_llama: Path) -> None:
    runner = _runner(tiny_llama, packed_gemm=False)
    assert runner.model is not None and runner.model.lean is None


def test_lean_forward_not_built_without_fused_projections(tiny_llama: Path) -> None:
    runner = TorchModelRunner(tiny_llama, device="cpu", kv_cache_blocks=NUM_BLOCKS, fuse_projections=False)
    runner.load()
    assert runner.model is not None and runner.model.lean is None


def test_lean_forward_rejects_a_cache_it_cannot_read(tiny_llama: Path) -> None:
    runner = _runner(tiny_llama)
    assert runner.model is not None and runner.model.lean is not None
    step = step_inputs(_step(SMALL, seed=0), BLOCK_SIZE)
    meta = attention_cpu.build_metadata(step, sliding_window=None)
    embeddings = torch.randn(step.num_tokens, runner.model.spec.hidden_size)
    cos_sin = runner.model.rotary.cos_sin(torch.from_numpy(step.positions.astype(np.int64)), torch.float32)
    strided = [(k.transpose(0, 1), v) for k, v in runner.kv_caches]
    with pytest.raises(ValueError, match="contiguous KV caches"):
        runner.model.lean(embeddings, cos_sin, strided, meta)
    narrow_values = [(k, v[:, :1].contiguous()) for k, v in runner.kv_caches]  # the writes would overrun them
    with pytest.raises(ValueError, match="contiguous KV caches"):
        runner.model.lean(embeddings, cos_sin, narrow_values, meta)


@pytest.mark.parametrize("in_c", [True, False], ids=["c", "python"])
def test_lean_forward_rejects_caches_and_slots_that_change_under_it(tiny_llama: Path, in_c: bool) -> None:
    """A step after a good one: a cache cut short at the same address, then a slot past the cache's end, each a
    ValueError before anything is written, on the one C call (which checks its caches again whenever one's
    shape differs from the last checked ones) as on the Python path."""
    runner = _runner(tiny_llama, "panels")
    model = runner.model
    assert model is not None and model.lean is not None
    if not in_c:
        model.lean._c_max_tokens = 0
    step = step_inputs(_step(SMALL, seed=0), BLOCK_SIZE)
    meta = attention_cpu.build_metadata(step, sliding_window=None)
    embeddings = torch.randn(step.num_tokens, model.spec.hidden_size)
    cos_sin = model.rotary.cos_sin(torch.from_numpy(step.positions.astype(np.int64)), torch.float32)
    model.lean(embeddings.clone(), cos_sin, runner.kv_caches, meta)
    (k0, v0), *rest = runner.kv_caches
    slots = int(meta.slot_mapping.max()) + 1
    short = [(k0, v0), *((k[:slots - 1], v[:slots - 1]) for k, v in rest)]  # same addresses, fewer slots
    before = [k.clone() for k, _ in runner.kv_caches]
    with pytest.raises(ValueError, match="KV"):
        model.lean(embeddings.clone(), cos_sin, short, meta)
    past = attention_cpu.build_metadata(step, sliding_window=None)
    past.slot_mapping[0] = runner.kv_caches[0][0].shape[0]
    with pytest.raises(ValueError, match="outside the cache"):
        model.lean(embeddings.clone(), cos_sin, runner.kv_caches, past)
    if in_c:  # checked before any layer runs: nothing written
        assert all(torch.equal(k, b) for (k, _), b in zip(runner.kv_caches, before, strict=True))
    mixed = [(k, v.bfloat16()) for k, v in runner.kv_caches]  # a float32 and a bfloat16 cache
    with pytest.raises(ValueError, match="of one dtype"):
        runner.model.lean(embeddings, cos_sin, mixed, meta)
    doubles = [(k.double(), v.double()) for k, v in runner.kv_caches]
    with pytest.raises(ValueError, match="float32 or bfloat16 KV caches"):
        runner.model.lean(embeddings, cos_sin, doubles, meta)
    meta.slot_mapping[0] = runner.kv_caches[0][0].shape[0]  # one past the last slot
    with pytest.raises(ValueError, match="outside the cache"):
        runner.model.lean(embeddings, cos_sin, runner.kv_caches, meta)
