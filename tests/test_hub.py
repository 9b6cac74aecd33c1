"""Hub ids: ``Engine.open("org/name")`` through huggingface_hub's cache, with no network.

The cache is a real hub-layout folder (``models--org--name/snapshots/<commit>/`` and ``refs/<branch>``)
built from tiny local models; the hub is a real HTTP server on loopback (tests/_fake_hub.py) that
records every connection, so "no network call" is checked on a socket, not on a mock.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from asyncllm import Engine, ModelNotFoundError, SamplingParams, UnsupportedModelError
from asyncllm.cli import build_parser, main
from asyncllm.default_model import resolve_model_path
from asyncllm.models import SUPPORTED_ARCHITECTURES
from asyncllm.testing.fake_hub import FakeHub, fake_hub
from asyncllm.testing.tiny_models import tiny_model_path

COMMIT_MAIN = "a" * 40
COMMIT_V2 = "b" * 40
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
ENGINE = {"device": "cpu", "kv_cache_blocks": 32, "attention_backend": "torch"}


@pytest.fixture(scope="module")
def tiny_other(tiny_cache: Path) -> Path:
    """A second tiny llama with other weights: its greedy output tells the revisions apart."""
    return tiny_model_path(tiny_cache, "llama", seed=1)


def _snapshot(cache: Path, repo_id: str, commit: str, source: Path, ref: str | None = None) -> Path:
    """Put ``source``'s files into the hub cache as ``repo_id``'s snapshot ``commit`` (refs/``ref`` -> it)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    shutil.copytree(source, snapshot)
    if ref is not None:
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def _variant(base: Path, folder: Path, **config: object) -> Path:
    """A copy of ``base`` whose config.json has ``config`` merged in."""
    shutil.copytree(base, folder)
    data = json.loads((folder / "config.json").read_text())
    data.update(config)
    (folder / "config.json").write_text(json.dumps(data))
    return folder


@pytest.fixture
def hub_cache(tmp_path: Path, tiny_llama: Path, tiny_other: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A hub cache holding org/tiny: main -> tiny_llama, v2 -> tiny_other; the environment points at it."""
    cache = tmp_path / "hub"
    _snapshot(cache, "org/tiny", COMMIT_MAIN, tiny_llama, ref="main")
    _snapshot(cache, "org/tiny", COMMIT_V2, tiny_other, ref="v2")
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    # A relative "org/tiny" must not exist as a local folder.
    monkeypatch.chdir(tmp_path)
    return cache


@pytest.fixture
def hub(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    """A fake hub on loopback (serving nothing unless a test adds repositories); HF_ENDPOINT points at it."""
    with fake_hub() as server:
        monkeypatch.setenv("HF_ENDPOINT", server.url)
        yield server


async def _greedy(model: str | Path, **options: object) -> list[int]:
    async with Engine.open(model, **ENGINE, **options) as engine:  # type: ignore[arg-type]
        return list((await engine.generate("Hello there", GREEDY)).token_ids)


@pytest.mark.anyio
async def test_open_by_hub_id_offline(hub_cache: Path, tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens; never asked anyway
    assert resolve_model_path("org/tiny") == hub_cache / "models--org--tiny" / "snapshots" / COMMIT_MAIN
    assert await _greedy("org/tiny") == await _greedy(tiny_llama)


@pytest.mark.anyio
async def test_cached_snapshot_makes_no_network_call_when_online(hub: FakeHub, tiny_other: Path) -> None:
    # Online (HF_HUB_OFFLINE unset), the hub reachable: a complete cached snapshot is used as it is.
    assert await _greedy("org/tiny", revision="v2") == await _greedy(tiny_other)
    assert resolve_model_path("org/tiny", revision=COMMIT_V2).name == COMMIT_V2
    assert resolve_model_path("org/tiny").name == COMMIT_MAIN
    assert hub.connections == 0 and hub.requests == []


def test_revisions_branch_and_commit(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    snapshots = hub_cache / "models--org--tiny" / "snapshots"
    assert resolve_model_path("org/tiny", revision="v2") == snapshots / COMMIT_V2
    assert resolve_model_path("org/tiny", revision=COMMIT_MAIN) == snapshots / COMMIT_MAIN
    with pytest.raises(ModelNotFoundError, match=r"revision 'v3'.*HF_HUB_OFFLINE"):
        resolve_model_path("org/tiny", revision="v3")


def test_offline_and_not_cached_says_so(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelNotFoundError) as caught:
        resolve_model_path("org/absent")
    message = str(caught.value)
    assert "no local folder" in message and str(Path.cwd() / "org" / "absent") in message
    assert str(hub_cache / "models--org--absent") in message and "HF_HUB_OFFLINE" in message


def test_an_incomplete_snapshot_is_not_used_offline(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    (hub_cache / "models--org--tiny" / "snapshots" / COMMIT_MAIN / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match=r"lacks weights"):
        resolve_model_path("org/tiny")


def test_missing_repo_is_a_clear_error(hub: FakeHub) -> None:
    with pytest.raises(ModelNotFoundError, match=r"no such model: http://127\.0\.0\.1:\d+/org/nothing"):
        resolve_model_path("org/nothing")


def test_gated_repo_says_gated_and_how_to_authenticate(hub: FakeHub) -> None:
    hub.repos["org/gated"] = "gated"
    with pytest.raises(ModelNotFoundError) as caught:
        resolve_model_path("org/gated")
    assert "gated" in str(caught.value) and "HF_TOKEN" in str(caught.value)
    assert "huggingface-cli login" in str(caught.value)


def test_unreachable_hub_is_a_clear_error(hub_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with fake_hub() as closed:
        url = closed.url
    monkeypatch.setenv("HF_ENDPOINT", url)  # the server is gone: connections are refused
    # huggingface_hub retries a refused connection 5 times, waiting 1+2+4+8+8 s: the waits are its own
    # business (not slept here); the error that follows is what is asserted.
    from huggingface_hub.utils import _http

    monkeypatch.setattr(_http, "time", SimpleNamespace(sleep=lambda seconds: None))
    with pytest.raises(ModelNotFoundError, match=r"could not be reached"):
        resolve_model_path("org/elsewhere")


@pytest.mark.anyio
async def test_download_through_the_hub_then_served_from_the_cache(
    hub: FakeHub, hub_cache: Path, tiny_llama: Path
) -> None:
    served = tiny_llama.parent / "served-with-extras"
    if not served.exists():
        shutil.copytree(tiny_llama, served)
        (served / "pytorch_model.bin").write_bytes(b"not wanted")
        (served / "modeling_custom.py").write_text("raise SystemExit('never run')\n")
    hub.repos["org/fresh"] = served
    assert await _greedy("org/fresh") == await _greedy(tiny_llama)
    fetched = {request.split()[1].rsplit("/", 1)[-1] for request in hub.requests if request.startswith("GET")}
    assert "model.safetensors" in fetched and "config.json" in fetched
    assert "pytorch_model.bin" not in fetched and "modeling_custom.py" not in fetched
    snapshot = hub_cache / "models--org--fresh" / "snapshots" / hub.commit("org/fresh")
    assert (hub_cache / "models--org--fresh" / "refs" / "main").read_text() == hub.commit("org/fresh")
    assert not (snapshot / "pytorch_model.bin").exists()
    # Cached now: the next open asks nothing.
    connections = hub.connections
    assert await _greedy("org/fresh") == await _greedy(tiny_llama)
    assert hub.connections == connections


def test_remote_code_is_refused_before_the_weights_download(hub: FakeHub, tiny_llama: Path, tmp_path: Path) -> None:
    hub.repos["org/custom"] = _variant(
        tiny_llama,
        tmp_path / "custom",
        architectures=["CustomForCausalLM"],
        auto_map={"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"},
    )
    with pytest.raises(UnsupportedModelError, match=r"org/custom needs trust_remote_code.*never runs"):
        resolve_model_path("org/custom")
    assert not any("model.safetensors" in request for request in hub.requests)


@pytest.mark.anyio
async def test_remote_code_local_folder_is_refused(tiny_llama: Path, tmp_path: Path) -> None:
    folder = _variant(
        tiny_llama,
        tmp_path / "custom",
        architectures=["CustomForCausalLM"],
        auto_map={"AutoModelForCausalLM": "modeling_custom.CustomForCausalLM"},
    )
    with pytest.raises(UnsupportedModelError, match="trust_remote_code"):
        await _greedy(folder)


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("quantization", "named"),
    [
        ({"quant_method": "gptq", "bits": 4}, "gptq"),
        ({"quant_method": "awq", "bits": 4}, "awq"),
        ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "fp8"),
        ({"quant_method": "compressed-tensors"}, "compressed-tensors"),
        ({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "bitsandbytes"),
    ],
)
async def test_quantized_checkpoints_are_refused_naming_the_method(
    tiny_llama: Path, tmp_path: Path, quantization: dict[str, object], named: str
) -> None:
    folder = _variant(tiny_llama, tmp_path / "quantized", quantization_config=quantization)
    with pytest.raises(UnsupportedModelError, match=rf"quantized weights \({named}.*unquantized"):
        await _greedy(folder)


@pytest.mark.anyio
async def test_unsupported_architecture_lists_the_supported_ones(tiny_llama: Path, tmp_path: Path) -> None:
    folder = _variant(tiny_llama, tmp_path / "other", architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnsupportedModelError) as caught:
        await _greedy(folder)
    assert "GPT2LMHeadModel" in str(caught.value)
    assert all(name in str(caught.value) for name in SUPPORTED_ARCHITECTURES)
    assert isinstance(caught.value, ValueError)


def test_revision_with_a_local_folder_is_an_error(tiny_llama: Path) -> None:
    with pytest.raises(ValueError, match="revision"):
        resolve_model_path(tiny_llama, revision="main")
    with pytest.raises(ValueError, match="revision"):
        Engine.open(tiny_llama, revision="")


def test_a_local_folder_wins_over_a_hub_id(hub_cache: Path, tiny_other: Path) -> None:
    (hub_cache.parent / "org").mkdir()
    shutil.copytree(tiny_other, hub_cache.parent / "org" / "tiny")
    assert resolve_model_path("org/tiny") == hub_cache.parent / "org" / "tiny"


def test_serve_takes_the_model_as_a_positional_argument() -> None:
    args = build_parser().parse_args(["serve", "org/tiny", "--revision", "v2"])
    assert args.positional_model == "org/tiny" and args.engine__revision == "v2"
    with pytest.raises(SystemExit):
        main(["serve", "org/tiny", "--model", "org/other"])


def test_serve_names_a_hub_model_by_its_id(hub_cache: Path, tmp_path: Path) -> None:
    """A real ``asyncllm serve org/tiny`` process, offline from the cache: /v1/models says ``org/tiny``."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(hub_cache)}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"), env.get("PYTHONPATH", "")])
    log = tmp_path / "serve.log"
    command = [sys.executable, "-m", "asyncllm.cli", "serve", "org/tiny", "--port", str(port)]
    command += ["--device", "cpu", "--kv-cache-blocks", "32"]
    with log.open("wb") as stderr:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr, env=env)
    try:
        deadline = time.monotonic() + 180
        while True:  # poll /health, bounded, until the server answers
            if process.poll() is not None:
                pytest.fail(f"asyncllm serve exited with {process.returncode}:\n{log.read_text()}")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(f"asyncllm serve not ready after 180 s:\n{log.read_text()}")
            time.sleep(0.2)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        assert [model["id"] for model in models["data"]] == ["org/tiny"]
    finally:
        process.terminate()
        process.wait(timeout=60)
