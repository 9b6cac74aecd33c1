"""CPU threads: the count follows the CPUs the process may use (affinity, cgroup quota), and the governor
drops threads while other work holds the CPUs and adds them back when CPUs are idle."""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from asyncllm.executor._runner import SequenceInput, StepBatch
from asyncllm.sampling_params import SamplingParams
from asyncllm.worker import _cpu_threads
from asyncllm.worker._cpu_threads import (
    ThreadGovernor,
    cgroup_cpu_limit,
    default_cpu_threads,
    read_cpu_quota,
    read_idle_seconds,
    read_schedstat,
    usable_cpus,
)
from asyncllm.worker._model_runner import TorchModelRunner


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_is_read_in_the_process_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    membership = tmp_path / "proc-cgroup"
    _write(membership, "0::/app.slice/engine.scope\n")
    root = tmp_path / "cgroup"
    _write(root / "app.slice" / "engine.scope" / "cpu.max", "max 100000\n")
    assert cgroup_cpu_limit(root, membership) is None  # "max": unlimited
    _write(root / "app.slice" / "cpu.max", "150000 100000\n")  # an ancestor's limit applies too
    assert cgroup_cpu_limit(root, membership) == 1.5
    _write(root / "app.slice" / "engine.scope" / "cpu.max", "50000 100000\n")  # the tightest wins
    assert cgroup_cpu_limit(root, membership) == 0.5


def test_cgroup_v2_namespaced_container_reads_its_own_root(tmp_path: Path) -> None:
    # Inside a container the cgroup filesystem's root is the container's cgroup, while
    # /proc/self/cgroup may still name the host's path for it.
    membership = tmp_path / "proc-cgroup"
    _write(membership, "0::/kubepods/pod1/container2\n")
    root = tmp_path / "cgroup"
    _write(root / "cpu.max", "200000 100000\n")
    assert cgroup_cpu_limit(root, membership) == 2.0


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    membership = tmp_path / "proc-cgroup"
    _write(membership, "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n")
    root = tmp_path / "cgroup"
    directory = root / "cpu,cpuacct" / "docker" / "abc"
    _write(directory / "cpu.cfs_quota_us", "-1\n")
    _write(directory / "cpu.cfs_period_us", "100000\n")
    assert cgroup_cpu_limit(root, membership) is None  # -1: unlimited
    _write(directory / "cpu.cfs_quota_us", "300000\n")
    assert cgroup_cpu_limit(root, membership) == 3.0


def test_no_cgroup_information_means_no_limit(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(tmp_path, tmp_path / "missing") is None
    membership = tmp_path / "proc-cgroup"
    _write(membership, "0::/\n")
    assert cgroup_cpu_limit(tmp_path / "cgroup", membership) is None
    _write(tmp_path / "cgroup" / "cpu.max", "garbage\n")
    assert cgroup_cpu_limit(tmp_path / "cgroup", membership) is None


def test_thread_count_follows_affinity_and_quota(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: set(range(64)))
    monkeypatch.setattr(_cpu_threads, "cgroup_cpu_limit", lambda: None)
    assert usable_cpus() == 64 and default_cpu_threads() == 63  # one CPU left to the event loop
    monkeypatch.setattr(_cpu_threads, "cgroup_cpu_limit", lambda: 2.5)  # a 64-core host, a 2.5-CPU container
    assert usable_cpus() == 2 and default_cpu_threads() == 2
    monkeypatch.setattr(_cpu_threads, "cgroup_cpu_limit", lambda: 0.5)
    assert usable_cpus() == 1 and default_cpu_threads() == 1
    monkeypatch.setattr(_cpu_threads, "cgroup_cpu_limit", lambda: 12.0)
    assert usable_cpus() == 12 and default_cpu_threads() == 11
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2})  # affinity tighter than the quota
    assert usable_cpus() == 3 and default_cpu_threads() == 3


class _Machine:
    """What the governor reads, scripted: a clock, the device thread's schedstat, the CPUs' idle seconds."""

    def __init__(self) -> None:
        self.now, self.on_cpu, self.waiting, self.idle = 0.0, 0, 0, 0.0

    def advance(self, seconds: float, *, waiting_share: float, idle_cpus: float, busy: float = 1.0) -> None:
        """``seconds`` pass; the device thread wants a CPU ``busy`` of them and waits ``waiting_share`` of that."""
        wanted = seconds * busy * 1e9
        self.now += seconds
        self.waiting += int(wanted * waiting_share)
        self.on_cpu += int(wanted * (1 - waiting_share))
        self.idle += idle_cpus * seconds

    def governor(self, most: int) -> ThreadGovernor:
        return ThreadGovernor(
            most,
            period=2.0,
            clock=lambda: self.now,
            schedstat=lambda: (self.on_cpu, self.waiting),
            idle_seconds=lambda: self.idle,
            cpu_quota=lambda: None,
        )


def test_the_governor_keeps_every_thread_while_the_device_thread_gets_its_cpus() -> None:
    machine = _Machine()
    governor = machine.governor(2)
    assert governor.threads() == 2
    for _ in range(5):  # alone beside a load client: the device thread waits 15-20% of the time it wants a CPU
        machine.advance(2.5, waiting_share=0.2, idle_cpus=0.1)
        assert governor.threads() == 2
    assert governor.last_wait_share == pytest.approx(0.2)


def test_the_governor_drops_a_thread_per_two_periods_of_contention_and_never_below_one() -> None:
    machine = _Machine()
    governor = machine.governor(3)
    governor.threads()
    machine.advance(1.0, waiting_share=0.6, idle_cpus=0.0)
    assert governor.threads() == 3  # half a period: no decision yet
    machine.advance(1.5, waiting_share=0.6, idle_cpus=0.0)
    assert governor.threads() == 3  # one period over: a burst, perhaps
    machine.advance(2.5, waiting_share=0.6, idle_cpus=0.0)
    assert governor.threads() == 2
    for expected in (2, 1, 1, 1):
        machine.advance(2.5, waiting_share=0.5, idle_cpus=0.0)
        assert governor.threads() == expected


def test_a_burst_of_one_period_drops_no_thread() -> None:
    machine = _Machine()
    governor = machine.governor(2)
    governor.threads()
    for share in (0.45, 0.2, 0.42, 0.15, 0.5, 0.3):  # a wave of requests now and then, alone
        machine.advance(2.5, waiting_share=share, idle_cpus=0.1)
        assert governor.threads() == 2


def test_the_governor_adds_threads_back_only_for_idle_cpus() -> None:
    machine = _Machine()
    governor = machine.governor(2)
    governor.threads()
    for expected in (2, 1):
        machine.advance(2.5, waiting_share=0.5, idle_cpus=0.0)
        assert governor.threads() == expected
    # One thread beside a busy process waits little, but no CPU is idle: a second thread would collapse again.
    for _ in range(3):
        machine.advance(2.5, waiting_share=0.12, idle_cpus=0.05)
        assert governor.threads() == 1
    machine.advance(2.5, waiting_share=0.05, idle_cpus=0.8)  # the other process left
    assert governor.threads() == 2
    machine.advance(2.5, waiting_share=0.05, idle_cpus=0.8)
    assert governor.threads() == 2  # never above the configured count


def test_the_governor_decides_nothing_from_a_period_the_device_thread_slept() -> None:
    machine = _Machine()
    governor = machine.governor(2)
    governor.threads()
    machine.advance(2.5, waiting_share=0.9, idle_cpus=0.0, busy=0.05)  # no steps ran: a few waits mean nothing
    assert governor.threads() == 2
    assert governor.last_wait_share is None


def _contended(most: int, periods: int) -> tuple[_Machine, ThreadGovernor]:
    """A governor of ``most`` threads after ``periods`` periods of contention (one thread fewer per two)."""
    machine = _Machine()
    governor = machine.governor(most)
    governor.threads()
    for _ in range(periods):
        machine.advance(2.5, waiting_share=0.5, idle_cpus=0.0)
        governor.threads()
    return machine, governor


def test_a_quiet_stretch_between_bursts_gives_the_threads_back() -> None:
    """Dropped to one thread during a burst beside other work; the engine then idles: on a quiet machine the
    next burst starts with both threads, beside still-busy CPUs with the one."""
    for idle_cpus, expected in ((1.9, 2), (1.0, 1), (0.3, 1)):  # 1.0: the engine's own CPU, the other busy
        machine, governor = _contended(2, periods=2)
        assert governor.current == 1
        machine.advance(60.0, waiting_share=0.0, idle_cpus=idle_cpus, busy=0.01)  # no steps for a minute
        assert governor.threads() == expected
        assert governor.last_wait_share == pytest.approx(0.5)  # the idle stretch measured no share


def test_a_quiet_stretch_gives_back_as_many_threads_as_cpus_were_idle() -> None:
    """The engine's own CPUs idle between bursts too: the idle CPUs are all the room, not room beside them."""
    machine, governor = _contended(8, periods=8)
    assert governor.current == 4
    machine.advance(30.0, waiting_share=0.0, idle_cpus=3.2, busy=0.01)
    assert governor.threads() == 4  # other work still holds almost 5 CPUs: no more than before
    machine.advance(30.0, waiting_share=0.0, idle_cpus=6.6, busy=0.01)
    assert governor.threads() == 7
    machine.advance(30.0, waiting_share=0.0, idle_cpus=7.9, busy=0.01)
    assert governor.threads() == 8  # never above the configured count


def test_a_burst_that_finds_the_cpus_held_again_goes_back_at_once() -> None:
    """Other work that began just before the burst hides in the quiet stretch's average: the burst's first
    measured period, contended, restores the count from before the stretch (no two periods to wait)."""
    for share, expected in ((0.5, 1), (0.2, 2)):
        machine, governor = _contended(2, periods=2)
        machine.advance(60.0, waiting_share=0.0, idle_cpus=1.9, busy=0.01)
        assert governor.threads() == 2
        machine.advance(2.5, waiting_share=share, idle_cpus=0.0)
        assert governor.threads() == expected
        machine.advance(2.5, waiting_share=0.2, idle_cpus=0.0)
        assert governor.threads() == expected  # and the next period decides as ever


def test_the_governor_reads_its_counters_once_a_period_not_once_a_step() -> None:
    machine, reads = _Machine(), []
    governor = ThreadGovernor(
        2,
        period=1.0,
        clock=lambda: machine.now,
        schedstat=lambda: reads.append("schedstat") or (machine.on_cpu, machine.waiting),  # type: ignore[func-returns-value]
        idle_seconds=lambda: reads.append("idle") or machine.idle,  # type: ignore[func-returns-value]
        cpu_quota=lambda: None,
    )
    for _ in range(50):  # 50 steps of 50 ms: 2.5 periods
        machine.advance(0.05, waiting_share=0.1, idle_cpus=0.1)
        governor.threads()
    assert reads.count("schedstat") == reads.count("idle") == 3  # the first call, then once per period


def test_the_governor_keeps_its_count_where_the_kernel_reports_no_schedstat() -> None:
    governor = ThreadGovernor(2, schedstat=lambda: None)
    assert [governor.threads() for _ in range(3)] == [2, 2, 2]
    assert ThreadGovernor(1).threads() == 1
    with pytest.raises(ValueError, match="at least 1"):
        ThreadGovernor(0)


def test_the_governor_drops_no_thread_it_could_not_add_back() -> None:
    # Without an idle reading no thread ever comes back: a passing burst of other work would leave the engine
    # on fewer threads for good.
    machine = _Machine()
    governor = ThreadGovernor(
        2, period=2.0, clock=lambda: machine.now, schedstat=lambda: (machine.on_cpu, machine.waiting),
        idle_seconds=lambda: None, cpu_quota=lambda: None,
    )  # fmt: skip
    governor.threads()
    machine.advance(2.5, waiting_share=0.6, idle_cpus=0.0)
    assert governor.threads() == 2
    assert governor.last_wait_share == pytest.approx(0.6)


def test_the_idle_reading_is_unknown_where_proc_stat_lacks_a_cpu_of_the_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    # LXCFS shows a container its CPUs renumbered from cpu0 while the affinity mask keeps the host's numbers: a
    # CPU of the mask missing from /proc/stat would read as never idle, and no thread would come back.
    if read_idle_seconds() is None:
        pytest.skip("no /proc/stat here")
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 4093})
    assert read_idle_seconds() is None


def test_the_governor_under_a_cpu_quota_counts_only_what_the_quota_leaves_idle() -> None:
    # A 2-CPU container on a 64-core host: its affinity mask holds the host's CPUs, mostly idle, while
    # another process in the container takes what the dropped thread left of the quota.
    machine, used = _Machine(), [0.0]
    governor = ThreadGovernor(
        2, period=2.0, clock=lambda: machine.now, schedstat=lambda: (machine.on_cpu, machine.waiting),
        idle_seconds=lambda: machine.idle, cpu_quota=lambda: (2.0, used[0]),
    )  # fmt: skip
    governor.threads()
    for expected in (2, 1):  # two periods with the quota full
        machine.advance(2.5, waiting_share=0.5, idle_cpus=40.0)
        used[0] += 2.5 * 2.0
        assert governor.threads() == expected
    for _ in range(3):
        machine.advance(2.5, waiting_share=0.12, idle_cpus=40.0)
        used[0] += 2.5 * 1.9  # 0.1 CPU of the quota unused
        assert governor.threads() == 1
    machine.advance(2.5, waiting_share=0.05, idle_cpus=41.0)  # the other process left
    used[0] += 2.5 * 1.0
    assert governor.threads() == 2


def test_cpu_quota_and_its_usage_are_read_where_the_tightest_limit_is(tmp_path: Path) -> None:
    membership = tmp_path / "proc-cgroup"
    _write(membership, "0::/kubepods/pod1/container2\n")
    root = tmp_path / "cgroup"
    assert read_cpu_quota(root, membership) is None  # no quota anywhere
    _write(root / "kubepods" / "pod1" / "cpu.max", "200000 100000\n")
    _write(root / "kubepods" / "pod1" / "container2" / "cpu.max", "max 100000\n")
    assert read_cpu_quota(root, membership) is None  # the quota's cgroup has no usage to read
    _write(root / "kubepods" / "pod1" / "cpu.stat", "usage_usec 7500000\nuser_usec 5000000\n")
    assert read_cpu_quota(root, membership) == (2.0, 7.5)
    v1 = tmp_path / "proc-cgroup-v1"
    _write(v1, "3:cpu,cpuacct:/docker/abc\n")
    directory = root / "cpu,cpuacct" / "docker" / "abc"
    _write(directory / "cpu.cfs_quota_us", "150000\n")
    _write(directory / "cpu.cfs_period_us", "100000\n")
    _write(directory / "cpuacct.usage", "3000000000\n")
    assert read_cpu_quota(root, v1) == (1.5, 3.0)


def test_the_governor_reads_this_thread_and_these_cpus() -> None:
    if not Path("/proc/thread-self/schedstat").exists():
        pytest.skip("no schedstat here")
    on_cpu, waiting = read_schedstat() or (0, 0)
    sum(range(2_000_000))  # some CPU time on this thread, counted at its next pass through the scheduler
    os.sched_yield()
    later = read_schedstat()
    assert later is not None and later[0] > on_cpu and later[1] >= waiting
    idle = read_idle_seconds()
    assert idle is not None and idle >= 0


def _greedy(runner: TorchModelRunner, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens of ``prompt`` straight through ``execute`` (on this thread, as the device thread would)."""
    params, table, out = SamplingParams(temperature=0.0), list(range(8)), []
    sequence = SequenceInput(0, prompt, 0, table, True, params)
    for _ in range(steps):
        out.append(runner.execute(StepBatch([sequence], [])).sampled_token_ids[0])
        sequence = SequenceInput(0, [out[-1]], len(prompt) + len(out) - 1, table, True, params)
    return out


def test_the_runner_applies_the_governor_s_count_before_each_step(tiny_llama, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(_cpu_threads, "usable_cpus", lambda: 2)
    before = torch.get_num_threads()
    runner = TorchModelRunner(tiny_llama, device="cpu", kv_cache_blocks=16, block_size=4)  # the automatic count
    runner.load()
    try:
        governor = runner.thread_governor
        assert governor is not None and governor.most == 2
        # The test sets the count itself: six steps take most of a period here, and on a loaded machine the
        # governor would otherwise decide on its own in the middle (and drop a thread before the first check).
        governor.period = math.inf
        alone = _greedy(runner, [3, 5, 7, 11], 6)
        assert torch.get_num_threads() == 2
        governor.current, governor.most = 1, 1  # as if a period had found the CPUs taken, and kept them so
        runner.sampler.forget([0])
        runner.input_batch.remove([0])
        shared = _greedy(runner, [3, 5, 7, 11], 6)
        assert torch.get_num_threads() == 1
        assert shared == alone  # no result depends on the thread count
    finally:
        runner.close()
        torch.set_num_threads(before)
    explicit = TorchModelRunner(tiny_llama, device="cpu", num_threads=2, kv_cache_blocks=16, block_size=4)
    explicit.load()
    try:
        assert explicit.thread_governor is None  # an explicit count is kept as it is
    finally:
        explicit.close()
        torch.set_num_threads(before)


def test_compiled_layers_keep_one_thread_count(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # inductor's CPU kernels split a long row's reduction over the threads running at the call (one row of
    # 8,192 floats: other bits at 1 thread than at 2), or fix the count they were compiled with: the governor
    # would change results, or not reach those kernels at all.
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(_cpu_threads, "usable_cpus", lambda: 2)
    before = torch.get_num_threads()
    runner = TorchModelRunner(tiny_llama, device="cpu", compile=True, kv_cache_blocks=16, block_size=4)
    try:
        runner._load_model()  # threads and weights; the compilation itself comes later in load()
        assert runner.num_threads == 2 and runner.thread_governor is None
    finally:
        runner.close()
        torch.set_num_threads(before)


_SPIN_CASES = """
import ctypes, glob, importlib.util, json, os, sys
from asyncllm.worker._cpu_threads import set_openmp_spin_default
cases = {}
os.environ["GOMP_SPINCOUNT"] = "77"
cases["own spin"] = [set_openmp_spin_default(), os.environ.pop("GOMP_SPINCOUNT")]
os.environ["OMP_WAIT_POLICY"] = "passive"
cases["own policy"] = [set_openmp_spin_default(), os.environ.pop("OMP_WAIT_POLICY"), os.environ.get("GOMP_SPINCOUNT")]
cases["unset"] = [set_openmp_spin_default(), os.environ.pop("GOMP_SPINCOUNT", None)]
# torch's own OpenMP runtime loaded first, as another library would, without importing torch: too late.
torch_lib = os.path.join(importlib.util.find_spec("torch").submodule_search_locations[0], "lib")
ctypes.CDLL(sorted(glob.glob(os.path.join(torch_lib, "libgomp*")))[0])
cases["runtime loaded"] = [set_openmp_spin_default(), os.environ.get("GOMP_SPINCOUNT")]
print(json.dumps(cases))
"""

_ENGINE_SPIN = """
import json, os, sys
import anyio
from asyncllm import Engine, SamplingParams

async def main():
    before = "torch" in sys.modules
    async with Engine.open(sys.argv[1], device="cpu", kv_cache_blocks=64) as engine:
        await engine.generate([1, 2, 3], SamplingParams(max_tokens=2))
    print(json.dumps([before, os.environ.get("GOMP_SPINCOUNT")]))

anyio.run(main)
"""

ENGINE_SETS_SPIN = sys.platform == "linux" and platform.machine() in ("x86_64", "AMD64")
"""Where ``set_openmp_spin_default`` sets anything (x86-64 Linux)."""


def _python(code: str, *args: str) -> object:
    """Run ``code`` in a fresh interpreter (torch not loaded, no OpenMP wait variables) and return the JSON its
    last line prints."""
    clean = {k: v for k, v in os.environ.items() if k not in _cpu_threads.OPENMP_WAIT_VARIABLES}
    src = str(Path(__file__).resolve().parents[2] / "src")
    clean["PYTHONPATH"] = os.pathsep.join(filter(None, (src, os.environ.get("PYTHONPATH"))))
    done = subprocess.run([sys.executable, "-c", code, *args], env=clean, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


TORCH_GNU_OPENMP = any(Path(torch.__file__).parent.joinpath("lib").glob("libgomp*"))


@pytest.mark.skipif(not TORCH_GNU_OPENMP, reason="this torch does not ship GNU OpenMP")
def test_the_openmp_spin_default_is_set_only_before_any_openmp_runtime_and_only_where_the_process_chose_none() -> None:
    spin = str(_cpu_threads.OPENMP_SPIN_COUNT)
    assert _python(_SPIN_CASES) == {
        "own spin": [False, "77"],
        "own policy": [False, "passive", None],
        "unset": [True, spin] if ENGINE_SETS_SPIN else [False, None],
        "runtime loaded": [False, None],
    }


def test_an_openmp_runtime_is_seen_in_the_process_maps(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f10 r-xp 0 08:01 12 /usr/lib/libc.so.6\n")
    assert not _cpu_threads.openmp_runtime_loaded(maps)
    maps.write_text("7f00-7f10 r-xp 0 08:01 13 /site-packages/torch/lib/libgomp-a34b3233.so.1\n")
    assert _cpu_threads.openmp_runtime_loaded(maps)
    assert _cpu_threads.openmp_runtime_loaded(tmp_path / "missing")  # unreadable: torch is imported here


def test_an_engine_sets_the_spin_before_it_loads_torch(tiny_llama: Path) -> None:
    expected = str(_cpu_threads.OPENMP_SPIN_COUNT) if ENGINE_SETS_SPIN else None
    assert _python(_ENGINE_SPIN, str(tiny_llama)) == [False, expected]
