"""Tests of ``asyncllm.testing.tiny_models``: tiny random HF model folders built locally."""

from __future__ import annotations

import json
import os
import pathlib
import time
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
)

from asyncllm.testing.tiny_models import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    FAMILIES,
    PAD_TOKEN,
    build_tiny_model,
    tiny_model_path,
)

ROUND_TRIP_TEXT = "héllo wörld 你好 🙂"
SAMPLE_TEXTS = [
    ROUND_TRIP_TEXT,
    "The quick brown fox jumps over the lazy dog.",
    "Numbers 12345 and 3.14159, code: def f(x): return x * 2\n\n  indented\ttab",
    "Café déjà vu — naïve résumé; Grüße! 日本語のテキスト 한국어 👨‍👩‍👧 🇫🇷",
    "<|im_start|>user\nhi there<|im_end|>\n<|im_start|>assistant\n",
    "",
    " leading and trailing spaces  ",
]


@pytest.fixture(scope="module", params=FAMILIES)
def family_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, pathlib.Path]:
    family = str(request.param)
    path = build_tiny_model(tmp_path_factory.mktemp(family) / "model", family)
    return family, path


def _load_model(path: pathlib.Path) -> PreTrainedModel:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert isinstance(model, PreTrainedModel)
    assert not model.training
    return model


def _random_ids(vocab_size: int, length: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab_size, (1, length), generator=generator)


def test_folder_layout(family_dir: tuple[str, pathlib.Path]) -> None:
    _, path = family_dir
    names = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")
    for name in names:
        assert (path / name).is_file(), name
    config = json.loads((path / "config.json").read_text())
    assert config["dtype"] == "float32"
    for tensor in load_file(path / "model.safetensors").values():
        assert tensor.dtype == torch.float32


def test_loads_with_transformers(family_dir: tuple[str, pathlib.Path]) -> None:
    family, path = family_dir
    config = AutoConfig.from_pretrained(path)
    assert config.model_type == {"gemma3": "gemma3_text"}.get(family, family)  # HF names gemma3 text so
    model = _load_model(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert model.config.vocab_size == 512
    assert len(tokenizer) == model.config.vocab_size


def test_tokenizer_round_trip_and_multibyte(family_dir: tuple[str, pathlib.Path]) -> None:
    _, path = family_dir
    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer.encode(ROUND_TRIP_TEXT, add_special_tokens=False)
    assert tokenizer.decode(ids) == ROUND_TRIP_TEXT
    for char in ("你", "🙂", "é"):
        assert len(tokenizer.encode(char, add_special_tokens=False)) > 1, char
    for text in SAMPLE_TEXTS:
        assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)) == text


def test_raw_tokenizer_agrees_with_auto_tokenizer(family_dir: tuple[str, pathlib.Path]) -> None:
    _, path = family_dir
    auto = AutoTokenizer.from_pretrained(path)
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    for text in SAMPLE_TEXTS:
        raw_ids = raw.encode(text, add_special_tokens=False).ids
        assert raw_ids == auto.encode(text, add_special_tokens=False), text
        assert raw.decode(raw_ids, skip_special_tokens=False) == text


def test_special_tokens_and_eos_ids_agree(family_dir: tuple[str, pathlib.Path]) -> None:
    _, path = family_dir
    tokenizer = AutoTokenizer.from_pretrained(path)
    config = AutoConfig.from_pretrained(path)
    generation = json.loads((path / "generation_config.json").read_text())
    assert tokenizer.eos_token == EOS_TOKEN
    assert tokenizer.pad_token == PAD_TOKEN
    assert tokenizer.eos_token_id == config.eos_token_id == generation["eos_token_id"] == 2
    assert tokenizer.pad_token_id == config.pad_token_id == 0
    assert tokenizer.convert_tokens_to_ids(["<|endoftext|>", "<|im_start|>", "<|im_end|>"]) == [0, 1, 2]
    ids = tokenizer.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == 1
    assert ids[-1] == 2
    assert tokenizer.encode("hi", add_special_tokens=True) == tokenizer.encode("hi", add_special_tokens=False)
    assert tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"


def test_chat_template(family_dir: tuple[str, pathlib.Path]) -> None:
    _, path = family_dir
    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"


def test_forward_logits_are_decisive(family_dir: tuple[str, pathlib.Path]) -> None:
    _, path = family_dir
    model = _load_model(path)
    ids = _random_ids(model.config.vocab_size, 96, seed=1)
    with torch.no_grad():
        logits = model(ids).logits[0]
    assert torch.isfinite(logits).all()
    assert logits.std().item() > 1.0
    top2 = logits.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert (gaps > 1e-4).float().mean().item() >= 0.9


def test_greedy_generate_runs(family_dir: tuple[str, pathlib.Path]) -> None:
    _, path = family_dir
    model = _load_model(path)
    tokenizer = AutoTokenizer.from_pretrained(path)
    inputs = tokenizer("Once upon a time", return_tensors="pt")
    with torch.no_grad():
        generate = model.generate  # mypy sees nn.Module.__getattr__ here, not GenerationMixin
        out = generate(**inputs, max_new_tokens=8, do_sample=False, min_new_tokens=8)  # type: ignore[operator]
    assert out.shape[1] == inputs["input_ids"].shape[1] + 8


def test_family_specifics(family_dir: tuple[str, pathlib.Path]) -> None:
    family, path = family_dir
    config = AutoConfig.from_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    tied = family in ("llama", "qwen3", "granite")
    assert config.tie_word_embeddings is tied
    assert ("lm_head.weight" in tensors) is not tied
    if family == "qwen2":
        bias = tensors["model.layers.0.self_attn.q_proj.bias"]
        assert bias.abs().min().item() > 0.0
    if family == "qwen3":
        assert config.head_dim * config.num_attention_heads != config.hidden_size
        assert "model.layers.0.self_attn.q_norm.weight" in tensors
    if family == "mistral":
        assert config.sliding_window is None
    if family in ("gemma2", "gemma3"):
        assert config.sliding_window == 8 and "sliding_attention" in config.layer_types
        assert "model.layers.0.pre_feedforward_layernorm.weight" in tensors
    if family == "gemma3":
        assert config.rope_parameters["full_attention"]["rope_type"] == "linear"
        assert "model.layers.0.self_attn.q_norm.weight" in tensors
    else:
        assert config.rope_parameters["rope_type"] == "default"
    norm = tensors["model.norm.weight"]
    assert not torch.equal(norm, torch.ones_like(norm))


def test_llama3_rope_scaling(tmp_path: pathlib.Path) -> None:
    path = build_tiny_model(tmp_path / "m", "llama", rope_scaling="llama3")
    config = AutoConfig.from_pretrained(path)
    assert config.rope_parameters["rope_type"] == "llama3"
    model = _load_model(path)
    with torch.no_grad():
        logits = model(_random_ids(512, 300, seed=2)).logits
    assert torch.isfinite(logits).all()


def test_rope_scaling_rejected_elsewhere(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="rope_scaling"):
        build_tiny_model(tmp_path / "m", "qwen2", rope_scaling="llama3")
    with pytest.raises(ValueError, match="rope_scaling"):
        build_tiny_model(tmp_path / "m", "mistral", rope_scaling="yarn")


def test_unknown_family(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match="gpt2"):
        build_tiny_model(tmp_path / "m", "gpt2")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"vocab_size": 100}, "vocab_size"),
        ({"num_heads": 4, "num_kv_heads": 3}, "num_kv_heads"),
        ({"hidden_size": 60, "num_heads": 8, "num_kv_heads": 2}, "hidden_size"),
        ({"head_dim": 15}, "head_dim"),
    ],
)
def test_bad_sizes(tmp_path: pathlib.Path, kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_tiny_model(tmp_path / "m", "llama", **kwargs)


def test_custom_sizes_and_untied_override(tmp_path: pathlib.Path) -> None:
    path = build_tiny_model(
        tmp_path / "m", "llama", vocab_size=300, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1,
        intermediate_size=48, tie_word_embeddings=False,
    )
    config = AutoConfig.from_pretrained(path)
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (300, 32, 1)
    assert config.tie_word_embeddings is False
    assert len(AutoTokenizer.from_pretrained(path)) == 300


def test_deterministic_and_seeded(tmp_path: pathlib.Path) -> None:
    state = torch.random.get_rng_state()
    first = build_tiny_model(tmp_path / "a", "qwen2", seed=3)
    assert torch.equal(state, torch.random.get_rng_state()), "global RNG must be left alone"
    second = build_tiny_model(tmp_path / "b", "qwen2", seed=3)
    other = build_tiny_model(tmp_path / "c", "qwen2", seed=4)
    a, b, c = (load_file(p / "model.safetensors") for p in (first, second, other))
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert (first / "tokenizer.json").read_bytes() == (second / "tokenizer.json").read_bytes()
    assert (first / "tokenizer.json").read_bytes() == (other / "tokenizer.json").read_bytes()


def test_build_is_fast(tmp_path: pathlib.Path) -> None:
    start = time.perf_counter()
    build_tiny_model(tmp_path / "m", "mistral")
    assert time.perf_counter() - start < 5.0


def test_tiny_model_path_caches(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "cache"
    path = tiny_model_path(root, "qwen3", seed=1)
    assert path.parent == root
    assert path.name.startswith("qwen3-")
    assert (path / "config.json").is_file()
    stamp = os.stat(path / "model.safetensors").st_mtime_ns
    assert tiny_model_path(root, "qwen3", seed=1) == path
    assert os.stat(path / "model.safetensors").st_mtime_ns == stamp
    assert tiny_model_path(root, "qwen3", seed=2) != path
    assert tiny_model_path(root, "llama", seed=1) != path
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == []


def test_tiny_model_path_replaces_incomplete_folder(tmp_path: pathlib.Path) -> None:
    root = tmp_path / "cache"
    path = tiny_model_path(root, "llama")
    (path / "config.json").unlink()
    assert tiny_model_path(root, "llama") == path
    assert (path / "config.json").is_file()
    _load_model(path)


def test_large_vocab_is_padded_with_reserved_tokens(tmp_path: pathlib.Path) -> None:
    path = build_tiny_model(tmp_path / "m", "qwen3", vocab_size=2048, hidden_size=32, num_heads=2, num_kv_heads=1)
    tokenizer = AutoTokenizer.from_pretrained(path)
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    assert len(tokenizer) == raw.get_vocab_size() == AutoConfig.from_pretrained(path).vocab_size == 2048
    assert str(tokenizer.convert_ids_to_tokens(2047)).startswith("<|reserved_")
    assert tokenizer.decode(tokenizer.encode(ROUND_TRIP_TEXT)) == ROUND_TRIP_TEXT


def test_tiny_model_path_key_includes_defaults(tmp_path: pathlib.Path) -> None:
    assert tiny_model_path(tmp_path, "mistral") == tiny_model_path(tmp_path, "mistral", seed=0, vocab_size=512)
    with pytest.raises(TypeError):
        tiny_model_path(tmp_path, "mistral", no_such_argument=1)
