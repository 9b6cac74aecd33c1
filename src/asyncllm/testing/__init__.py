"""Test helpers for applications and for asyncllm's own tests."""

from __future__ import annotations

from asyncllm.testing.by_path import import_path
from asyncllm.testing.scripted import EOS_ID, ByteTokenizer, RecordedStep, ScriptedRunner, cycle

__all__ = ["EOS_ID", "ByteTokenizer", "RecordedStep", "ScriptedRunner", "cycle", "import_path"]
