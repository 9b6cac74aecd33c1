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
