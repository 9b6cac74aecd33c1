"""Every example in examples/ runs, on a tiny model (ASYNCLLM_MODEL), on the backends it is written for.

quickstart.py runs as a script (its ``__main__`` path included); the others are imported and
driven in-process, the frameworks through their lifespan and httpx's ASGITransport.
concurrent_client.py needs a server: it is exercised in test_http_server.py; ray_serve_app.py needs a
Ray cluster: it is deployed in tests/integrations/test_ray_serve.py.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import httpx
import pytest

from asyncllm import SamplingParams

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def load(name: str, monkeypatch: pytest.MonkeyPatch, model: Path) -> ModuleType:
    """Import examples/<name>.py afresh (a module-level engine can be entered only once)."""
    monkeypatch.setenv("ASYNCLLM_MODEL", str(model))
    monkeypatch.delenv("ASYNCLLM_API_KEY", raising=False)
    spec = importlib.util.spec_from_file_location(f"example_{name}", EXAMPLES / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_example_is_tested() -> None:
    tested = {"quickstart", "quickstart_trio", "fastapi_app", "starlette_app", "concurrent_client", "ray_serve_app"}
    assert {p.stem for p in EXAMPLES.glob("*.py")} == tested


def test_quickstart_runs_as_a_script(tiny_llama: Path) -> None:
    env = {**os.environ, "ASYNCLLM_MODEL": str(tiny_llama)}
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / "quickstart.py")], env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    story, _, reply = result.stdout.partition("\nassistant: ")
    assert story and reply.rstrip().endswith("[length]")


def test_quickstart_trio_runs_on_trio(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import trio

    example = load("quickstart_trio", monkeypatch, tiny_llama)
    trio.run(example.main, str(tiny_llama))
    lines = capsys.readouterr().out.splitlines()
    assert sorted(line.split(" -> ")[0] for line in lines) == ["'Mountains are'", "'The sea is'"]


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_fastapi_example_streams_on_asyncio(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    example = load("fastapi_app", monkeypatch, tiny_llama)
    app = example.app
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            response = await http.post("/generate", json={"prompt": "Once upon a time", "max_tokens": 8})
            bad = await http.post("/generate", json={"prompt": "", "max_tokens": 8})
            stats = (await http.get("/stats")).json()
        expected = await app.state.engine.generate("Once upon a time", SamplingParams(max_tokens=8, temperature=0.0))
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    assert response.text == expected.text
    assert bad.status_code == 400 and "empty" in bad.json()["error"]
    assert stats["running"] == 0 and stats["kv_blocks_free"] > 0


@pytest.mark.anyio
async def test_starlette_example_mounts_the_openai_app(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    example = load("starlette_app", monkeypatch, tiny_llama)
    app = example.app
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
            home = await http.get("/")
            models = (await http.get("/v1/models")).json()
            request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, "temperature": 0}
            chat = (await http.post("/v1/chat/completions", json=request)).json()
            streamed = await http.post("/v1/chat/completions", json={**request, "stream": True})
    assert home.status_code == 200 and "/v1" in home.text
    assert [m["id"] for m in models["data"]] == [tiny_llama.name]
    assert chat["usage"]["completion_tokens"] == 5
    events = [json.loads(b.removeprefix("data: ")) for b in streamed.text.split("\n\n") if b and "[DONE]" not in b]
    assert (
        "".join(e["choices"][0]["delta"].get("content", "") for e in events) == chat["choices"][0]["message"]["content"]
    )
