"""The CPU KV cache faulted in on a background thread (``worker._memory.Prefault``)."""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import sys
import threading
import weakref
from pathlib import Path

import pytest
import torch

from asyncllm.worker import _memory
from asyncllm.worker._memory import PAGE_BYTES, Prefault, mapped_tensor, prefault_ranges
from asyncllm.worker._model_runner import TorchModelRunner

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_POPULATE_WRITE is Linux's")

THREAD = "asyncllm-kv-prefault"


def _resident_pages(tensor: torch.Tensor) -> list[bool]:
    """Per page of ``tensor``'s mapping: resident or not (``mincore(2)``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    length = -(-tensor.numel() * tensor.element_size() // PAGE_BYTES) * PAGE_BYTES
    flags = (ctypes.c_ubyte * (length // PAGE_BYTES))()
    if libc.mincore(tensor.data_ptr(), length, flags) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return [bool(flag & 1) for flag in flags]


def _kv_like(rows: int, row_elements: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return mapped_tensor(rows * row_elements, dtype).view(rows, row_elements)


def _prefault_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == THREAD]


def test_ranges_cover_every_page_in_row_order_across_tensors() -> None:
    """Round r of every tensor before round r + 1 of any; each range page-aligned, inside its tensor's
    pages; together they cover every byte."""
    tensors = [_kv_like(1000, 96), _kv_like(1000, 40, torch.bfloat16), _kv_like(300, 96)]
    rows = 64
    ranges = list(prefault_ranges(tensors, rows))
    owners = []
    for address, length in ranges:
        assert address % PAGE_BYTES == 0 and length % PAGE_BYTES == 0 and length > 0
        owner = next(
            i for i, t in enumerate(tensors) if t.data_ptr() <= address < t.data_ptr() + t.numel() * t.element_size()
        )
        tensor = tensors[owner]
        mapped_end = tensor.data_ptr() + -(-tensor.numel() * tensor.element_size() // PAGE_BYTES) * PAGE_BYTES
        assert address + length <= mapped_end
        # The middle row: a range reaches less than a page into its neighbours, and every round here
        # is at least a page long.
        middle_row = (address + length // 2 - tensor.data_ptr()) // (tensor.stride(0) * tensor.element_size())
        owners.append((owner, middle_row // rows))
    # Rounds: 16 of 64 rows (the longest tensor has 1000); the short one drops out after its 5th.
    rounds = [round_index for _, round_index in owners]
    assert rounds == sorted(rounds)
    assert [owner for owner, round_index in owners if round_index == 0] == [0, 1, 2]
    assert len(ranges) == 16 + 16 + 5
    for index, tensor in enumerate(tensors):
        covered = set()
        for (address, length), (owner, _) in zip(ranges, owners):
            if owner == index:
                first_page = (address - tensor.data_ptr()) // PAGE_BYTES
                covered.update(range(first_page, first_page + length // PAGE_BYTES))
        assert covered == set(range(len(_resident_pages(tensor))))
    with pytest.raises(ValueError, match="rows_per_round"):
        list(prefault_ranges(tensors, 0))


def test_prefault_makes_every_page_resident_and_never_changes_contents() -> None:
    """While the thread runs, another thread writes rows (as the forward does): every written value
    survives, the rest stays zero, and every page ends resident."""
    tensors = [_kv_like(4096, 512), _kv_like(4096, 512)]  # 8 MiB each
    assert not all(_resident_pages(tensors[0]))
    written = list(range(0, 4096, 7))
    for row in written[::2]:  # some rows before the thread starts: whatever order the threads run in
        for tensor in tensors:
            tensor[row] = float(row + 1)

    def write() -> None:
        for row in written[1::2]:
            for tensor in tensors:
                tensor[row] = float(row + 1)

    writer = threading.Thread(target=write)
    prefault = Prefault(tensors, rows_per_round=256)
    writer.start()
    writer.join()
    assert prefault.wait()
    assert prefault.completed
    assert prefault.faulted_bytes >= sum(t.numel() * t.element_size() for t in tensors)
    for tensor in tensors:
        assert all(_resident_pages(tensor))
        expected = torch.zeros(4096)
        expected[written] = torch.tensor(written, dtype=torch.float32) + 1
        assert torch.equal(tensor[:, 0], expected)
        assert torch.equal(tensor, expected[:, None].expand_as(tensor))


def test_stop_ends_and_joins_the_thread() -> None:
    tensors = [_kv_like(1 << 16, 1024)]  # 256 MiB: many rounds
    prefault = Prefault(tensors, rows_per_round=512)
    prefault.stop()
    assert not _prefault_threads()
    assert prefault.wait(0)
    if not prefault.completed:  # stopped part-way: the pages after it are left to be faulted in on use
        assert prefault.faulted_bytes < tensors[0].numel() * tensors[0].element_size()


@pytest.mark.parametrize(
    ("code", "level", "message"),
    [(errno.EINVAL, logging.DEBUG, "lacks MADV_POPULATE_WRITE"), (errno.ENOMEM, logging.WARNING, "stopped")],
)
def test_a_refusal_ends_the_thread_and_says_why(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, code: int, level: int, message: str
) -> None:
    """A kernel before 5.14 refuses the advice (EINVAL): said at debug level; running out of memory is a
    warning. Either way the pages are left to be faulted in on use."""
    calls: list[tuple[int, int, int]] = []

    def refuse(address: int, length: int, advice: int) -> int:
        calls.append((address, length, advice))
        ctypes.set_errno(code)
        return -1

    monkeypatch.setattr(_memory, "_libc_madvise", lambda: refuse)
    caplog.set_level(logging.DEBUG, logger="asyncllm")
    prefault = Prefault([_kv_like(1024, 1024)], rows_per_round=64)
    assert prefault.wait()
    assert not prefault.completed and prefault.faulted_bytes == 0
    assert len(calls) == 1 and calls[0][2] == _memory.MADV_POPULATE_WRITE
    assert [r.levelno for r in caplog.records if message in r.getMessage()] == [level]


def test_the_runner_prefaults_its_cpu_kv_cache_and_joins_at_close(tiny_llama: Path) -> None:
    runner = TorchModelRunner(tiny_llama, device="cpu", kv_cache_blocks=512)
    try:
        runner.load()
        assert runner.kv_prefault is not None
        assert runner.kv_prefault.wait()
        assert runner.kv_prefault.completed
        for keys, values in runner.kv_caches:
            assert all(_resident_pages(keys)) and all(_resident_pages(values))
    finally:
        runner.close()
    assert runner.kv_prefault is None
    assert not _prefault_threads()


def test_with_the_wait_the_cache_is_resident_when_the_load_returns(tiny_llama: Path) -> None:
    """``kv_cache_prefault_wait``: the load itself faults the whole cache in (no thread left running), as a server
    that listens only then needs; without ``kv_cache_prefault`` it faults nothing in."""
    runner = TorchModelRunner(tiny_llama, device="cpu", kv_cache_blocks=512, kv_cache_prefault_wait=True)
    try:
        runner.load()
        assert runner.kv_prefault is not None and runner.kv_prefault.completed
        assert not _prefault_threads()
        for keys, values in runner.kv_caches:
            assert all(_resident_pages(keys)) and all(_resident_pages(values))
    finally:
        runner.close()
    off = TorchModelRunner(
        tiny_llama, device="cpu", kv_cache_blocks=512, kv_cache_prefault=False, kv_cache_prefault_wait=True
    )
    try:
        off.load()
        assert off.kv_prefault is None and not all(_resident_pages(off.kv_caches[0][0]))
    finally:
        off.close()
    from asyncllm.engine._options import EngineOptions

    with pytest.raises(ValueError, match="kv_cache_prefault_wait must be a bool"):
        EngineOptions.from_keywords(kv_cache_prefault_wait="yes")


def test_the_switch_leaves_pages_to_first_use(tiny_llama: Path) -> None:
    runner = TorchModelRunner(tiny_llama, device="cpu", kv_cache_blocks=512, kv_cache_prefault=False)
    try:
        runner.load()
        assert runner.kv_prefault is None
        keys = runner.kv_caches[0][0]
        assert not all(_resident_pages(keys))
    finally:
        runner.close()


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_closing_an_engine_joins_a_prefault_in_progress(tiny_llama: Path) -> None:
    """An engine closed at once, while its 512 MiB cache is still being faulted in: the thread goes with it."""
    from asyncllm import Engine

    async with Engine.open(tiny_llama, device="cpu", kv_cache_memory=512 << 20) as engine:
        assert engine._core is not None and getattr(engine._core.runner, "kv_prefault", None) is not None
    assert not _prefault_threads()


def test_off_linux_the_thread_renices_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only Linux sets one thread's niceness through ``setpriority(PRIO_PROCESS, tid)``: elsewhere a thread id
    is no process id (on macOS it could name another process of the user), so nothing is reniced there."""
    calls: list[tuple[int, ...]] = []
    monkeypatch.setattr(sys, "platform", "darwin")
    monkeypatch.setattr(os, "setpriority", lambda *args: calls.append(args))
    prefault = Prefault([_kv_like(64, 1024)], rows_per_round=16, busy=lambda: False)
    assert prefault.wait()
    assert calls == []
    assert not prefault.completed and prefault.faulted_bytes == 0


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread niceness is Linux's")
def test_the_thread_yields_beside_steps_but_not_to_a_load_that_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Beside steps (``busy`` given) the thread lowers its own priority; a load that waits for it
    (``kv_cache_prefault_wait``: no ``busy``) would only wait longer, so there it keeps its creator's."""
    calls: list[tuple[int, ...]] = []
    monkeypatch.setattr(os, "setpriority", lambda *args: calls.append(args))
    beside = Prefault([_kv_like(64, 1024)], rows_per_round=16, busy=lambda: False)
    assert beside.wait() and beside.completed
    assert len(calls) == 1 and calls[0][0] == os.PRIO_PROCESS and calls[0][2] == _memory.PREFAULT_NICENESS
    waited = Prefault([_kv_like(64, 1024)], rows_per_round=16)
    assert waited.wait() and waited.completed
    assert len(calls) == 1


def test_an_ended_thread_holds_no_tensor(monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused (or stopped) part-way, the thread lets go of the tensors even while its ``Prefault`` is kept."""

    def refuse(address: int, length: int, advice: int) -> int:
        ctypes.set_errno(errno.EINVAL)
        return -1

    monkeypatch.setattr(_memory, "_libc_madvise", lambda: refuse)
    tensor = _kv_like(1024, 1024)
    ref = weakref.ref(tensor)
    prefault = Prefault([tensor], rows_per_round=64)
    assert prefault.wait()
    del tensor
    assert ref() is None
    assert prefault is not None  # still referenced


def test_a_load_that_fails_after_allocating_stops_the_prefault(
    tiny_llama: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The engine never closes a runner whose load raised: the load itself stops the thread it started, while
    that thread is still inside its first range (held there until ``stop()`` is called)."""
    from asyncllm.worker import _compile

    entered, release = threading.Event(), threading.Event()
    started: list[Prefault] = []

    def held(address: int, length: int, advice: int) -> int:
        entered.set()
        release.wait()
        return 0

    original_init, original_stop = Prefault.__init__, Prefault.stop

    def recording_init(self: Prefault, *args: object, **kwargs: object) -> None:
        started.append(self)
        original_init(self, *args, **kwargs)  # type: ignore[arg-type]

    def releasing_stop(self: Prefault) -> None:
        release.set()
        original_stop(self)

    def fail(model: object) -> float:
        assert entered.wait(timeout=60)  # the prefault is running when the load fails
        raise RuntimeError("no C compiler")

    monkeypatch.setattr(_memory, "_libc_madvise", lambda: held)
    monkeypatch.setattr(Prefault, "__init__", recording_init)
    monkeypatch.setattr(Prefault, "stop", releasing_stop)
    monkeypatch.setattr(_compile, "compile_dense_parts", fail)
    runner = TorchModelRunner(tiny_llama, device="cpu", attention_backend="torch", compile=True, kv_cache_blocks=4096)
    try:
        with pytest.raises(RuntimeError, match="no C compiler"):
            runner.load()
        assert runner.kv_prefault is None
        assert not _prefault_threads()
        assert len(started) == 1 and not started[0].completed  # stopped part-way, not run to the end
    finally:
        runner.close()


def test_the_prefault_stops_while_too_little_memory_would_be_left(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A cache planned larger than what is free now stays partly unfaulted rather than pushing out the rest."""
    monkeypatch.setattr(_memory, "host_available_bytes", lambda: _memory.PREFAULT_RESERVE_BYTES + (1 << 20))
    caplog.set_level(logging.WARNING, logger="asyncllm")
    tensor = _kv_like(4096, 1024)  # 16 MiB, one range per round of 1024 rows (4 MiB)
    prefault = Prefault([tensor], rows_per_round=1024)
    assert prefault.wait()
    assert not prefault.completed and prefault.faulted_bytes == 0
    assert not any(_resident_pages(tensor))
    assert any("less than 512 MiB" in r.getMessage() for r in caplog.records)


def _cgroup(root: Path, relative: str, files: dict[str, str]) -> None:
    directory = root / relative
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (directory / name).write_text(text)


def test_cgroup_memory_headroom_reads_the_tightest_limit(tmp_path: Path) -> None:
    """cgroup v2: limit less usage in the process's cgroup and its ancestors, the smallest; "max" is no limit."""
    root, membership = tmp_path / "cg", tmp_path / "self-cgroup"
    membership.write_text("0::/app/worker\n")
    _cgroup(root, "", {"memory.max": "max", "memory.current": "5000000000"})
    _cgroup(root, "app", {"memory.max": str(8 << 30), "memory.current": str(3 << 30)})
    _cgroup(root, "app/worker", {"memory.max": str(6 << 30), "memory.current": str(2 << 30)})
    assert _memory.cgroup_memory_headroom(root, membership) == 4 << 30
    (root / "app" / "worker" / "memory.max").write_text("max")
    assert _memory.cgroup_memory_headroom(root, membership) == 5 << 30
    (root / "app" / "memory.max").write_text("max\n")
    assert _memory.cgroup_memory_headroom(root, membership) is None


def test_cgroup_v1_memory_headroom_and_its_unlimited_value(tmp_path: Path) -> None:
    root, membership = tmp_path / "cg", tmp_path / "self-cgroup"
    membership.write_text("4:memory:/jobs/one\n3:cpu,cpuacct:/\n")
    _cgroup(root, "memory/jobs/one", {"memory.limit_in_bytes": str(2 << 30), "memory.usage_in_bytes": str(3 << 30)})
    _cgroup(root, "memory", {"memory.limit_in_bytes": "9223372036854771712", "memory.usage_in_bytes": "1"})
    assert _memory.cgroup_memory_headroom(root, membership) == 0  # over its limit: nothing left, not negative
    (root / "memory" / "jobs" / "one" / "memory.limit_in_bytes").write_text("9223372036854771712")
    assert _memory.cgroup_memory_headroom(root, membership) is None
    assert _memory.cgroup_memory_headroom(root, tmp_path / "missing") is None


def test_available_memory_is_the_containers_where_it_allows_less(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_memory, "cgroup_memory_headroom", lambda: None)
    host = _memory.host_available_bytes()
    monkeypatch.setattr(_memory, "cgroup_memory_headroom", lambda: 123 << 20)
    assert _memory.host_available_bytes() == min(host, 123 << 20)


def test_the_option_must_be_a_bool() -> None:
    """A non-bool (a string from a config file, say) is refused at open, naming the option."""
    from asyncllm.engine._options import EngineOptions

    with pytest.raises(ValueError, match="kv_cache_prefault must be a bool"):
        EngineOptions.from_keywords(kv_cache_prefault="no")
    assert EngineOptions.from_keywords(kv_cache_prefault=False).kv_cache_prefault is False



def _recording_madvise(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The lengths the prefault thread asks madvise to fault in, recorded instead of faulted."""
    lengths: list[int] = []

    def record(address: int, length: int, advice: int) -> int:
        lengths.append(length)
        return 0

    monkeypatch.setattr(_memory, "_libc_madvise", lambda: record)
    return lengths


def test_nothing_is_faulted_in_while_the_engine_is_busy(monkeypatch: pytest.MonkeyPatch) -> None:
    """Beside steps the thread took a share of a core from them; while ``busy`` says so it only waits, and
    ``stop()`` ends that wait at once."""
    lengths = _recording_madvise(monkeypatch)
    asked = threading.Event()

    def busy() -> bool:
        asked.set()
        return True

    prefault = Prefault([_kv_like(1024, 1024)], rows_per_round=64, busy=busy)
    assert asked.wait(timeout=60)
    prefault.stop()
    assert lengths == [] and prefault.faulted_bytes == 0 and not prefault.completed


def test_the_thread_goes_on_once_the_engine_is_idle(monkeypatch: pytest.MonkeyPatch) -> None:
    """Busy for the first two looks, then idle: every range is faulted in, and ``busy`` was asked before each."""
    lengths = _recording_madvise(monkeypatch)
    answers = [True, True]
    looks: list[int] = []

    def busy() -> bool:
        looks.append(len(lengths))
        return answers.pop(0) if answers else False

    tensor = _kv_like(1024, 1024)
    prefault = Prefault([tensor], rows_per_round=256, busy=busy)
    assert prefault.wait() and prefault.completed
    assert sum(lengths) >= tensor.numel() * tensor.element_size()
    assert looks == [0, 0, *range(len(lengths))]  # two waits before the first range, then one look per range


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio"])
async def test_a_step_holds_the_runners_prefault_off(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The runner's ``device_busy``: while a step runs (however long), and ``PREFAULT_QUIET_SECONDS`` after."""
    from asyncllm import Engine, SamplingParams

    async with Engine.open(tiny_llama, device="cpu", kv_cache_memory=8 << 20) as engine:
        runner = engine._core.runner if engine._core is not None else None
        assert isinstance(runner, TorchModelRunner)
        during: list[bool] = []
        launch = runner._launch

        def observed(*args: object) -> object:
            during.append(runner.device_busy())
            runner.last_step_ended = runner.last_step_started - 1.0  # a long step: the last end long ago
            return launch(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(runner, "_launch", observed)
        await engine.generate("hello", SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
        assert during and all(during)
        assert runner.last_step_ended >= runner.last_step_started
        assert runner.device_busy()  # just ended
        runner.last_step_started -= _memory.PREFAULT_QUIET_SECONDS
        runner.last_step_ended -= _memory.PREFAULT_QUIET_SECONDS
        assert not runner.device_busy()
