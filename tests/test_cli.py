"""The ``asyncllm`` command, run in-process through ``cli.main`` on a tiny model.

``serve`` runs as a real process in test_http_server.py.
"""

from __future__ import annotations

import dataclasses
import errno
import importlib.metadata
import io
import logging
import shutil
import sys
from pathlib import Path
from typing import Any

import anyio
import pytest

from asyncllm import Engine, EngineOptions, SamplingParams, cli

ENGINE = ["--device", "cpu", "--kv-cache-blocks", "64"]


def _greedy_chat(model: Path, turns: list[str], max_tokens: int) -> list[str]:
    """The replies a greedy conversation of ``turns`` gets, computed through the library."""

    async def run() -> list[str]:
        replies: list[str] = []
        messages: list[dict[str, str]] = []
        async with Engine.open(model, device="cpu", kv_cache_blocks=64) as engine:
            for turn in turns:
                messages.append({"role": "user", "content": turn})
                reply = await engine.chat(messages, SamplingParams(max_tokens=max_tokens, temperature=0.0))
                messages.append({"role": "assistant", "content": reply.text})
                replies.append(reply.text)
        return replies

    return anyio.run(run)


def test_every_engine_option_is_a_flag(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    options = [f.name for f in dataclasses.fields(EngineOptions) if f.name != "model"]
    parser = cli.build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "--help"])
    help_text = capsys.readouterr().out
    for name in options:
        assert f"--{name.replace('_', '-')}" in help_text
    seen: dict[str, Any] = {}
    monkeypatch.setattr(Engine, "open", lambda model=None, **kw: seen.update(model=model, **kw))
    # generate and chat have a sampling --seed, so the engine's is --engine-seed there.
    for command, seed in ((["generate", "p"], "--engine-seed"), (["chat"], "--engine-seed"), (["serve"], "--seed")):
        args = parser.parse_args([*command, "--model", "m", "--block-size", "32", seed, "5"])
        cli._open_engine(args)
        assert sorted(seen) == sorted(["model", *options]), command
        assert (seen["model"], seen["block_size"], seen["seed"]) == ("m", 32, 5)


def test_generate_streams_the_completion_to_stdout(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["generate", "Once upon a time", "--model", str(tiny_llama), "--max-tokens", "8", *ENGINE]) == 0
    out, err = capsys.readouterr()

    async def expected() -> str:
        async with Engine.open(tiny_llama, device="cpu", kv_cache_blocks=64) as engine:
            return (await engine.generate("Once upon a time", SamplingParams(max_tokens=8, temperature=0.0))).text

    assert out == anyio.run(expected) + "\n"
    assert "8 tokens in" in err and "tokens/s" in err


def test_generate_chat_on_trio(tiny_llama: Path, capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["generate", "Hi", "--chat", "--backend", "trio", "--model", str(tiny_llama), "--max-tokens", "5", *ENGINE]
    assert cli.main(argv) == 0
    assert capsys.readouterr().out == _greedy_chat(tiny_llama, ["Hi"], 5)[0] + "\n"


def test_chat_keeps_the_conversation(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\n\nHow are you?\n/reset\nHello\n/exit\nignored\n"))
    assert cli.main(["chat", "--model", str(tiny_llama), "--max-tokens", "6", *ENGINE]) == 0
    out, err = capsys.readouterr()
    first, second = _greedy_chat(tiny_llama, ["Hello", "How are you?"], 6)
    # The second reply saw the first exchange; after /reset the conversation starts over.
    assert out == f"{first}\n{second}\n{first}\n"
    assert "(conversation cleared)" in err


def test_chat_reports_a_turn_that_does_not_fit_and_goes_on(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(sys, "stdin", io.StringIO("x" * 200 + "\nHello\n"))
    argv = ["chat", "--model", str(tiny_llama), "--max-tokens", "4", "--max-model-len", "48", *ENGINE]
    assert cli.main(argv) == 0
    out, err = capsys.readouterr()
    assert "error:" in err and "max_model_len" in err
    assert out == _greedy_chat(tiny_llama, ["Hello"], 4)[0] + "\n"  # the failed turn was dropped


def test_chat_without_a_chat_template_is_a_clear_error(
    tiny_llama: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    plain = shutil.copytree(tiny_llama, tmp_path / "no-template")
    (plain / "chat_template.jinja").unlink()
    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello\n"))
    assert cli.main(["chat", "--model", str(plain), *ENGINE]) == 1
    assert "no chat template" in capsys.readouterr().err


def test_a_missing_model_is_an_error_message_not_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["generate", "x", "--model", str(tmp_path / "nowhere"), *ENGINE]) == 1
    assert "asyncllm generate: error: Model folder not found" in capsys.readouterr().err


def test_bench_runs_the_named_script_with_its_arguments(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    benchmarks = tmp_path / "benchmarks"
    benchmarks.mkdir()
    (benchmarks / "echo.py").write_text("import sys\nprint('args', sys.argv[1:])\nsys.exit(3)\n")
    monkeypatch.chdir(tmp_path)  # ./benchmarks is looked at first
    assert cli.main(["bench", "echo", "--help", "-n", "2"]) == 3  # the script's own exit status
    assert "args ['--help', '-n', '2']" in capfd.readouterr().out
    assert cli.main(["bench"]) == 0
    assert "echo" in capfd.readouterr().err
    assert cli.main(["bench", "--dir", str(benchmarks), "echo"]) == 3


def test_bench_names_what_is_missing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "--dir", str(tmp_path), "throughput"]) == 2
    err = capsys.readouterr().err
    assert "no benchmark named 'throughput'" in err and str(tmp_path) in err


def test_the_console_script_is_cli_main() -> None:
    (script,) = [e for e in importlib.metadata.entry_points(group="console_scripts") if e.name == "asyncllm"]
    assert script.value == "asyncllm.cli:main"


def test_serve_waits_for_a_resident_kv_cache_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """``serve`` listens once its KV cache is resident (``kv_cache_prefault_wait`` on); ``generate`` and ``chat``
    keep the engine's default (the background prefault); the flag turns it off for ``serve``."""
    seen: dict[str, Any] = {}
    monkeypatch.setattr(Engine, "open", lambda model=None, **kw: seen.update(kw))
    parser = cli.build_parser()
    expected = {
        ("serve",): True,
        ("generate", "p"): False,
        ("chat",): False,
        ("serve", "--no-kv-cache-prefault-wait"): False,
    }
    for argv, wait in expected.items():
        cli._open_engine(parser.parse_args(list(argv)))
        assert seen["kv_cache_prefault_wait"] is wait, argv
    assert EngineOptions().kv_cache_prefault_wait is False


def test_serve_transport_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: dict[str, Any] = {}

    async def fake_serve(args: Any) -> None:
        seen.update(vars(args))

    monkeypatch.setattr(cli, "_serve", fake_serve)
    assert cli.main(["serve"]) == 0
    from asyncllm.http import DEFAULT_BODY_TIMEOUT, DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_CONCURRENT_REQUESTS
    assert (seen["max_body_bytes"], seen["body_timeout"], seen["max_concurrent_requests"]) == (
        DEFAULT_MAX_BODY_BYTES,
        DEFAULT_BODY_TIMEOUT,
        DEFAULT_MAX_CONCURRENT_REQUESTS,
    )
    assert (seen["cors_origins"], seen["graceful_timeout"], seen["send_timeout"]) == (None, 5.0, 15.0)
    argv = ["serve", "--cors-origins", "https://a.example, http://localhost:3000", "--body-timeout", "2.5"]
    assert cli.main([*argv, "--max-concurrent-requests", "8", "--graceful-timeout", "0", "--send-timeout", "1"]) == 0
    assert seen["cors_origins"] == ["https://a.example", "http://localhost:3000"]
    assert (seen["body_timeout"], seen["max_concurrent_requests"], seen["graceful_timeout"]) == (2.5, 8, 0.0)
    assert seen["send_timeout"] == 1.0


def test_hypercorn_config_checks_its_timeouts() -> None:
    with pytest.raises(ValueError, match="graceful-timeout"):
        cli._hypercorn_config(["127.0.0.1:0"], backend="trio", access_log=False, graceful_timeout=-1, send_timeout=1)
    with pytest.raises(ValueError, match="send-timeout"):
        cli._hypercorn_config(["127.0.0.1:0"], backend="trio", access_log=False, graceful_timeout=0, send_timeout=0)


def _accept_failure(name: str, message: str) -> logging.LogRecord:
    error = OSError(errno.EMFILE, "Too many open files")
    return logging.LogRecord(name, logging.ERROR, __file__, 1, message, None, (OSError, error, None))


def test_accept_failures_pass_once_a_second_without_tracebacks() -> None:
    now = [100.0]
    accept_failures = cli._AcceptFailureFilter(clock=lambda: now[0])
    asyncio_message = "socket.accept() out of system resource\nsocket: <asyncio.TransportSocket fd=6>"
    trio_message = "accept returned EMFILE (Too many open files); retrying in 0.1 seconds"

    def at(time: float, name: str, message: str) -> str | None:
        now[0] = time
        record = _accept_failure(name, message)
        if not accept_failures.filter(record):
            return None
        assert record.exc_info is None  # the traceback is always the same: dropped
        return record.getMessage()

    first = at(100.0, "asyncio", asyncio_message)
    assert first == "socket.accept() out of system resource: [Errno 24] Too many open files"
    assert [at(100.0 + i / 10, "trio.serve_listeners", trio_message) for i in range(1, 10)] == [None] * 9
    assert at(101.0, "trio.serve_listeners", trio_message) == trio_message + " (9 more like it since the last report)"
    assert at(101.5, "asyncio", asyncio_message) is None
    assert at(102.0, "trio.serve_listeners", trio_message) == trio_message + " (1 more like it since the last report)"
    other = logging.LogRecord("asyncio", logging.ERROR, __file__, 1, "something else", None, None)
    assert accept_failures.filter(other) and other.getMessage() == "something else"  # untouched
