"""The CPU threads the device thread computes with: how many, and how many while others share the machine.

An engine embedded in an application shares its machine: with the event loop, the application's own
work, a load generator, other containers. Two choices keep the forward from collapsing there:

- **How many.** ``usable_cpus()`` counts the CPUs this process may really run on: its affinity mask,
  capped by its cgroup's CPU quota (a container limited to 2 CPUs on a 64-core host sees 64 cores
  in its affinity mask; 64 threads sharing a 2-CPU quota are throttled together at every barrier).
- **How many while others run.** Between two parallel regions, and at each region's closing barrier, an
  idle OpenMP thread spins before it sleeps (GNU OpenMP, the runtime of torch's Linux CPU builds: 300,000
  iterations by default). Alone, that spin is what keeps a step fast: the threads never sleep between the
  hundreds of regions of a step. When another process holds a core, the team's slowest thread is
  descheduled and the others spin for it at every barrier, which also takes the CPU from the thread they
  wait for. ``ThreadGovernor`` watches for that (the device thread waiting for a CPU) and drops a thread
  while it lasts; one thread meets no barrier.
- **How long a waiting thread spins.** After the last region of a step the workers spin too, while the
  event loop needs a CPU to deliver that step's tokens and schedule the next. ``set_openmp_spin_default()``
  shortens the spin to ``OPENMP_SPIN_COUNT`` (longer than the gaps between a step's regions, a tenth of the
  runtime's 300,000) on x86-64 Linux, when the process has not chosen one and no OpenMP runtime is loaded
  yet (the runtime reads it once, when loaded).

The measurements behind the choices are in docs/performance.md ("Sharing the machine").
"""

from __future__ import annotations

import logging
import math
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

logger = logging.getLogger(__name__)

RESERVE_CORE_FROM = 8
"""From this many usable CPUs on, the automatic thread count leaves one to the event loop."""

OPENMP_SPIN_COUNT = 30_000
"""Pause instructions an idle GNU OpenMP thread spins before it sleeps, where ``set_openmp_spin_default()`` sets
it: longer than the gaps between a step's regions, short enough to give the CPU back to the event loop soon after
a step (measurements: docs/performance.md, "Sharing the machine")."""

OPENMP_WAIT_VARIABLES = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
"""Environment variables that set GNU OpenMP's wait: either one set means the process chose its own."""


def openmp_runtime_loaded(maps: Path = Path("/proc/self/maps")) -> bool:
    """Whether an OpenMP runtime (GNU's, Intel's or LLVM's) is mapped into this process already.

    torch's own import loads one; so may a library imported before it (an OpenMP build of a BLAS, a C
    extension built with ``-fopenmp``), and torch then binds to that copy. Where ``maps`` cannot be read,
    ``torch`` being imported is the answer.
    """
    try:
        text = maps.read_text()
    except OSError:
        return "torch" in sys.modules
    return any(name in text for name in ("libgomp", "libiomp", "libomp"))


def set_openmp_spin_default() -> bool:
    """Put ``GOMP_SPINCOUNT=OPENMP_SPIN_COUNT`` in the environment for the OpenMP runtime torch is about to load.

    Only on x86-64 Linux (where torch's CPU builds use GNU OpenMP and its spin is a ``pause`` loop; elsewhere an
    iteration can be nearly free), and only where the process set neither ``GOMP_SPINCOUNT`` nor
    ``OMP_WAIT_POLICY`` (its choice stands) and no OpenMP runtime is loaded yet (it read its environment when it
    was loaded: too late; logged). The engine calls it before it first imports torch. The variable stays in
    ``os.environ``: rank processes, and any process the application starts later, inherit it.

    Returns:
        Whether the variable was put in the environment (not whether a runtime will read it).
    """
    if sys.platform != "linux" or platform.machine() not in ("x86_64", "AMD64"):
        return False
    if any(name in os.environ for name in OPENMP_WAIT_VARIABLES):
        return False
    if openmp_runtime_loaded():
        logger.info(
            "an OpenMP runtime was loaded before the engine: it keeps its own spin-wait "
            "(set GOMP_SPINCOUNT=%d before importing torch for the engine's; docs/performance.md)",
            OPENMP_SPIN_COUNT,
        )
        return False
    os.environ["GOMP_SPINCOUNT"] = str(OPENMP_SPIN_COUNT)
    return True


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
    tightest = _tightest_cpu_limit(cgroup_root, membership)
    return None if tightest is None else tightest[0]


def _tightest_cpu_limit(cgroup_root: Path, membership: Path) -> tuple[float, int, Path] | None:
    """The tightest CPU quota over this process's cgroup and its ancestors, in CPUs, with the cgroup version and
    directory that set it; None when unlimited."""
    tightest: tuple[float, int, Path] | None = None
    for version, directory in cgroup_directories("cpu", cgroup_root, membership):
        for limit in _v2_limit(directory / "cpu.max") if version == 2 else _v1_limit(directory):
            if tightest is None or limit < tightest[0]:
                tightest = (limit, version, directory)
    return tightest


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


GOVERNOR_PERIOD_S = 1.0
"""How long ``ThreadGovernor`` measures between two decisions."""

GOVERNOR_DROP_ABOVE = 0.35
"""``ThreadGovernor`` drops a thread when the device thread spent more than this share of the time it wanted a
CPU waiting for one."""

GOVERNOR_DROP_AFTER = 2
"""``ThreadGovernor`` drops a thread after this many periods in a row above ``GOVERNOR_DROP_ABOVE``: a burst of
the engine's own work (a wave of requests arriving, parsed and tokenized on the event loop) is no other load."""

GOVERNOR_ADD_IDLE_CPUS = 0.5
"""``ThreadGovernor`` adds a thread back when the CPUs this process may use were idle this many CPUs' worth of
a period, on average."""


def read_schedstat() -> tuple[int, int] | None:
    """The calling thread's nanoseconds on a CPU and waiting, runnable, for one (``/proc/thread-self/schedstat``);
    None where the kernel does not report them."""
    try:
        with open("/proc/thread-self/schedstat", encoding="ascii") as stats:
            fields = stats.read().split()
        return int(fields[0]), int(fields[1])
    except (OSError, ValueError, IndexError):
        return None


def read_idle_seconds() -> float | None:
    """Seconds the CPUs in this process's affinity mask have been idle, summed (``/proc/stat``); None where
    unreadable, or where ``/proc/stat`` lacks a CPU of the mask (LXCFS numbers a container's CPUs from 0 while
    the mask keeps the host's: a missing CPU would count as never idle)."""
    try:
        cpus = {f"cpu{index}" for index in os.sched_getaffinity(0)}
        ticks, found = 0, 0
        with open("/proc/stat", encoding="ascii") as stat:
            for line in stat:
                fields = line.split()
                if fields and fields[0] in cpus:
                    ticks += int(fields[4]) + int(fields[5])  # idle, iowait
                    found += 1
        return ticks / os.sysconf("SC_CLK_TCK") if found == len(cpus) else None
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def read_cpu_quota(
    cgroup_root: Path = Path("/sys/fs/cgroup"), membership: Path = Path("/proc/self/cgroup")
) -> tuple[float, float] | None:
    """The tightest CPU quota over this process's cgroup and its ancestors, in CPUs, and the CPU seconds that
    cgroup has used so far (cgroup v2's ``cpu.stat``, v1's ``cpuacct.usage``); None without a quota, or where
    its cgroup's usage is unreadable.

    Args:
        cgroup_root: Where the cgroup filesystem is mounted.
        membership: The ``/proc/<pid>/cgroup`` file that names the process's cgroups.
    """
    tightest = _tightest_cpu_limit(cgroup_root, membership)
    if tightest is None:
        return None
    limit, version, directory = tightest
    try:
        if version == 1:
            return limit, int((directory / "cpuacct.usage").read_text()) / 1e9
        for line in (directory / "cpu.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == "usage_usec":
                return limit, int(value) / 1e6
    except (OSError, ValueError):
        pass
    return None


class ThreadGovernor:
    """Fewer compute threads while other work holds the cores, and more again when they are free.

    OpenMP's threads meet at a barrier hundreds of times a step. Alone, a spin-wait longer than the gaps between
    regions is the fast choice: the threads never sleep inside a step. When other processes hold the cores, one
    thread of the team is descheduled at almost every barrier and the others spin for it, and the forward
    collapses.
    The governor measures, per period, the share of the time the device thread (the team's master) wanted a
    CPU that it spent waiting for one: above ``GOVERNOR_DROP_ABOVE`` for ``GOVERNOR_DROP_AFTER`` periods in a
    row it drops a thread (one thread meets no barrier). It adds one back, up to ``most``, when the process's
    CPUs were idle at least ``GOVERNOR_ADD_IDLE_CPUS`` of a CPU on average: a CPU free for the thread, which a
    waiting share cannot tell (one thread beside a busy process waits little, yet a second would collapse
    again). A period in which the device thread mostly slept (no steps) measures no waiting share: it drops
    nothing and raises the count to the CPUs idle on average, rounded (the engine's own idle too, so that is
    all the room there is), so that a burst after a quiet stretch starts with them; the burst's first
    measured period over ``GOVERNOR_DROP_ABOVE`` puts the count back at once (other work that began just
    before the burst hides in the stretch's average).

    Call ``threads()`` on the device thread before each step and apply a changed count there
    (``torch.set_num_threads`` is per thread). The count changes no result: every CPU kernel computes each
    output the same way at any thread count.

    Args:
        most: The configured thread count, the most the governor uses.
        period: Seconds measured between two decisions.
        clock: Monotonic seconds (tests pass their own, as for the next two).
        schedstat: The calling thread's (on-CPU, runnable-waiting) nanoseconds so far, None where unknown;
            where it is None the governor keeps ``most``.
        idle_seconds: The process's CPUs' idle seconds so far, summed; None where unknown (the governor then
            keeps its count: it drops no thread it could not add back).
        cpu_quota: The cgroup CPU quota over the process, in CPUs, and its cgroup's CPU seconds so far; None
            without one. Under a quota the idle CPUs counted are at most what the quota left unused (a
            2-CPU container on a 64-core host sees the host's idle CPUs in its affinity mask).
    """

    def __init__(
        self,
        most: int,
        *,
        period: float = GOVERNOR_PERIOD_S,
        clock: Callable[[], float] = time.monotonic,
        schedstat: Callable[[], tuple[int, int] | None] = read_schedstat,
        idle_seconds: Callable[[], float | None] = read_idle_seconds,
        cpu_quota: Callable[[], tuple[float, float] | None] = read_cpu_quota,
    ) -> None:
        if most < 1:
            raise ValueError(f"most must be at least 1, got {most}")
        self.most = most
        self.current = most
        self.period = period
        self._clock = clock
        self._schedstat = schedstat
        self._idle_seconds = idle_seconds
        self._cpu_quota = cpu_quota
        self._since: tuple[float, int, int, float | None, tuple[float, float] | None] | None = None
        self._periods_over = 0
        self._before_quiet: int | None = None  # the count a quiet stretch raised, until a period measures it
        self.last_wait_share: float | None = None
        """The waiting share of the last period that decided (None before one did)."""

    def threads(self) -> int:
        """The thread count for the next step, from the period that ended (if one did) since the last call."""
        if self.most == 1:
            return 1
        now = self._clock()
        # Nothing is read between two decisions: /proc/stat has a line per CPU and per interrupt, long to
        # produce and parse on a large host, and this runs on the device thread before every step.
        if self._since is not None and now - self._since[0] < self.period:
            return self.current
        stats = self._schedstat()
        if stats is None:
            return self.current
        idle, quota = self._idle_seconds(), self._cpu_quota()
        if self._since is None:
            self._since = (now, *stats, idle, quota)
            return self.current
        start, start_cpu, start_wait, start_idle, start_quota = self._since
        elapsed = now - start
        self._since = (now, *stats, idle, quota)
        wanted = (stats[0] - start_cpu + stats[1] - start_wait) / 1e9
        idle_cpus = None if idle is None or start_idle is None else (idle - start_idle) / elapsed
        if idle_cpus is not None and quota is not None and start_quota is not None:
            # Under a quota the host's idle CPUs are not this process's to take: what the quota left unused is.
            idle_cpus = min(idle_cpus, quota[0] - (quota[1] - start_quota[1]) / elapsed)
        if wanted < 0.1 * elapsed:  # the device thread mostly slept (no steps): no waiting share measured
            self._periods_over = 0
            # Between bursts the engine's own CPUs idle too, so the idle CPUs are all the room there is: the
            # next burst starts with that many threads rather than the count the last one ended with.
            room = 0 if idle_cpus is None else min(self.most, int(idle_cpus + 0.5))
            if room > self.current:
                if self._before_quiet is None:
                    self._before_quiet = self.current
                self.current = room
                logger.info("the CPUs are free again: %d compute threads", self.current)
            return self.current
        share = (stats[1] - start_wait) / 1e9 / wanted
        self.last_wait_share = share
        if self._before_quiet is not None:
            # The quiet stretch's idle CPUs were an average: work that began just before this burst hides in
            # it. Its first measured period decides: contended, the count goes back at once.
            before, self._before_quiet = self._before_quiet, None
            if share > GOVERNOR_DROP_ABOVE:
                self.current = before
                logger.info(
                    "other work holds the CPUs (the device thread waited for one %.0f%% of the time): %d compute "
                    "threads",
                    100 * share,
                    self.current,
                )
                return self.current
        if idle_cpus is None:  # a thread dropped now could never be added back: the count stays
            return self.current
        self._periods_over = self._periods_over + 1 if share > GOVERNOR_DROP_ABOVE else 0
        if self._periods_over >= GOVERNOR_DROP_AFTER and self.current > 1:
            self._periods_over = 0
            self.current -= 1
            logger.info(
                "other work holds the CPUs (the device thread waited for one %.0f%% of the time): %d compute threads",
                100 * share,
                self.current,
            )
        elif share <= GOVERNOR_DROP_ABOVE and self.current < self.most and idle_cpus >= GOVERNOR_ADD_IDLE_CPUS:
            self.current += 1
            logger.info("the CPUs are free again: %d compute threads", self.current)
        return self.current
