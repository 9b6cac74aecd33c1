"""Start-up work that makes the forward fast: ``torch.compile`` of the dense parts.

``compile_dense_parts(model)`` compiles the two dense halves of a decoder layer
(``DecoderLayer.pre_attention``: input norm, fused q/k/v matmul, q/k norms, rotary;
``DecoderLayer.post_attention``: o_proj, residual, post norm, fused gate/up matmul, SiLU, down
matmul, residual) with inductor, and warms them up at once, on the calling (device) thread, so no
request ever waits for a compilation. The attention between them stays outside the graphs: it
reads and writes the paged KV cache through its backend.

- One graph serves every layer: the layer is an argument of the compiled function, its weights are
  graph inputs, so a model of 8 or 30 layers compiles the same two functions. Each model compiles
  its own copies of them, so models of different shapes in one process do not share (or exhaust)
  dynamo's per-function recompilation budget.
- Shapes: the token dimension is dynamic (warm-up at a few tokens, marked dynamic), plus the
  single-token shape, which torch specializes (a decode step of one sequence). Two graphs per
  function, whatever the batch; nothing recompiles while serving.
- Cache: inductor's on-disk caches (``TORCHINDUCTOR_CACHE_DIR``, by default
  ``/tmp/torchinductor_<user>``) keep the generated code, so a second start-up with the same model
  shapes and torch version skips code generation (seconds instead of tens of seconds).
"""

from __future__ import annotations

import functools
import logging
import time
import types
from collections.abc import Callable
from typing import Any

import torch

from asyncllm.models._llama import CompiledParts, DecoderForCausalLM, DecoderLayer

logger = logging.getLogger("asyncllm")

__all__ = ["compile_dense_parts", "inductor_cache_dir"]

# Tokens of the warm-up call that compiles the dynamic graph: any size > 1 does (1 is specialized).
_WARMUP_TOKENS = 8


def inductor_cache_dir() -> str:
    """Where inductor keeps its on-disk cache in this process."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return str(cache_dir())


def compile_dense_parts(model: DecoderForCausalLM) -> float:
    """Compile every layer's dense parts and warm them up; afterwards the model runs them compiled.

    Runs on the device thread (the thread that later runs the model) and logs a progress line.

    Args:
        model: The loaded model (after ``fuse_projections``, which the graphs then include).

    Returns:
        Seconds spent compiling and warming up.
    """
    spec = model.spec
    layers = [layer for layer in model.model.layers if isinstance(layer, DecoderLayer)]
    if not layers:
        return 0.0
    device, dtype = layers[0].input_layernorm.weight.device, layers[0].input_layernorm.weight.dtype
    logger.info(
        "compiling %s's dense layers with torch.compile on %s (once; cached in %s) ...",
        spec.architecture,
        device,
        inductor_cache_dir(),
    )
    start = time.perf_counter()
    pre = torch.compile(_private_copy(DecoderLayer.pre_attention))
    post = torch.compile(_private_copy(DecoderLayer.post_attention))
    for layer in layers:
        layer.compiled = CompiledParts(functools.partial(pre, layer), functools.partial(post, layer))
    try:
        with torch.inference_mode():
            # The dynamic graph first, then the single-token one. Every layer is called once so
            # that each one's guards are known to pass before the first request.
            for tokens in (_WARMUP_TOKENS, 1):
                x = torch.zeros(tokens, spec.hidden_size, device=device, dtype=dtype)
                cos = torch.ones(tokens, spec.rotary_dim, device=device, dtype=dtype)
                sin = torch.zeros(tokens, spec.rotary_dim, device=device, dtype=dtype)
                attended = torch.zeros(tokens, spec.num_heads * spec.head_dim, device=device, dtype=dtype)
                if tokens > 1:
                    for tensor in (x, cos, sin, attended):
                        torch._dynamo.maybe_mark_dynamic(tensor, 0)
                for layer in layers:
                    assert layer.compiled is not None
                    layer.compiled.pre_attention(x, cos, sin, True)
                    layer.compiled.post_attention(x, attended)
    except BaseException:
        for layer in layers:
            layer.compiled = None
        raise
    elapsed = time.perf_counter() - start
    logger.info("compiled %s's dense layers in %.1f s", spec.architecture, elapsed)
    return elapsed


def _private_copy(function: Callable[..., Any]) -> Callable[..., Any]:
    # dynamo keeps compiled graphs, guards and the recompile limit on the code object: a copy of
    # the code gives this model's compilation its own.
    assert isinstance(function, types.FunctionType)
    code = function.__code__.replace()
    copy = types.FunctionType(code, function.__globals__, function.__name__, function.__defaults__)
    copy.__qualname__ = function.__qualname__
    return copy
