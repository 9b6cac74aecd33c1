"""Reading an HF-format model folder: config, safetensors weights, end-of-sequence ids.

``load_model`` builds the model on the meta device (no memory), allocates each parameter once in the
target dtype on the target device, and fills it from the checkpoint a slice at a time: the weights
exist once, in their final dtype and layout (q/k/v and gate/up already stacked), plus at most
``LOAD_CHUNK_BYTES`` in flight. Peak memory during load is the weights' size in the target dtype,
whatever the checkpoint's dtype.
"""

from __future__ import annotations

import functools
import json
import math
import struct
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from asyncllm.errors import ModelLoadError
from asyncllm.models import DecoderForCausalLM, build_model
from asyncllm.models._parallel import SINGLE, TensorParallel

LOAD_CHUNK_BYTES = 16 << 20
"""At most this many bytes of a checkpoint tensor (in its own dtype) are read at once while loading:
the only memory beyond the weights themselves."""

CheckpointTensor = tuple[str, tuple[int, ...], Callable[[int, int], torch.Tensor]]
"""One tensor of a checkpoint: its HF name, its shape, and a reader of rows ``[start, stop)`` (a CPU tensor
in the checkpoint's dtype)."""


def load_config(model_path: Path) -> Any:
    """The folder's config.json as a transformers config object."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_path)


_SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def checkpoint_tensors(model_path: Path) -> Iterator[CheckpointTensor]:
    """Every tensor of the folder's *.safetensors files, lazily: nothing is read until a reader is called
    (each call opens the file, so a reader stays valid after the iteration).

    The files are read with plain reads, not mapped (safetensors' own reader maps them): pages of a
    mapping that the copy touches count as the process's resident memory until the file is closed,
    which would double the load's measured peak; read() leaves them in the page cache only. The
    format is safetensors' documented one: an 8-byte little-endian header length, a JSON header
    (each tensor's dtype, shape and byte range after the header), then the data.

    Raises:
        ModelLoadError: A file's header is malformed, or a tensor has a dtype outside
            F64/F32/F16/BF16/I64/I32/I16/I8/U8/BOOL.
    """
    for file in sorted(model_path.glob("*.safetensors")):
        with open(file, "rb") as handle:
            try:
                (header_size,) = struct.unpack("<Q", handle.read(8))
                header = json.loads(handle.read(header_size))
            except (struct.error, ValueError) as exc:
                raise ModelLoadError(f"{file} is not a safetensors file: {exc}") from exc
            data_start = 8 + header_size
            for name, entry in header.items():
                if name == "__metadata__":
                    continue
                dtype = _SAFETENSORS_DTYPES.get(entry.get("dtype"))
                if dtype is None:
                    raise ModelLoadError(
                        f"{file}: tensor {name!r} has dtype {entry.get('dtype')!r}, which is not supported"
                    )
                shape = tuple(int(size) for size in entry["shape"])
                offset = data_start + int(entry["data_offsets"][0])
                yield name, shape, functools.partial(_read_rows, file, offset, shape, dtype)


def _read_rows(
    file: Path, offset: int, shape: tuple[int, ...], dtype: torch.dtype, start: int, stop: int
) -> torch.Tensor:
    # Rows [start, stop) of a row-major tensor are one contiguous byte range, read straight into the result.
    row_elements = math.prod(shape[1:])
    rows = torch.empty((stop - start, *shape[1:]), dtype=dtype)
    view = memoryview(rows.view(torch.uint8).numpy().data).cast("B") if rows.numel() else memoryview(b"")
    with open(file, "rb") as handle:
        handle.seek(offset + start * row_elements * rows.element_size())
        if handle.readinto(view) != len(view):
            raise ModelLoadError(f"{file} ends inside a tensor")
    return rows if shape else rows.reshape(())


def load_model(
    config: Any,
    tensors: Iterable[CheckpointTensor],
    *,
    device: torch.device,
    dtype: torch.dtype,
    fuse_projections: bool,
    parallel: TensorParallel = SINGLE,
) -> DecoderForCausalLM:
    """Build the model ``config`` describes and load ``tensors`` into it, in ``dtype`` on ``device``.

    The model is built on the meta device (and fused there with ``fuse_projections``), each parameter
    is then allocated once in ``dtype`` on ``device`` (tied embeddings stay one tensor), and
    ``load_weights`` fills them. The rotary frequencies are computed in float32 on the host, as
    ``RotaryEmbedding`` does at init, and moved to ``device`` in float32.

    Args:
        config: The HF config (``load_config``), or the model's ``DecoderSpec`` read off it (a rank of a
            tensor-parallel model gets rank 0's, and need not import transformers).
        tensors: The checkpoint (``checkpoint_tensors``), with HF's names.
        device: Where the weights go.
        dtype: The floating-point dtype of every parameter.
        fuse_projections: Stack q/k/v and gate/up (``DecoderForCausalLM.fuse_projections``).
        parallel: The rank's place in a tensor-parallel model: the model holds its shard of every
            split weight, and only that shard is copied from the checkpoint (its rows, or its columns
            read a row range at a time).

    Returns:
        The model, in eval mode.

    Raises:
        ModelLoadError: The checkpoint lacks a tensor the model needs, has one it does not know, or
            one of the wrong shape.
        NotImplementedError: The config's architecture is not implemented.
    """
    with torch.device("meta"):
        model = build_model(config, parallel)
        if fuse_projections:
            model.fuse_projections()
    allocated: dict[int, nn.Parameter] = {}  # by the meta parameter's id: tied parameters stay one
    for module in model.modules():
        for name, param in module.named_parameters(recurse=False):
            if id(param) not in allocated:
                target = dtype if param.is_floating_point() else param.dtype
                allocated[id(param)] = nn.Parameter(
                    torch.empty(param.shape, dtype=target, device=device), requires_grad=False
                )
            setattr(module, name, allocated[id(param)])
    model.reset_rotary(device)
    load_weights(model, tensors)
    return model.eval()


def load_weights(model: DecoderForCausalLM, tensors: Iterable[CheckpointTensor]) -> None:
    """Copy every checkpoint tensor into its parameter (or its rows of a fused one, or of a stacked MoE
    expert parameter), casting on the way; a rank of a tensor-parallel model copies only its shard
    (``DecoderForCausalLM.checkpoint_slices``).

    Reads at most ``LOAD_CHUNK_BYTES`` at a time. With tied embeddings a checkpoint's ``lm_head.weight``
    is ignored (the input embedding is the output projection). Precomputed rotary tables are ignored:
    ours are computed from the config.

    Raises:
        ModelLoadError: A tensor is unknown, has the wrong shape, or a parameter is left unfilled.
    """
    params = dict(model.named_parameters())
    slices = model.checkpoint_slices()
    filled: dict[str, int] = dict.fromkeys(params, 0)
    with torch.no_grad():
        for padded, valid in model.padded_rows().items():  # no checkpoint row lands there: zeros
            param = params[padded]
            param.data[valid:].zero_()
            filled[padded] += param.data[valid:].numel()
    for name, shape, read in tensors:
        if "rotary_emb" in name or (name == "lm_head.weight" and model.spec.tie_word_embeddings):
            continue
        where = slices.get(name)
        target_name, first = (name, 0) if where is None else (where.target, where.first_row)
        target = params.get(target_name)
        if target is None:
            raise ModelLoadError(f"the checkpoint has a tensor {name!r} that the model does not have")
        rows = (0, shape[0] if shape else 1) if where is None or where.rows is None else where.rows
        columns = None if where is None else where.columns
        if rows[1] > (shape[0] if shape else 1) or (columns is not None and (len(shape) < 2 or columns[1] > shape[1])):
            raise ModelLoadError(f"the checkpoint's {name!r} of shape {list(shape)} is too small to split over ranks")
        width = tuple(shape[1:]) if columns is None else (columns[1] - columns[0], *shape[2:])
        count = rows[1] - rows[0]
        if target.dim() == len(shape) + 1 and len(shape) >= 1:
            # One expert's matrix of a stacked [experts, rows, columns] parameter (``models._moe``):
            # its rows are rows of the stack seen as [experts * rows, columns].
            destination = target.data.view(-1, *target.shape[2:])
        else:
            destination = target.data.view(-1, *target.shape[1:]) if target.dim() else target.data.view(1)
        if tuple(destination.shape[1:]) != width or first + count > destination.shape[0]:
            raise ModelLoadError(
                f"the checkpoint's {name!r} has shape {list(shape)}, which does not fit the model's "
                f"{target_name!r} of shape {list(target.shape)}"
            )
        # Whole rows are read (a row range is one contiguous read), then cut to the rank's columns.
        row_bytes = max(1, destination[0].numel() * destination.element_size(), math.prod(shape[1:]) * 4)
        step = max(1, LOAD_CHUNK_BYTES // row_bytes)
        with torch.no_grad():
            for start in range(0, count, step):
                stop = min(count, start + step)
                chunk = read(rows[0] + start, rows[0] + stop) if shape else read(0, 1).reshape(1)
                if columns is not None:
                    chunk = chunk[:, columns[0] : columns[1]]
                destination[first + start : first + stop].copy_(chunk)
                del chunk
        filled[target_name] += count * math.prod(width)
    missing = [name for name, param in params.items() if filled[name] != param.numel()]
    if missing:
        raise ModelLoadError(
            f"the checkpoint does not fill the model's {', '.join(missing[:5])}"
            f"{f' and {len(missing) - 5} more' if len(missing) > 5 else ''}"
        )


def load_eos_token_ids(model_path: Path, config: Any) -> frozenset[int]:
    """The ids that end generation: from generation_config.json if present, else config.json."""
    generation_config = model_path / "generation_config.json"
    value: Any = None
    if generation_config.exists():
        value = json.loads(generation_config.read_text()).get("eos_token_id")
    if value is None:
        value = getattr(config, "eos_token_id", None)
    if value is None:
        return frozenset()
    if isinstance(value, int):
        return frozenset((value,))
    return frozenset(int(v) for v in value)
