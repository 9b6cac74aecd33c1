"""pytest plugin: fixtures for testing application code against a real asyncllm ``Engine``.

Registered through the ``pytest11`` entry point, so installing asyncllm makes these fixtures
available in any test suite (async tests run with anyio's pytest plugin: ``@pytest.mark.anyio``):

- ``scripted_engine``: a real, entered ``Engine`` over ``ScriptedRunner`` + ``ByteTokenizer``; no
  weights, a few milliseconds per test. It emits ``DEFAULT_SCRIPT`` unless the test is marked
  ``@pytest.mark.asyncllm_script("text or token ids", **ScriptedRunner options)``.
  ``scripted_runner`` is that runner (to inspect the recorded steps).
- ``asyncllm_engine``: a real, entered ``Engine`` on a tiny random llama model that is built
  locally, once per session (``asyncllm_model_path``); nothing is downloaded. Its options come
  from the ``asyncllm_engine_options`` fixture (override it to change them).

An ``Engine`` belongs to the event loop it was entered in (its task group, events and the
device thread's wake-ups live there), and anyio's pytest plugin gives each test its own loop by
default. So ``asyncllm_engine`` is function-scoped by default: fresh state per test, on whichever
backend the test runs, at the cost of loading the (tiny, already built) model each time (about
0.1 s). To share one engine across tests, set the ini option ``asyncllm_engine_scope = session``
(or ``module``) and define a ``session``-scoped ``anyio_backend`` fixture: anyio then runs all those
tests in one loop, which the shared engine lives in. See docs/testing.md.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from asyncllm.engine._engine import Engine
from asyncllm.testing.scripted import EOS_ID, ByteTokenizer, Script, ScriptedRunner

DEFAULT_SCRIPT: tuple[int, ...] = (*b"Hello from the scripted engine!", EOS_ID)
"""What ``scripted_engine`` emits by default: a short text, then EOS (``finish_reason="stop"``)."""

_SCOPES = ("function", "class", "module", "package", "session")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addini(
        "asyncllm_engine_scope",
        "Scope of the asyncllm_engine fixture: function (default), class, module, package or session. "
        "Wider than function needs an anyio_backend fixture of at least that scope.",
        default="function",
    )


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "asyncllm_script(script, **options): what the scripted_engine fixture emits; script is a str "
        "(its UTF-8 bytes), token ids (EOS is asyncllm.testing.EOS_ID) or a function of the step input; "
        "options go to ScriptedRunner.",
    )


def _engine_scope(fixture_name: str, config: pytest.Config) -> Any:
    scope = str(config.getini("asyncllm_engine_scope")).strip() or "function"
    if scope not in _SCOPES:
        raise pytest.UsageError(f"asyncllm_engine_scope must be one of {', '.join(_SCOPES)}, got {scope!r}")
    return scope


@pytest.fixture(scope="session")
def asyncllm_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random llama model folder (weights, tokenizer with a chat template), built once per session."""
    from asyncllm.testing.tiny_models import tiny_model_path  # imports torch: only when asked for
    return tiny_model_path(tmp_path_factory.mktemp("asyncllm-models"), "llama")


@pytest.fixture(scope=_engine_scope)
def asyncllm_engine_options() -> dict[str, Any]:
    """Keyword arguments of ``Engine.open`` for ``asyncllm_engine``; override to change them."""
    return {"device": "cpu", "kv_cache_blocks": 128}


@pytest.fixture(scope=_engine_scope)
async def asyncllm_engine(asyncllm_model_path: Path, asyncllm_engine_options: dict[str, Any]) -> AsyncIterator[Engine]:
    """A real engine on the tiny model, entered in the test's event loop."""
    async with Engine.open(asyncllm_model_path, **asyncllm_engine_options) as engine:
        yield engine


@pytest.fixture
def scripted_runner(request: pytest.FixtureRequest) -> ScriptedRunner:
    """The ``ScriptedRunner`` behind ``scripted_engine`` (see the ``asyncllm_script`` marker)."""
    marker = request.node.get_closest_marker("asyncllm_script")
    script: str | Sequence[int] | Script = DEFAULT_SCRIPT
    options: dict[str, Any] = {}
    if marker is not None:
        script = marker.args[0] if marker.args else DEFAULT_SCRIPT
        options = dict(marker.kwargs)
    if isinstance(script, str):
        script = ByteTokenizer().encode(script)
    return ScriptedRunner(script, **options)


@pytest.fixture
async def scripted_engine(scripted_runner: ScriptedRunner) -> AsyncIterator[Engine]:
    """A real engine over ``scripted_runner`` and a ``ByteTokenizer``: streaming without weights."""
    async with Engine.open(runner=scripted_runner, tokenizer=ByteTokenizer()) as engine:
        yield engine
