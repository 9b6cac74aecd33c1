"""The compiled variants of the attention kernels a model can reach, as a pure function of its shapes.

Triton compiles a kernel once per *compile key*: its constexpr arguments, its warps, and the
specialisation of its other arguments (an integer equal to 1 becomes a constant, one divisible by 16
and a pointer aligned to 16 bytes are compiled as such). The launchers keep everything but the
constexprs constant for a model: sizes that change per step (``num_seqs``, the split count) are not
specialised on, the packed metadata's sections are aligned and its block tables 16 columns wide
(``_launchers.PackedLayout``), and the split-KV scratch is padded. What remains varies only with the
kind of step (decode or prefill) and the split count, a power of two; ``reachable_keys`` lists the
keys over every batch and context a model's limits allow, and ``warm_up`` compiles them all at load
so none is compiled mid-serving.

``expected_signature`` is the specialisation every launch of a kernel has (checked against triton's
own on real launches in tests/backends/triton/test_variants.py); ``aot_usage`` compiles a key ahead of
time for a GPU architecture, without a GPU, and reports its registers and spills
(tests/backends/triton/test_aot_compile.py).

The fused-MoE kernels (``fused_moe``) have the same three: ``moe_keys`` (two tile configurations per
dtype, each a gate/up and a down kernel), ``moe_expected_signature`` (model constants only: the batch
changes the grid, never the key) and ``moe_aot_usage`` (tests/backends/triton/test_aot_compile_moe.py).
"""

from __future__ import annotations

import contextlib
import io
import re
import time
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import triton

from asyncllm.backends.triton._kernels.fused_moe import moe_configs
from asyncllm.backends.triton._kernels.paged_attention import dot_precision, launch_config
from asyncllm.backends.triton._kernels.split_kv_decode import num_kv_splits

__all__ = [
    "AttentionShape",
    "CompileKey",
    "KernelUsage",
    "MoeShape",
    "aot_usage",
    "expected_signature",
    "moe_aot_usage",
    "moe_expected_signature",
    "moe_keys",
    "reachable_keys",
    "step_keys",
    "warm_up",
]

_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_METADATA = ("query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr")
_SCRATCH = ("acc_ptr", "max_ptr", "sum_ptr")
_UNSPECIALISED = ("num_seqs", "sliding_window", "num_splits")
_FLOATS = ("scale_log2e", "softcap")


class CompileKey(NamedTuple):
    """One compiled variant: the kernel, its constexprs (sorted by name) and its warps."""

    kernel: str
    """``paged_attention``, ``split_kv`` or ``reduce``."""
    constexprs: tuple[tuple[str, int | bool | str], ...]
    num_warps: int


@dataclass(frozen=True, slots=True)
class AttentionShape:
    """What of a model decides its attention kernels' variants."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    block_size: int
    sliding_window: int | None = None
    softcap: float | None = None
    """The attention soft-cap (gemma2): its value is a runtime argument, only whether there is one a constexpr."""


def _attention_key(kernel: str, shape: AttentionShape, max_query_len: int) -> CompileKey:
    queries_per_kv = shape.num_heads // shape.num_kv_heads
    config = launch_config(queries_per_kv, max_query_len, shape.head_dim, shape.dtype)
    constexprs: dict[str, int | bool | str] = {
        "QUERIES_PER_KV": queries_per_kv,
        "HEAD_DIM": shape.head_dim,
        "HEAD_DIM_PAD": triton.next_power_of_2(shape.head_dim),
        "BLOCK_SIZE": shape.block_size,
        "BLOCK_M": config.block_m,
        "BLOCK_Q": config.block_q,
        "TILE_N": config.tile_n,
        "SLIDING": shape.sliding_window is not None,
        "SOFTCAP": shape.softcap is not None,
        "DOT_DTYPE": _DTYPE_NAMES[shape.dtype],
        "DOT_PRECISION": dot_precision(shape.dtype),
    }
    return CompileKey(kernel, tuple(sorted(constexprs.items())), config.num_warps)


def step_keys(shape: AttentionShape, *, max_query_len: int, num_splits: int) -> tuple[CompileKey, ...]:
    """The keys one step launches: the attention kernel, or the split-KV kernel and its reduce.

    Args:
        shape: The model's attention shape.
        max_query_len: The step's longest query (1: decode only).
        num_splits: The step's KV splits (1: no split).
    """
    if num_splits <= 1:
        return (_attention_key("paged_attention", shape, max_query_len),)
    reduce = {
        "SPLITS_PAD": triton.next_power_of_2(num_splits),
        "HEAD_DIM": shape.head_dim,
        "HEAD_DIM_PAD": triton.next_power_of_2(shape.head_dim),
    }
    return (_attention_key("split_kv", shape, max_query_len), CompileKey("reduce", tuple(sorted(reduce.items())), 4))


def _reachable_splits(shape: AttentionShape, max_model_len: int, max_num_seqs: int, num_sms: int | None) -> set[int]:
    if num_sms is None:
        return set()
    longest = max(1, max_model_len // 256)  # num_kv_splits only looks at max_seq_len // min_tokens
    splits = set()
    for batch in range(1, max_num_seqs + 1):
        for tokens in range(1, longest + 1):
            splits.add(num_kv_splits(batch, shape.num_kv_heads, tokens * 256 + 255, num_sms))
    return splits - {1}


def reachable_keys(
    shape: AttentionShape, *, max_model_len: int, max_num_seqs: int, num_sms: int | None
) -> dict[CompileKey, tuple[int, int]]:
    """Every key a model's steps can launch, with a (max_query_len, num_splits) that launches it.

    Args:
        shape: The model's attention shape.
        max_model_len: The longest context.
        max_num_seqs: The largest batch.
        num_sms: The device's streaming multiprocessors; None: no split-KV (off CUDA).
    """
    cases = [(1, 1), (2, 1)] + [(1, s) for s in sorted(_reachable_splits(shape, max_model_len, max_num_seqs, num_sms))]
    keys: dict[CompileKey, tuple[int, int]] = {}
    for max_query_len, splits in cases:
        for key in step_keys(shape, max_query_len=max_query_len, num_splits=splits):
            keys.setdefault(key, (max_query_len, splits))
    return keys


def _pointer_type(kernel: str, name: str, dtype: torch.dtype) -> str:
    if name in _METADATA:
        return "*i32"
    if name in _SCRATCH and not (kernel == "reduce" and name == "out_ptr"):
        return "*fp32"
    return f"*{_DTYPE_NAMES[dtype]}"


def _kernel(kernel: str) -> Any:
    from asyncllm.backends.triton._kernels import paged_attention, split_kv_decode
    return {
        "paged_attention": paged_attention._paged_attention_kernel,
        "split_kv": split_kv_decode._split_kv_kernel,
        "reduce": split_kv_decode._reduce_kernel,
    }[kernel]


def _runtime_params(kernel: str) -> list[str]:
    # The kernels spell their constexpr parameters in capitals, their runtime ones in lower case.
    return [name for name in _kernel(kernel).arg_names if not name.isupper()]


def expected_signature(kernel: str, dtype: torch.dtype) -> tuple[tuple[str, str | None], ...]:
    """The (type, specialisation) of each runtime argument in every launch of ``kernel``, in order.

    Pointers are 16-byte aligned (``"D"``), strides multiples of 16 (``"D"``), per-step sizes not
    specialised (None), the softmax scale and the soft-cap floats (None): triton's own spelling
    (``triton.runtime.jit.native_specialize_impl``).
    """
    signature: list[tuple[str, str | None]] = []
    for name in _runtime_params(kernel):
        if name.endswith("_ptr"):
            signature.append((_pointer_type(kernel, name, dtype), "D"))
        elif name in _FLOATS:
            signature.append(("fp32", None))
        else:
            signature.append(("i32", None if name in _UNSPECIALISED else "D"))
    return tuple(signature)


class KernelUsage(NamedTuple):
    """What ptxas reports for one compiled variant."""

    registers: int
    spill_bytes: int
    """Spill stores plus spill loads."""
    seconds: float
    """Compile time (triton's passes and ptxas)."""
    shared_bytes: int = 0
    """Shared memory the variant needs per program (its pipelined tiles)."""


_DOT_DTYPES = {"fp32": triton.language.float32, "fp16": triton.language.float16, "bf16": triton.language.bfloat16}


def _compile_usage(
    fn: Any, key: CompileKey, runtime: dict[str, tuple[str, str | None]], capability: int
) -> KernelUsage:
    """Compile ``fn`` with ``key``'s constexprs and warps and the runtime arguments' (type, specialisation)
    for ``sm_<capability>``, and read ptxas's report."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    constexprs: dict[str, Any] = dict(key.constexprs)
    if "DOT_DTYPE" in constexprs:
        constexprs["DOT_DTYPE"] = _DOT_DTYPES[str(constexprs["DOT_DTYPE"])]
    signature = {name: runtime[name][0] if name in runtime else "constexpr" for name in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(fn.arg_names) if runtime.get(name, ("", None))[1]}
    log = io.StringIO()
    start = time.perf_counter()
    with knobs.nvidia.scope(), knobs.cache.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(log):
        knobs.nvidia.dump_ptxas_log = True
        knobs.compilation.always_compile = True
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=GPUTarget("cuda", capability, 32),
                                  options={"num_warps": key.num_warps})  # fmt: skip
    seconds = time.perf_counter() - start
    text = log.getvalue()
    registers = re.search(r"Used (\d+) registers", text)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", text)
    if registers is None or spills is None:
        raise RuntimeError(f"ptxas reported no register use for {key}: {text[-2000:]!r}")
    spill_bytes = int(spills.group(1)) + int(spills.group(2))
    return KernelUsage(int(registers.group(1)), spill_bytes, seconds, int(compiled.metadata.shared))


def aot_usage(key: CompileKey, dtype: torch.dtype, capability: int) -> KernelUsage:
    """Compile ``key`` ahead of time for ``sm_<capability>`` (90: sm_90a) and read ptxas's report.

    Needs no GPU, only triton's compiler and the ptxas its wheel ships; must run in a process where
    ``TRITON_INTERPRET`` is unset (the interpreter replaces the kernels). Triton's cache is bypassed so
    that ptxas runs and reports.

    Raises:
        RuntimeError: ptxas printed no register count.
    """
    runtime = dict(zip(_runtime_params(key.kernel), expected_signature(key.kernel, dtype), strict=True))
    return _compile_usage(_kernel(key.kernel), key, runtime, capability)


@dataclass(frozen=True, slots=True)
class MoeShape:
    """What of a Mixture-of-Experts model decides its fused-MoE kernels' variants."""

    num_experts: int
    top_k: int
    hidden_size: int
    intermediate_size: int
    dtype: torch.dtype


_MOE_KERNELS = ("moe_gate_up", "moe_down")


def moe_keys(shape: MoeShape) -> tuple[CompileKey, ...]:
    """Every key a model's MoE layers launch: for each of ``fused_moe.moe_config``'s two configurations
    (by the batch's pairs per expert), the gate/up kernel and the down kernel."""
    keys = []
    for config in moe_configs(shape.num_experts, shape.dtype):
        for kernel in _MOE_KERNELS:
            constexprs: dict[str, int | bool | str] = {
                "HIDDEN": shape.hidden_size,
                "INTERMEDIATE": shape.intermediate_size,
                "NUM_EXPERTS": shape.num_experts,
                "BLOCK_M": config.block_m,
                "BLOCK_N": config.block_n,
                "BLOCK_K": config.block_k,
                "DOT_DTYPE": _DTYPE_NAMES[shape.dtype],
                "DOT_PRECISION": dot_precision(shape.dtype),
            }
            if kernel == "moe_gate_up":
                constexprs["TOP_K"] = shape.top_k
            keys.append(CompileKey(kernel, tuple(sorted(constexprs.items())), config.num_warps))
    return tuple(keys)


def _moe_kernel(kernel: str) -> Any:
    from asyncllm.backends.triton._kernels import fused_moe
    return {"moe_gate_up": fused_moe._gate_up_kernel, "moe_down": fused_moe._down_kernel}[kernel]


def _moe_strides(kernel: str, shape: MoeShape) -> dict[str, int]:
    hidden, intermediate = shape.hidden_size, shape.intermediate_size
    if kernel == "moe_gate_up":
        return {"stride_act": intermediate, "stride_x": hidden, "stride_w_expert": 2 * intermediate * hidden,
                "stride_w_row": hidden}  # fmt: skip
    return {"stride_out": hidden, "stride_act": intermediate, "stride_w_expert": hidden * intermediate,
            "stride_w_row": intermediate}  # fmt: skip


def moe_expected_signature(kernel: str, shape: MoeShape) -> tuple[tuple[str, str | None], ...]:
    """The (type, specialisation) of each runtime argument in every launch of a fused-MoE kernel.

    Pointers: fresh or parameter tensors, 16-byte aligned (``"D"``); the layout's int32, the routing
    weights float32, the rest the model's dtype. Strides: the model's sizes (``"D"`` where a multiple
    of 16), whatever the batch.
    """
    strides = _moe_strides(kernel, shape)
    signature: list[tuple[str, str | None]] = []
    for name in _moe_kernel(kernel).arg_names:
        if name.isupper():
            continue
        if name.endswith("_ptr"):
            pointee = "i32" if name in ("pairs_ptr", "block_experts_ptr") else "fp32" if name == "routing_ptr" else None
            signature.append((f"*{pointee or _DTYPE_NAMES[shape.dtype]}", "D"))
        else:
            signature.append(("i32", "D" if strides[name] % 16 == 0 else None))
    return tuple(signature)


def moe_aot_usage(key: CompileKey, shape: MoeShape, capability: int) -> KernelUsage:
    """``aot_usage`` for a fused-MoE key (``moe_keys``) of a model of ``shape``."""
    fn = _moe_kernel(key.kernel)
    names = [name for name in fn.arg_names if not name.isupper()]
    runtime = dict(zip(names, moe_expected_signature(key.kernel, shape), strict=True))
    return _compile_usage(fn, key, runtime, capability)


def warm_up(shape: AttentionShape, cases: list[tuple[int, int]], device: torch.device) -> None:
    """Launch the attention kernels once for each (max_query_len, num_splits), on a tiny batch, so
    that triton compiles (or loads from its cache) every variant before the first request.

    The variant depends only on the model's shapes and the case, not on the batch
    (``reachable_keys``), so one sequence of ``max_query_len`` tokens stands for every step.
    """
    from asyncllm.backends.triton._kernels.paged_attention import paged_attention
    from asyncllm.backends.triton._launchers import PackedLayout, table_width

    slots = shape.block_size
    q = torch.zeros(2, shape.num_heads, shape.head_dim, dtype=shape.dtype, device=device)
    k_cache = torch.zeros(slots, shape.num_kv_heads, shape.head_dim, dtype=shape.dtype, device=device)
    for max_query_len, splits in cases:
        layout = PackedLayout(1, table_width(max_query_len, shape.block_size), max_query_len)
        packed = torch.zeros(layout.size, dtype=torch.int32)
        packed[1] = max_query_len
        packed[layout.seq_lens_at] = max_query_len
        on_device = packed.to(device)
        meta = layout.metadata(
            on_device, 1, max_query_len, block_size=shape.block_size, max_query_len=max_query_len,
            max_seq_len=max_query_len, num_kv_splits=splits, sliding_window=shape.sliding_window,
        )  # fmt: skip
        args = (q[:max_query_len], k_cache, k_cache, meta.query_start_loc, meta.seq_lens, meta.block_tables)
        if splits > 1:
            from asyncllm.backends.triton._kernels.split_kv_decode import split_kv_attention
            split_kv_attention(*args, block_size=shape.block_size, max_query_len=max_query_len, scale=1.0,
                               num_splits=splits, sliding_window=shape.sliding_window,
                               softcap=shape.softcap)  # fmt: skip
        else:
            paged_attention(*args, block_size=shape.block_size, max_query_len=max_query_len, scale=1.0,
                            sliding_window=shape.sliding_window, softcap=shape.softcap)  # fmt: skip
