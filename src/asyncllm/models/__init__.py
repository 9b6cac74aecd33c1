"""Our implementations of HF decoder architectures, looked up by the config's ``architectures``."""

from __future__ import annotations

from typing import Any

from asyncllm.models._llama import DecoderForCausalLM, DecoderSpec
from asyncllm.models._parallel import SINGLE, TensorParallel

# Every family here is a Llama-shaped decoder; they differ in a few switches (see DecoderSpec).
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    # ---- phi3 / granite / olmo2: begin ----
    "Phi3ForCausalLM",
    "GraniteForCausalLM",
    "Olmo2ForCausalLM",
    # ---- phi3 / granite / olmo2: end ----
    "Qwen3MoeForCausalLM",
    "MixtralForCausalLM",
)
_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    # ---- phi3 / granite / olmo2: begin ----
    "phi3": "Phi3ForCausalLM",
    "granite": "GraniteForCausalLM",
    "olmo2": "Olmo2ForCausalLM",
    # ---- phi3 / granite / olmo2: end ----
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
}


def model_spec(config: Any) -> DecoderSpec:
    """The ``DecoderSpec`` of the model an HF config describes.

    Raises:
        NotImplementedError: The config names an architecture asyncllm does not implement.
    """
    architectures = list(getattr(config, "architectures", None) or [])
    if not architectures and getattr(config, "model_type", None) in _BY_MODEL_TYPE:
        # Converted checkpoints (GGUF) sometimes say only which family they are.
        architectures = [_BY_MODEL_TYPE[config.model_type]]
    for name in architectures:
        if name in SUPPORTED_ARCHITECTURES:
            return DecoderSpec.from_hf_config(config, name)
    raise NotImplementedError(
        f"architectures {architectures} are not supported; asyncllm implements {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


def build_model(config: Any, parallel: TensorParallel = SINGLE) -> DecoderForCausalLM:
    """Instantiate (on the meta-free default device, uninitialised) the model an HF config describes.

    Args:
        config: The HF config, or the model's ``DecoderSpec`` read off it already (``model_spec``).
        parallel: The rank's place in a tensor-parallel model: the model then holds its shard.

    Raises:
        NotImplementedError: The config names an architecture asyncllm does not implement, or one that
            cannot be split over ``parallel.size`` ranks.
    """
    spec = config if isinstance(config, DecoderSpec) else model_spec(config)
    return DecoderForCausalLM(spec, parallel)


TENSOR_PARALLEL_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
"""The families ``tensor_parallel_size`` > 1 splits: the plain Llama layer (with q/k/v biases, per-head q/k
norms, a sliding window). The others' extra parts (MoE experts, whole-projection norms, fused
checkpoints, Gemma's layer) are not sharded yet."""


def tensor_parallel_problem(config: Any, size: int) -> str | None:
    """Why the model ``config`` describes cannot be split over ``size`` ranks; None when it can.

    The query heads, and the MLP's intermediate size, must divide evenly over the ranks; the KV
    heads too, or the ranks over them (each KV head is then replicated on ``size / num_kv_heads``
    ranks).
    """
    spec = model_spec(config)
    if spec.architecture not in TENSOR_PARALLEL_ARCHITECTURES:
        supported = ", ".join(TENSOR_PARALLEL_ARCHITECTURES)
        return f"tensor parallelism supports {supported}; this model is {spec.architecture}"
    if spec.num_heads % size:
        return f"its {spec.num_heads} attention heads do not divide over {size} ranks"
    if spec.num_kv_heads % size and size % spec.num_kv_heads:
        return (
            f"its {spec.num_kv_heads} KV heads and {size} ranks do not divide one into the other "
            "(each rank needs whole KV heads, or a KV head replicated on a whole number of ranks)"
        )
    if spec.intermediate_size % size:
        return f"its MLP intermediate size {spec.intermediate_size} does not divide over {size} ranks"
    return None


__all__ = [
    "SUPPORTED_ARCHITECTURES",
    "TENSOR_PARALLEL_ARCHITECTURES",
    "DecoderForCausalLM",
    "DecoderSpec",
    "build_model",
    "model_spec",
    "tensor_parallel_problem",
]
