"""The device thread's overlap, checked on the CPU through a recording ``DeviceOps``.

``RecordingOps`` is the CPU's ops that say they are asynchronous, so the engine takes the overlapping
path (launch step N+1, then collect step N) with the real runner, model and sampler. It logs every
host-device copy, every event, every wait and every read, and the runner's forwards: the order of
events and the host synchronisations per step are then read from the log.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from asyncllm import Engine, SamplingParams
from asyncllm.backends.triton._launchers import StaticDecodeMetadata
from asyncllm.executor._runner import SequenceInput, StepBatch
from asyncllm.worker._device_ops import CpuOps
from asyncllm.worker._input_batch import step_inputs
from asyncllm.worker._model_runner import PendingStep, TorchModelRunner

pytestmark = pytest.mark.anyio


class RecordingOps(CpuOps):
    """The CPU's ops, claiming to be asynchronous, with a log of what the runner asks of them."""

    asynchronous = True

    def __init__(self) -> None:
        super().__init__()
        self.log: list[tuple[str, Any]] = []
        self._host: set[int] = set()
        self._events = 0

    def to_device(self, array: np.ndarray[Any, Any]) -> torch.Tensor:
        self.log.append(("copy", np.asarray(array).size))
        return super().to_device(array)

    def tensor(self, values: Any, dtype: torch.dtype) -> torch.Tensor:
        self.log.append(("copy", len(values)))
        return super().tensor(values, dtype)

    def to_host(self, tensor: torch.Tensor) -> torch.Tensor:
        host = tensor.clone()
        self._host.add(id(host))
        self.log.append(("to_host", None))
        return host

    def record(self) -> int:
        self._events += 1
        self.log.append(("record", self._events))
        return self._events

    def wait(self, event: Any) -> None:
        self.log.append(("wait", event))

    def tolist(self, tensor: torch.Tensor) -> list[Any]:
        # A read of a host tensor filled by to_host is free after the wait; any other is a sync.
        self.log.append(("read" if id(tensor) in self._host else "sync", None))
        return super().tolist(tensor)


def _instrument(runner: TorchModelRunner, ops: RecordingOps) -> None:
    """Log each launch, forward and collect, numbered by step."""
    launch, forward = runner.launch, runner._forward
    count = iter(range(1, 1 << 30))

    def logged_launch(batch: StepBatch, after: PendingStep | None = None) -> PendingStep:
        k = next(count)
        ops.log.append(("launch", k))
        pending = launch(batch, after)
        result = pending.result

        def logged_result() -> Any:
            ops.log.append(("collect", k))
            return result()

        pending.result = logged_result  # type: ignore[method-assign]
        return pending

    def logged_forward(*args: Any) -> torch.Tensor:
        ops.log.append(("forward", None))
        return forward(*args)

    runner.launch = logged_launch  # type: ignore[method-assign]
    runner._forward = logged_forward  # type: ignore[method-assign]


def _phases(log: list[tuple[str, Any]]) -> Iterator[tuple[str, int, list[tuple[str, Any]]]]:
    """(``launch`` or ``collect``, step, the entries logged until the next phase)."""
    current: tuple[str, int] | None = None
    entries: list[tuple[str, Any]] = []
    for entry in log:
        if entry[0] in ("launch", "collect"):
            if current is not None:
                yield current[0], current[1], entries
            current, entries = (entry[0], entry[1]), []
        else:
            entries.append(entry)
    if current is not None:
        yield current[0], current[1], entries


PROMPTS = ["The quick brown fox", "Once upon a time", "1 2 3 4"]
PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=12),
    SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=12),
    SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True),
]


async def _generate(tiny_llama: Path, ops: CpuOps | None, params: list[SamplingParams]) -> list[list[int]]:
    runner = TorchModelRunner(tiny_llama, device="cpu", kv_cache_blocks=64, greedy_head=False)
    if ops is not None:
        runner.ops = ops
        if isinstance(ops, RecordingOps):
            _instrument(runner, ops)
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama)
    async with Engine.open(runner=runner, tokenizer=tokenizer) as engine:
        import anyio

        results: list[list[int]] = [[] for _ in PROMPTS]

        async def one(index: int) -> None:
            output = await engine.generate(PROMPTS[index], params[index])
            results[index] = list(output.token_ids)

        async with anyio.create_task_group() as group:
            for index in range(len(PROMPTS)):
                group.start_soon(one, index)
    return results


async def test_step_n_plus_1_launches_before_step_n_is_read(tiny_llama: Path) -> None:
    ops = RecordingOps()
    overlapped = await _generate(tiny_llama, ops, PARAMS)
    phases = list(_phases(ops.log))
    launches = [k for phase, k, _ in phases if phase == "launch"]
    collects = [k for phase, k, _ in phases if phase == "collect"]
    assert collects == launches == list(range(1, len(launches) + 1))
    assert len(launches) > 5
    order = [(phase, k) for phase, k, _ in phases]
    # Every step but the last is read back only after its successor's inputs were copied and its
    # forward launched.
    for k in launches[:-1]:
        assert order.index(("launch", k + 1)) < order.index(("collect", k)), order
        entries = dict(((p, s), e) for p, s, e in phases)[("launch", k + 1)]
        assert ("forward", None) in entries and any(kind == "copy" for kind, _ in entries)
    # The same tokens as the synchronous CPU path.
    assert overlapped == await _generate(tiny_llama, None, PARAMS)


async def test_one_host_synchronisation_per_step(tiny_llama: Path) -> None:
    ops = RecordingOps()
    await _generate(tiny_llama, ops, PARAMS)
    phases = list(_phases(ops.log))
    for phase, k, entries in phases:
        kinds = [kind for kind, _ in entries]
        if phase == "launch":
            # Launching never waits: copies go out, one event is recorded after the ids' copy home.
            assert "wait" not in kinds and "sync" not in kinds, (k, kinds)
            assert kinds.count("record") == 1 and kinds.count("to_host") == 1, (k, kinds)
            assert kinds.index("to_host") < kinds.index("record")
        else:
            # Collecting waits once, for that event, then reads the pinned ids for free.
            assert kinds == ["wait", "read"], (k, kinds)


async def test_a_request_with_history_waits_for_its_token_and_stays_identical(tiny_llama: Path) -> None:
    # Penalties read the request's tokens so far: its placeholder is resolved on the host, which
    # makes that launch wait for the step before (the one extra synchronisation, by design).
    params = [*PARAMS[:2], SamplingParams(temperature=0.0, max_tokens=9, repetition_penalty=1.3)]
    ops = RecordingOps()
    overlapped = await _generate(tiny_llama, ops, params)
    assert overlapped == await _generate(tiny_llama, None, params)
    order = [(phase, k) for phase, k, _ in _phases(ops.log)]
    # Decode launches collected their predecessor first (before their forward) while it ran.
    waited = [k for (phase, k), after in itertools.pairwise(order) if phase == "launch" and after == ("collect", k - 1)]
    assert len(waited) >= 5


def test_cpu_path_has_no_events_and_no_overlap(tiny_llama: Path) -> None:
    # Without the greedy head, whose host-picked tokens have no device ids (AMX or AVX512-BF16 machines).
    runner = TorchModelRunner(tiny_llama, device="cpu", kv_cache_blocks=16, greedy_head=False)
    runner.load()
    assert isinstance(runner.ops, CpuOps) and not runner.overlaps
    seq = SequenceInput(1, [5, 6, 7], 0, [0], True, SamplingParams(temperature=0.0, max_tokens=2))
    pending = runner.launch(StepBatch([seq], []))
    assert pending.device_ids is not None and pending._event is None
    assert len(pending.result().sampled_token_ids) == 1
    runner.close()


def test_graph_metadata_copies_only_the_used_block_table_prefix() -> None:
    block = 4
    meta = StaticDecodeMetadata(
        max_batch=8, max_blocks=64, block_size=block, device=torch.device("cpu"), sliding_window=None
    )

    def decode(tables: list[list[int]], lens: list[int]) -> Any:
        return step_inputs(
            [SequenceInput(i, [1], n - 1, t, True, SamplingParams()) for i, (t, n) in enumerate(zip(tables, lens))],
            block,
        )

    long = decode([[3, 7, 1], [0, 5], [9, 2, 11, 4], [6]], [10, 6, 15, 2])
    meta.fill(long)
    meta.upload(non_blocking=False)
    assert meta.table_entries_uploaded == 4 * 4  # 4 rows by ceil(15 / 4) blocks, not 8 x 64
    view = meta.metadata(8, 1)
    assert view.block_tables[:4, :4].tolist() == long.tables(None, 4).tolist()
    assert view.seq_lens.tolist() == [10, 6, 15, 2, 1, 1, 1, 1]
    assert view.slot_mapping.tolist()[4:] == [-1] * 4
    short = decode([[8]], [3])
    meta.fill(short)
    meta.upload(non_blocking=False)
    assert meta.table_entries_uploaded == 1
    view = meta.metadata(2, 1)
    assert view.block_tables[0, 0].item() == 8
    assert view.seq_lens.tolist() == [3, 1]  # the rows the longer step used are padding again
    assert view.slot_mapping.tolist() == [8 * block + 2, -1]


def test_graphs_are_captured_on_the_runners_stream(tiny_llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Capture gets the current stream (the runner's), not torch's side stream; CUDA faked on the CPU."""
    pytest.importorskip("triton", reason="the graph inputs come from the triton backend")
    from asyncllm.worker._graphs import DecodeGraphs

    runner = TorchModelRunner(
        tiny_llama, device="cpu", dtype="float32", block_size=4, kv_cache_blocks=8,
        attention_backend="triton", enforce_eager=True,
    )  # fmt: skip
    runner.load()
    assert runner.model is not None
    runner_stream = object()
    captured: list[object] = []

    class FakeGraph:
        def replay(self) -> None: ...

    class FakeCapture:
        def __init__(self, graph: FakeGraph, pool: object = None, stream: object = None) -> None:
            captured.append(stream)

        def __enter__(self) -> None: ...

        def __exit__(self, *exc: object) -> None: ...

    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "graph", FakeCapture)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: runner_stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    graphs = DecodeGraphs(
        runner.model, runner.kv_caches, block_size=4, max_seq_len=16, max_batch=2, device=runner.device
    )
    graphs.capture()
    assert captured == [runner_stream] * len(graphs.sizes)
    runner.close()
