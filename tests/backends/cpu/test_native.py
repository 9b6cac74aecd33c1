"""``asyncllm.backends.cpu._native``: the kernel cache is reused, and libraries nobody used for a month go."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from asyncllm.backends.cpu import _native as native

SOURCE = "int asyncllm_test_answer(void) { return 42; }\n"

pytestmark = pytest.mark.skipif(native.compiler() is None, reason="no C compiler")


def test_build_reuses_its_library_and_removes_stale_ones(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import ctypes

    monkeypatch.setenv("ASYNCLLM_CACHE_DIR", str(tmp_path))
    folder = tmp_path / "kernels"
    folder.mkdir()
    month_ago = time.time() - (native.STALE_AFTER_DAYS + 1) * 86400
    stale = folder / "paged_decode_hd64_0123456789abcdef0123.so"  # an older version's kernel
    recent = folder / "attention_hd64_fedcba9876543210fedc.so"  # used a day ago: kept
    other = folder / "notes.txt"  # not a library: never touched
    for path in (stale, recent, other):
        path.write_bytes(b"")
    os.utime(stale, (month_ago, month_ago))
    os.utime(other, (month_ago, month_ago))
    os.utime(recent, (time.time() - 86400,) * 2)

    built = native.build("answer", SOURCE)
    assert built is not None and built.parent == folder
    assert ctypes.CDLL(str(built)).asyncllm_test_answer() == 42
    assert not stale.exists()
    assert recent.exists() and other.exists()

    # Reused, not rebuilt, and marked as used: an old modification time becomes now.
    os.utime(built, (month_ago, month_ago))
    assert native.build("answer", SOURCE) == built
    assert built.stat().st_mtime > time.time() - 3600
