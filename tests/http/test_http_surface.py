"""What the clients of an OpenAI-compatible server expect of it (issue 24): ``echo`` with logprobs
(lm-evaluation-harness's loglikelihood), vLLM's ``prompt_logprobs``, ``usage.prompt_tokens_details``,
a ``code`` and ``param`` on every 400, message roles, ``/tokenize`` and ``/detokenize``.

Through the real ASGI app over httpx's ASGITransport, on the tiny model where numbers matter and on
the scripted engine where the exact text does. The same features over TCP with the official client
are in test_http_server.py.
"""

from __future__ import annotations

import json
import threading
from collections.abc import AsyncIterator, Mapping, Sequence
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest

from asyncllm import Engine, SamplingParams
from asyncllm.http import create_app
from asyncllm.http._app import OpenAIApp
from asyncllm.testing import EOS_ID, ByteTokenizer, ScriptedRunner

pytestmark = pytest.mark.anyio

SCRIPT = b"Hello there"


@asynccontextmanager
async def client(app: OpenAIApp) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        yield http


def sse(response: httpx.Response) -> list[Any]:
    assert response.status_code == 200, response.text
    return [
        json.loads(block.removeprefix("data: "))
        for block in response.text.split("\n\n")
        if block and block != "data: [DONE]"
    ]


class BosTokenizer(ByteTokenizer):
    """A ByteTokenizer that starts every text with a BOS (id 1) unless asked not to, and has a chat template."""

    chat_template = "<role>content per message"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + super().encode(text)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]], **kwargs: Any) -> dict[str, list[int]]:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        if kwargs["add_generation_prompt"]:
            text += "<assistant>"
        return {"input_ids": super().encode(text)}


@pytest.fixture
async def bos_engine() -> AsyncIterator[Engine]:
    runner = ScriptedRunner([*SCRIPT, EOS_ID], max_model_len=512)
    async with Engine.open(runner=runner, tokenizer=BosTokenizer()) as engine:
        yield engine


# -- echo and logprobs (lm-evaluation-harness) ----------------------------------------------------


async def test_loglikelihood_round_trip_equals_the_python_api(asyncllm_engine: Engine) -> None:
    """What lm-eval's local-completions sends for loglikelihood (token ids, echo, logprobs=1, temperature 0;
    max_tokens 0 as the issue says, 1 as lm-eval does today) gives the engine's own prompt_logprobs."""
    context = await asyncllm_engine.tokenize("The capital of France is")
    continuation = await asyncllm_engine.tokenize(" Paris", add_special_tokens=False)
    tokens = context + continuation
    expected = await asyncllm_engine.generate(tokens, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
    assert expected.prompt_logprobs is not None
    request = {"model": "m", "prompt": [tokens], "echo": True, "logprobs": 1, "temperature": 0, "seed": 1234}
    async with client(create_app(asyncllm_engine, model_name="m")) as http:
        zero = (await http.post("/v1/completions", json={**request, "max_tokens": 0})).json()
        one = (await http.post("/v1/completions", json={**request, "max_tokens": 1})).json()
    (choice,) = zero["choices"]
    logprobs = choice["logprobs"]
    assert choice["text"] == asyncllm_engine.tokenizer.decode(tokens, skip_special_tokens=False)
    assert choice["finish_reason"] == "length"
    assert zero["usage"]["completion_tokens"] == 0 and zero["usage"]["prompt_tokens"] == len(tokens)
    assert len(logprobs["tokens"]) == len(logprobs["token_logprobs"]) == len(logprobs["text_offset"]) == len(tokens)
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    for got, entry in zip(logprobs["token_logprobs"][1:], expected.prompt_logprobs[1:]):
        assert entry is not None and got == pytest.approx(entry.token.logprob, abs=1e-6)
    assert logprobs["tokens"][1:] == [e.token.text for e in expected.prompt_logprobs[1:] if e is not None]
    # lm-eval's sum over the continuation, and its greedy check (the token is the best of its top).
    ctxlen = len(context)
    engine_sum = sum(e.token.logprob for e in expected.prompt_logprobs[ctxlen:] if e is not None)
    assert sum(logprobs["token_logprobs"][ctxlen:]) == pytest.approx(engine_sum, abs=1e-6)
    for token, top in zip(logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:]):
        assert len(top) in (1, 2) and max(top.values()) >= token
    # max_tokens=1 (lm-eval today): one generated token more, which it leaves out with [ctxlen:-1].
    generated = one["choices"][0]["logprobs"]
    assert len(generated["tokens"]) == len(tokens) + 1 and one["usage"]["completion_tokens"] == 1
    assert sum(generated["token_logprobs"][ctxlen:-1]) == pytest.approx(engine_sum, abs=1e-6)
    assert generated["token_logprobs"][: len(tokens)] == logprobs["token_logprobs"]


async def test_echo_text_with_n_prompt_lists_and_max_tokens_zero(bos_engine: Engine) -> None:
    async with client(create_app(bos_engine)) as http:
        plain = (await http.post("/v1/completions", json={"prompt": "ab", "echo": True, "max_tokens": 5})).json()
        several = (
            await http.post("/v1/completions", json={"prompt": ["ab", "cd"], "echo": True, "max_tokens": 2, "n": 2})
        ).json()
        ids = (await http.post("/v1/completions", json={"prompt": [[99, 100]], "echo": True, "max_tokens": 1})).json()
        only = (await http.post("/v1/completions", json={"prompt": "xyz", "echo": True, "max_tokens": 0})).json()
        streamed = sse(
            await http.post("/v1/completions", json={"prompt": "ab", "echo": True, "max_tokens": 3, "stream": True})
        )
    assert plain["choices"][0]["text"] == "abHello"
    assert [(c["index"], c["text"]) for c in several["choices"]] == [(0, "abHe"), (1, "abHe"), (2, "cdHe"), (3, "cdHe")]
    assert ids["choices"][0]["text"] == "cdH"
    assert only["choices"][0]["text"] == "xyz" and only["choices"][0]["finish_reason"] == "length"
    assert only["usage"]["completion_tokens"] == 0
    assert streamed[0]["choices"][0]["text"] == "ab"  # the first event is the prompt
    assert "".join(e["choices"][0]["text"] for e in streamed) == "abHel"


async def test_echo_logprobs_streamed_and_whole(asyncllm_engine: Engine) -> None:
    request = {"prompt": "One two three", "echo": True, "max_tokens": 3, "logprobs": 0, "temperature": 0}
    num_prompt = len(await asyncllm_engine.tokenize("One two three"))
    async with client(create_app(asyncllm_engine)) as http:
        whole = (await http.post("/v1/completions", json=request)).json()
        events = sse(await http.post("/v1/completions", json={**request, "stream": True}))
        streamed_only = sse(
            await http.post("/v1/completions", json={**request, "max_tokens": 0, "stream": True, "n": 2})
        )
    choice = whole["choices"][0]
    logprobs = choice["logprobs"]
    assert choice["text"].startswith("One two three") and len(logprobs["tokens"]) == num_prompt + 3
    assert logprobs["token_logprobs"][0] is None and all(v is not None for v in logprobs["token_logprobs"][1:])
    assert all(len(top) == 1 for top in logprobs["top_logprobs"][1:])  # logprobs=0: the token itself
    offsets = logprobs["text_offset"]
    assert offsets == [sum(len(t) for t in logprobs["tokens"][:i]) for i in range(len(offsets))]
    # Streamed: the first event is the prompt with its logprobs; the rest add up to the whole.
    assert events[0]["choices"][0]["text"] == "One two three"
    assert len(events[0]["choices"][0]["logprobs"]["tokens"]) == num_prompt
    assert "".join(e["choices"][0]["text"] for e in events) == choice["text"]
    for key in ("tokens", "token_logprobs", "text_offset"):
        assert [v for e in events for v in (e["choices"][0]["logprobs"] or {key: []})[key]] == logprobs[key]
    # max_tokens=0 streamed with n=2: each choice echoes the prompt with its logprobs, then ends with "length".
    by_choice: dict[int, list[Any]] = {0: [], 1: []}
    for event in streamed_only:
        (item,) = event["choices"]
        by_choice[item["index"]].append(item)
    for items in by_choice.values():
        assert "".join(i["text"] for i in items) == "One two three" and items[-1]["finish_reason"] == "length"
        entries = [v for i in items for v in (i["logprobs"] or {"token_logprobs": []})["token_logprobs"]]
        assert entries == logprobs["token_logprobs"][:num_prompt]


async def test_max_tokens_zero_computes_the_prompt_alone(asyncllm_engine: Engine) -> None:
    """max_tokens=0 is a prefill-only request: with echo the prompt and its logprobs, without it an empty
    text (vLLM refuses that one; OpenAI's legacy completions took it); "length" and no completion tokens
    either way. Chat wants a reply: 0 stays a 400 there, as OpenAI's."""
    tokens = await asyncllm_engine.tokenize("Once upon a time")
    expected = await asyncllm_engine.generate(tokens, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=1))
    assert expected.prompt_logprobs is not None
    max_model_len = asyncllm_engine.max_model_len
    async with client(create_app(asyncllm_engine)) as http:
        request = {"prompt": tokens, "echo": True, "logprobs": 1, "max_tokens": 0, "temperature": 0}
        scored = (await http.post("/v1/completions", json=request)).json()
        plain = (await http.post("/v1/completions", json={"prompt": "Once upon a time", "max_tokens": 0})).json()
        usage = {"stream": True, "stream_options": {"include_usage": True}}
        streamed = sse(await http.post("/v1/completions", json={**request, **usage}))
        # A prompt of exactly max_model_len tokens: nothing is generated, so it fits.
        full = {"prompt": [tokens[1]] * max_model_len, "echo": True, "logprobs": 0, "max_tokens": 0}
        longest = await http.post("/v1/completions", json=full)
        hi = [{"role": "user", "content": "hi"}]
        chat = await http.post("/v1/chat/completions", json={"messages": hi, "max_tokens": 0})
        chat_new = await http.post("/v1/chat/completions", json={"messages": hi, "max_completion_tokens": 0})
    (choice,) = scored["choices"]
    assert choice["finish_reason"] == "length" and choice["text"] == await asyncllm_engine.detokenize(tokens)
    assert choice["logprobs"]["token_logprobs"] == [None] + [e.token.logprob for e in expected.prompt_logprobs[1:]]
    assert scored["usage"]["completion_tokens"] == 0 and scored["usage"]["prompt_tokens"] == len(tokens)
    assert plain["choices"][0]["text"] == "" and plain["choices"][0]["finish_reason"] == "length"
    assert plain["choices"][0]["logprobs"] is None and plain["usage"]["completion_tokens"] == 0
    # Streamed: one event with the echoed prompt, one that ends the choice, then the usage.
    assert [e["choices"][0]["text"] for e in streamed[:-1]] == [choice["text"], ""]
    assert [e["choices"][0]["finish_reason"] for e in streamed[:-1]] == [None, "length"]
    assert streamed[0]["choices"][0]["logprobs"] == choice["logprobs"]
    assert streamed[-1]["choices"] == [] and streamed[-1]["usage"]["completion_tokens"] == 0
    assert longest.status_code == 200, longest.text
    assert len(longest.json()["choices"][0]["logprobs"]["tokens"]) == max_model_len
    for response, param in ((chat, "max_tokens"), (chat_new, "max_completion_tokens")):
        assert response.status_code == 400 and response.json()["error"]["param"] == param
        assert response.json()["error"]["code"] == "integer_below_min_value"
    stats = asyncllm_engine.statistics()
    assert stats.kv_blocks_free == stats.kv_blocks_total


async def test_prompt_logprobs_as_vllm_returns_them(asyncllm_engine: Engine) -> None:
    prompt = "Once upon a time"
    expected = await asyncllm_engine.generate(prompt, SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=2))
    assert expected.prompt_logprobs is not None
    async with client(create_app(asyncllm_engine)) as http:
        request = {"prompt": prompt, "max_tokens": 2, "temperature": 0, "prompt_logprobs": 2, "n": 2}
        completion = (await http.post("/v1/completions", json=request)).json()
        streamed = sse(await http.post("/v1/completions", json={**request, "n": 1, "stream": True}))
        chat_request = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 1}
        chat = (await http.post("/v1/chat/completions", json=chat_request)).json()
        chat_events = sse(await http.post("/v1/chat/completions", json={**chat_request, "stream": True}))
        plain = (await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1})).json()
    for choice in completion["choices"]:  # each choice carries its prompt's
        entries = choice["prompt_logprobs"]
        assert entries[0] is None and len(entries) == len(expected.prompt_logprobs)
        for got, entry in zip(entries[1:], expected.prompt_logprobs[1:]):
            assert entry is not None
            mine = got[str(entry.token.token_id)]
            assert mine["logprob"] == pytest.approx(entry.token.logprob, abs=1e-6)
            assert mine["rank"] == entry.token.rank and mine["decoded_token"] == entry.token.text
            assert {int(k) for k in got} == {entry.token.token_id} | {alt.token_id for alt in entry.top}
            assert [v["rank"] for k, v in got.items() if int(k) != entry.token.token_id] in ([1, 2], [1], [2])
    assert streamed[0]["choices"][0]["prompt_logprobs"] == completion["choices"][0]["prompt_logprobs"]
    assert all("prompt_logprobs" not in e["choices"][0] for e in streamed[1:])
    assert chat["prompt_logprobs"][0] is None and all(len(e) in (1, 2) for e in chat["prompt_logprobs"][1:])
    assert [e["prompt_logprobs"] for e in chat_events if "prompt_logprobs" in e] == [chat["prompt_logprobs"]]
    assert "prompt_logprobs" not in plain["choices"][0]  # left out unless asked for


# -- usage.prompt_tokens_details.cached_tokens ----------------------------------------------------


async def test_cached_tokens_count_prefix_cache_hits(bos_engine: Engine) -> None:
    prompt = "a long prompt of several blocks, " * 3  # 100 characters: 6 full blocks of 16
    chat_messages = [{"role": "user", "content": prompt}]
    usage_only = {"stream": True, "stream_options": {"include_usage": True}}
    async with client(create_app(bos_engine)) as http:

        async def cached(path: str, body: dict[str, Any]) -> tuple[int, int]:
            whole = (await http.post(path, json=body)).json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            streamed = sse(await http.post(path, json={**body, **usage_only}))[-1]["usage"]
            return whole, streamed["prompt_tokens_details"]["cached_tokens"]

        first = (await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2})).json()["usage"]
        again = await cached("/v1/completions", {"prompt": prompt, "max_tokens": 2})
        chat_first = (await http.post("/v1/chat/completions", json={"messages": chat_messages, "max_tokens": 2}))
        chat_again = await cached("/v1/chat/completions", {"messages": chat_messages, "max_tokens": 2})
        salted = (await http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 2, "cache_salt": "t2"}))
    assert first["prompt_tokens_details"] == {"cached_tokens": 0} and first["prompt_tokens"] == 100
    assert again == (96, 96)  # every full block but the one holding the last token
    assert chat_first.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    assert chat_again[0] > 0 and chat_again[0] % 16 == 0 and chat_again == (chat_again[0],) * 2
    assert salted.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


async def test_cached_tokens_in_the_python_api(bos_engine: Engine) -> None:
    prompt = "x" * 40
    first = await bos_engine.generate(prompt, SamplingParams(max_tokens=1))
    second = await bos_engine.generate(prompt, SamplingParams(max_tokens=1))
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 32)


# -- every 400 has a code and the right param ------------------------------------------------------

_USER = [{"role": "user", "content": "hi"}]
BAD_REQUESTS: list[tuple[str, dict[str, Any], str | None]] = [
    ("/v1/completions", {"prompt": "x", "max_tokens": "many"}, "max_tokens"),
    ("/v1/completions", {}, "prompt"),
    ("/v1/completions", {"prompt": []}, "prompt"),
    ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("/v1/completions", {"prompt": "x", "top_p": 2}, "top_p"),
    ("/v1/completions", {"prompt": "x", "logprobs": 6}, "logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": 6}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
    ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
    ("/v1/completions", {"prompt": [1, 99999]}, "prompt"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"a": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "logit_bias": {"99999": 1}}, "logit_bias"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [99999]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "seed": -1}, "seed"),
    ("/v1/completions", {"prompt": "x", "max_tokens": 100000}, "prompt"),
    ("/v1/completions", {"prompt": "x", "response_format": {"type": "xml"}}, "response_format"),
    ("/v1/completions", {"prompt": "x", "stream_options": {"continuous_usage_stats": True}}, "stream_options"),
    ("/v1/completions", {"prompt": "x", "n": 300}, "n"),
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": _USER, "n": 0}, "n"),
    ("/v1/chat/completions", {"messages": _USER, "top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": _USER, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": [{"role": "system", "content": "x"}, {"role": "user"}]},
     "messages[1].content"),
    ("/v1/chat/completions", {"messages": [{"content": "hi"}]}, "messages"),
    ("/v1/chat/completions", {"messages": _USER, "tool_choice": "required"}, "tool_choice"),
    ("/v1/chat/completions", {"messages": _USER, "functions": [{"name": "f"}]}, "functions"),
    ("/v1/chat/completions", {"messages": _USER, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": "x", "messages": _USER}, "prompt"),
    ("/detokenize", {"tokens": [1, 99999]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
]


@pytest.mark.parametrize(("path", "body", "param"), BAD_REQUESTS, ids=[f"{p}:{b}" for p, b, _ in BAD_REQUESTS])
async def test_every_400_has_a_code_and_the_param_at_fault(
    bos_engine: Engine, path: str, body: dict[str, Any], param: str | None
) -> None:
    async with client(create_app(bos_engine)) as http:
        response = await http.post(path, json=body)
        healthy = await http.get("/health")
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert isinstance(error["code"], str) and error["code"], error
    assert error["param"] == param, error
    assert healthy.status_code == 200


async def test_a_body_that_is_not_an_object_and_a_wrong_method_have_codes(bos_engine: Engine) -> None:
    async with client(create_app(bos_engine)) as http:
        not_object = await http.post("/v1/completions", json=[1, 2])
        wrong_method = await http.get("/v1/completions")
    assert not_object.status_code == 400 and not_object.json()["error"]["code"] == "invalid_parameter"
    assert wrong_method.status_code == 405 and wrong_method.json()["error"]["code"] == "method_not_allowed"


# -- message roles --------------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["system", "developer", "user", "assistant"])
async def test_openai_roles_are_accepted(bos_engine: Engine, role: str) -> None:
    messages = [{"role": role, "content": "hi"}] + ([] if role == "user" else [{"role": "user", "content": "go"}])
    async with client(create_app(bos_engine)) as http:
        response = await http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 2})
    assert response.status_code == 200, response.text


async def test_an_unknown_role_is_refused_at_its_index(bos_engine: Engine) -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "yo"},
        {"role": "bot", "content": "x"},
    ]
    async with client(create_app(bos_engine)) as http:
        response = await http.post("/v1/chat/completions", json={"messages": messages})
        counted = await http.post("/tokenize", json={"messages": messages})
    for refused in (response, counted):
        error = refused.json()["error"]
        assert refused.status_code == 400 and error["param"] == "messages[2].role" and "'bot'" in error["message"]


# -- /tokenize and /detokenize --------------------------------------------------------------------


async def test_tokenize_and_detokenize(bos_engine: Engine) -> None:
    async with client(create_app(bos_engine, model_name="m")) as http:
        text = (await http.post("/tokenize", json={"model": "m", "prompt": "hé"})).json()
        bare = (await http.post("/v1/tokenize", json={"prompt": "hé", "add_special_tokens": False})).json()
        strs = (await http.post("/tokenize", json={"prompt": "ab", "return_token_strs": True})).json()
        chat = (await http.post("/tokenize", json={"messages": _USER})).json()
        history = (await http.post("/tokenize", json={"messages": _USER, "add_generation_prompt": False})).json()
        back = (await http.post("/detokenize", json={"model": "m", "tokens": bare["tokens"]})).json()
        back_v1 = (await http.post("/v1/detokenize", json={"tokens": [1, 104, 105]})).json()
        other_model = await http.post("/tokenize", json={"model": "other", "prompt": "x"})
        empty = (await http.post("/tokenize", json={"prompt": ""})).json()
    assert text == {"count": 4, "max_model_len": 512, "tokens": [1, 104, 195, 169]}
    assert bare["tokens"] == [104, 195, 169] and bare["count"] == 3
    assert strs["token_strs"] == ["\x01", "a", "b"]
    assert chat["tokens"] == list(b"<user>hi\n<assistant>") and history["tokens"] == list(b"<user>hi\n")
    assert back == {"prompt": "hé"} and back_v1 == {"prompt": "\x01hi"}
    assert other_model.status_code == 404 and other_model.json()["error"]["code"] == "model_not_found"
    assert empty == {"count": 1, "max_model_len": 512, "tokens": [1]}


class ThreadTokenizer(BosTokenizer):
    """Records the threads it encodes and decodes in."""

    def __init__(self) -> None:
        self.threads: list[int] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.threads.append(threading.get_ident())
        return super().encode(text, add_special_tokens)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        self.threads.append(threading.get_ident())
        return super().decode(token_ids, skip_special_tokens)


async def test_tokenize_a_long_text_runs_off_the_event_loop() -> None:
    tokenizer = ThreadTokenizer()
    runner = ScriptedRunner([EOS_ID], max_model_len=16384)  # max_prompt_bytes: 4 per token, 65,536
    text = "word " * 4000  # 20,000 characters: tokenized in a worker thread
    async with Engine.open(runner=runner, tokenizer=tokenizer) as engine:
        async with client(create_app(engine)) as http:
            tokenizer.threads.clear()
            got = (await http.post("/tokenize", json={"prompt": text, "add_special_tokens": False})).json()
            back = (await http.post("/detokenize", json={"tokens": got["tokens"]})).json()
            too_big = await http.post("/tokenize", json={"prompt": "x" * 70_000})
    assert got["tokens"] == list(text.encode()) and back["prompt"] == text
    # (the first encode, of "a", settles the tokenizer in this thread before threads share it)
    assert len(tokenizer.threads) >= 2 and threading.get_ident() not in tokenizer.threads[-2:]
    error = too_big.json()["error"]
    assert too_big.status_code == 400 and error["param"] == "prompt" and "max_prompt_bytes" in error["message"]


# -- the official client --------------------------------------------------------------------------


async def test_official_async_client_echo_prompt_logprobs_and_models(asyncllm_engine: Engine) -> None:
    app = create_app(asyncllm_engine, model_name="m")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://test") as http:
        api = openai.AsyncOpenAI(base_url="http://test/v1", api_key="x", http_client=http, max_retries=0)
        scored = await api.completions.create(model="m", prompt="One two", echo=True, logprobs=1, max_tokens=0)
        extra = await api.completions.create(
            model="m", prompt="One two", max_tokens=1, extra_body={"prompt_logprobs": 1}
        )
        card = await api.models.retrieve("m")
        with pytest.raises(openai.NotFoundError) as missing:
            await api.models.retrieve("nope")
    (choice,) = scored.choices
    assert choice.text == "One two" and choice.logprobs is not None and choice.logprobs.token_logprobs is not None
    assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.token_logprobs) >= 2
    assert scored.usage is not None and scored.usage.prompt_tokens_details is not None
    assert scored.usage.prompt_tokens_details.cached_tokens == 0
    assert (extra.choices[0].model_extra or {})["prompt_logprobs"][0] is None
    assert card.id == "m"
    assert missing.value.code == "model_not_found"
