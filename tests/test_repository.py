"""The repository keeps its promises: CI runs README's test command; the public API is curated."""

from __future__ import annotations

import re
from pathlib import Path

import asyncllm

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    commands = re.findall(r"```bash\n(pip install [^\n]+)\n```", readme)
    assert len(commands) == 2, "README gives exactly two set-up commands"
    test_command = commands[1]
    assert "pytest" in test_command
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert test_command in ci_lines


def test_public_api_is_sorted_and_importable() -> None:
    assert list(asyncllm.__all__) == sorted(asyncllm.__all__)
    for name in asyncllm.__all__:
        assert hasattr(asyncllm, name), name


def test_public_callables_have_docstrings() -> None:
    for name in asyncllm.__all__:
        obj = getattr(asyncllm, name)
        if callable(obj):
            assert obj.__doc__, name
    for method in ("open", "stream", "generate", "statistics"):
        assert getattr(asyncllm.Engine, method).__doc__, method


def test_types_in_public_signatures_are_exported() -> None:
    # A type an application meets in the public API (an argument or a result of Engine's methods)
    # is importable from the top level, not only from a private module.
    import inspect
    import typing

    exported = {getattr(asyncllm, name) for name in asyncllm.__all__ if not name.startswith("__")}
    seen = set()
    for name, member in inspect.getmembers(asyncllm.Engine):
        if name.startswith("_"):
            continue
        function = member.fget if isinstance(member, property) else member
        if not callable(function):
            continue
        for hint in typing.get_type_hints(function).values():
            for kind in (hint, *typing.get_args(hint)):
                if isinstance(kind, type) and kind.__module__.startswith("asyncllm"):
                    seen.add(kind)
                    assert kind in exported, f"Engine.{name} uses {kind.__qualname__}, which asyncllm does not export"
    assert {asyncllm.EngineMetrics, asyncllm.RequestStream, asyncllm.Completion, asyncllm.ModelRunner} <= seen


def test_every_event_loop_serve_offers_comes_with_the_plain_install() -> None:
    # `asyncllm serve --backend trio` must work after README's first set-up command, which installs
    # only the base dependencies (a test extra would hide a missing one: CI installs it).
    import tomllib

    from asyncllm.cli import build_parser

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = {re.split(r"[<>=!~\[; ]", requirement, maxsplit=1)[0].lower() for requirement in project["dependencies"]}
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    backends = next(action.choices for action in serve._actions if action.dest == "backend")
    assert set(backends) - {"asyncio"} <= base, f"serve offers {sorted(backends)}; base dependencies: {sorted(base)}"
