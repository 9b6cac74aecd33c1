"""``GET /metrics``: the engine's metrics in Prometheus' text exposition format, written by hand.

Why by hand rather than with ``prometheus_client``: the numbers already live in the engine
(``Engine.metrics`` histograms and counters, ``Engine.statistics()`` gauges), so exposing them is a
few lines of formatting; ``prometheus_client`` would add a dependency and, by default, a
process-global registry, which is wrong for a library: two engines (or two test engines) in one
process would fight over the same metric names. Here one engine is one app is one ``/metrics``
page, rendered from a snapshot at scrape time, with nothing global.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from asyncllm.engine._metrics import EngineMetrics, HistogramSnapshot
from asyncllm.outputs import EngineStatistics

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""The exposition format's media type."""

_FINISH_REASONS = ("stop", "length", "abort")  # always exported, so the series exist from the start


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if math.isnan(value):
        return "NaN"
    return repr(float(value))


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


class _Page:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> None:
        self.lines.append(f"# HELP {name} {help_text}")
        self.lines.append(f"# TYPE {name} {kind}")

    def sample(self, name: str, value: float, labels: Iterable[tuple[str, str]] = ()) -> None:
        label_text = ",".join(f'{key}="{_escape(val)}"' for key, val in labels)
        self.lines.append(f"{name}{{{label_text}}} {_number(value)}" if label_text else f"{name} {_number(value)}")

    def gauge(self, name: str, value: float, help_text: str) -> None:
        self.family(name, "gauge", help_text)
        self.sample(name, value)

    def counter(self, name: str, value: float, help_text: str) -> None:
        self.family(name, "counter", help_text)
        self.sample(name, value)

    def histogram(self, name: str, snapshot: HistogramSnapshot, help_text: str) -> None:
        self.family(name, "histogram", help_text)
        for bound, count in zip(snapshot.buckets, snapshot.counts):
            self.sample(f"{name}_bucket", count, [("le", _number(float(bound)))])
        self.sample(f"{name}_bucket", snapshot.count, [("le", "+Inf")])
        self.sample(f"{name}_sum", snapshot.sum)
        self.sample(f"{name}_count", snapshot.count)


def render_metrics(metrics: EngineMetrics, stats: EngineStatistics) -> str:
    """The ``/metrics`` page for one engine.

    Args:
        metrics: The engine's latency histograms and token counters (``Engine.metrics``).
        stats: A snapshot of its state (``Engine.statistics()``). Prefix-cache counters are
            exported when the snapshot has them.

    Returns:
        The page in the Prometheus text format (version 0.0.4), newline-terminated.
    """
    page = _Page()
    page.histogram(
        "asyncllm_request_queue_time_seconds", metrics.queue_time.snapshot(), "Time from arrival to first scheduled."
    )
    page.histogram(
        "asyncllm_time_to_first_token_seconds",
        metrics.time_to_first_token.snapshot(),
        "Time from arrival to the first generated token.",
    )
    page.histogram(
        "asyncllm_inter_token_latency_seconds",
        metrics.inter_token_latency.snapshot(),
        "Time between consecutive generated tokens.",
    )
    page.histogram(
        "asyncllm_e2e_request_latency_seconds", metrics.e2e_latency.snapshot(), "Time from arrival to finish."
    )
    page.counter("asyncllm_prompt_tokens_total", metrics.prompt_tokens, "Prompt tokens of answered requests.")
    page.counter("asyncllm_generation_tokens_total", metrics.generation_tokens, "Generated tokens.")
    page.family("asyncllm_request_finished_total", "counter", "Finished requests, by finish reason.")
    reasons = list(_FINISH_REASONS) + sorted(set(metrics.finished_requests) - set(_FINISH_REASONS))
    for reason in reasons:
        page.sample("asyncllm_request_finished_total", metrics.finished_requests.get(reason, 0), [("reason", reason)])

    page.gauge("asyncllm_num_requests_running", stats.num_running, "Requests holding KV blocks and being stepped.")
    page.gauge("asyncllm_num_requests_waiting", stats.num_waiting, "Requests queued for admission.")
    page.gauge("asyncllm_kv_cache_blocks_total", stats.kv_blocks_total, "Blocks in the KV cache.")
    page.gauge("asyncllm_kv_cache_blocks_free", stats.kv_blocks_free, "KV blocks not held by any request.")
    usage = getattr(stats, "kv_usage", None)
    if usage is None:
        usage = 1.0 - stats.kv_blocks_free / stats.kv_blocks_total if stats.kv_blocks_total else 0.0
    page.gauge("asyncllm_kv_cache_usage_ratio", float(usage), "Fraction of KV blocks held by requests (0-1).")
    # A hybrid model's sliding layers' pool (the gauges above are then the global layers' pool): 0 without one.
    page.gauge(
        "asyncllm_kv_cache_sliding_blocks_total",
        getattr(stats, "kv_sliding_blocks_total", 0),
        "Blocks in a hybrid model's sliding-window KV pool (0: no such pool).",
    )
    page.gauge(
        "asyncllm_kv_cache_sliding_blocks_free",
        getattr(stats, "kv_sliding_blocks_free", 0),
        "Sliding-window KV pool blocks not held by any request.",
    )
    page.gauge(
        "asyncllm_kv_cache_sliding_usage_ratio",
        float(getattr(stats, "kv_sliding_usage", 0.0)),
        "Fraction of the sliding-window KV pool's blocks held by requests (0-1).",
    )
    page.counter("asyncllm_num_preemptions_total", stats.num_preemptions, "Requests preempted (KV recomputed later).")
    page.counter("asyncllm_num_steps_total", stats.num_steps, "Model steps run.")
    page.family(
        "asyncllm_step_seconds_total",
        "counter",
        "Seconds spent per part of the step pipeline: the event loop's (schedule, prepare, output) and "
        "the device thread's (device_prepare, device_forward, device_sample, device_idle).",
    )
    for part in ("schedule", "prepare", "output"):
        page.sample("asyncllm_step_seconds_total", float(getattr(stats, f"time_{part}", 0.0)), [("part", part)])
    for part in ("device_prepare", "device_forward", "device_sample", "device_idle"):
        page.sample("asyncllm_step_seconds_total", float(getattr(stats, part, 0.0)), [("part", part)])
    # Present once the engine has a prefix cache; read by name so this works before and after.
    queries = getattr(stats, "prefix_cache_queries", None)
    hits = getattr(stats, "prefix_cache_hits", None)
    if queries is not None and hits is not None:
        page.counter("asyncllm_prefix_cache_queries_total", queries, "Prompt tokens looked up in the prefix cache.")
        page.counter("asyncllm_prefix_cache_hits_total", hits, "Prompt tokens whose KV was found in the prefix cache.")
    page.counter(
        "asyncllm_grammars_compiled_total", getattr(stats, "grammars_compiled", 0), "Structured-output specs compiled."
    )
    page.counter(
        "asyncllm_grammar_cache_hits_total",
        getattr(stats, "grammar_cache_hits", 0),
        "Structured-output specs found in the grammar cache.",
    )
    page.counter(
        "asyncllm_grammar_compile_seconds_total",
        float(getattr(stats, "grammar_compile_seconds", 0.0)),
        "Seconds spent compiling structured-output grammars (worker threads).",
    )
    _speculative(page, stats)
    return "\n".join(page.lines) + "\n"


def _speculative(page: _Page, stats: EngineStatistics) -> None:
    """Speculative decoding's counters (zero without it); per draft position only with it."""
    page.counter(
        "asyncllm_spec_decode_num_drafts_total", stats.spec_num_drafts, "Steps in which a request fed a draft."
    )
    page.counter("asyncllm_spec_decode_num_draft_tokens_total", stats.spec_draft_tokens, "Draft tokens fed.")
    page.counter(
        "asyncllm_spec_decode_num_accepted_tokens_total",
        stats.spec_accepted_tokens,
        "Draft tokens the model accepted.",
    )
    page.gauge(
        "asyncllm_spec_decode_acceptance_rate",
        float(stats.spec_acceptance_rate),
        "Accepted over fed draft tokens since start (0 before any draft).",
    )
    positions = stats.spec_draft_tokens_per_position
    if not positions:
        return
    page.family(
        "asyncllm_spec_decode_num_draft_tokens_per_pos_total", "counter", "Draft tokens fed, by position in the draft."
    )
    for position, count in enumerate(positions):
        page.sample("asyncllm_spec_decode_num_draft_tokens_per_pos_total", count, [("position", str(position))])
    page.family(
        "asyncllm_spec_decode_num_accepted_tokens_per_pos_total",
        "counter",
        "Draft tokens accepted, by position in the draft.",
    )
    for position, count in enumerate(stats.spec_accepted_tokens_per_position):
        page.sample("asyncllm_spec_decode_num_accepted_tokens_per_pos_total", count, [("position", str(position))])
    page.family(
        "asyncllm_spec_decode_acceptance_rate_per_pos",
        "gauge",
        "Accepted over fed draft tokens since start, by position in the draft.",
    )
    for position, rate in enumerate(stats.spec_acceptance_rate_per_position):
        page.sample("asyncllm_spec_decode_acceptance_rate_per_pos", float(rate), [("position", str(position))])
