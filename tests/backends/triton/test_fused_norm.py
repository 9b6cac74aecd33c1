"""The fused residual-add + RMSNorm on the triton backend (``DecoderForCausalLM.fused_norm``).

The model runs the same steps twice, with the fused kernels and with the unfused torch ops, each
against its own KV cache: the hidden states agree to float32 rounding and greedy tokens are equal.
Counting the kernel's calls shows the fused path really runs, and only where it should (triton
metadata, eager layers). On the CPU the kernels run in triton's interpreter: tiny model, few steps.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("triton", reason="triton is not installed (pip install -e '.[gpu]')")

import torch

import asyncllm.backends.triton._kernels.rms_norm
from asyncllm import SamplingParams
from asyncllm.backends.triton._launchers import build_metadata
from asyncllm.executor._runner import SequenceInput
from asyncllm.models import DecoderForCausalLM
from asyncllm.models._llama import CompiledParts, DecoderLayer
from asyncllm.testing.tiny_models import tiny_model_path
from asyncllm.worker._input_batch import step_inputs
from asyncllm.worker._model_runner import TorchModelRunner

GPU = torch.cuda.is_available()
BLOCK = 4
KV_BLOCKS = 16


@pytest.fixture(scope="module", params=["llama", "qwen3"])
def runner(request: pytest.FixtureRequest, tiny_cache: Path) -> Iterator[TorchModelRunner]:
    # qwen3: head_dim 64, GQA 2 and q/k RMSNorm (which stays on torch: it is not a residual norm).
    kwargs: dict[str, Any] = {"hidden_size": 128, "num_heads": 4, "num_kv_heads": 2, "head_dim": 64}
    path = tiny_model_path(tiny_cache, request.param, **(kwargs if request.param == "qwen3" else {}))
    runner = TorchModelRunner(
        path, device="cuda" if GPU else "cpu", dtype="float32", block_size=BLOCK, kv_cache_blocks=KV_BLOCKS,
        attention_backend="triton", enforce_eager=True,
    )  # fmt: skip
    runner.load()
    yield runner
    runner.close()


def _model(runner: TorchModelRunner) -> DecoderForCausalLM:
    assert runner.model is not None
    return runner.model


def _fresh_caches(runner: TorchModelRunner) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in runner.kv_caches]


def _forward(
    runner: TorchModelRunner, sequences: list[SequenceInput], caches: list[tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    model = _model(runner)
    step = step_inputs(sequences, BLOCK)
    meta = build_metadata(step, num_kv_heads=model.spec.num_kv_heads, device=runner.device)
    ids = torch.from_numpy(step.input_ids).to(runner.device)
    positions = torch.from_numpy(step.positions).to(runner.device)
    with torch.inference_mode():
        result: torch.Tensor = model(ids, positions, caches, meta)
    return result


def _greedy(runner: TorchModelRunner, fused: bool, steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill two ragged prompts in one step, then decode ``steps`` tokens each, greedily."""
    model = _model(runner)
    model.fused_norm = fused
    caches = _fresh_caches(runner)
    tables = [[5, 2, 9, 0], [7, 3, 11]]
    tokens = [[11, 12, 13, 14, 15, 16, 17, 18, 19], [40, 41, 42, 43, 44]]
    hidden_states = []
    fed = [list(t) for t in tokens]
    for _ in range(steps + 1):
        sequences = [
            SequenceInput(i, feed, len(tokens[i]) - len(feed), tables[i], True, SamplingParams())
            for i, feed in enumerate(fed)
        ]
        hidden = _forward(runner, sequences, caches)
        hidden_states.append(hidden)
        last = torch.tensor([len(f) for f in fed]).cumsum(0) - 1
        with torch.inference_mode():
            next_ids = model.logits(hidden[last.to(hidden.device)]).argmax(-1).tolist()
        for i, token in enumerate(next_ids):
            tokens[i].append(token)
        fed = [[token] for token in next_ids]
    model.fused_norm = True
    return tokens, hidden_states


def test_fused_norm_matches_unfused(runner: TorchModelRunner) -> None:
    fused_tokens, fused_hidden = _greedy(runner, fused=True, steps=3)
    plain_tokens, plain_hidden = _greedy(runner, fused=False, steps=3)
    assert fused_tokens == plain_tokens
    for fused, plain in zip(fused_hidden, plain_hidden):
        # Only the norms' reductions run in another order: float32 rounding apart.
        torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)


@pytest.fixture
def norm_calls(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Whether each call of the RMSNorm kernel had a residual, in call order."""
    calls: list[bool] = []
    kernel = asyncllm.backends.triton._kernels.rms_norm.rms_norm

    def counting(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> Any:
        calls.append(residual is not None)
        return kernel(x, weight, eps, residual=residual)

    monkeypatch.setattr(asyncllm.backends.triton._kernels.rms_norm, "rms_norm", counting)
    return calls


def _one_step(runner: TorchModelRunner) -> torch.Tensor:
    sequences = [SequenceInput(0, [3, 4, 5, 6, 7], 0, [1, 2], True, SamplingParams())]
    return _forward(runner, sequences, _fresh_caches(runner))


def test_fused_path_runs_one_kernel_per_norm(runner: TorchModelRunner, norm_calls: list[bool]) -> None:
    layers = _model(runner).spec.num_layers
    _one_step(runner)
    # The first input norm has no residual yet; every later norm adds the one before it, the
    # final norm included.
    assert norm_calls == [False] + [True] * (2 * layers)
    norm_calls.clear()
    _model(runner).fused_norm = False
    try:
        _one_step(runner)
    finally:
        _model(runner).fused_norm = True
    assert norm_calls == []


def test_compiled_layers_do_not_fuse(runner: TorchModelRunner, norm_calls: list[bool]) -> None:
    # Stand-ins for compiled parts (the eager methods): their presence alone selects the unfused path.
    layers = [layer for layer in _model(runner).model.layers if isinstance(layer, DecoderLayer)]
    for layer in layers:
        layer.compiled = CompiledParts(layer.pre_attention, layer.post_attention)
    try:
        _one_step(runner)
    finally:
        for layer in layers:
            layer.compiled = None
    assert norm_calls == []
