"""``DeviceOps``: the few calls through which the runner and the sampler move data between host and device.

Everything that copies host data to the device, brings results back, or makes the host wait goes
through one of these objects, so that the synchronisation points of a step are in one place (and can
be counted and ordered in tests, with a recording fake, on a machine without a GPU):

- ``to_device`` / ``tensor``: host arrays and Python lists to the device. On CUDA they are staged in
  pinned memory (torch's caching host allocator, which keeps a block until the copy reading it is
  done) and copied with ``non_blocking=True``: the host never waits for them.
- ``to_host``: starts a copy of a device tensor into a fresh pinned host tensor, without waiting.
- ``record`` / ``wait``: an event on the runner's stream, and the host waiting for it: the one point
  where a step's host thread waits for the device.
- ``tolist``: reads a tensor into Python; a host tensor filled by ``to_host`` is read after ``wait``
  on the event recorded after the copy, which makes the read free.

``CpuOps`` is the CPU: every call is the plain synchronous operation it always was (``asynchronous``
is False, and the runner then runs each step start to end, as before). ``CudaOps`` is CUDA.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np
import torch

__all__ = ["CpuOps", "CudaOps", "DeviceOps", "device_ops"]


class DeviceOps(Protocol):
    """Host-device traffic and synchronisation for one device (see the module docstring)."""

    device: torch.device
    asynchronous: bool
    """Launches return before the device has finished: the runner may launch a step before it reads
    the previous step's sampled ids (CUDA). False: every call completes before it returns (CPU)."""

    def to_device(self, array: np.ndarray[Any, Any]) -> torch.Tensor:
        """``array`` on the device, copied without the host waiting; the caller may drop ``array`` at once."""
        ...

    def tensor(self, values: Sequence[int] | Sequence[float], dtype: torch.dtype) -> torch.Tensor:
        """A Python list as a 1-D tensor of ``dtype`` on the device, copied without the host waiting."""
        ...

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor that holds ``tensor`` once the next ``record``ed event is complete."""
        ...

    def record(self) -> Any:
        """An event recorded on the current stream now (None where there is nothing to wait for)."""
        ...

    def wait(self, event: Any) -> None:
        """Block the host until ``event`` (from ``record``) is complete: a host synchronisation."""
        ...

    def tolist(self, tensor: torch.Tensor) -> list[Any]:
        """``tensor.tolist()``: a host synchronisation when ``tensor`` lives on the device."""
        ...


class CpuOps:
    """The CPU: plain synchronous calls, exactly what the runner did before the seam existed."""

    asynchronous = False

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device if device is not None else torch.device("cpu")

    def to_device(self, array: np.ndarray[Any, Any]) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)

    def tensor(self, values: Sequence[int] | Sequence[float], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def record(self) -> None:
        return None

    def wait(self, event: Any) -> None:
        return None

    def tolist(self, tensor: torch.Tensor) -> list[Any]:
        result: list[Any] = tensor.tolist()
        return result


class CudaOps:
    """CUDA: pinned staging and non-blocking copies on the current stream (the runner's), events to wait on."""

    asynchronous = True

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def to_device(self, array: np.ndarray[Any, Any]) -> torch.Tensor:
        host = torch.from_numpy(np.ascontiguousarray(array))
        return host.pin_memory().to(self.device, non_blocking=True)

    def tensor(self, values: Sequence[int] | Sequence[float], dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, pin_memory=True).to(self.device, non_blocking=True)

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        host.copy_(tensor, non_blocking=True)
        return host

    def record(self) -> torch.cuda.Event:
        event = torch.cuda.Event()
        event.record()
        return event

    def wait(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    def tolist(self, tensor: torch.Tensor) -> list[Any]:
        result: list[Any] = tensor.tolist()
        return result


def device_ops(device: torch.device) -> DeviceOps:
    """The ops for ``device``: ``CudaOps`` on CUDA, ``CpuOps`` elsewhere."""
    return CudaOps(device) if device.type == "cuda" else CpuOps(device)
