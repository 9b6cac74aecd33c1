"""Tiny random Hugging Face format model folders for tests, built locally with nothing downloaded.

``build_tiny_model(path, family)`` writes a folder that ``transformers`` (and asyncllm) load like
any checkpoint: ``config.json``, ``generation_config.json``, ``model.safetensors`` (float32 by default,
random weights) and a byte-level BPE tokenizer (``tokenizer.json``, ``tokenizer_config.json``)
trained in well under a second on a small built-in corpus, with a ChatML chat template.

The weights are random but deliberately large, so that logits spread over several units and
greedy choices are not near-ties: a test comparing asyncllm's tokens with ``transformers``'
greedy output is not at the mercy of float rounding. Everything is deterministic for a given
set of arguments.

``tiny_model_path(cache_root, family, **kwargs)`` builds such a folder once under a cache
directory (keyed by a hash of the arguments) and returns it on later calls.

Special tokens (ids fixed): ``<|endoftext|>`` = 0 (pad, and the config's bos),
``<|im_start|>`` = 1, ``<|im_end|>`` = 2 (eos). The tokenizer adds no bos token to prompts.
Multi-byte characters (accents, CJK, emoji) are rare in the training corpus, so they are split
over several byte tokens: detokenization has to cope with tokens that are not valid UTF-8 alone.

The tokenizer pipeline follows the family: a plain ``ByteLevel`` pre-tokenizer for llama and
mistral; for qwen2 and qwen3 the exact pipeline of ``transformers``' ``Qwen2Tokenizer`` (NFC,
Qwen's split regex, ``ByteLevel``), because ``AutoTokenizer`` rebuilds that pipeline for
``qwen2`` folders regardless of ``tokenizer.json``. Either way, ``tokenizers.Tokenizer.from_file``
on ``tokenizer.json`` and ``AutoTokenizer.from_pretrained`` on the folder give the same ids.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import math
import os
import pathlib
import random
import shutil
import tempfile
from collections.abc import Iterator
from typing import Any

import torch
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    trainers,
)
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    GraniteConfig,
    GraniteForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Olmo2Config,
    Olmo2ForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

__all__ = [
    "BUILDER_VERSION",
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "FAMILIES",
    "IM_START_TOKEN",
    "PAD_TOKEN",
    "SPECIAL_TOKENS",
    "build_tiny_model",
    "tiny_model_path",
]

#: Bump when the output of ``build_tiny_model`` changes, so ``tiny_model_path`` caches rebuild.
BUILDER_VERSION = 1

# ---- phi3 / granite / olmo2 and rope scaling: begin ----
_PHI_GRANITE_OLMO: tuple[str, ...] = ("phi3", "granite", "olmo2")
# ---- phi3 / granite / olmo2 and rope scaling: end ----

#: Model families ``build_tiny_model`` can build.
_MOE: tuple[str, ...] = ("qwen3_moe", "mixtral")
FAMILIES: tuple[str, ...] = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", *_PHI_GRANITE_OLMO, *_MOE)

PAD_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
#: Special tokens in id order: they get ids 0, 1, 2.
SPECIAL_TOKENS: tuple[str, ...] = (PAD_TOKEN, IM_START_TOKEN, EOS_TOKEN)

#: A plain ChatML template (Jinja), as Qwen-style chat models ship.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

_CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "gemma2": Gemma2Config,
    "gemma3": Gemma3TextConfig,
}
_MODEL_CLASSES: dict[str, type[PreTrainedModel]] = {
    "llama": LlamaForCausalLM,
    "mistral": MistralForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gemma2": Gemma2ForCausalLM,
    "gemma3": Gemma3ForCausalLM,
}
_TIED_BY_DEFAULT: dict[str, bool] = {
    "llama": True,
    "mistral": False,
    "qwen2": False,
    "qwen3": True,
    # Untied, unlike real Gemma: with a tied embedding these tiny models mostly repeat their input token,
    # whatever the attention does, and the parity tests would not see a wrong window or soft-cap.
    "gemma2": False,
    "gemma3": False,
}
# Gemma's quirks, at sizes where they change the tokens: a window shorter than most test prompts,
# soft-caps of the order of the scores and logits (so tanh bends them), an attention scale that is
# not head_dim's, and (gemma3) linear rope scaling on the global layers with a base of their own.
_GEMMA_SLIDING_WINDOW = 8
_GEMMA_QUERY_PRE_ATTN_SCALAR = 24
_GEMMA2_SOFTCAPS: dict[str, float] = {"attn_logit_softcapping": 1.5, "final_logit_softcapping": 10.0}
_GEMMA3_ROPE: dict[str, Any] = {
    "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
    "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
}
_ROPE_THETA = 10000.0

# ---- phi3 / granite / olmo2 and rope scaling: begin ----
_CONFIG_CLASSES.update({"phi3": Phi3Config, "granite": GraniteConfig, "olmo2": Olmo2Config})
_CONFIG_CLASSES.update({"qwen3_moe": Qwen3MoeConfig, "mixtral": MixtralConfig})
_MODEL_CLASSES.update({"qwen3_moe": Qwen3MoeForCausalLM, "mixtral": MixtralForCausalLM})
_TIED_BY_DEFAULT.update({"qwen3_moe": False, "mixtral": False})
_MODEL_CLASSES.update({"phi3": Phi3ForCausalLM, "granite": GraniteForCausalLM, "olmo2": Olmo2ForCausalLM})
_TIED_BY_DEFAULT.update({"phi3": False, "granite": True, "olmo2": False})
#: Which ``rope_scaling`` each family accepts (besides None).
_ROPE_SCALINGS: dict[str, tuple[str, ...]] = {
    "llama": ("llama3", "yarn"),
    "qwen2": ("yarn",),
    "qwen3": ("yarn",),
    "phi3": ("longrope",),
}
# Phi-4-mini rotates 3/4 of each head. LongRoPE's original context is past the parity tests' longest
# sequence (70 + 16 tokens): transformers recomputes a sequence that crosses it with the long factors,
# which asyncllm does not do (docs/architecture.md); the long factors are checked at the rotary level.
_PHI3_PARTIAL_ROTARY = 0.75
_LONGROPE_ORIGINAL_CONTEXT = 96
_YARN_ROPE: dict[str, Any] = {
    "rope_type": "yarn",
    "rope_theta": _ROPE_THETA,
    "factor": 4.0,
    "original_max_position_embeddings": 256,
}
# Granite's constants, away from 1 so that a forgotten one shows (Granite 3 uses 12, 0.22, 1/128, 8).
_GRANITE_MULTIPLIERS: dict[str, float] = {
    "embedding_multiplier": 2.0,
    "residual_multiplier": 0.5,
    "attention_multiplier": 0.3,
    "logits_scaling": 1.5,
}


def _longrope(head_dim: int) -> dict[str, Any]:
    """Phi-3-style LongRoPE settings with distinct, deterministic short and long factors."""
    pairs = int(head_dim * _PHI3_PARTIAL_ROTARY) // 2
    return {
        "rope_type": "longrope",
        "rope_theta": _ROPE_THETA,
        "short_factor": [1.0 + 0.05 * index for index in range(pairs)],
        "long_factor": [1.0 + 1.5 * index for index in range(pairs)],
        "original_max_position_embeddings": _LONGROPE_ORIGINAL_CONTEXT,
        "partial_rotary_factor": _PHI3_PARTIAL_ROTARY,
    }


def _family_config_kwargs(family: str, kwargs: dict[str, Any], rope_scaling: str | None) -> None:
    """Add the family's quirks and the rope scaling to ``kwargs`` (the config's arguments)."""
    if rope_scaling == "yarn":
        kwargs["rope_parameters"] = dict(_YARN_ROPE)
    if family == "phi3":
        kwargs["partial_rotary_factor"] = _PHI3_PARTIAL_ROTARY
        kwargs["rope_parameters"]["partial_rotary_factor"] = _PHI3_PARTIAL_ROTARY
        if rope_scaling == "longrope":
            kwargs["rope_parameters"] = _longrope(int(kwargs["head_dim"]))
            kwargs["original_max_position_embeddings"] = _LONGROPE_ORIGINAL_CONTEXT
        del kwargs["head_dim"]  # Phi-3 derives it (hidden_size // heads)
    elif family == "granite":
        kwargs.update(_GRANITE_MULTIPLIERS)
    elif family in _MOE:
        _moe_config_kwargs(family, kwargs)


# Mixture of Experts: 4 experts, top-2. Qwen3-MoE's experts are half the dense width, and its last
# layer is dense (``mlp_only_layers``), so a model of two layers has both kinds.
_MOE_EXPERTS = 4
_MOE_TOP_K = 2


def _moe_config_kwargs(family: str, kwargs: dict[str, Any]) -> None:
    kwargs["num_experts_per_tok"] = _MOE_TOP_K
    if family == "mixtral":
        kwargs["num_local_experts"] = _MOE_EXPERTS
        del kwargs["head_dim"]  # Mixtral derives it (hidden_size // heads)
        return
    kwargs["num_experts"] = _MOE_EXPERTS
    kwargs["moe_intermediate_size"] = max(2, int(kwargs["intermediate_size"]) // 2)
    kwargs["norm_topk_prob"] = True
    kwargs["decoder_sparse_step"] = 1
    kwargs["mlp_only_layers"] = [int(kwargs["num_hidden_layers"]) - 1] if int(kwargs["num_hidden_layers"]) > 1 else []


# ---- phi3 / granite / olmo2 and rope scaling: end ----
_LLAMA3_ROPE: dict[str, Any] = {
    "rope_type": "llama3",
    "rope_theta": _ROPE_THETA,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 128,
}
# Weight scales: linear weights keep activations at unit scale; the output projection (or the
# tied embedding, seen through the final RMSNorm) gives logits with a standard deviation of about
# _LOGIT_STD, so the top-1/top-2 gap is typically around a unit.
_LOGIT_STD = 4.0
_LINEAR_GAIN = 1.0
_BIAS_STD = 0.2
_NORM_STD = 0.1
_CORPUS_SEED = 1234
# transformers' Qwen2Tokenizer pre-tokenization regex (models/qwen2/tokenization_qwen2.py).
_QWEN_PRETOKENIZE_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ----------------------------------------------------------------------------------------------
# Tokenizer corpus
# ----------------------------------------------------------------------------------------------

_ENGLISH_LINES = """\
The quick brown fox jumps over the lazy dog.
Once upon a time there was a small town at the edge of a large forest.
The people of the town were farmers, bakers, and carpenters.
Every morning the baker opened the shop before the sun came up.
She made bread, rolls, and cakes for everyone in the village.
In the evening the children played games in the square near the fountain.
The old clock on the tower struck nine, and the lights went out one by one.
It was a quiet place, and nothing much ever happened there.
One day a stranger arrived with a heavy bag and a long coat.
He asked for a room at the inn and paid with a gold coin.
Nobody knew where he came from or why he had come.
Hello, world! This is a test of the tokenizer.
How are you today? I am fine, thank you very much.
What is the capital of France? The capital of France is Paris.
What is two plus two? Two plus two is four.
Please write a short story about a robot who learns to paint.
Translate the following sentence into French.
Summarize the text below in one sentence.
The answer is yes. The answer is no. The answer is maybe.
Machine learning models predict the next token from the previous tokens.
A language model assigns a probability to every possible continuation.
Greedy decoding always picks the most likely token.
Sampling draws a token at random according to the probabilities.
Temperature controls how sharp or flat the distribution is.
Top-k keeps only the k most likely tokens; top-p keeps the smallest set above p.
The server streams tokens back to the client as soon as they are ready.
Requests are batched together so that the accelerator stays busy.
Each request has a prompt, a maximum number of tokens, and stop conditions.
The cache stores keys and values for every layer and every position.
When memory runs out, the scheduler waits until some requests finish.
def add(a, b):
    return a + b
for i in range(10):
    print(i, i * i)
if x > 0 and y < 100:
    result = x * y + 42
class Counter:
    def __init__(self) -> None:
        self.count = 0
import os, sys, json
{"name": "tiny", "layers": 2, "hidden": 64, "ok": true}
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 256 1024 2048 3.14 2.718 -1 1e-5
Dates: 2024-01-01, 1999-12-31, 12:30:45, Monday, Tuesday, Wednesday.
Punctuation: (parentheses) [brackets] {braces} <angles> "quotes" 'single' - _ + = * / \\ | ~ ` ^ % $ # @ !
URL: https://example.com/path?query=value&other=1#section
Email: someone@example.org
The end.
"""

_MULTIBYTE_LINES = """\
Café, naïve, résumé, façade, jalapeño, déjà vu, crème brûlée.
Héllo wörld! Grüße aus München; schöne Straße, Äpfel und Öl.
¿Dónde está la estación? ¡Olé! Año nuevo, niño, señor.
Ελληνικά: γειά σου κόσμε. Русский: привет, мир.
你好，世界。今天天气很好。我们去公园散步吧。
日本語のテキスト：こんにちは、元気ですか。カタカナ。
한국어: 안녕하세요 세계.
Emoji: 🙂 😀 🚀 🎉 👍🏽 ❤️ 🇫🇷 👨‍👩‍👧
Math: ∑ ∫ √ ∞ ≈ ≠ ≤ ≥ → ← ↔ × ÷ ± π µ °C €100 £5 ¥300
"""

_SUBJECTS = (
    "the cat",
    "the dog",
    "a teacher",
    "my friend",
    "the engineer",
    "a small bird",
    "the king",
    "our neighbour",
    "the robot",
    "a student",
    "the captain",
    "her brother",
    "the model",
    "the server",
    "a farmer",
    "the scientist",
)
_VERBS = (
    "found",
    "watched",
    "built",
    "painted",
    "carried",
    "opened",
    "wanted",
    "remembered",
    "followed",
    "cleaned",
    "counted",
    "described",
    "ignored",
    "borrowed",
    "repaired",
    "visited",
)
_OBJECTS = (
    "a red box",
    "the old house",
    "three apples",
    "the long road",
    "a strange letter",
    "the blue door",
    "every window",
    "a broken chair",
    "the river",
    "some fresh bread",
    "the last train",
    "a quiet garden",
    "the new computer",
    "two green bottles",
    "the morning paper",
    "a warm blanket",
)
_ENDINGS = (
    "before dinner",
    "after the rain",
    "in the morning",
    "at night",
    "without a word",
    "with great care",
    "near the station",
    "for the first time",
    "again and again",
    "on a sunny day",
    "because it was late",
    "while everyone slept",
    "",
    "",
    "",
    "",
)


def _generated_lines(count: int) -> Iterator[str]:
    """Yield ``count`` simple English sentences, the same ones every time."""
    rng = random.Random(_CORPUS_SEED)
    for _ in range(count):
        words = [rng.choice(_SUBJECTS), rng.choice(_VERBS), rng.choice(_OBJECTS), rng.choice(_ENDINGS)]
        sentence = " ".join(word for word in words if word)
        yield sentence[0].upper() + sentence[1:] + rng.choice((".", ".", ".", "!", "?"))


def _corpus() -> list[str]:
    """The tokenizer's training text: fixed English, generated sentences and some multi-byte text.

    Multi-byte text appears once, so the trainer merges mostly English byte pairs and multi-byte
    characters (CJK, emoji) stay split over several tokens.
    """
    lines = _ENGLISH_LINES.splitlines()
    lines += list(_generated_lines(300))
    lines += _MULTIBYTE_LINES.splitlines()
    return lines


# ----------------------------------------------------------------------------------------------
# Tokenizer
# ----------------------------------------------------------------------------------------------


def _byte_level_tokenizer(family: str) -> Tokenizer:
    """An empty BPE tokenizer with the byte-level pipeline ``transformers`` uses for ``family``.

    llama and mistral get the plain GPT-2 style ``ByteLevel`` pre-tokenizer. qwen2 and qwen3 get
    exactly the pipeline of ``transformers``' ``Qwen2Tokenizer`` (NFC, Qwen's split regex, then
    ``ByteLevel`` without its own regex): ``AutoTokenizer`` in transformers 5 loads ``qwen2``
    folders with that class whatever ``tokenizer_config.json`` says, and rebuilds this pipeline,
    so ``tokenizer.json`` must match it for every loader to produce the same ids.
    """
    tokenizer = Tokenizer(models.BPE())
    if family in ("qwen2", "qwen3"):
        tokenizer.normalizer = normalizers.NFC()
        tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(_QWEN_PRETOKENIZE_REGEX), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    else:
        tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return tokenizer


def _train_tokenizer(vocab_size: int, family: str) -> Tokenizer:
    """Train a byte-level BPE tokenizer with exactly ``vocab_size`` entries.

    Ids 0-2 are the special tokens, the next 256 the byte alphabet, then merges. The corpus
    supports about 1500 entries; beyond that, the rest are reserved special tokens
    ``<|reserved_N|>`` (as Llama 3 does), so the tokenizer and the model always agree on size.
    """
    tokenizer = _byte_level_tokenizer(family)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=1,
        show_progress=False,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    missing = vocab_size - tokenizer.get_vocab_size()
    if missing > 0:
        tokenizer.add_special_tokens(
            [AddedToken(f"<|reserved_{index}|>", special=True, normalized=False) for index in range(missing)]
        )
    return tokenizer


def _wrap_tokenizer(tokenizer: Tokenizer, max_length: int) -> PreTrainedTokenizerFast:
    """Wrap a ``tokenizers`` tokenizer for ``transformers``, with ChatML special tokens."""
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]  # transformers leaves __init__ untyped
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[IM_START_TOKEN],
        chat_template=CHAT_TEMPLATE,
        model_max_length=max_length,
        clean_up_tokenization_spaces=False,
    )


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------


def _check_args(family: str, vocab_size: int, hidden_size: int, num_heads: int, num_kv_heads: int) -> None:
    """Raise ``ValueError`` for arguments that cannot make a model."""
    if family not in _CONFIG_CLASSES:
        raise ValueError(f"unknown model family {family!r}; expected one of {', '.join(FAMILIES)}")
    minimum_vocab = len(SPECIAL_TOKENS) + 256
    if vocab_size < minimum_vocab:
        raise ValueError(
            f"vocab_size must be at least {minimum_vocab} (byte alphabet + special tokens), got {vocab_size}"
        )
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
    if hidden_size % num_heads:
        raise ValueError(f"hidden_size ({hidden_size}) must be divisible by num_heads ({num_heads})")


def _make_config(
    family: str,
    *,
    vocab_size: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    intermediate_size: int,
    max_position_embeddings: int,
    tie_word_embeddings: bool,
    rope_scaling: str | None,
    sliding_window: int | None = None,
) -> PretrainedConfig:
    """Build the family's ``transformers`` config."""
    kwargs: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": max_position_embeddings,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": tie_word_embeddings,
        "rope_parameters": {"rope_type": "default", "rope_theta": _ROPE_THETA},
        "bos_token_id": SPECIAL_TOKENS.index(PAD_TOKEN),
        "eos_token_id": SPECIAL_TOKENS.index(EOS_TOKEN),
        "pad_token_id": SPECIAL_TOKENS.index(PAD_TOKEN),
        "dtype": "float32",
    }
    if rope_scaling == "llama3":
        kwargs["rope_parameters"] = dict(_LLAMA3_ROPE)
    _family_config_kwargs(family, kwargs, rope_scaling)
    if family == "mistral":
        kwargs["sliding_window"] = sliding_window
    if family in ("qwen2", "qwen3") and sliding_window is not None:
        # The window on the second half of the layers only (HF's layer_types from max_window_layers).
        kwargs.update(use_sliding_window=True, sliding_window=sliding_window, max_window_layers=num_layers // 2)
    if family in ("gemma2", "gemma3"):
        kwargs["sliding_window"] = _GEMMA_SLIDING_WINDOW if sliding_window is None else sliding_window
        kwargs["query_pre_attn_scalar"] = _GEMMA_QUERY_PRE_ATTN_SCALAR
        kwargs["hidden_activation"] = "gelu_pytorch_tanh"
    if family == "gemma2":
        kwargs.update(_GEMMA2_SOFTCAPS)  # layer_types: HF's default, sliding and global alternating
    if family == "gemma3":
        kwargs["rope_parameters"] = json.loads(json.dumps(_GEMMA3_ROPE))  # a deep copy
        kwargs["final_logit_softcapping"] = _GEMMA2_SOFTCAPS["final_logit_softcapping"]
        # layer_types: HF's default, five sliding layers to one global (num_layers 6 has both)
    return _CONFIG_CLASSES[family](**kwargs)


def _init_weights(model: PreTrainedModel, seed: int) -> None:
    """Overwrite every parameter with seeded random values at a scale that gives decisive logits.

    Parameters are visited in name order with a private generator, so the result depends only on
    ``seed`` and the architecture, not on the global RNG or construction order.
    """
    generator = torch.Generator().manual_seed(seed)
    hidden_size = int(model.config.hidden_size)
    tied = bool(model.config.tie_word_embeddings)
    offset_norms = model.config.model_type in ("gemma2", "gemma3_text")  # Gemma's norms scale by 1 + weight
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda item: item[0]):
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            if name.endswith("norm.weight"):
                values = (0.0 if offset_norms else 1.0) + _NORM_STD * noise
            elif name.endswith(".bias"):
                values = _BIAS_STD * noise
            elif name.endswith("embed_tokens.weight"):
                # Seen through the final RMSNorm when tied, so its std sets the logit spread.
                values = noise * (_LOGIT_STD / math.sqrt(hidden_size) if tied else 1.0)
            elif name.endswith("lm_head.weight"):
                values = noise * (_LOGIT_STD / math.sqrt(hidden_size))
            else:
                values = noise * (_LINEAR_GAIN / math.sqrt(param.shape[-1]))
            param.data = values  # float32 even if torch's default dtype is not


def _make_model(family: str, config: PretrainedConfig, seed: int) -> PreTrainedModel:
    """Instantiate a float32 model for ``config`` with seeded random weights."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _MODEL_CLASSES[family](config)
    _init_weights(model, seed)
    return model


# ----------------------------------------------------------------------------------------------
# Public API
# ----------------------------------------------------------------------------------------------


def build_tiny_model(
    path: str | os.PathLike[str],
    family: str = "llama",
    *,
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_position_embeddings: int = 1024,
    tie_word_embeddings: bool | None = None,
    rope_scaling: str | None = None,
    head_dim: int | None = None,
    dtype: str = "float32",
    sliding_window: int | None = None,
) -> pathlib.Path:
    """Write a tiny random model of ``family`` and its tokenizer into the folder ``path``.

    The folder gets ``config.json``, ``generation_config.json``, ``model.safetensors`` (float32
    unless ``dtype`` says otherwise) and ``tokenizer.json`` + ``tokenizer_config.json``; it loads with
    ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained``. Nothing is
    downloaded, and the same arguments always give the same files' contents.

    Args:
        path: Folder to write into; created if missing. Existing files of the same names are
            overwritten.
        family: ``"llama"``, ``"mistral"``, ``"qwen2"`` (q/k/v biases), ``"qwen3"`` (q/k norms,
            ``head_dim`` decoupled from ``hidden_size``), ``"gemma2"`` (sliding and global layers
            alternating, attention and final logit soft-caps, scaled embeddings, GeGLU, four offset
            RMSNorms per layer, ``query_pre_attn_scalar`` 24) or ``"gemma3"`` (the same without the
            attention soft-cap, plus q/k norms and a rope per layer type: theta 10000 on the sliding
            layers, 1e6 with linear scaling 2 on the global ones; five sliding layers to one global),
            ``"phi3"`` (fused qkv and gate_up weights, 3/4 of each head rotated), ``"granite"``
            (embedding, residual, attention and logit multipliers away from 1) or ``"olmo2"``
            (post-norms, whole-projection q/k norms), ``"qwen3_moe"`` (qwen3's attention, 4 experts of
            half ``intermediate_size``, top-2 renormalised; the last layer dense when there are two
            or more) or ``"mixtral"`` (4 experts of ``intermediate_size``, top-2).
        seed: Seed of the random weights. The tokenizer does not depend on it.
        vocab_size: Vocabulary size of the model and of the tokenizer (at least 259: 3 special
            tokens and 256 byte tokens). Past about 1500, the corpus runs out of merges and the
            remaining ids are reserved special tokens ``<|reserved_N|>``.
        hidden_size: Model width.
        num_layers: Number of decoder layers.
        num_heads: Number of attention (query) heads.
        num_kv_heads: Number of key/value heads (grouped-query attention when fewer than
            ``num_heads``); must divide ``num_heads``.
        intermediate_size: Width of the MLP.
        max_position_embeddings: Longest sequence the config declares (also the tokenizer's
            ``model_max_length``).
        tie_word_embeddings: Share the input embedding with the output projection. Default:
            ``True`` for llama and qwen3, ``False`` for mistral and qwen2.
        rope_scaling: ``None`` for plain RoPE (theta 10000); ``"llama3"`` (llama) for Llama
            3.1-style frequency scaling (factor 8, original context 128); ``"yarn"`` (llama, qwen2,
            qwen3) for YaRN (factor 4, original context 256, its attention scaling); ``"longrope"``
            (phi3) for LongRoPE (original context 96, distinct short and long factors).
        head_dim: Size of each attention head. Default: ``hidden_size // num_heads``, except for
            qwen3 where it is twice that, so that ``num_heads * head_dim != hidden_size``.
        dtype: ``"float32"`` or ``"bfloat16"``: the checkpoint's dtype (and the config's). The
            weights are drawn in float32 either way and rounded once when saved.
        sliding_window: The sliding window of mistral (default None: none), of gemma's sliding
            layers (default 8, shorter than most test prompts), and of qwen2's and qwen3's layers from
            ``num_layers // 2`` on (``use_sliding_window`` with ``max_window_layers``; default None: none);
            ignored by the other families.

    Returns:
        The folder, as a ``pathlib.Path``.

    Raises:
        ValueError: If ``family`` is not one of ``FAMILIES``, ``rope_scaling`` is not ``None`` or
            one the family takes (see above), or the sizes are
            inconsistent (heads not dividing, odd ``head_dim``, vocabulary too small).
    """
    _check_args(family, vocab_size, hidden_size, num_heads, num_kv_heads)
    if rope_scaling is not None and rope_scaling not in _ROPE_SCALINGS.get(family, ()):
        raise ValueError(
            f"rope_scaling={rope_scaling!r} is not supported for family {family!r};"
            f" it takes {_ROPE_SCALINGS.get(family, ())} or None"
        )
    if head_dim is None:
        head_dim = hidden_size // num_heads * (2 if family in ("qwen3", "qwen3_moe") else 1)
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"head_dim must be a positive even number (RoPE rotates pairs), got {head_dim}")
    if tie_word_embeddings is None:
        tie_word_embeddings = _TIED_BY_DEFAULT[family]
    if dtype not in ("float32", "bfloat16"):
        raise ValueError(f"dtype must be 'float32' or 'bfloat16', got {dtype!r}")

    out = pathlib.Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = _make_config(
        family,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        rope_scaling=rope_scaling,
        sliding_window=sliding_window,
    )
    model = _make_model(family, config, seed)
    if dtype == "bfloat16":
        for param in model.parameters():
            param.data = param.data.to(torch.bfloat16)
        model.config.dtype = "bfloat16"
    model.save_pretrained(out, safe_serialization=True)
    tokenizer = _wrap_tokenizer(_train_tokenizer(vocab_size, family), max_position_embeddings)
    tokenizer.save_pretrained(out)
    return out


def _cache_key(family: str, kwargs: dict[str, Any]) -> str:
    """A short stable hash of the full build arguments, defaults included, and the builder version.

    Raises:
        TypeError: If ``kwargs`` has a name ``build_tiny_model`` does not accept.
    """
    bound = inspect.signature(build_tiny_model).bind(".", family, **kwargs)
    bound.apply_defaults()
    arguments = {name: value for name, value in bound.arguments.items() if name != "path"}
    payload = json.dumps({"builder_version": BUILDER_VERSION, **arguments}, sort_keys=True, default=repr)
    return hashlib.sha256(payload.encode()).hexdigest()[:16]


def tiny_model_path(cache_root: str | os.PathLike[str], family: str = "llama", **kwargs: Any) -> pathlib.Path:
    """Return a folder under ``cache_root`` holding ``build_tiny_model(family, **kwargs)``, built once.

    The folder is ``cache_root / f"{family}-{hash}"``, where the hash covers all arguments of
    ``build_tiny_model`` (defaults filled in, so ``seed=0`` and no ``seed`` are the same folder)
    and the builder version. It is built only if it has no ``config.json``;
    building happens in a temporary folder next to it that is then renamed into place, so a
    concurrent or interrupted build never leaves a half-written folder under the final name.

    Args:
        cache_root: Directory for cached models; created if missing.
        family: Passed to ``build_tiny_model``.
        **kwargs: Keyword arguments of ``build_tiny_model`` (``seed``, ``vocab_size``, ...).

    Returns:
        The model folder.

    Raises:
        ValueError: As ``build_tiny_model``.
        TypeError: If ``kwargs`` has a name ``build_tiny_model`` does not accept.
    """
    root = pathlib.Path(cache_root)
    final = root / f"{family}-{_cache_key(family, kwargs)}"
    if (final / "config.json").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{final.name}.", suffix=".tmp", dir=root))
    try:
        build_tiny_model(tmp, family, **kwargs)
        _move_into_place(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _move_into_place(tmp: pathlib.Path, final: pathlib.Path) -> None:
    """Rename the built folder ``tmp`` to ``final``, unless another build finished first."""
    if final.exists() and not (final / "config.json").is_file():
        shutil.rmtree(final, ignore_errors=True)  # leftover without a config: not a finished build
    try:
        os.replace(tmp, final)
    except OSError:
        if not (final / "config.json").is_file():
            raise
        # Another process put a complete build there first; keep theirs, ours is discarded.
