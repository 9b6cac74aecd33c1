"""Import a Python file that belongs to no package (the scripts in ``benchmarks/``) by its path."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

__all__ = ["import_path"]


def import_path(path: Path | str, name: str) -> ModuleType:
    """The module in the file ``path``, imported once under ``name``.

    The module is kept in ``sys.modules`` under ``name``, so a second call (from another script that
    shares the file) returns the same module; ``sys.path`` is left alone, so a generic file name such
    as ``common.py`` cannot shadow or be shadowed by another module.

    Raises:
        ImportError: ``path`` is not a Python file that can be loaded.
    """
    module = sys.modules.get(name)
    if module is not None:
        return module
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path} as {name!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]  # a half-run module must not be handed out by the next call
        raise
    return module
