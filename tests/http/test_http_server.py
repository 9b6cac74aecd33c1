"""``asyncllm serve`` as a real server process (hypercorn, asyncio and trio), driven by the official
``openai`` client over TCP on 127.0.0.1, on a tiny model."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest

API_KEY = "test-key"
MODEL = "tiny"
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@dataclass
class Server:
    base_url: str
    process: subprocess.Popen[bytes]
    log: Path

    def client(self, api_key: str = API_KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, timeout=60)

    def metrics(self) -> dict[str, float]:
        text = httpx.get(f"{self.base_url}/metrics", timeout=10).text
        return {name: float(value) for name, value in re.findall(r"^([^#\s]\S*) (\S+)$", text, re.M)}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _wait_ready(server: Server, deadline_s: float = 180.0) -> None:
    """Poll /health (a bounded loop) until the server answers; fail with its log if it exits."""
    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            pytest.fail(f"asyncllm serve exited with {server.process.returncode}:\n{server.log.read_text()}")
        try:
            if httpx.get(f"{server.base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    pytest.fail(f"asyncllm serve not ready after {deadline_s} s:\n{server.log.read_text()}")


def _stop(process: subprocess.Popen[bytes]) -> int:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
    return process.wait()


@pytest.fixture(scope="module", params=["asyncio", "trio"])
def server(
    request: pytest.FixtureRequest, tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Server]:
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "stderr.txt"
    command = [
        sys.executable, "-m", "asyncllm.cli", "serve", "--model", str(tiny_llama), "--host", "127.0.0.1",
        "--port", str(port), "--backend", request.param, "--device", "cpu", "--kv-cache-blocks", "128",
        "--api-key", API_KEY, "--served-model-name", MODEL,
    ]  # fmt: skip
    with open(log, "wb") as stderr:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=stderr)
    server = Server(f"http://127.0.0.1:{port}", process, log)
    try:
        _wait_ready(server)
        yield server
    finally:
        _stop(process)


def test_completions_streaming_and_not(server: Server) -> None:
    client = server.client()
    assert [m.id for m in client.models.list().data] == [MODEL]
    whole = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    assert whole.choices[0].finish_reason == "length" and whole.usage is not None
    assert (whole.usage.completion_tokens, whole.usage.total_tokens) == (12, whole.usage.prompt_tokens + 12)
    events = list(
        client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0, stream=True)
    )
    assert "".join(e.choices[0].text for e in events) == whole.choices[0].text
    assert events[-1].choices[0].finish_reason == "length"


def test_chat_streaming_and_not(server: Server) -> None:
    client = server.client()
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "Hello there"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=10, temperature=0, seed=1)
    assert whole.choices[0].message.role == "assistant" and whole.usage is not None
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=10,
            temperature=0,
            seed=1,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_errors_reach_the_client_as_openai_errors(server: Server) -> None:
    with pytest.raises(openai.AuthenticationError):
        server.client(api_key="wrong").models.list()
    client = server.client()
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.completions.create(model="gpt-4", prompt="x")
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=-1)
    with pytest.raises(openai.BadRequestError, match="not supported yet"):
        client.completions.create(model=MODEL, prompt="x", suffix="tail")
    assert httpx.get(f"{server.base_url}/health", timeout=10).json() == {"status": "ok"}  # no key needed


def test_a_client_that_disconnects_mid_stream_frees_its_blocks(server: Server) -> None:
    aborted_before = server.metrics()['asyncllm_request_finished_total{reason="abort"}']
    body = {"model": MODEL, "prompt": "x", "max_tokens": 900, "ignore_eos": True, "stream": True}
    headers = {"authorization": f"Bearer {API_KEY}"}
    with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body, headers=headers, timeout=60) as response:
        lines = response.iter_lines()
        received = [line for line, _ in zip(lines, range(6)) if line.startswith("data: ")]
        assert len(received) >= 3
        assert server.metrics()["asyncllm_num_requests_running"] == 1  # still generating
    # The connection is closed. Poll (bounded) until the server has seen it and the engine freed the blocks.
    deadline = time.monotonic() + 60
    while True:
        metrics = server.metrics()
        freed = metrics["asyncllm_kv_cache_blocks_free"] == metrics["asyncllm_kv_cache_blocks_total"]
        if metrics["asyncllm_num_requests_running"] == 0 and freed:
            break
        assert time.monotonic() < deadline, metrics
        time.sleep(0.05)
    assert metrics['asyncllm_request_finished_total{reason="abort"}'] == aborted_before + 1


def test_concurrent_client_example(server: Server) -> None:
    spec = importlib.util.spec_from_file_location("concurrent_client_example", EXAMPLES / "concurrent_client.py")
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    texts = asyncio.run(example.main(f"{server.base_url}/v1", API_KEY, streams=32, max_tokens=8))
    assert len(texts) == 32 and all(texts)


POINT = {
    "type": "object",
    "properties": {"x": {"type": "integer", "minimum": 0, "maximum": 9}, "label": {"enum": ["a", "b"]}},
    "required": ["x", "label"],
    "additionalProperties": False,
}
TOOLS: list[openai.types.chat.ChatCompletionToolParam] = [
    {"type": "function", "function": {"name": "plot", "description": "Plot a point.", "parameters": POINT}}
]


def test_structured_output_and_tools_over_tcp(server: Server) -> None:
    import jsonschema

    client = server.client()
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": "Plot a point"}]
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=40, seed=3,
        response_format={"type": "json_schema", "json_schema": {"name": "point", "schema": POINT, "strict": True}},
    )  # fmt: skip
    jsonschema.validate(json.loads(reply.choices[0].message.content or ""), POINT)
    # A forced call, streamed: the client reassembles the tool_calls deltas into one call.
    calls: dict[int, dict[str, str]] = {}
    finish = None
    for chunk in client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=200, seed=3, tools=TOOLS, tool_choice="required",
        parallel_tool_calls=False, stream=True,
    ):  # fmt: skip
        choice = chunk.choices[0]
        assert not (choice.delta.content or "").strip().startswith("<tool_call>")
        for delta in choice.delta.tool_calls or ():
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": ""})
            call["id"] += delta.id or ""
            if delta.function is not None:
                call["name"] += delta.function.name or ""
                call["arguments"] += delta.function.arguments or ""
        finish = choice.finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == "plot" and calls[0]["id"].startswith("call_")
    jsonschema.validate(json.loads(calls[0]["arguments"]), POINT)
    # auto: a random model rarely calls; whatever it answers is well formed (text, or parsed calls).
    auto = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=30, seed=3, tools=TOOLS)
    message = auto.choices[0].message
    assert "<tool_call>" not in (message.content or "")
    for call in message.tool_calls or ():
        jsonschema.validate(json.loads(call.function.arguments), POINT)


def test_echo_cached_tokens_tokenize_and_errors_over_tcp(server: Server) -> None:
    """Issue 24's surface through the official client over TCP (vLLM extensions through extra_body)."""
    client = server.client()
    auth = {"authorization": f"Bearer {API_KEY}"}
    # A prompt no other test sent (the server is shared): the first time nothing of it is cached.
    prompt = f"{uuid.uuid4().hex} " + "the quick brown fox jumps over the lazy dog " * 6
    counted = httpx.post(f"{server.base_url}/tokenize", json={"model": MODEL, "prompt": prompt}, headers=auth).json()
    first = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    second = client.completions.create(model=MODEL, prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens == counted["count"] == len(counted["tokens"])
    assert first.usage.prompt_tokens_details is not None and second.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    # Every whole block of 16 before the last token, and at most every token but the last (computed for its
    # logits): the rows of the partial block are a hit only if the first request's last block was completed
    # (a step past its end, which async scheduling may or may not run), so either count is right.
    prompt_tokens = first.usage.prompt_tokens
    assert cached is not None and (prompt_tokens - 1) // 16 * 16 <= cached <= prompt_tokens - 1
    back = httpx.post(f"{server.base_url}/v1/detokenize", json={"tokens": counted["tokens"]}, headers=auth).json()
    assert prompt in back["prompt"]
    # lm-evaluation-harness's loglikelihood request: the prompt alone, scored.
    scored = client.completions.create(
        model=MODEL, prompt=[counted["tokens"]], echo=True, logprobs=1, max_tokens=0, temperature=0, seed=1234
    )
    logprobs = scored.choices[0].logprobs
    assert logprobs is not None and logprobs.token_logprobs is not None and logprobs.top_logprobs is not None
    assert len(logprobs.token_logprobs) == counted["count"] and logprobs.token_logprobs[0] is None
    assert scored.usage is not None and scored.usage.completion_tokens == 0
    # vLLM's prompt_logprobs on chat, and the streamed usage's cached tokens.
    messages: list[openai.types.chat.ChatCompletionMessageParam] = [{"role": "user", "content": prompt}]
    chat = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=2, extra_body={"prompt_logprobs": 1}
    )
    assert (chat.model_extra or {})["prompt_logprobs"][0] is None
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=messages, max_tokens=2, stream=True, stream_options={"include_usage": True}
        )
    )
    usage = chunks[-1].usage
    assert usage is not None and usage.prompt_tokens_details is not None
    assert (usage.prompt_tokens_details.cached_tokens or 0) > 0
    # Errors: an unknown model id, a role OpenAI does not have, logprobs beyond the cap.
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError) as missing:
        client.models.retrieve("no-such-model")
    assert missing.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as role:
        client.chat.completions.create(model=MODEL, messages=[{"role": "wizard", "content": "hi"}])  # type: ignore[misc,list-item]
    assert role.value.param == "messages[0].role" and role.value.code == "invalid_value"
    with pytest.raises(openai.BadRequestError, match="max_completion_logprobs") as capped:
        client.completions.create(model=MODEL, prompt="x", logprobs=49152)
    assert capped.value.param == "logprobs" and capped.value.code is not None


def test_sigterm_stops_the_server_cleanly(server: Server) -> None:
    # Last in the module: the server is gone afterwards.
    assert _stop(server.process) == 0
    log = server.log.read_text()
    assert "received SIGTERM, shutting down" in log and "Traceback" not in log
