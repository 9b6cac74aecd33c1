"""CPU threads: the count follows the CPUs the process may use (affinity, cgroup quota), and the OpenMP
runtime torch loads gets a short spin-wait (checked in the runtime's own report of its settings)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from asyncllm.worker import _cpu_threads
from asyncllm.worker._cpu_threads import OPENMP_SPIN_COUNT, cgroup_cpu_limit, default_cpu_threads, usable_cpus


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


def _openmp_settings(code: str, **env: str) -> tuple[str, str]:
    """Run ``code`` in a fresh interpreter; return its stdout and the OpenMP runtime's report of its settings."""
    chosen = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "KMP_BLOCKTIME")
    environment = {k: v for k, v in os.environ.items() if k not in chosen}
    environment.update(env, OMP_DISPLAY_ENV="VERBOSE")
    done = subprocess.run(
        [sys.executable, "-c", code + "\nimport torch; torch.ones(8).sum()"],
        env=environment, capture_output=True, text=True, timeout=120, check=True,
    )
    return done.stdout, done.stderr


def _spin_count(report: str) -> str:
    for line in report.splitlines():
        if line.strip().startswith("GOMP_SPINCOUNT"):
            return line.split("=", 1)[1].strip().strip("'")
    pytest.skip("torch's OpenMP runtime is not GNU's (no GOMP_SPINCOUNT in its report)")


def test_importing_asyncllm_before_torch_gives_openmp_a_short_spin() -> None:
    stdout, report = _openmp_settings(
        "import asyncllm\nfrom asyncllm.worker._cpu_threads import prepare_openmp_wait_policy\n"
        "print(prepare_openmp_wait_policy())"
    )
    assert stdout.split() == ["environment"]  # the import set it; a second call sees it
    assert _spin_count(report) == str(OPENMP_SPIN_COUNT)


def test_torch_first_keeps_the_runtime_default_and_says_so() -> None:
    stdout, report = _openmp_settings(
        "import torch\nfrom asyncllm.worker._cpu_threads import prepare_openmp_wait_policy\n"
        "print(prepare_openmp_wait_policy())"
    )
    assert stdout.strip() == "too late"
    assert _spin_count(report) != str(OPENMP_SPIN_COUNT)


def test_the_environment_s_own_wait_policy_is_left_alone() -> None:
    code = "import asyncllm, os\nprint(os.environ.get('GOMP_SPINCOUNT'))"
    stdout, report = _openmp_settings(code, OMP_WAIT_POLICY="ACTIVE")
    assert stdout.split() == ["None"]
    assert "OMP_WAIT_POLICY = 'ACTIVE'" in report
