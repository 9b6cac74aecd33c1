"""Stop strings: held back while they could still match, cut on a match, and the request freed.

Most tests use ``ScriptedRunner`` + ``ByteTokenizer`` (one byte per token, so multi-byte
characters span tokens and every stop string is typed one token at a time); one runs a real model.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from asyncllm import Engine, SamplingParams, StreamChunk
from asyncllm.core._request import Request
from asyncllm.core._scheduler import TokenEvent
from asyncllm.engine._output_processor import OutputProcessor
from asyncllm.testing import EOS_ID, ByteTokenizer, ScriptedRunner

TOKENIZER = ByteTokenizer()


# ----------------------------------------------------------------------------------------------
# The output processor alone: what each step pushes
# ----------------------------------------------------------------------------------------------


@dataclass
class _Recorder:
    """Stands in for a RequestStream: records what the output processor pushes."""

    pushes: list[tuple[str, str | None, Any]] = field(default_factory=list)
    wakes_at_end: bool = False  # a streaming consumer: text step by step

    def _push(self, index: int, text: str, token_ids: list[int], finish_reason: str | None, **extra: Any) -> None:
        self.pushes.append((text, finish_reason, extra.get("stop_reason")))

    @property
    def text(self) -> str:
        return "".join(text for text, _, _ in self.pushes)


def _feed(
    text: str, params: SamplingParams, *, per_event: int = 1, finish_last: bool = False
) -> tuple[_Recorder, list[int]]:
    """Push ``text``'s bytes through an OutputProcessor; return what it pushed and when it stopped."""
    processor = OutputProcessor(TOKENIZER)
    recorder = _Recorder()
    request = Request(0, [1], params, frozenset({EOS_ID}), 10_000)
    processor.register(0, recorder)  # type: ignore[arg-type]
    ids = TOKENIZER.encode(text)
    stopped_at = []
    for start in range(0, len(ids), per_event):
        chunk = ids[start : start + per_event]
        request.output_token_ids.extend(chunk)
        last = start + per_event >= len(ids)
        event = TokenEvent(request, chunk, "length" if finish_last and last else None)
        if processor.process([event]).stopped:
            stopped_at.append(start)
        if processor.num_open == 0:
            break
    return recorder, stopped_at


def test_text_that_could_start_a_stop_string_is_held_back() -> None:
    recorder, stopped_at = _feed("Hello world, more", SamplingParams(stop=("world",)))
    texts = [text for text, _, _ in recorder.pushes]
    assert texts == [*"Hello ", "", "", "", "", ""]
    assert recorder.pushes[-1] == ("", "stop", "world")
    assert stopped_at == [len("Hello world") - 1]


def test_a_false_start_is_released_once_it_cannot_match() -> None:
    recorder, stopped_at = _feed("wow worl!", SamplingParams(stop=("world",)), finish_last=True)
    assert [text for text, _, _ in recorder.pushes] == ["", "", "wo", "w ", "", "", "", "", "worl!"]
    assert recorder.text == "wow worl!"
    assert recorder.pushes[-1][1:] == ("length", None)
    assert stopped_at == []


def test_include_stop_str_in_output_sends_text_at_once_and_keeps_the_string() -> None:
    params = SamplingParams(stop=("ab",), include_stop_str_in_output=True)
    recorder, stopped_at = _feed("xaab!", params)
    assert [text for text, _, _ in recorder.pushes] == ["x", "a", "a", "b"]
    assert recorder.text == "xaab"
    assert recorder.pushes[-1][1:] == ("stop", "ab")
    assert stopped_at == [3]


def test_several_tokens_at_once_stop_where_one_token_at_a_time_would() -> None:
    # A verified speculative draft brings several tokens in one event. "cd" is complete at the fourth
    # token, before "bcde" (which starts earlier) is: one token per step would have stopped at "cd".
    params = SamplingParams(stop=("cd", "bcde", "zz"))
    one_by_one, _ = _feed("abcdef", params)
    recorder, _ = _feed("abcdef", params, per_event=6)
    assert recorder.text == one_by_one.text == "ab"
    assert recorder.pushes == [("ab", "stop", "cd")]


def test_a_multibyte_stop_string_spanning_several_tokens() -> None:
    recorder, _ = _feed("ok 🙂 no", SamplingParams(stop=("🙂",)))
    assert recorder.text == "ok "
    assert recorder.pushes[-1][1:] == ("stop", "🙂")


def test_stop_strings_wait_for_min_tokens() -> None:
    recorder, _ = _feed("ab ab ab", SamplingParams(stop=("ab",), min_tokens=4, max_tokens=100))
    assert recorder.text == "ab "
    assert recorder.pushes[-1][1:] == ("stop", "ab")


def test_held_text_comes_out_when_the_request_ends_otherwise() -> None:
    recorder, _ = _feed("the end wor", SamplingParams(stop=("world",)), finish_last=True)
    assert recorder.text == "the end wor"
    assert recorder.pushes[-1][1] == "length"


# ----------------------------------------------------------------------------------------------
# Through the engine (scripted runner)
# ----------------------------------------------------------------------------------------------


async def _run(text: str, params: SamplingParams) -> tuple[list[StreamChunk], ScriptedRunner, Any]:
    runner = ScriptedRunner(TOKENIZER.encode(text), num_kv_blocks=128, block_size=4)
    async with Engine.open(runner=runner, tokenizer=TOKENIZER) as engine:
        chunks = [chunk async for chunk in engine.stream("prompt", params)]
        await engine.generate("barrier", SamplingParams(max_tokens=1))  # let the loop settle
        stats = engine.statistics()
    return chunks, runner, stats


@pytest.mark.anyio
async def test_a_stop_string_ends_the_request_and_frees_its_blocks() -> None:
    text = "Hello wörld! The end STOP and what follows"
    params = SamplingParams(max_tokens=100, stop=("STOP", "never"), ignore_eos=True)
    chunks, runner, stats = await _run(text, params)
    assert "".join(c.text for c in chunks) == "Hello wörld! The end "
    assert chunks[-1].finished and chunks[-1].finish_reason == "stop" and chunks[-1].stop_reason == "STOP"
    assert all(c.stop_reason is None for c in chunks[:-1])
    # Every token up to the one that completed the string is reported, nothing after it.
    ids = [t for c in chunks for t in c.token_ids]
    assert ids == TOKENIZER.encode("Hello wörld! The end STOP")
    assert stats.num_running == stats.num_waiting == 0
    assert stats.kv_blocks_free == stats.kv_blocks_total
    # The runner heard that the request finished, and computed for it at most twice more: the
    # tokens of step N are detokenized while step N+1 runs, and step N+2 was already scheduled.
    request_id = runner.steps[0].sequences[0].request_id
    finished_at = next(i for i, step in enumerate(runner.steps) if request_id in step.finished_request_ids)
    after = [s for step in runner.steps[finished_at:] for s in step.sequences if s.request_id == request_id]
    assert after == []
    fed = [s for step in runner.steps for s in step.sequences if s.request_id == request_id and s.sample]
    assert len(fed) <= len(ids) + 2


@pytest.mark.anyio
async def test_stop_reason_names_a_stop_token_id_but_not_eos() -> None:
    by_id, _, _ = await _run("abcdef", SamplingParams(max_tokens=50, stop_token_ids=(ord("d"),), ignore_eos=True))
    assert "".join(c.text for c in by_id) == "abcd"
    assert (by_id[-1].finish_reason, by_id[-1].stop_reason) == ("stop", ord("d"))
    runner = ScriptedRunner([*TOKENIZER.encode("ab"), EOS_ID])
    async with Engine.open(runner=runner, tokenizer=TOKENIZER) as engine:
        completion = await engine.generate("x", SamplingParams(max_tokens=50))
    assert (completion.text, completion.finish_reason, completion.stop_reason) == ("ab", "stop", None)


@pytest.mark.anyio
async def test_generate_reports_the_stop_string() -> None:
    runner = ScriptedRunner(TOKENIZER.encode("one, two, three"))
    async with Engine.open(runner=runner, tokenizer=TOKENIZER) as engine:
        cut = await engine.generate("x", SamplingParams(max_tokens=50, stop=(", t",)))
        kept = await engine.generate("x", SamplingParams(max_tokens=50, stop=(", t",), include_stop_str_in_output=True))
    assert (cut.text, cut.finish_reason, cut.stop_reason) == ("one", "stop", ", t")
    assert (kept.text, kept.finish_reason, kept.stop_reason) == ("one, t", "stop", ", t")
    assert cut.token_ids == kept.token_ids == tuple(TOKENIZER.encode("one, t"))


def _expected(text: str, stops: list[str], include: bool) -> tuple[str, str | None]:
    """The text a stream must produce: up to the stop string that is completed first."""
    matches = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not matches:
        return text, None
    end, start, stop = min(matches)
    return text[: end if include else start], stop


@settings(max_examples=60, deadline=None)
@given(
    text=st.text(alphabet="ab 🙂é", min_size=1, max_size=24),
    stops=st.lists(st.text(alphabet="ab 🙂é", min_size=1, max_size=3), min_size=1, max_size=3),
    include=st.booleans(),
)
def test_streamed_chunks_add_up_to_the_final_text(text: str, stops: list[str], include: bool) -> None:
    expected_text, expected_stop = _expected(text, stops, include)
    params = SamplingParams(
        max_tokens=len(text.encode()), stop=tuple(stops), include_stop_str_in_output=include, ignore_eos=True
    )

    async def main() -> list[StreamChunk]:
        chunks, _, stats = await _run(text, params)
        assert stats.kv_blocks_free == stats.kv_blocks_total
        return chunks

    chunks = anyio.run(main)
    streamed = ""
    for chunk in chunks:
        streamed += chunk.text
        # Nothing that is sent is ever taken back: the text so far is always a prefix of the end result.
        assert expected_text.startswith(streamed)
    assert streamed == expected_text
    assert chunks[-1].finish_reason == ("stop" if expected_stop is not None else "length")
    assert chunks[-1].stop_reason == expected_stop


# ----------------------------------------------------------------------------------------------
# A real model
# ----------------------------------------------------------------------------------------------


@pytest.mark.anyio
async def test_stop_string_on_a_real_model(tiny_llama: Path) -> None:
    sampling = SamplingParams(temperature=3.0, seed=2, max_tokens=32, ignore_eos=True)
    async with Engine.open(tiny_llama, device="cpu", kv_cache_blocks=64) as engine:
        free = await engine.generate("the quick brown fox", sampling)
        assert len(free.text) > 12
        stop = free.text[8:11]
        start = free.text.index(stop)
        params = SamplingParams(temperature=3.0, seed=2, max_tokens=32, ignore_eos=True, stop=(stop,))
        chunks = [chunk async for chunk in engine.stream("the quick brown fox", params)]
        await engine.generate("barrier", SamplingParams(max_tokens=1))
        stats = engine.statistics()
    assert "".join(c.text for c in chunks) == free.text[:start]
    assert chunks[-1].finish_reason == "stop" and chunks[-1].stop_reason == stop
    ids = tuple(t for c in chunks for t in c.token_ids)
    assert ids == free.token_ids[: len(ids)] and len(ids) < len(free.token_ids)
    assert stats.kv_blocks_free == stats.kv_blocks_total and stats.num_running == 0


@pytest.mark.anyio
async def test_min_tokens_holds_off_eos_and_stop_ids_even_from_a_runner_that_emits_them() -> None:
    runner = ScriptedRunner([ord("a"), EOS_ID])
    async with Engine.open(runner=runner, tokenizer=TOKENIZER) as engine:
        early = await engine.generate("x", SamplingParams(max_tokens=50))
        held = await engine.generate("x", SamplingParams(max_tokens=50, min_tokens=3))
        by_id = await engine.generate("x", SamplingParams(max_tokens=50, min_tokens=2, stop_token_ids=(ord("a"),)))
    assert early.token_ids == (ord("a"), EOS_ID) and early.finish_reason == "stop"
    assert held.token_ids == (ord("a"), EOS_ID, ord("a"), EOS_ID) and held.text == "aa"
    assert by_id.token_ids == (ord("a"), EOS_ID, ord("a")) and by_id.stop_reason == ord("a")
