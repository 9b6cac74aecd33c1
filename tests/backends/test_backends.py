"""The attention backends (``asyncllm.backends``): the object the runner picks is the one the model calls.

The runner picks one backend object at load for its ``attention_backend`` setting and hands it to the
model; the CUDA graphs build their static metadata through the same object. The model calls the
backend and never looks at the metadata: a backend injected here wraps the real one's metadata in a
type of its own, records every call, and the hidden states are the real backend's, bit for bit. Its
capabilities alone steer the model's path (fused norms, in-kernel rotary, the lean forward).
"""

from __future__ import annotations

import ast
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import Tensor

import asyncllm
from asyncllm.backends import (
    AttentionBackend,
    CpuAttentionBackend,
    TorchAttentionBackend,
    TritonAttentionBackend,
)
from asyncllm.backends._base import DecodeGraphInputs, KVCache
from asyncllm.backends.cpu import _attention as attention_cpu
from asyncllm.backends.cpu import _elementwise as elementwise_cpu
from asyncllm.backends.cpu import _gemm as gemm_cpu
from asyncllm.backends.triton._kernels import triton_available
from asyncllm.executor._runner import SequenceInput
from asyncllm.sampling_params import SamplingParams
from asyncllm.worker._input_batch import StepInputs, step_inputs
from asyncllm.worker._model_runner import TorchModelRunner

BLOCK = 4
CPU_KERNELS = elementwise_cpu.available() and attention_cpu.native_decode_available(16)
needs_cpu_kernels = pytest.mark.skipif(not CPU_KERNELS, reason="no C compiler: the cpu kernels are unavailable")
needs_triton = pytest.mark.skipif(not triton_available(), reason="triton is not installed")


def _runner(model: Path, **options: Any) -> TorchModelRunner:
    runner = TorchModelRunner(model, device="cpu", block_size=BLOCK, kv_cache_blocks=64, **options)
    runner.load()
    return runner


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ({"attention_backend": "torch"}, TorchAttentionBackend),
        pytest.param({"attention_backend": "cpu"}, CpuAttentionBackend, marks=needs_cpu_kernels),
        pytest.param({}, CpuAttentionBackend, marks=needs_cpu_kernels),  # "auto" on the CPU
        # cpu runs float32 only: with torch's bfloat16 it falls back to the reference; bfloat16 weights on
        # bfloat16 panels compute in float32, on it
        ({"attention_backend": "cpu", "dtype": "bfloat16", "packed_gemm": False}, TorchAttentionBackend),
        pytest.param(
            {"attention_backend": "cpu", "dtype": "bfloat16"},
            CpuAttentionBackend,
            marks=[needs_cpu_kernels, pytest.mark.skipif(not gemm_cpu.bfloat16_available(), reason="bf16 panels")],
        ),
        pytest.param({"attention_backend": "triton", "dtype": "float32"}, TritonAttentionBackend, marks=needs_triton),
    ],
    ids=["torch", "cpu", "auto", "cpu-bfloat16", "cpu-bfloat16-panels", "triton"],
)
def test_runner_hands_the_model_the_backend_of_its_setting(
    tiny_llama: Path, options: dict[str, Any], expected: type[AttentionBackend[Any]]
) -> None:
    runner = _runner(tiny_llama, **options)
    assert runner.model is not None
    assert type(runner.backend) is expected
    assert runner.model.backend is runner.backend  # one object: what the runner builds metadata with
    assert runner.attention_backend == runner.backend.name


def test_cpu_falls_back_to_the_reference_without_its_kernel(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(attention_cpu, "native_decode_available", lambda head_dim: False)
    runner = _runner(tiny_llama, attention_backend="cpu")
    assert type(runner.backend) is TorchAttentionBackend and runner.attention_backend == "torch"


@dataclass(frozen=True)
class Tagged:
    """Metadata of the recording backend's own type (the real backend's inside): the model must not care."""

    inner: Any


class Recording(AttentionBackend[Any]):
    """Forwards to a real backend and records the calls; its capabilities are set per test.

    Its metadata is ``Tagged`` unless ``tag`` is False: the lean forward reads the cpu backend's
    metadata itself (``runs_lean_forward`` says it may).
    """

    def __init__(self, inner: AttentionBackend[Any], tag: bool = True, **capabilities: bool) -> None:
        self.inner = inner
        self.tag = tag
        self.name = inner.name
        for name in ("rotates_in_kernel", "fuses_norms", "runs_lean_forward", "captures_graphs"):
            setattr(self, name, capabilities.get(name, getattr(inner, name)))
        self.calls: list[str] = []

    def _unwrap(self, meta: Any) -> Any:
        if not self.tag:
            return meta
        assert type(meta) is Tagged  # what build_metadata made, handed back untouched
        return meta.inner

    def build_metadata(self, step: StepInputs) -> Any:
        self.calls.append("build_metadata")
        meta = self.inner.build_metadata(step)
        return Tagged(meta) if self.tag else meta

    def write_kv(self, kv_cache: KVCache, k: Tensor, v: Tensor, meta: Any) -> None:
        self.calls.append("write_kv")
        self.inner.write_kv(kv_cache, k, v, self._unwrap(meta))

    def attend(
        self, q: Tensor, k: Tensor, v: Tensor, kv_cache: KVCache, meta: Any, scale: float, **options: Any
    ) -> Tensor:
        self.calls.append("attend")
        return self.inner.attend(q, k, v, kv_cache, self._unwrap(meta), scale, **options)

    def rotary_(self, q: Tensor, k: Tensor, cos: Tensor, sin: Tensor) -> None:
        self.calls.append("rotary_")
        self.inner.rotary_(q, k, cos, sin)

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float, residual: Tensor | None) -> Tensor:
        self.calls.append("rms_norm")
        return self.inner.rms_norm(x, weight, eps, residual)

    def kv_splits(self, num_seqs: int, max_seq_len: int) -> int:
        self.calls.append("kv_splits")
        return self.inner.kv_splits(num_seqs, max_seq_len)

    def graph_inputs(
        self, *, max_batch: int, max_blocks: int, block_size: int, device: torch.device
    ) -> DecodeGraphInputs[Any]:
        self.calls.append("graph_inputs")
        inputs = self.inner.graph_inputs(
            max_batch=max_batch, max_blocks=max_blocks, block_size=block_size, device=device
        )
        return TaggedGraphInputs(inputs) if self.tag else inputs


class TaggedGraphInputs:
    def __init__(self, inner: DecodeGraphInputs[Any]) -> None:
        self.inner = inner

    def fill(self, step: StepInputs) -> None:
        self.inner.fill(step)

    def upload(self, non_blocking: bool) -> None:
        self.inner.upload(non_blocking)

    def metadata(self, size: int, splits: int) -> Tagged:
        return Tagged(self.inner.metadata(size, splits))


def _step(seed: int) -> StepInputs:
    """A mixed step on shuffled blocks: decodes with cached context, a fresh prompt, a chunk with history."""
    rng = random.Random(seed)
    free = list(range(64))
    rng.shuffle(free)
    sequences = []
    for request_id, (start, new) in enumerate([(9, 1), (0, 7), (5, 4), (14, 1)]):
        table = [free.pop() for _ in range(-(-(start + new) // BLOCK))]
        ids = [rng.randrange(3, 200) for _ in range(new)]
        sequences.append(SequenceInput(request_id, ids, start, table, True, SamplingParams()))
    return step_inputs(sequences, BLOCK)


def _forward(runner: TorchModelRunner, step: StepInputs) -> tuple[Tensor, list[Tensor]]:
    """Hidden states of one step on fresh (zeroed) caches, and the caches it wrote."""
    for k_cache, v_cache in runner.kv_caches:
        k_cache.zero_()
        v_cache.zero_()
    with torch.inference_mode():
        hidden = runner._forward(step).clone()
    return hidden, [t.clone() for pair in runner.kv_caches for t in pair]


def _inject(runner: TorchModelRunner, backend: AttentionBackend[Any]) -> None:
    assert runner.model is not None
    runner.backend = runner.model.backend = backend


def _per_layer(runner: TorchModelRunner) -> int:
    assert runner.model is not None
    return runner.model.spec.num_layers


@needs_cpu_kernels
@pytest.mark.parametrize(
    ("capabilities", "same_path", "layer_calls", "final_calls"),
    [
        # the fused-norm modules path: each residual add in a norm kernel, rotary in place
        (
            {"runs_lean_forward": False},
            {"lean_forward": False},
            ["rms_norm", "rotary_", "write_kv", "attend", "rms_norm"],
            ["rms_norm"],
        ),
        # no fused norms: torch's norms and rotation, the backend for the KV write and the attention
        ({"fuses_norms": False}, {"fused_norm": False}, ["write_kv", "attend"], []),
        # the unfused path with the rotation left to the backend (as triton's eager layers do)
        (
            {"fuses_norms": False, "rotates_in_kernel": True},
            {"fused_norm": False},
            ["rotary_", "write_kv", "attend"],
            [],
        ),
    ],
    ids=["fused-norms", "unfused", "unfused-rotary-in-kernel"],
)
def test_the_model_calls_the_backend_it_is_given(
    tiny_llama: Path,
    capabilities: dict[str, bool],
    same_path: dict[str, bool],
    layer_calls: list[str],
    final_calls: list[str],
) -> None:
    runner = _runner(tiny_llama)  # the cpu backend; the lean forward built
    assert runner.model is not None and runner.backend is not None
    step = _step(seed=1)
    for switch, value in same_path.items():  # the real backend on the path the capabilities pick
        setattr(runner.model, switch, value)
    expected_hidden, expected_caches = _forward(runner, step)
    recording = Recording(runner.backend, **capabilities)
    _inject(runner, recording)
    for switch in same_path:
        setattr(runner.model, switch, True)
    hidden, caches = _forward(runner, step)
    assert recording.calls == ["build_metadata"] + layer_calls * _per_layer(runner) + final_calls
    # The same bits (the C rotary is torch's rotation bit for bit).
    assert torch.equal(hidden, expected_hidden) and hidden.abs().sum() > 0
    assert all(torch.equal(got, want) for got, want in zip(caches, expected_caches, strict=True))


@needs_cpu_kernels
def test_the_lean_forward_runs_where_the_backend_says_so(tiny_llama: Path) -> None:
    runner = _runner(tiny_llama)
    assert runner.backend is not None and runner.backend.runs_lean_forward
    step = _step(seed=2)
    expected = _forward(runner, step)[0]
    recording = Recording(runner.backend, tag=False)
    _inject(runner, recording)
    assert torch.equal(_forward(runner, step)[0], expected)
    assert recording.calls == ["build_metadata"]  # the lean forward called the kernels itself
    recording.runs_lean_forward = False
    recording.calls.clear()
    assert torch.equal(_forward(runner, step)[0], expected)  # the modules: the same bits
    assert "attend" in recording.calls


@needs_triton
def test_cuda_graphs_build_their_metadata_through_the_backend(tiny_llama: Path) -> None:
    from asyncllm.worker._graphs import DecodeGraphs
    gpu = torch.cuda.is_available()
    runner = TorchModelRunner(
        tiny_llama, device="cuda" if gpu else "cpu", dtype="float32", block_size=BLOCK, kv_cache_blocks=24,
        attention_backend="triton", enforce_eager=True,
    )  # fmt: skip
    runner.load()
    assert runner.model is not None and runner.backend is not None
    recording = Recording(runner.backend)
    _inject(runner, recording)
    tables = [[3, 7], [0, 5]]
    with torch.inference_mode():
        prefill = [SequenceInput(i, [11 + i] * 5, 0, t, True, SamplingParams()) for i, t in enumerate(tables)]
        runner._forward(step_inputs(prefill, BLOCK))
        decode = [SequenceInput(i, [40 + i], 5, t, True, SamplingParams()) for i, t in enumerate(tables)]
        step = step_inputs(decode, BLOCK)
        eager = runner._forward(step).clone()
        recording.calls.clear()
        graphs = DecodeGraphs(
            runner.model, runner.kv_caches, block_size=BLOCK, max_seq_len=32, max_batch=2, device=runner.device,
            use_graphs=gpu,
        )  # fmt: skip
        graphs.capture()
        assert recording.calls[0] == "graph_inputs"
        replayed = graphs.run(step)
    torch.testing.assert_close(replayed, eager, atol=1e-5, rtol=1e-5)
    if not gpu:  # the padded path ran eagerly: the layers called the same object with the static metadata
        assert recording.calls.count("graph_inputs") == 1 and "attend" in recording.calls
    runner.close()


def test_no_metadata_type_checks_outside_the_backends() -> None:
    # The model, the runner and the graphs hold metadata opaquely: no isinstance on a metadata type.
    package = Path(asyncllm.__file__).parent
    sources = [*sorted((package / "models").glob("*.py")), *sorted((package / "worker").glob("*.py"))]
    assert len(sources) >= 10
    for source in sources:
        tree = ast.parse(source.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "isinstance":
                checked = ast.unparse(node.args[1])
                assert "Metadata" not in checked, f"{source.name}:{node.lineno} checks isinstance(..., {checked})"
    # and the model reaches no backend's kernels but through the backend object
    llama = (package / "models" / "_llama.py").read_text(encoding="utf-8")
    for module in ("backends.cpu._attention", "backends.triton._launchers", "backends.cpu._elementwise"):
        assert module not in llama


def test_backends_without_a_hook_say_so() -> None:
    reference = TorchAttentionBackend()
    x = torch.zeros(2, 8)
    with pytest.raises(NotImplementedError, match="torch attention backend"):
        reference.rms_norm(x, torch.ones(8), 1e-6, None)
    with pytest.raises(NotImplementedError, match="rotary"):
        reference.rotary_(x.view(2, 1, 8), x.view(2, 1, 8), x, x)
    with pytest.raises(NotImplementedError, match="triton"):
        reference.graph_inputs(max_batch=1, max_blocks=1, block_size=BLOCK, device=torch.device("cpu"))
    assert reference.kv_splits(4, 4096) == 1
    assert not (reference.fuses_norms or reference.rotates_in_kernel or reference.captures_graphs)
