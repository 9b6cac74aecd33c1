"""``asyncllm.testing.import_path``: the benchmark scripts' way of sharing ``benchmarks/common.py``."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from asyncllm.testing import import_path


def test_a_file_is_imported_once_under_its_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    script = tmp_path / "common.py"
    script.write_text("import itertools\nloads = next(COUNTER)\n")
    counter = __import__("itertools").count()
    monkeypatch.setattr("builtins.COUNTER", counter, raising=False)
    monkeypatch.delitem(sys.modules, "asyncllm_test_by_path", raising=False)
    first = import_path(script, "asyncllm_test_by_path")
    assert first.loads == 0 and sys.modules["asyncllm_test_by_path"] is first
    assert import_path(script, "asyncllm_test_by_path") is first  # not run a second time
    assert next(counter) == 1
    monkeypatch.delitem(sys.modules, "asyncllm_test_by_path")


def test_a_failing_file_leaves_nothing_behind(tmp_path: Path) -> None:
    script = tmp_path / "broken.py"
    script.write_text("raise RuntimeError('half-way')\n")
    with pytest.raises(RuntimeError, match="half-way"):
        import_path(script, "asyncllm_test_broken")
    assert "asyncllm_test_broken" not in sys.modules
    with pytest.raises(ImportError, match="cannot import"):
        import_path(tmp_path / "notes.txt", "asyncllm_test_not_python")
