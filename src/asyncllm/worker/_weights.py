"""Reading an HF-format model folder: config, safetensors weights, end-of-sequence ids."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file


def load_config(model_path: Path) -> Any:
    """The folder's config.json as a transformers config object."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path)


def load_state_dict(model_path: Path, tie_word_embeddings: bool) -> dict[str, torch.Tensor]:
    """Every tensor of the folder's *.safetensors files, named as HF names them.

    With tied embeddings the output projection is the input embedding, whether or not the
    checkpoint stores it separately.
    """
    state: dict[str, torch.Tensor] = {}
    for file in sorted(model_path.glob("*.safetensors")):
        state.update(load_file(file))
    if tie_word_embeddings:
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    # Checkpoints may carry precomputed rotary tables; ours are computed from the config.
    return {name: tensor for name, tensor in state.items() if "rotary_emb" not in name}


def load_eos_token_ids(model_path: Path, config: Any) -> frozenset[int]:
    """The ids that end generation: from generation_config.json if present, else config.json."""
    generation_config = model_path / "generation_config.json"
    value: Any = None
    if generation_config.exists():
        value = json.loads(generation_config.read_text()).get("eos_token_id")
    if value is None:
        value = getattr(config, "eos_token_id", None)
    if value is None:
        return frozenset()
    if isinstance(value, int):
        return frozenset((value,))
    return frozenset(int(v) for v in value)
