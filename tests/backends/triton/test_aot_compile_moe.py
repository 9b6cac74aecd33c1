"""Every fused-MoE kernel configuration the launcher can pick, compiled ahead of time for sm_90a (H200) and
sm_80 (A100) with triton's compiler and the ptxas its wheel ships: no GPU needed.

As for attention (test_aot_compile.py): a variant that spills registers runs from local memory on
the GPU, which only a device would show, so the test reads ptxas's report instead; float16 and
bfloat16 must not spill, and each variant's pipelined tiles must fit the architecture's shared
memory (a launch would fail otherwise). The shapes are Qwen3-30B-A3B's experts (128 experts, top-8,
hidden 2048, 768 wide) in both dtypes and architectures, and Mixtral-8x7B's (8 experts, top-2, hidden
4096, 14336 wide) in bfloat16 on sm_90a: the sizes only bound the kernels' loops, so register use
does not follow them. The table is printed (``pytest -s``) and copied into docs/gpu.md.
"""

from __future__ import annotations

import os
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[gpu]')")

import torch

from asyncllm.backends.triton._kernels.variants import CompileKey, KernelUsage, MoeShape, moe_aot_usage, moe_keys

DTYPES = {"fp16": torch.float16, "bf16": torch.bfloat16}
ARCHS = (90, 80)
SHARED_LIMIT = {90: 227 * 1024, 80: 163 * 1024}
"""The most shared memory one program may use: sm_90's and sm_80's opt-in maximum per block."""
MODELS = {"Qwen3-30B-A3B": (128, 8, 2048, 768), "Mixtral-8x7B": (8, 2, 4096, 14336)}


def _ptxas_available() -> bool:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        return all(os.path.exists(get_ptxas(arch).path) for arch in ARCHS)
    except Exception:  # no CUDA backend or no ptxas in this triton: nothing to compile with
        return False


def _configurations() -> list[tuple[str, str, CompileKey, int]]:
    configs = []
    for model, (experts, top_k, hidden, intermediate) in MODELS.items():
        for name, dtype in DTYPES.items():
            archs = ARCHS if model == "Qwen3-30B-A3B" else (90,) if name == "bf16" else ()
            shape = MoeShape(experts, top_k, hidden, intermediate, dtype)
            configs.extend((model, name, key, arch) for key in moe_keys(shape) for arch in archs)
    return configs


def _compile(job: tuple[str, str, CompileKey, int]) -> KernelUsage:
    model, dtype, key, arch = job
    experts, top_k, hidden, intermediate = MODELS[model]
    return moe_aot_usage(key, MoeShape(experts, top_k, hidden, intermediate, DTYPES[dtype]), arch)


@pytest.mark.skipif(not _ptxas_available(), reason="triton's ptxas is missing")
def test_no_register_spills_and_shared_memory_fits(monkeypatch: pytest.MonkeyPatch, tmp_path: os.PathLike[str]) -> None:
    configs = _configurations()
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)  # the workers compile for real
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRITON_DEFAULT_FP_FUSION", "1")  # triton's default, said aloud (it warns otherwise)
    start = time.perf_counter()
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1, mp_context=get_context("spawn")) as pool:
        usages = list(pool.map(_compile, configs))
    print(f"\n{len(configs)} compiles in {time.perf_counter() - start:.0f} s on {os.cpu_count()} cores")
    print(f"{'model':<14} {'dtype':>5} {'kernel':<12} {'arch':>6} {'M':>3} {'N':>3} {'K':>4} {'warps':>5} "
          f"{'regs':>4} {'spill B':>7} {'smem KB':>7} {'s':>5}")  # fmt: skip
    failures = []
    for (model, dtype, key, arch), usage in zip(configs, usages, strict=True):
        c = dict(key.constexprs)
        arch_name = "sm_90a" if arch == 90 else f"sm_{arch}"
        print(f"{model:<14} {dtype:>5} {key.kernel:<12} {arch_name:>6} {c['BLOCK_M']:>3} {c['BLOCK_N']:>3} "
              f"{c['BLOCK_K']:>4} {key.num_warps:>5} {usage.registers:>4} {usage.spill_bytes:>7} "
              f"{usage.shared_bytes / 1024:>7.0f} {usage.seconds:>5.1f}")  # fmt: skip
        if usage.spill_bytes or usage.shared_bytes > SHARED_LIMIT[arch]:
            failures.append((model, dtype, key.kernel, c["BLOCK_M"], arch_name, usage))
    assert not failures, f"configurations that spill registers or overflow shared memory: {failures}"
