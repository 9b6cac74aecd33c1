"""Where a model comes from: a local folder, or a Hugging Face hub id resolved through the hub's cache.

A ``model`` string that names an existing local folder is that folder. Otherwise a string of the form
``org/name`` is a hub id: it is looked up in huggingface_hub's cache (``$HF_HUB_CACHE``, by default
``~/.cache/huggingface/hub``, the folder transformers and vLLM share) and downloaded into it when the
cache lacks a complete snapshot of the revision. Under ``HF_HUB_OFFLINE=1``, or when the cache already
holds a complete snapshot, no network call is made: a model that is there is served without asking
the hub whether a newer commit exists (pass a commit hash, or empty the cache, to move on).

Before the weights are downloaded, the checkpoint's ``config.json`` is checked (:func:`check_model_config`):
a model that needs ``trust_remote_code``, one with quantized weights, or one of an architecture asyncllm
does not implement is refused with :class:`~asyncllm.errors.UnsupportedModelError`. The repository's code
is never run.
"""

from __future__ import annotations

import json
import logging
import os
import pathlib
import re
from collections.abc import Mapping
from typing import Any

from asyncllm.errors import ModelNotFoundError, UnsupportedModelError

__all__ = [
    "ALLOW_PATTERNS",
    "check_model_config",
    "check_model_folder",
    "hub_cache_dir",
    "hub_id",
    "resolve_hub_model",
]

logger = logging.getLogger("asyncllm")

ALLOW_PATTERNS = (
    "config.json",
    "generation_config.json",
    # Tokenizers: the fast tokenizer's file, the slow ones' vocabularies, and their configs.
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    # Chat templates kept out of tokenizer_config.json.
    "chat_template.jinja",
    "chat_template.json",
    "additional_chat_templates/*",
    # Weights, and the index of sharded ones.
    "*.safetensors",
    "*.safetensors.index.json",
    # sentence-transformers' pooling: modules.json and each module's config (1_Pooling/config.json).
    "modules.json",
    "*/config.json",
)
"""The files of a hub repository the engine reads; nothing else (PyTorch .bin files, ONNX or GGUF
copies, the repository's Python code) is downloaded."""

# Hub ids are "org/name": letters, digits, "-", "_" and "." (the hub's own rule), neither part
# starting or ending with "-" or ".", no "--" or "..". One slash: bare names are local paths.
_PART = r"[A-Za-z0-9_](?:[A-Za-z0-9_.\-]*[A-Za-z0-9_])?"
_HUB_ID = re.compile(rf"{_PART}/{_PART}")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def hub_id(model: str | os.PathLike[str] | None) -> str | None:
    """The hub id ``model`` names, or None when it names a local folder (or is None).

    An existing local path wins; otherwise a string of the form ``org/name`` (no leading ``./``,
    ``/`` or ``~``, at most 96 characters, no ``--`` or ``..``) is a hub id.
    """
    if model is None or not isinstance(model, str):
        return None
    if pathlib.Path(model).expanduser().exists():
        return None
    if len(model) > 96 or "--" in model or ".." in model or not _HUB_ID.fullmatch(model):
        return None
    return model


def _truthy(value: str | None) -> bool:
    return (value or "").strip().upper() in {"1", "ON", "YES", "TRUE"}


def _offline() -> bool:
    # Read at each call (huggingface_hub reads it once, at import), so a process can switch it.
    from huggingface_hub import constants

    if "HF_HUB_OFFLINE" in os.environ or "TRANSFORMERS_OFFLINE" in os.environ:
        return _truthy(os.environ.get("HF_HUB_OFFLINE")) or _truthy(os.environ.get("TRANSFORMERS_OFFLINE"))
    return bool(constants.HF_HUB_OFFLINE)


def hub_cache_dir() -> pathlib.Path:
    """huggingface_hub's cache folder: ``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else its default
    (``~/.cache/huggingface/hub``); the environment is read at each call."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return pathlib.Path(os.environ["HF_HUB_CACHE"]).expanduser().absolute()
    if os.environ.get("HF_HOME"):
        return (pathlib.Path(os.environ["HF_HOME"]).expanduser() / "hub").absolute()
    return pathlib.Path(constants.HF_HUB_CACHE).expanduser().absolute()


def _endpoint() -> str:
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def _missing_files(folder: pathlib.Path) -> list[str]:
    """What a model folder lacks to be loaded: config.json, or weights (every shard its index names)."""
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values())
        except (OSError, ValueError, AttributeError):
            shards = set()
        absent = sorted(shard for shard in shards if not (folder / shard).is_file())
        if absent or not shards:
            missing.append(f"weight shards ({', '.join(absent) or 'an unreadable index'})")
    elif not any(path.is_file() for path in folder.glob("*.safetensors")):
        missing.append("weights (*.safetensors files)")
    return missing


def check_model_config(config: Mapping[str, Any], source: str) -> None:
    """Refuse a checkpoint asyncllm cannot run, from its ``config.json``, before any weight is read.

    Args:
        config: The parsed ``config.json``.
        source: The model as the user named it (a hub id or a folder), for the message.

    Raises:
        UnsupportedModelError: No architecture of ``config["architectures"]`` is implemented (the
            message lists the supported ones, and says when the model's own code would be needed:
            an ``auto_map``, which asyncllm never runs), or the weights are quantized
            (``quantization_config``: the message names the method).
    """
    from asyncllm.models import SUPPORTED_ARCHITECTURES

    architectures = [str(name) for name in config.get("architectures") or []]
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    if architectures and not any(name in SUPPORTED_ARCHITECTURES for name in architectures):
        if config.get("auto_map"):
            raise UnsupportedModelError(
                f"{source} needs trust_remote_code: its config.json's auto_map points to Python code in the "
                f"repository ({', '.join(architectures)}), and asyncllm never runs a model's own code. "
                f"asyncllm implements {supported}."
            )
        raise UnsupportedModelError(
            f"{source}: architectures {architectures} are not supported; asyncllm implements {supported}."
        )
    quantization = config.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method") if isinstance(quantization, Mapping) else None
        if not method and isinstance(quantization, Mapping):
            method = "bitsandbytes" if any(k.startswith(("load_in_", "bnb_")) for k in quantization) else None
        raise UnsupportedModelError(
            f"{source} holds quantized weights ({method or 'unknown method'}, from config.json's "
            "quantization_config); asyncllm loads only unquantized float32, float16 or bfloat16 "
            "safetensors for now. Use the unquantized checkpoint."
        )


def check_model_folder(folder: pathlib.Path, source: str) -> None:
    """:func:`check_model_config` on ``folder/config.json``.

    Raises:
        UnsupportedModelError: See :func:`check_model_config`.
        ModelNotFoundError: config.json is not a JSON object.
    """
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelNotFoundError(f"{source}: cannot read {folder / 'config.json'}: {exc}") from exc
    if not isinstance(config, dict):
        raise ModelNotFoundError(f"{source}: {folder / 'config.json'} is not a JSON object")
    check_model_config(config, source)


def _cached_snapshot(repo_id: str, revision: str, cache_dir: pathlib.Path) -> pathlib.Path | None:
    """The cache's snapshot of ``repo_id`` at ``revision`` (a commit hash, or a branch or tag its
    ``refs/`` records), if present; reads files only."""
    repo_folder = cache_dir / f"models--{repo_id.replace('/', '--')}"
    commit = revision
    if not _COMMIT.fullmatch(revision):
        try:
            commit = (repo_folder / "refs" / revision).read_text(encoding="utf-8").strip()
        except (OSError, ValueError):
            return None
    snapshot = repo_folder / "snapshots" / commit
    return snapshot if snapshot.is_dir() else None


def _not_found(repo_id: str, revision: str, cache_dir: pathlib.Path, why: str) -> ModelNotFoundError:
    local = pathlib.Path(repo_id).absolute()
    cached = cache_dir / f"models--{repo_id.replace('/', '--')}"
    return ModelNotFoundError(
        f"Model {repo_id!r} (revision {revision!r}) not found: there is no local folder {local}, "
        f"the hub cache {cached} has no complete snapshot of it, and {why}"
    )


def resolve_hub_model(repo_id: str, revision: str | None = None) -> pathlib.Path:
    """The local snapshot folder of hub model ``repo_id`` at ``revision``, downloaded if needed.

    A complete snapshot already in the cache is returned without a network call; so is any cached
    one under ``HF_HUB_OFFLINE=1``. Otherwise ``config.json`` is fetched and checked first
    (:func:`check_model_config`), then the files in :data:`ALLOW_PATTERNS` of that same commit.

    Args:
        repo_id: ``org/name``.
        revision: A branch, tag or commit hash; None is ``main``.

    Returns:
        The snapshot folder (in the hub cache).

    Raises:
        ModelNotFoundError: Not cached and offline, the hub cannot be reached, no such repository
            or revision, or a gated repository without access (the message says to set ``HF_TOKEN``
            or log in). The message names the local path, the cache folder and the hub tried.
        UnsupportedModelError: The checkpoint's config.json is refused (:func:`check_model_config`).
    """
    from huggingface_hub import hf_hub_download, snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        OfflineModeIsEnabled,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    revision = revision or "main"
    cache_dir = hub_cache_dir()
    endpoint = _endpoint()
    cached = _cached_snapshot(repo_id, revision, cache_dir)
    if cached is not None and not _missing_files(cached):
        check_model_folder(cached, repo_id)
        return cached
    if _offline():
        why = "HF_HUB_OFFLINE is set, so the hub was not asked"
        if cached is not None:
            why = f"its snapshot {cached} lacks {' and '.join(_missing_files(cached))}; {why}"
        raise _not_found(repo_id, revision, cache_dir, why + ".")

    where = f"{endpoint}/{repo_id}"
    try:
        logger.info("downloading %s (revision %s) from %s into %s", repo_id, revision, endpoint, cache_dir)
        config_file = pathlib.Path(
            hf_hub_download(repo_id, "config.json", revision=revision, cache_dir=cache_dir, endpoint=endpoint)
        )
        # The snapshot folder is named by its commit: the weights come from the same commit even
        # if the branch moves meanwhile.
        commit = config_file.parent.name
        check_model_folder(config_file.parent, repo_id)
        folder = pathlib.Path(
            snapshot_download(
                repo_id,
                revision=commit,
                cache_dir=cache_dir,
                endpoint=endpoint,
                allow_patterns=list(ALLOW_PATTERNS),
            )
        )
    except GatedRepoError as exc:
        raise _not_found(
            repo_id,
            revision,
            cache_dir,
            f"{where} is a gated repository: accept its terms on that page, then authenticate with a token "
            f"that has access (set HF_TOKEN, or run `huggingface-cli login`). The hub said: {_first_line(exc)}",
        ) from exc
    except RevisionNotFoundError as exc:
        raise _not_found(repo_id, revision, cache_dir, f"{where} has no revision {revision!r}.") from exc
    except RepositoryNotFoundError as exc:
        raise _not_found(
            repo_id,
            revision,
            cache_dir,
            f"the hub has no such model: {where} (if it is private, set HF_TOKEN to a token with access).",
        ) from exc
    except (OfflineModeIsEnabled, LocalEntryNotFoundError) as exc:
        raise _not_found(
            repo_id, revision, cache_dir, f"the hub at {endpoint} could not be reached: {_first_line(exc)}"
        ) from exc
    except HfHubHTTPError as exc:
        raise _not_found(repo_id, revision, cache_dir, f"the hub at {endpoint} answered: {_first_line(exc)}") from exc
    except OSError as exc:
        raise _not_found(
            repo_id, revision, cache_dir, f"the hub at {endpoint} could not be reached: {_first_line(exc)}"
        ) from exc
    except Exception as exc:
        # huggingface_hub's HTTP client raises its own (httpx) errors for connection failures.
        if type(exc).__module__.split(".")[0] not in {"httpx", "httpx2", "httpcore", "requests"}:
            raise
        raise _not_found(
            repo_id, revision, cache_dir, f"the hub at {endpoint} could not be reached: {_first_line(exc)}"
        ) from exc
    missing = _missing_files(folder)
    if missing:
        raise _not_found(
            repo_id, revision, cache_dir, f"{where} at commit {commit} has no {' and '.join(missing)} to download."
        )
    return folder


def _first_line(exc: BaseException) -> str:
    text = " ".join(line.strip() for line in str(exc).splitlines() if line.strip())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__
