"""Every attention-kernel configuration the launchers can pick, compiled ahead of time for sm_90a (H200)
and sm_80 (A100) with triton's compiler and the ptxas its wheel ships: no GPU needed.

A configuration that spills registers runs from local memory on the GPU; this would only show on a
device, so the test reads ptxas's report instead. float16 and bfloat16 must not spill at all. The
compiles run in fresh processes (the test session runs triton's interpreter, which replaces the
kernels) in parallel, one per core; the table of registers and spills is printed (``pytest -s``) and
copied into docs/gpu.md.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[gpu]')")

import torch

from asyncllm.backends.triton._kernels.variants import AttentionShape, CompileKey, KernelUsage, aot_usage, step_keys

HEAD_SIZES = (64, 80, 96, 128, 256)
DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
ARCHS = (90, 80)
# float32 is not asserted (no GPU model is served in it) and, to keep the test within CI's minutes,
# compiled for sm_90a only and without the sliding-window variants.
FP32_ARCHS = (90,)
# (label, max_query_len, num_splits): the launch kinds; the reduce is compiled at its widest (64 splits).
KINDS = (("decode", 1, 1), ("prefill", 2, 1), ("split-KV", 1, 64))
# The soft-capped variants (gemma2) at its head sizes, with the window (its sliding layers: the window's
# masks besides the cap, the most registers of its variants), in fp16 only, to keep the test within
# CI's minutes: bf16 compiled to the same registers, no spills (docs/gpu.md).
SOFTCAP_HEAD_SIZES = (128, 256)


def _ptxas_available() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return all(os.path.exists(get_ptxas(arch).path) for arch in ARCHS)
    except Exception:  # no CUDA backend or no ptxas in this triton: nothing to compile with
        return False


def _configurations() -> list[tuple[str, str, CompileKey, int]]:
    """(label, dtype name, key, arch) for every configuration: 4 query heads per KV head (GQA, the usual
    ratio; BLOCK_M is the same for 1 to 16), a sliding window at head size 128 (Mistral, Qwen2), and the
    soft-capped variants (``SOFTCAP_HEAD_SIZES``)."""
    configs = []
    for head_dim in HEAD_SIZES:
        for name, dtype in DTYPES.items():
            variants: list[tuple[int | None, float | None]] = [(None, None)]
            if head_dim == 128 and name != "fp32":
                variants.append((4096, None))
            if head_dim in SOFTCAP_HEAD_SIZES and name == "fp16":
                variants.append((4096, 50.0))
            for window, softcap in variants:
                shape = AttentionShape(32, 8, head_dim, dtype, 16, window, softcap)
                for kind, max_query_len, splits in KINDS:
                    for key in step_keys(shape, max_query_len=max_query_len, num_splits=splits):
                        label = f"{kind}{' reduce' if key.kernel == 'reduce' else ''}{' window' if window else ''}"
                        label += " softcap" if softcap and key.kernel != "reduce" else ""
                        archs = FP32_ARCHS if name == "fp32" else ARCHS
                        configs.extend((label, name, key, arch) for arch in archs)
    # The reduce does not depend on the window: compile it once per head size and dtype.
    unique: dict[tuple[CompileKey, str, int], tuple[str, str, CompileKey, int]] = {}
    for label, name, key, arch in configs:
        unique.setdefault((key, name, arch), (label, name, key, arch))
    return list(unique.values())


def _compile(job: tuple[CompileKey, str, int]) -> KernelUsage:
    key, dtype, arch = job
    return aot_usage(key, DTYPES[dtype], arch)


@pytest.mark.skipif(not _ptxas_available(), reason="triton's ptxas is missing")
def test_no_register_spills(monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]) -> None:
    configs = _configurations()
    # The workers are spawned with this environment: no interpreter, a cache of their own.
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # triton's default, said aloud (it warns otherwise)
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1, mp_context=get_context("spawn")) as pool:
        usages = list(pool.map(_compile, [(key, dtype, arch) for _, dtype, key, arch in configs]))
    elapsed = time.perf_counter() - start
    print(f"\n{len(configs)} compiles in {elapsed:.0f} s on {os.cpu_count()} cores")
    print(f"{'head':>4} {'dtype':>5} {'kind':<22} {'arch':>6} {'M':>3} {'N':>3} {'warps':>5} "
          f"{'regs':>4} {'spill B':>7} {'s':>5}")  # fmt: skip
    spilled = []
    for (label, dtype, key, arch), usage in zip(configs, usages, strict=True):
        c = dict(key.constexprs)
        arch_name = "sm_90a" if arch == 90 else f"sm_{arch}"
        print(f"{c['HEAD_DIM']:>4} {dtype:>5} {label:<22} {arch_name:>6} {c.get('BLOCK_M', '-'):>3} "
              f"{c.get('TILE_N', '-'):>3} {key.num_warps:>5} {usage.registers:>4} {usage.spill_bytes:>7} "
              f"{usage.seconds:>5.1f}")  # fmt: skip
        if usage.spill_bytes and dtype != "fp32":
            spilled.append((c["HEAD_DIM"], dtype, label, arch_name, usage.spill_bytes))
    assert not spilled, f"configurations that spill registers: {spilled}"
