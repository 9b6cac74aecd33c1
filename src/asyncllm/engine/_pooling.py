"""Embeddings' defaults and finishing: which pooling a model wants, and the vector's last touches.

A model folder converted for sentence-transformers says how its embeddings are made: ``modules.json``
lists the modules (Transformer, then Pooling, optionally Normalize), and the Pooling module's
``config.json`` names the pooling mode. Qwen3-Embedding checkpoints, for one, are plain Qwen3 decoders
with last-token pooling and a Normalize module. Where that config is present (and the engine option
``pooling`` is "auto") it sets the defaults of ``Engine.embed``; otherwise last-token pooling, L2
normalized, which is what decoder embedding models are trained with.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from asyncllm.executor._runner import PooledVector, Pooling

logger = logging.getLogger("asyncllm")

POOLING_OPTIONS = ("auto", "last", "mean")
"""The values of ``EngineOptions.pooling``."""

_MODES: dict[str, Pooling] = {"pooling_mode_lasttoken": "last", "pooling_mode_mean_tokens": "mean"}
_ST = "sentence_transformers.models."
_KNOWN_MODULES = frozenset({_ST + "Transformer", _ST + "Pooling", _ST + "Normalize"})


@dataclass(frozen=True, slots=True)
class PoolingDefaults:
    """What ``Engine.embed`` does when the call does not say."""

    pooling: Pooling | None
    """None: the model's sentence-transformers config asks for what the engine cannot do (``problem``);
    calls must then name a pooling themselves."""
    normalize: bool
    source: str
    """Where the defaults came from, for the log and error messages."""
    problem: str | None = None


BUILT_IN = PoolingDefaults("last", True, "the engine's default")


def pooling_defaults(option: str, model_path: Path | None) -> PoolingDefaults:
    """The defaults for ``option`` (``EngineOptions.pooling``) and the model folder (if there is one).

    "last" or "mean" is that pooling, normalized unless the folder's sentence-transformers config has
    no Normalize module; "auto" is the config's pooling, or ``BUILT_IN`` without a config. A config the
    engine cannot follow (another pooling mode, a Dense module) is logged and leaves ``pooling`` None
    under "auto": generation is unaffected, and embedding calls must name a pooling.
    """
    config = read_sentence_transformers(model_path) if model_path is not None else None
    if option in ("last", "mean"):
        normalize = config.normalize if config is not None else True
        return PoolingDefaults(option, normalize, "the pooling option")  # type: ignore[arg-type]
    if config is None:
        return BUILT_IN
    if config.problem is not None:
        logger.warning("asyncllm: embeddings need an explicit pooling: %s", config.problem)
    return config


def read_sentence_transformers(model_path: Path) -> PoolingDefaults | None:
    """The defaults a sentence-transformers config in ``model_path`` sets; None when it has none.

    A file that cannot be read or parsed counts as no config (logged): it must not stop the engine.
    """
    modules_file = model_path / "modules.json"
    if not modules_file.is_file():
        return None
    source = f"the sentence-transformers config in {model_path}"
    try:
        modules: Any = json.loads(modules_file.read_text(encoding="utf-8"))
        types = [str(module.get("type", "")) for module in modules]
        pooling_dirs = [str(m.get("path", "")) for m in modules if m.get("type") == _ST + "Pooling"]
        pooling_config: Any = {}
        if pooling_dirs:
            pooling_config = json.loads((model_path / pooling_dirs[0] / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, AttributeError, TypeError) as exc:
        logger.warning("asyncllm: ignoring the unreadable sentence-transformers config in %s: %r", model_path, exc)
        return None
    normalize = _ST + "Normalize" in types
    unknown = sorted({t for t in types if t not in _KNOWN_MODULES})
    if unknown:
        return PoolingDefaults(None, normalize, source, f"{source} has modules asyncllm does not apply: {unknown}")
    if not pooling_dirs:
        return PoolingDefaults(None, normalize, source, f"{source} has no Pooling module")
    modes = sorted(key for key, value in pooling_config.items() if key.startswith("pooling_mode_") and value is True)
    if len(modes) != 1 or modes[0] not in _MODES:
        return PoolingDefaults(
            None, normalize, source, f"{source} asks for pooling {modes}; asyncllm pools 'last' or 'mean'"
        )
    return PoolingDefaults(_MODES[modes[0]], normalize, source)


def finish_vector(raw: PooledVector, *, dimensions: int | None, normalize: bool) -> tuple[float, ...]:
    """The vector a caller gets: the first ``dimensions`` values (Matryoshka truncation), then L2
    normalized if asked (in float64; a zero vector stays zero)."""
    vector = np.asarray(raw[:dimensions] if dimensions is not None else raw, dtype=np.float64)
    if normalize:
        norm = float(np.linalg.norm(vector))
        if norm > 0.0:
            vector = vector / norm
    values: list[float] = vector.tolist()
    return tuple(values)
