"""The attention kernels' compiled variants are few and known at load (``_kernels.variants``).

Triton compiles a kernel once per compile key (constexprs, warps, and the specialisation of the other
arguments: an integer equal to 1 or divisible by 16, a pointer aligned to 16 bytes). Each new key met
while serving is a compile in the middle of a step. The tests check that (a) the launches' real
specialisation, as triton computes it, never varies with the batch, (b) over every context length
and batch size a model allows, the keys are few and all listed by ``reachable_keys``, and (c) the
backend's warm-up launches exactly those keys.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[gpu]')")

import torch
from triton.backends.compiler import BaseBackend
from triton.runtime.jit import native_specialize_impl

from asyncllm import SamplingParams
from asyncllm.backends.triton._backend import TritonAttentionBackend
from asyncllm.backends.triton._kernels import paged_attention as paged_module
from asyncllm.backends.triton._kernels import split_kv_decode as split_module
from asyncllm.backends.triton._kernels.split_kv_decode import num_kv_splits
from asyncllm.backends.triton._kernels.variants import (
    AttentionShape,
    CompileKey,
    expected_signature,
    reachable_keys,
    step_keys,
)
from asyncllm.backends.triton._launchers import build_metadata, paged_attention
from asyncllm.executor._runner import SequenceInput
from asyncllm.worker._input_batch import step_inputs

KERNELS = {"paged_attention": (paged_module, "_paged_attention_kernel"),
           "split_kv": (split_module, "_split_kv_kernel"), "reduce": (split_module, "_reduce_kernel")}  # fmt: skip


class Recorder:
    """Stands in for a triton kernel: records each launch's compile key and triton's specialisation."""

    def __init__(self, name: str, kernel: Any, launches: list[tuple[CompileKey, tuple[Any, ...], torch.dtype]]) -> None:
        self.name, self.launches = name, launches
        self.arg_names: list[str] = kernel.arg_names
        self.unspecialised = set(kernel.kwargs["do_not_specialize"] or ())

    def __getitem__(self, grid: object) -> Callable[..., None]:
        def launch(*args: Any, num_warps: int = 4, **constexprs: Any) -> None:
            names = [n for n in self.arg_names if n not in constexprs]
            signature = tuple(
                native_specialize_impl(BaseBackend, arg, False, name not in self.unspecialised, True)
                for name, arg in zip(names, args, strict=True)
            )
            dtype = next(a.dtype for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()
                         and a.dtype != torch.float32) if self.name != "reduce" else args[0].dtype  # fmt: skip
            plain = {k: str(v) if k == "DOT_DTYPE" else v for k, v in constexprs.items()}
            self.launches.append((CompileKey(self.name, tuple(sorted(plain.items())), num_warps), signature, dtype))

        return launch


def _seq(request_id: int, tokens: int, start: int) -> SequenceInput:
    table = list(range(request_id * 64, request_id * 64 + -(-(start + tokens) // 16)))
    return SequenceInput(request_id, list(range(tokens)), start, table, True, SamplingParams())


def test_launch_specialisation_never_varies(monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps of 1 to 33 sequences, decode and prefill, contexts across 16-column and 16-byte
    boundaries: every launch's specialisation is the kernel's ``expected_signature``, and its key
    one of ``step_keys``'s. Before: num_seqs of 1 became a constant, 16 or 32 a multiple of 16, the
    metadata slices' alignment followed the batch, and the table width the context."""
    launches: list[tuple[CompileKey, tuple[Any, ...], torch.dtype]] = []
    for name, (module, attr) in KERNELS.items():
        monkeypatch.setattr(module, attr, Recorder(name, getattr(module, attr), launches))
    dtype = torch.float16
    shape = AttentionShape(8, 2, 64, dtype, 16, None)
    k_cache = torch.zeros(40 * 64 * 16, 2, 64, dtype=dtype)
    expected_keys: set[CompileKey] = set()
    for num_seqs in (1, 2, 3, 5, 16, 17, 32, 33):
        for tokens, context in ((1, 1), (1, 15), (1, 200), (1, 257), (3, 40), (16, 16)):
            step = step_inputs([_seq(i, tokens, context - tokens) for i in range(num_seqs)], 16)
            for splits in (1, 2, 8) if tokens == 1 else (1,):
                meta = build_metadata(step, num_kv_heads=2, device=torch.device("cpu"), num_kv_splits=splits)
                q = torch.zeros(step.num_tokens, 8, 64, dtype=dtype)
                paged_attention(q, k_cache, k_cache, meta, 0.125)
                expected_keys.update(step_keys(shape, max_query_len=tokens, num_splits=splits))
    assert launches
    for key, signature, launch_dtype in launches:
        assert signature == expected_signature(key.kernel, launch_dtype), key
    assert {key for key, _, _ in launches} == expected_keys


def test_compile_keys_over_every_context_and_batch() -> None:
    """Qwen3-0.6B's attention on an H200 (132 SMs): every context up to max_model_len and every batch
    up to max_num_seqs, decode and prefill. Before: the split count took every value from 2 to 64
    (a variant each), now a power of two."""
    shape = AttentionShape(16, 8, 128, torch.bfloat16, 16, None)
    max_model_len, max_num_seqs, num_sms = 8192, 256, 132
    splits_seen: set[int] = set()
    for batch in range(1, max_num_seqs + 1):
        for context in range(1, max_model_len + 1):
            splits_seen.add(num_kv_splits(batch, shape.num_kv_heads, context, num_sms))
    keys = {key for splits in splits_seen for key in step_keys(shape, max_query_len=1, num_splits=splits)}
    keys |= set(step_keys(shape, max_query_len=2, num_splits=1))  # a prefill or mixed step never splits
    print(f"\nsplit counts: {sorted(splits_seen)}; {len(keys)} compile keys:")
    for key in sorted(keys):
        print(f"  {key.kernel} warps={key.num_warps} {dict(key.constexprs)}")
    assert all(s & (s - 1) == 0 for s in splits_seen)
    assert keys == set(reachable_keys(shape, max_model_len=max_model_len, max_num_seqs=max_num_seqs, num_sms=num_sms))
    assert len(keys) <= 2 + 1 + 6  # decode, prefill, the split kernel, a reduce per power of two up to 64


def test_warm_up_launches_every_reachable_key(monkeypatch: pytest.MonkeyPatch) -> None:
    launches: list[tuple[CompileKey, tuple[Any, ...], torch.dtype]] = []
    for name, (module, attr) in KERNELS.items():
        monkeypatch.setattr(module, attr, Recorder(name, getattr(module, attr), launches))
    backend = TritonAttentionBackend(device=torch.device("cpu"), num_kv_heads=2, sliding_window=32)
    count = backend.warm_up(num_heads=8, head_dim=64, dtype=torch.float16, block_size=16, max_model_len=4096,
                            max_num_seqs=8, num_sms=132)  # fmt: skip
    shape = AttentionShape(8, 2, 64, torch.float16, 16, 32)
    wanted = set(reachable_keys(shape, max_model_len=4096, max_num_seqs=8, num_sms=132))
    assert {key for key, _, _ in launches} == wanted
    assert count == len(wanted)
    # A hybrid model's global layers attend without the window: their variants are compiled too.
    launches.clear()
    count = backend.warm_up(num_heads=8, head_dim=64, dtype=torch.float16, block_size=16, max_model_len=4096,
                            max_num_seqs=8, num_sms=132, global_layers=True)  # fmt: skip
    unwindowed = set(reachable_keys(AttentionShape(8, 2, 64, torch.float16, 16), max_model_len=4096, max_num_seqs=8,
                                    num_sms=132))  # fmt: skip
    assert {key for key, _, _ in launches} == wanted | unwindowed and unwindowed - wanted
    for key, signature, launch_dtype in launches:
        assert signature == expected_signature(key.kernel, launch_dtype), key


def test_soft_capped_variants_are_their_own_and_warmed_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """gemma2: a soft-capped model's backend warms up (and its layers launch) the SOFTCAP variants only,
    with the cap a float argument never specialised on: the same keys as without, but for SOFTCAP."""
    launches: list[tuple[CompileKey, tuple[Any, ...], torch.dtype]] = []
    for name, (module, attr) in KERNELS.items():
        monkeypatch.setattr(module, attr, Recorder(name, getattr(module, attr), launches))
    backend = TritonAttentionBackend(device=torch.device("cpu"), num_kv_heads=2, sliding_window=32, softcap=50.0)
    count = backend.warm_up(num_heads=8, head_dim=64, dtype=torch.float16, block_size=16, max_model_len=4096,
                            max_num_seqs=8, num_sms=132, global_layers=True)  # fmt: skip
    capped = AttentionShape(8, 2, 64, torch.float16, 16, 32, 50.0)
    per_shape = [reachable_keys(shape, max_model_len=4096, max_num_seqs=8, num_sms=132)
                 for shape in (capped, dataclasses.replace(capped, sliding_window=None))]  # fmt: skip
    wanted = {key for keys in per_shape for key in keys}
    assert {key for key, _, _ in launches} == wanted and count == sum(map(len, per_shape))
    plain = set(reachable_keys(dataclasses.replace(capped, softcap=None), max_model_len=4096, max_num_seqs=8,
                               num_sms=132))  # fmt: skip
    # The attention keys differ in SOFTCAP; the reduce has no soft-cap and is shared.
    assert wanted & plain and all(key.kernel == "reduce" for key in wanted & plain)
    assert all(dict(key.constexprs).get("SOFTCAP", True) for key in wanted)
    # A step of the model, decode and prefill, split or not: the keys and specialisation warm-up compiled.
    launches.clear()
    for tokens, splits in ((1, 1), (1, 4), (5, 1)):
        step = step_inputs([_seq(i, tokens, 300) for i in range(3)], 16)
        meta = build_metadata(step, num_kv_heads=2, device=torch.device("cpu"), num_kv_splits=splits,
                              sliding_window=32)  # fmt: skip
        q = torch.zeros(step.num_tokens, 8, 64, dtype=torch.float16)
        k_cache = torch.zeros(40 * 64 * 16, 2, 64, dtype=torch.float16)
        backend.attend(q, q, q, (k_cache, k_cache), meta, 0.125, softcap=50.0)
    assert {key for key, _, _ in launches} <= wanted
    for key, signature, launch_dtype in launches:
        assert signature == expected_signature(key.kernel, launch_dtype), key
