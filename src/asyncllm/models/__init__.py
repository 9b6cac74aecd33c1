"""Our implementations of HF decoder architectures, looked up by the config's ``architectures``."""

from __future__ import annotations

from typing import Any

from asyncllm.models._llama import DecoderForCausalLM, DecoderSpec

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


def build_model(config: Any) -> DecoderForCausalLM:
    """Instantiate (on the meta-free default device, uninitialised) the model an HF config describes.

    Raises:
        NotImplementedError: The config names an architecture asyncllm does not implement.
    """
    architectures = list(getattr(config, "architectures", None) or [])
    if not architectures and getattr(config, "model_type", None) in _BY_MODEL_TYPE:
        # Converted checkpoints (GGUF) sometimes say only which family they are.
        architectures = [_BY_MODEL_TYPE[config.model_type]]
    for name in architectures:
        if name in SUPPORTED_ARCHITECTURES:
            return DecoderForCausalLM(DecoderSpec.from_hf_config(config, name))
    raise NotImplementedError(
        f"architectures {architectures} are not supported; asyncllm implements {', '.join(SUPPORTED_ARCHITECTURES)}"
    )


__all__ = ["SUPPORTED_ARCHITECTURES", "DecoderForCausalLM", "DecoderSpec", "build_model"]
