"""The pytest plugin (``asyncllm.testing.plugin``, loaded through the ``pytest11`` entry point)."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from asyncllm import Engine, SamplingParams
from asyncllm.testing import ScriptedRunner

pytest_plugins = ["pytester"]


def test_the_plugin_is_registered_as_a_pytest11_entry_point() -> None:
    (entry,) = [e for e in importlib.metadata.entry_points(group="pytest11") if e.name == "asyncllm"]
    assert entry.value == "asyncllm.testing.plugin"


@pytest.mark.anyio
async def test_scripted_engine_emits_the_default_script(scripted_engine: Engine) -> None:
    completion = await scripted_engine.generate("hi", SamplingParams(max_tokens=100))
    assert (completion.text, completion.finish_reason) == ("Hello from the scripted engine!", "stop")


@pytest.mark.anyio
@pytest.mark.asyncllm_script("abc", max_model_len=64)
async def test_the_marker_sets_the_script_and_runner_options(
    scripted_engine: Engine, scripted_runner: ScriptedRunner
) -> None:
    chunks = [chunk.text async for chunk in scripted_engine.stream("hi", SamplingParams(max_tokens=5))]
    assert "".join(chunks) == "abcab" and scripted_engine.max_model_len == 64
    assert scripted_runner.steps and scripted_runner.steps[0].sequences[0].token_ids == [104, 105]


@pytest.mark.anyio
@pytest.mark.asyncllm_script([7, 8, 9])
async def test_the_marker_takes_token_ids(scripted_engine: Engine) -> None:
    completion = await scripted_engine.generate("hi", SamplingParams(max_tokens=4))
    assert completion.token_ids == (7, 8, 9, 7)


@pytest.mark.anyio
async def test_asyncllm_engine_is_a_real_engine_on_the_tiny_model(
    asyncllm_engine: Engine, asyncllm_model_path: Path
) -> None:
    assert (asyncllm_model_path / "config.json").is_file()
    completion = await asyncllm_engine.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=3))
    assert len(completion.token_ids) == 3 and asyncllm_engine.statistics().num_running == 0


SHARED_TESTS = """
import pytest

pytestmark = pytest.mark.anyio
seen = []


@pytest.fixture(scope="session")
def anyio_backend():
    return "{backend}"


async def test_one(asyncllm_engine):
    seen.append(asyncllm_engine)
    await asyncllm_engine.generate("a")


async def test_two(asyncllm_engine):
    seen.append(asyncllm_engine)
    await asyncllm_engine.generate("b")
    assert seen[0] is seen[1]  # one engine for both tests, in one event loop
"""


@pytest.mark.parametrize("backend", ["asyncio", "trio"])
def test_a_session_scoped_engine_is_shared_across_tests(pytester: pytest.Pytester, backend: str) -> None:
    pytester.makeini("[pytest]\nasyncllm_engine_scope = session\n")
    pytester.makepyfile(test_shared=SHARED_TESTS.replace("{backend}", backend))
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def test_a_bad_scope_is_a_usage_error(pytester: pytest.Pytester) -> None:
    pytester.makeini("[pytest]\nasyncllm_engine_scope = forever\n")
    pytester.makepyfile(test_x="def test_x(asyncllm_engine):\n    pass\n")
    result = pytester.runpytest("-p", "no:cacheprovider")
    assert "asyncllm_engine_scope must be one of" in result.stdout.str() + result.stderr.str()
