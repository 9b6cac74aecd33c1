"""The CPU threads the device thread computes with: how many, and how they wait.

An engine embedded in an application shares its machine: with the event loop, the application's own
work, a load generator, other containers. Two choices keep the forward from collapsing there:

- **How many.** ``usable_cpus()`` counts the CPUs this process may really run on: its affinity mask,
  capped by its cgroup's CPU quota (a container limited to 2 CPUs on a 64-core host sees 64 cores
  in its affinity mask; 64 threads sharing a 2-CPU quota are throttled together at every barrier).
- **How they wait.** Between two parallel regions, and at each region's closing barrier, an idle
  OpenMP thread spins before it sleeps. GNU OpenMP (the runtime of torch's Linux CPU builds) spins
  for 300,000 iterations by default, milliseconds of a core. When another process holds a core,
  the team's slowest thread is descheduled and the others burn their time slices spinning for it,
  which also takes the CPU from the thread they are waiting for: every one of the hundreds of
  parallel regions in a step pays for it. ``prepare_openmp_wait_policy()`` shortens the spin
  (``GOMP_SPINCOUNT``, and ``KMP_BLOCKTIME`` for Intel's runtime) so that a waiting thread gives
  its core back within tens of microseconds: long enough to cover the gap between two regions of
  one step when the engine runs alone, short enough to yield when it does not.

The OpenMP runtime reads its wait policy once, when torch's library is loaded: the policy must be
in the environment before the process's first ``import torch``. ``import asyncllm`` and
``Engine.open`` set it when torch is not loaded yet and the environment does not already choose one.
The measurements behind the choices are in docs/performance.md ("Sharing the machine").
"""

from __future__ import annotations

import logging
import math
import os
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

OPENMP_SPIN_COUNT = 1000
"""``GOMP_SPINCOUNT`` set by ``prepare_openmp_wait_policy``: spin iterations before an idle GNU OpenMP
thread sleeps (libgomp's own default: 300,000)."""

INTEL_OPENMP_BLOCKTIME_MS = 0
"""``KMP_BLOCKTIME`` set by ``prepare_openmp_wait_policy``, for a process that loads Intel's OpenMP
runtime in place of GNU's: milliseconds spent spinning before sleeping (Intel's default: 200)."""

_WAIT_POLICY_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")

RESERVE_CORE_FROM = 8
"""From this many usable CPUs on, the automatic thread count leaves one to the event loop."""


def prepare_openmp_wait_policy() -> str:
    """Put a short OpenMP spin-wait into the environment, if it can still take effect.

    Returns:
        What is in effect, for the start-up log: ``"set"`` (this call set it), ``"environment"`` (the
        environment already chose a policy: left alone), or ``"too late"`` (torch is loaded already,
        with the runtime's default).
    """
    if any(name in os.environ for name in _WAIT_POLICY_VARIABLES):
        return "environment"
    if "torch" in sys.modules:
        return "too late"
    os.environ["GOMP_SPINCOUNT"] = str(OPENMP_SPIN_COUNT)
    os.environ["KMP_BLOCKTIME"] = str(INTEL_OPENMP_BLOCKTIME_MS)
    return "set"


def cgroup_cpu_limit(
    cgroup_root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")
) -> float | None:
    """The CPU quota of this process's cgroup, in CPUs (``1.5``: one and a half), or None when unlimited.

    Reads cgroup v2's ``cpu.max`` or v1's ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, in the
    process's own cgroup and each ancestor up to the root (the tightest limit wins, as the kernel
    applies them all). A container that mounts its own cgroup as the root is read there.

    Args:
        cgroup_root: Where the cgroup filesystem is mounted.
        membership: The ``/proc/<pid>/cgroup`` file that names the process's cgroups.
    """
    limits: list[float] = []
    for version, directory in cgroup_directories("cpu", cgroup_root, membership):
        limits.extend(_v2_limit(directory / "cpu.max") if version == 2 else _v1_limit(directory))
    return min(limits) if limits else None


def cgroup_directories(
    controller: str, cgroup_root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")
) -> list[tuple[int, Path]]:
    """``(version, directory)`` of this process's cgroup and each of its ancestors where ``controller``'s files
    are: 2 for cgroup v2's unified hierarchy, 1 for the v1 hierarchy that has the controller (under its
    mount's name, e.g. ``cpu,cpuacct``, and under the controller's own name, where it is mounted alone).
    Empty where ``membership`` cannot be read.

    Args:
        controller: "cpu", "memory", ...
        cgroup_root: Where the cgroup filesystem is mounted.
        membership: The ``/proc/<pid>/cgroup`` file that names the process's cgroups.
    """
    try:
        lines = membership.read_text().splitlines()
    except OSError:
        return []
    found: list[tuple[int, Path]] = []
    for line in lines:
        _, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if controllers == "":
            found += [(2, directory) for directory in self_and_ancestors(cgroup_root, path)]
        elif controller in controllers.split(","):
            mounts = [controllers] if controllers == controller else [controllers, controller]
            found += [(1, directory) for mount in mounts for directory in self_and_ancestors(cgroup_root / mount, path)]
    return found


def self_and_ancestors(root: Path, path: str) -> list[Path]:
    """A cgroup's directory under ``root`` for ``path`` (from ``/proc/self/cgroup``), then each ancestor's."""
    parts = [part for part in path.split("/") if part and part != ".."]
    return [root.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]


def _v2_limit(cpu_max: Path) -> list[float]:
    try:
        quota, period = cpu_max.read_text().split()[:2]
        return [] if quota == "max" else [int(quota) / int(period)]
    except (OSError, ValueError):
        return []


def _v1_limit(directory: Path) -> list[float]:
    try:
        quota = int((directory / "cpu.cfs_quota_us").read_text())
        period = int((directory / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return []
    return [quota / period] if quota > 0 and period > 0 else []


def usable_cpus() -> int:
    """CPUs this process may run on: its affinity mask, capped by its cgroup quota (rounded down, at least 1)."""
    cpus = len(os.sched_getaffinity(0))
    limit = cgroup_cpu_limit()
    if limit is not None:
        cpus = min(cpus, max(1, math.floor(limit)))
    return cpus


def default_cpu_threads() -> int:
    """The automatic intra-op thread count: ``usable_cpus()``, less one from ``RESERVE_CORE_FROM`` CPUs on.

    With 8 or more CPUs one is a small price for the event loop's own; below, a reserved CPU costs
    more than sharing one does."""
    cpus = usable_cpus()
    return max(1, cpus - 1 if cpus >= RESERVE_CORE_FROM else cpus)


def configure_cpu_threads(requested: int | None) -> int:
    """Set torch's intra-op threads for the calling (device) thread and return the count.

    Args:
        requested: A thread count; or None: ``OMP_NUM_THREADS`` if it is set (torch read it at
            start-up; left as is), else ``default_cpu_threads()``.

    Returns:
        The thread count now in effect.

    Note:
        torch's thread count is per process for threads that start using torch later; the runner
        calls this on its device thread at load.
    """
    import torch

    if requested is None and os.environ.get("OMP_NUM_THREADS"):
        return torch.get_num_threads()
    threads = max(1, requested if requested is not None else default_cpu_threads())
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
    return threads
