"""The HTTP transport, over loopback under a real hypercorn set up as ``asyncllm serve`` sets it up.

In-process (the test's own event loop, asyncio and trio; ``cli._serve_app``): framing that could
smuggle a request, bodies that never finish, the cap on requests in flight, shutdown. As a
subprocess (the real ``asyncllm serve`` over a scripted engine): running out of file descriptors,
and SIGTERM with a stream open. Raw sockets where the behaviour is below what an HTTP client shows.
"""

from __future__ import annotations

import array
import fcntl
import json
import re
import resource
import signal
import socket
import subprocess
import sys
import termios
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from asyncllm import Engine, cli
from asyncllm.http import OpenAIApp, create_app

pytestmark = pytest.mark.anyio

READ_BOUND_S = 30.0  # generous bound on any wait for the server; never a timing assertion


@asynccontextmanager
async def serving(
    app: OpenAIApp,
    backend: str,
    *,
    graceful_timeout: float = 0.0,
    send_timeout: float = cli.DEFAULT_SEND_TIMEOUT,
    send_buffer: int | None = None,
) -> AsyncIterator[str]:
    """Serve ``app`` as ``asyncllm serve`` does, on a listening socket made here; yield its URL.

    ``send_buffer`` shrinks the kernel's send buffer of the accepted connections, so that a client
    that does not read blocks the server after kilobytes rather than megabytes.
    """
    listener = socket.socket()
    if send_buffer is not None:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer)  # accepted sockets inherit it
    listener.bind(("127.0.0.1", 0))
    listener.listen(100)  # listening already: clients may connect before hypercorn accepts
    port = listener.getsockname()[1]
    config = cli._hypercorn_config(
        [f"fd://{listener.detach()}"],
        backend=backend,
        access_log=False,
        graceful_timeout=graceful_timeout,
        send_timeout=send_timeout,
    )
    stop = anyio.Event()
    serve = partial(cli._serve_app, app, config, backend=backend, graceful_timeout=graceful_timeout, stop=stop.wait)
    url = f"http://127.0.0.1:{port}"
    async with anyio.create_task_group() as task_group:
        task_group.start_soon(serve)
        try:
            # Wait (bounded) until hypercorn answers: connections made earlier, queued by the kernel
            # before the server set its socket options, would not have them.
            async with httpx.AsyncClient(base_url=url) as http:
                with anyio.fail_after(READ_BOUND_S):
                    while (await http.get("/metrics")).status_code != 200:
                        await anyio.sleep(0.01)
            yield url
        finally:
            stop.set()


def _port(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


async def read_until_closed(stream: anyio.abc.ByteStream) -> bytes:
    """Everything the server sends until it closes the connection (bounded)."""
    received = b""
    with anyio.fail_after(READ_BOUND_S):
        while True:
            try:
                received += await stream.receive()
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                return received


async def read_response(stream: anyio.abc.ByteStream) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length body (bounded)."""
    received = b""
    with anyio.fail_after(READ_BOUND_S):
        while True:
            received += await stream.receive()
            head, found, rest = received.partition(b"\r\n\r\n")
            if found:
                length = int(re.search(rb"(?i)content-length: *(\d+)", head).group(1))  # type: ignore[union-attr]
                if len(rest) >= length:
                    ((answer),) = responses(received)
                    return answer


def responses(raw: bytes) -> list[tuple[int, dict[str, str], bytes]]:
    """The HTTP/1.1 responses in ``raw`` (each with a Content-Length body): status, headers, body."""
    found = []
    while raw:
        head, _, rest = raw.partition(b"\r\n\r\n")
        status_line, *lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines)}
        length = int(headers.get("content-length", "0"))
        found.append((int(status_line.split()[1]), headers, rest[:length]))
        raw = rest[length:]
    return found


def request(method: str, path: str, body: bytes = b"", **headers: str) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", "Host: test", *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


COMPLETION = json.dumps({"prompt": "x", "max_tokens": 2}).encode()


# -- framing -------------------------------------------------------------------------------------


async def test_content_length_with_transfer_encoding_is_400_and_closes(
    scripted_engine: Engine, anyio_backend: str
) -> None:
    # Both framings at once (RFC 9112 6.3): a front proxy that reads Content-Length would see one
    # request where the server reads another, so the server answers 400 and closes the connection.
    chunked = f"{len(COMPLETION):x}\r\n".encode() + COMPLETION + b"\r\n0\r\n\r\n"
    smuggle = request(
        "POST", "/v1/completions", chunked,
        content_type="application/json", content_length="5", transfer_encoding="chunked",
    )  # fmt: skip
    async with serving(create_app(scripted_engine), anyio_backend) as url:
        async with await anyio.connect_tcp("127.0.0.1", _port(url)) as stream:
            await stream.send(smuggle)
            raw = await read_until_closed(stream)
    ((status, headers, body),) = responses(raw)
    assert status == 400 and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "invalid_framing"


# -- slow bodies ---------------------------------------------------------------------------------


async def test_a_body_that_stalls_gets_408_and_the_connection_closes(
    scripted_engine: Engine, anyio_backend: str
) -> None:
    app = create_app(scripted_engine, body_timeout=0.5)
    head = request("POST", "/v1/completions", content_type="application/json", content_length="100")
    async with serving(app, anyio_backend) as url:
        async with await anyio.connect_tcp("127.0.0.1", _port(url)) as stream:
            await stream.send(head + b'{"prompt": ')  # and nothing more
            raw = await read_until_closed(stream)
        assert app.requests_in_flight == 0
    ((status, headers, body),) = responses(raw)
    assert status == 408 and headers["connection"] == "close"
    assert json.loads(body)["error"]["code"] == "request_timeout"


async def _wait_in_flight(app: OpenAIApp, count: int) -> None:
    with anyio.fail_after(READ_BOUND_S):
        while app.requests_in_flight != count:
            await anyio.sleep(0.01)  # a bounded poll of the server's state, not a timing assumption


async def test_requests_beyond_the_cap_get_503_at_once_and_health_still_answers(
    scripted_engine: Engine, anyio_backend: str
) -> None:
    app = create_app(scripted_engine, max_concurrent_requests=2)
    head = request("POST", "/v1/completions", content_type="application/json", content_length=str(len(COMPLETION)))
    async with serving(app, anyio_backend) as url:
        port = _port(url)
        async with (
            await anyio.connect_tcp("127.0.0.1", port) as first,
            await anyio.connect_tcp("127.0.0.1", port) as second,
        ):
            for slow in (first, second):  # two requests whose bodies are slow: they fill the cap
                await slow.send(head + COMPLETION[:5])
            await _wait_in_flight(app, 2)
            async with await anyio.connect_tcp("127.0.0.1", port) as third:
                await third.send(head + COMPLETION)
                refused = responses(await read_until_closed(third))  # closed: it holds no descriptor
            async with httpx.AsyncClient(base_url=url) as http:
                health = await http.get("/health")
            for slow in (first, second):  # the slow bodies arrive after all and are answered
                await slow.send(COMPLETION[5:] + request("GET", "/health", connection="close"))
            answers = [responses(await read_until_closed(slow)) for slow in (first, second)]
        async with httpx.AsyncClient(base_url=url) as http:
            after = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
    ((status, headers, body),) = refused
    assert status == 503 and headers["connection"] == "close" and headers["retry-after"] == "1"
    assert json.loads(body)["error"]["code"] == "too_many_requests"
    assert health.status_code == 200
    assert [[status for status, _, _ in answer] for answer in answers] == [[200, 200], [200, 200]]
    assert after.status_code == 200


LONG = {"max_model_len": 100_000, "num_kv_blocks": 7_000}  # scripted streams of up to 100k tokens (seconds)


async def _stream_without_reading(url: str) -> socket.socket:
    """Start a long stream from a client that never reads (its receive buffer is small)."""
    client = socket.socket()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    body = json.dumps({"prompt": "x", "max_tokens": 90_000, "ignore_eos": True, "stream": True}).encode()
    head = request("POST", "/v1/completions", content_type="application/json", content_length=str(len(body)))
    await anyio.to_thread.run_sync(client.connect, ("127.0.0.1", _port(url)))
    await anyio.to_thread.run_sync(client.sendall, head + body)
    with anyio.fail_after(READ_BOUND_S):  # until its receive buffer holds kilobytes: the server is blocked soon
        while _unread_bytes(client) < 2048:
            await anyio.sleep(0.01)
    return client


def _unread_bytes(sock: socket.socket) -> int:
    count = array.array("i", [0])
    fcntl.ioctl(sock, termios.FIONREAD, count)
    return count[0]


@pytest.mark.asyncllm_script("h", **LONG)
async def test_a_client_that_stops_reading_is_cut_after_the_send_timeout(
    scripted_engine: Engine, anyio_backend: str
) -> None:
    # The server's send blocks once the buffers are full; nothing above the socket can time it out
    # (hypercorn shields it on trio). The kernel aborts the connection (TCP_USER_TIMEOUT).
    app = create_app(scripted_engine)
    async with serving(app, anyio_backend, send_timeout=0.5, send_buffer=4096) as url:
        with await _stream_without_reading(url):
            await _wait_in_flight(app, 1)
            await _wait_in_flight(app, 0)  # bounded: fails if the request stays in flight
    await scripted_engine.generate("y", {"max_tokens": 1})
    assert scripted_engine.metrics.finished_requests["abort"] == 1
    stats = scripted_engine.statistics()
    assert stats.kv_blocks_free == stats.kv_blocks_total


# -- shutdown ------------------------------------------------------------------------------------


async def test_shutdown_ends_an_open_stream_with_an_error_event(scripted_engine: Engine, anyio_backend: str) -> None:
    app = create_app(scripted_engine)
    body = {"prompt": "x", "max_tokens": 1500, "ignore_eos": True, "stream": True}
    lines: list[str] = []
    async with serving(app, anyio_backend, graceful_timeout=0) as url:
        async with httpx.AsyncClient(base_url=url, timeout=READ_BOUND_S) as http:
            async with http.stream("POST", "/v1/completions", json=body) as response:
                events = response.aiter_lines()
                async for line in events:
                    lines.append(line)
                    if len(lines) == 3:
                        break
                await _wait_in_flight(app, 1)
                with anyio.fail_after(READ_BOUND_S):
                    await app.shutdown(0)  # what the server does at SIGTERM
                    lines += [line async for line in events]
    data = [line.removeprefix("data: ") for line in lines if line]
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["error"]["code"] == "shutting_down"
    assert all("choices" in json.loads(event) for event in data[:-2])
    # The engine request was aborted as the stream closed: its blocks are free at the next step.
    await scripted_engine.generate("y", {"max_tokens": 1})
    assert scripted_engine.metrics.finished_requests["abort"] == 1
    stats = scripted_engine.statistics()
    assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_shutdown_lets_requests_in_flight_finish_within_the_grace(
    scripted_engine: Engine, anyio_backend: str
) -> None:
    app = create_app(scripted_engine)
    head = request("POST", "/v1/completions", content_type="application/json", content_length=str(len(COMPLETION)))
    with anyio.fail_after(READ_BOUND_S):  # far below the grace: shutdown returns once the request is answered
        async with serving(app, anyio_backend) as url:
            async with await anyio.connect_tcp("127.0.0.1", _port(url)) as slow:
                await slow.send(head + COMPLETION[:5])  # certainly in flight: its body is not all here
                await _wait_in_flight(app, 1)
                async with anyio.create_task_group() as task_group:
                    task_group.start_soon(partial(app.shutdown, grace=3600))
                    async with httpx.AsyncClient(base_url=url) as http:
                        refused = await http.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
                        health = await http.get("/health")
                    await slow.send(COMPLETION[5:])
                    answer = await read_response(slow)
    status, _, body = answer
    assert status == 200 and json.loads(body)["choices"][0]["text"] == "He"
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert health.status_code == 503 and health.headers["connection"] == "close"


async def test_shutdown_refuses_new_requests_and_health(scripted_engine: Engine) -> None:
    app = create_app(scripted_engine)
    await app.shutdown()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as http:
        refused = await http.post("/v1/completions", json={"prompt": "x"})
        health = await http.get("/health")
        metrics = await http.get("/metrics")
    assert refused.status_code == health.status_code == 503
    assert refused.json()["error"]["code"] == health.json()["error"]["code"] == "shutting_down"
    assert metrics.status_code == 200  # still scrapeable while draining


# -- as a process: asyncllm serve over a scripted engine -------------------------------------------

# `asyncllm serve` itself (cli.main), its engine a scripted one whose streams can run for a long
# time (a ScriptedRunner that records nothing), so a stream is certainly open when SIGTERM comes.
LAUNCHER = """
import sys
from asyncllm import Engine, cli
from asyncllm.executor._runner import StepOutput
from asyncllm.testing import ByteTokenizer, ScriptedRunner
class Endless(ScriptedRunner):
    def execute(self, batch):
        return StepOutput([104 for seq in batch.sequences if seq.sample])

def open_engine(args):
    runner = Endless([104], max_model_len=250_000, num_kv_blocks=16_000)
    return Engine.open(runner=runner, tokenizer=ByteTokenizer())

cli._open_engine = open_engine
sys.exit(cli.main(["serve", *sys.argv[1:]]))
"""


@dataclass
class Process:
    url: str
    process: subprocess.Popen[bytes]
    log: Path


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(params=["asyncio", "trio"])
def start_serve(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Any]:
    """Start ``asyncllm serve`` (scripted engine) on ``request.param``'s backend; wait until ready."""
    started: list[subprocess.Popen[bytes]] = []

    def start(*flags: str, fd_limit: int | None = None) -> Process:
        port = _free_port()
        log = tmp_path / "stderr.txt"
        argv = [sys.executable, "-c", LAUNCHER, "--port", str(port), "--backend", request.param, *flags]
        limit = None if fd_limit is None else partial(resource.setrlimit, resource.RLIMIT_NOFILE, (fd_limit, fd_limit))
        with open(log, "wb") as stderr:
            process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stderr=stderr, preexec_fn=limit)
        started.append(process)
        server = Process(f"http://127.0.0.1:{port}", process, log)
        deadline = time.monotonic() + 60
        while True:  # bounded poll until it answers
            assert process.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            try:
                if httpx.get(f"{server.url}/health", timeout=2).status_code == 200:
                    return server
            except httpx.TransportError:
                time.sleep(0.05)

    yield start
    for process in started:
        if process.poll() is None:
            process.kill()
        process.wait()


def test_sigterm_ends_open_streams_with_an_error_event_and_exits(start_serve: Any) -> None:
    server: Process = start_serve("--graceful-timeout", "0")
    body = {"prompt": "x", "max_tokens": 200_000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=READ_BOUND_S) as response:
        lines = response.iter_lines()
        received = [line for line, _ in zip(lines, range(6)) if line]
        server.process.send_signal(signal.SIGTERM)
        received += [line for line in lines if line]  # the stream ends: it does not hang
    assert server.process.wait(timeout=READ_BOUND_S) == 0
    data = [line.removeprefix("data: ") for line in received]
    assert data[-1] == "[DONE]"
    assert json.loads(data[-2])["error"]["code"] == "shutting_down"
    log = server.log.read_text()
    assert "received SIGTERM, shutting down" in log and "Traceback" not in log


def test_running_out_of_file_descriptors_logs_once_a_second(start_serve: Any) -> None:
    fd_limit = 64
    began = time.monotonic()
    server: Process = start_serve(fd_limit=fd_limit)
    port = _port(server.url)
    clients: list[socket.socket] = []
    try:
        # More connections than the server has descriptors: the kernel completes them (listen
        # backlog 100); the server's accept() fails with EMFILE until it closes some (idle, 5 s).
        for _ in range(fd_limit + 20):
            clients.append(socket.create_connection(("127.0.0.1", port), timeout=READ_BOUND_S))
        deadline = time.monotonic() + READ_BOUND_S
        while len(re.findall(r"EMFILE|Too many open files", server.log.read_text())) < 2:  # a second report
            assert time.monotonic() < deadline, server.log.read_text()[-3000:]
            time.sleep(0.05)
    finally:
        for client in clients:
            client.close()
    # It recovers: with descriptors free again it answers.
    deadline = time.monotonic() + READ_BOUND_S
    while True:
        try:
            assert httpx.get(f"{server.url}/health", timeout=READ_BOUND_S).status_code == 200
            break
        except httpx.TransportError:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    server.process.send_signal(signal.SIGTERM)
    assert server.process.wait(timeout=READ_BOUND_S) == 0
    elapsed = time.monotonic() - began
    log = server.log.read_text()
    reports = [line for line in log.splitlines() if "EMFILE" in line or "Too many open files" in line]
    # At most one report a second (each naming how many were held back), no tracebacks: before,
    # asyncio logged ~600 tracebacks a second and trio 10.
    assert 2 <= len(reports) <= elapsed + 1, reports
    assert "Traceback" not in log and len(log.splitlines()) < 40 + 2 * elapsed, log[-3000:]
