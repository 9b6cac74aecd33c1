"""``asyncllm.integrations.ray_serve`` on a local Ray cluster (CPU): two replicas of a tiny model behind
Serve's HTTP proxy, driven by the official ``openai`` client over real HTTP; one replica killed
mid-load while the other goes on. One Ray cluster serves the whole module.

Ray Serve runs each replica on its own asyncio loop, so the Ray tests are plain (synchronous) tests;
the replica's health check, which needs no Ray, runs on both anyio backends.
"""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest

import asyncllm
from asyncllm.errors import EngineDeadError
from asyncllm.integrations.ray_serve import REPLICA_HEADER, _OpenAIReplica, openai_app
from asyncllm.testing import ByteTokenizer, ScriptedRunner, import_path

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)  # Ray 2.60's pydantic models warn when imported
    try:
        import ray
        from ray import serve
    except ImportError:
        ray = serve = None

needs_ray = pytest.mark.skipif(ray is None, reason="Ray Serve is not installed (pip install 'asyncllm[ray]')")

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
MODEL = "tiny"
HEADER = REPLICA_HEADER.decode()
BATCH = 2  # the engine's max_num_seqs, hence each replica's max_ongoing_requests
LONG = 800  # tokens: a stream that is still running while the others start
# Tiny and single-threaded: two replicas share this machine's two cores.
ENGINE = {"device": "cpu", "num_threads": 1, "kv_cache_blocks": 256, "max_num_seqs": BATCH, "max_model_len": 2048}


def _app(model: Path, **options: Any) -> Any:
    """The tiny model on two replicas (or as ``options`` say), half a logical CPU each."""
    if "autoscaling_config" not in options:
        options.setdefault("num_replicas", 2)
    return openai_app(
        model, engine_options=ENGINE, app_options={"model_name": MODEL}, ray_actor_options={"num_cpus": 0.5}, **options
    )


@dataclass
class Cluster:
    base_url: str
    model: Path

    def client(self) -> openai.OpenAI:
        # No retries: a request that fails must show here, not be hidden by the client.
        return openai.OpenAI(base_url=f"{self.base_url}/v1", api_key="none", max_retries=0, timeout=120)

    def replicas(self, app: str = "default") -> set[str]:
        """The ids of the replica actors of ``app`` (starting or running)."""
        assert ray is not None
        names = [actor["name"] for actor in ray.util.list_named_actors(all_namespaces=True)]
        return {name.rsplit("#", 1)[1] for name in names if name.startswith(f"SERVE_REPLICA::{app}#")}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def cluster(tiny_llama: Path) -> Iterator[Cluster]:
    assert ray is not None and serve is not None
    ours = psutil.Process()
    before = {child.pid for child in ours.children(recursive=True)}
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves the machine
    src = str(Path(asyncllm.__file__).resolve().parents[1])  # the replicas import this asyncllm
    # Logical CPUs, for Ray's bookkeeping: the replicas of every test's app fit at once.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": {"PYTHONPATH": src}})
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(_app(tiny_llama), route_prefix="/")
        yield Cluster(f"http://127.0.0.1:{port}", tiny_llama)
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
        # Everything Ray started (GCS, raylet, workers, replicas) is gone.
        started = [child for child in ours.children(recursive=True) if child.pid not in before]
        _, alive = psutil.wait_procs(started, timeout=60)
        assert not alive, f"Ray left processes behind: {[p.pid for p in alive]}"


def _streams(client: openai.OpenAI, count: int, on_first: threading.Barrier | None = None) -> list[Any]:
    """``count`` long completions streamed at once; each waits at ``on_first`` (if given) after its
    first event, so all are in flight together. Returns, per stream, (replica, completion tokens or
    None, error)."""

    def one(index: int) -> tuple[str | None, int | None, BaseException | None]:
        raw = client.completions.with_raw_response.create(
            model=MODEL,
            prompt=f"Once upon a time, number {index}",
            max_tokens=LONG,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        replica, tokens, first = raw.headers.get(HEADER), None, True
        try:
            for event in raw.parse():
                if first and on_first is not None:
                    on_first.wait(timeout=120)
                    first = False
                if event.usage is not None:
                    tokens = event.usage.completion_tokens
        except (openai.APIError, httpx.HTTPError) as exc:
            return replica, tokens, exc
        return replica, tokens, None

    with ThreadPoolExecutor(count) as pool:
        return list(pool.map(one, range(count)))


@needs_ray
def test_two_replicas_answer_the_openai_client_through_serve(cluster: Cluster) -> None:
    client = cluster.client()
    assert [model.id for model in client.models.list().data] == [MODEL]
    assert httpx.get(f"{cluster.base_url}/health", timeout=30).json() == {"status": "ok"}

    whole = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert whole.choices[0].finish_reason == "length" and whole.usage is not None
    assert whole.usage.completion_tokens == 8
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hello"}], max_tokens=8, temperature=0, stream=True
        )
    )
    assert chunks[-1].choices[0].finish_reason == "length"

    # Four streams at once, each replica taking at most BATCH: both replicas answer, and each
    # stream runs to its end.
    replicas = cluster.replicas()
    assert len(replicas) == 2
    results = _streams(client, 2 * BATCH, threading.Barrier(2 * BATCH))
    assert [(tokens, error) for _, tokens, error in results] == [(LONG, None)] * (2 * BATCH)
    assert {replica for replica, _, _ in results} == replicas


@needs_ray
def test_requests_go_on_through_the_other_replica_when_one_is_killed_mid_load(cluster: Cluster) -> None:
    assert ray is not None
    client = cluster.client()
    all_started = threading.Barrier(2 * BATCH + 1)  # the streams and this test
    with ThreadPoolExecutor(1) as pool:
        running = pool.submit(_streams, client, 2 * BATCH, all_started)
        all_started.wait(timeout=120)
        # Every stream has its first tokens, so each replica runs BATCH of them: kill one replica.
        replicas = cluster.replicas()
        victim = sorted(replicas)[0]
        ray.kill(ray.get_actor(f"SERVE_REPLICA::default#asyncllm#{victim}", namespace="serve"), no_restart=True)
        results = running.result()

    by_replica = {replica: [(tokens, error) for r, tokens, error in results if r == replica] for replica in replicas}
    assert len(by_replica[victim]) == BATCH
    for tokens, error in by_replica[victim]:  # cut off, and the client knows it
        assert tokens is None and isinstance(error, openai.APIConnectionError)
    (survivor,) = replicas - {victim}
    assert by_replica[survivor] == [(LONG, None)] * BATCH

    # New requests go on, through the survivor (or the replica Serve starts in the victim's place).
    answered = []
    for _ in range(4):
        raw = client.completions.with_raw_response.create(
            model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0
        )  # greedy: sampled at temperature 1, the tiny model can end early on its end-of-text token
        assert raw.parse().choices[0].finish_reason == "length"
        answered.append(raw.headers.get(HEADER))
    assert victim not in answered


@needs_ray
@pytest.mark.filterwarnings("ignore:The `metrics_interval_s` field:DeprecationWarning")
def test_serve_adds_a_replica_when_requests_queue(cluster: Cluster) -> None:
    assert serve is not None
    # Serve 2.60 still reads metrics_interval_s (deprecated): the proxy reports its queue every 0.5 s, not 10 s.
    scaling = {
        "min_replicas": 1,
        "max_replicas": 2,
        "upscale_delay_s": 0,
        "look_back_period_s": 1,
        "metrics_interval_s": 0.5,
    }
    app = _app(cluster.model, autoscaling_config=scaling, name="scaled")  # target: 1 (half of BATCH)
    serve.run(app, name="scaled", route_prefix="/scaled")
    try:
        assert len(cluster.replicas("scaled")) == 1
        client = openai.OpenAI(base_url=f"{cluster.base_url}/scaled/v1", api_key="none", max_retries=0, timeout=120)
        with ThreadPoolExecutor(1) as pool:
            # Twice a batch: BATCH requests run, BATCH wait in Serve's queue, and the autoscaler
            # (1 ongoing request per replica wanted) asks for the second replica.
            load = pool.submit(_streams, client, 2 * BATCH)
            deadline = time.monotonic() + 120
            while len(cluster.replicas("scaled")) < 2 and not load.done() and time.monotonic() < deadline:
                time.sleep(0.1)  # polling Ray's actor list, bounded by the deadline
            scaled_up = len(cluster.replicas("scaled")) == 2
            results = load.result()
        assert scaled_up, "no second replica while requests were queued"
        assert [(tokens, error) for _, tokens, error in results] == [(LONG, None)] * (2 * BATCH)
    finally:
        serve.delete("scaled")


@needs_ray
def test_the_example_deploys(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    assert serve is not None
    monkeypatch.setenv("ASYNCLLM_MODEL", str(cluster.model))
    example = import_path(EXAMPLES / "ray_serve_app.py", "example_ray_serve_app")
    serve.run(example.app, name="example", route_prefix="/example")
    try:
        client = openai.OpenAI(base_url=f"{cluster.base_url}/example/v1", api_key="none", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model=cluster.model.name,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=5,
            extra_headers={"x-session-id": "a-conversation"},
        )
        assert reply.choices[0].finish_reason == "length"
    finally:
        serve.delete("example")


class _MarkingRunner(ScriptedRunner):
    """A scripted runner that leaves a file in ``marks`` when the engine loads it and when it closes it."""

    def __init__(self, marks: Path) -> None:
        super().__init__([65])
        self.marks = marks

    def load(self) -> Any:
        (self.marks / f"loaded-{os.getpid()}").touch()
        return super().load()

    def close(self) -> None:
        (self.marks / f"closed-{os.getpid()}").touch()
        super().close()


@needs_ray
def test_replicas_open_their_engines_at_start_close_them_at_stop_and_keep_sessions(
    cluster: Cluster, tmp_path: Path
) -> None:
    """Two replicas over a scripted runner that marks its load and close; sessions stick to a replica."""
    assert ray is not None and serve is not None
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the replicas cannot import this module
    engine = {"runner": _MarkingRunner(tmp_path), "tokenizer": ByteTokenizer()}
    app = openai_app(
        engine_options=engine, app_options={"model_name": MODEL}, num_replicas=2, session_affinity=True, name="sticky"
    )
    # An app of its own: a running deployment's proxies keep the router they were built with.
    serve.run(app, name="sticky", route_prefix="/sticky")
    try:
        # Each replica's lifespan loaded its engine before Serve called the app running.
        loaded = sorted(mark.name for mark in tmp_path.iterdir())
        pids = {int(name.removeprefix("loaded-")) for name in loaded}
        assert len(pids) == 2 and os.getpid() not in pids and all(name.startswith("loaded-") for name in loaded)

        client = openai.OpenAI(base_url=f"{cluster.base_url}/sticky/v1", api_key="none", max_retries=0, timeout=120)
        answered: dict[str, set[str | None]] = {}
        for session in ("alice", "bob", "carol", "dave"):
            for _ in range(3):
                raw = client.completions.with_raw_response.create(
                    model=MODEL, prompt="hi", max_tokens=3, extra_headers={"x-session-id": session}
                )
                assert raw.parse().choices[0].text == "AAA"
                answered.setdefault(session, set()).add(raw.headers.get(HEADER))
        assert all(len(replicas) == 1 for replicas in answered.values()), answered
    finally:
        serve.delete("sticky")
    # Stopping each replica closed its engine.
    assert sorted(mark.name for mark in tmp_path.iterdir()) == sorted(
        [f"closed-{pid}" for pid in pids] + [f"loaded-{pid}" for pid in pids]
    )


def _deployment(app: Any) -> Any:
    return app._bound_deployment  # the one deployment of the application


def _scripted(**options: Any) -> dict[str, Any]:
    return {"runner": ScriptedRunner([65]), "tokenizer": ByteTokenizer(), **options}


@needs_ray
def test_replicas_wait_for_a_resident_kv_cache_unless_told_not_to() -> None:
    """As ``asyncllm serve``: a replica takes requests once its KV cache is resident (``kv_cache_prefault_wait``
    on by default), and the engine options can turn it off."""
    by_default = _deployment(openai_app(engine_options=_scripted()))
    assert by_default.init_args[1]["kv_cache_prefault_wait"] is True
    off = _deployment(openai_app(engine_options=_scripted(kv_cache_prefault_wait=False)))
    assert off.init_args[1]["kv_cache_prefault_wait"] is False


@needs_ray
def test_serves_admission_limits_come_from_the_engines() -> None:
    fixed = _deployment(openai_app(engine_options=_scripted(max_num_seqs=8, max_waiting_requests=100)))
    assert (fixed.num_replicas, fixed.max_ongoing_requests, fixed.max_queued_requests) == (1, 8, 100)
    # The app's max_concurrent_requests caps a replica's share; an unbounded engine queue, Serve's.
    capped = _deployment(
        openai_app(
            engine_options=_scripted(max_num_seqs=64, max_waiting_requests=None),
            app_options={"max_concurrent_requests": 16},
        )
    )
    assert (capped.max_ongoing_requests, capped.max_queued_requests) == (16, -1)
    scaled = _deployment(openai_app(engine_options=_scripted(max_num_seqs=8), autoscaling_config={"max_replicas": 3}))
    autoscaling = scaled._deployment_config.autoscaling_config
    assert (autoscaling.max_replicas, autoscaling.target_ongoing_requests) == (3, 4)
    chosen = _deployment(
        openai_app(
            engine_options=_scripted(),
            max_ongoing_requests=5,
            autoscaling_config={"max_replicas": 2, "target_ongoing_requests": 3},
        )
    )
    assert chosen.max_ongoing_requests == 5
    assert chosen._deployment_config.autoscaling_config.target_ongoing_requests == 3


@needs_ray
def test_bad_options_fail_at_the_call() -> None:
    with pytest.raises(TypeError):
        openai_app(engine_options=_scripted(max_num_seq=8))  # a typo
    with pytest.raises(ValueError, match="max_concurrent_requests"):
        openai_app(engine_options=_scripted(), app_options={"max_concurrent_requests": 4}, max_ongoing_requests=5)
    with pytest.raises(ValueError, match="not both"):
        openai_app(engine_options=_scripted(), num_replicas=2, autoscaling_config={"max_replicas": 2})
    with pytest.raises(ValueError, match="num_replicas must be >= 1"):
        openai_app(engine_options=_scripted(), num_replicas=0)
    with pytest.raises(ValueError, match="max_queued_requests"):
        openai_app(engine_options=_scripted(), max_queued_requests=0)
    with pytest.raises(ValueError, match="max_ongoing_requests"):
        openai_app(engine_options=_scripted(), deployment_options={"max_ongoing_requests": 3})


def test_importing_the_integration_loads_neither_ray_nor_torch() -> None:
    code = "import sys, asyncllm.integrations.ray_serve; print(sorted({'ray', 'torch'} & set(sys.modules)))"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]"


def test_without_ray_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray raises ImportError
    with pytest.raises(ImportError, match=re.escape("pip install 'asyncllm[ray]'")):
        openai_app(engine_options=_scripted())


@pytest.mark.anyio
async def test_the_health_check_is_what_health_says() -> None:
    # Serve calls check_health periodically and replaces a replica whose check raises.
    runner = ScriptedRunner([65, 66, 67], fail_at_step=1)
    replica = _OpenAIReplica(None, {"runner": runner, "tokenizer": ByteTokenizer()}, {})
    with pytest.raises(RuntimeError, match=r"GET /health answered 503.*engine_closed"):
        await replica.check_health()  # not started yet
    engine = replica._app.engine
    with pytest.raises(EngineDeadError):  # leaving the engine re-raises why it died
        async with engine:
            await replica.check_health()
            with pytest.raises(EngineDeadError):
                await engine.generate("hi", {"max_tokens": 4})  # the scripted step 1 fails: the engine dies
            with pytest.raises(RuntimeError, match=r"GET /health answered 503.*engine_dead"):
                await replica.check_health()
