"""Prometheus metrics of one server, in a registry of its own (no process-wide state).

Two sources:

- the server itself observes every request's outputs: prompt and generation tokens, time to first
  token (from the request's arrival to the end of the step that produced its first token),
  inter-token latency (between the steps that produced successive tokens), end-to-end latency and
  finished requests by finish reason;
- the engine's ``get_stats().scheduler`` snapshot, read when ``/metrics`` is scraped: KV-cache
  usage, running and waiting requests, prefix-cache queries and hits (in tokens), preemptions, and
  the ``n > 1`` fork's counts (samples forked, copy-on-write block copies, blocks shared now).
  These are the engine's own running totals, exposed by a collector, not copied into counters.

Names follow vLLM's V1 names with ``pagedkv:`` in place of ``vllm:``; ``prefix="vllm"``
(``serve --metrics-prefix vllm``) gives vLLM's own names, so vLLM's Grafana dashboards work
unchanged, plus the two older names they may still read: ``vllm:gpu_cache_usage_perc`` (the
same value as ``kv_cache_usage_perc``) and ``vllm:time_per_output_token_seconds`` (the same
observations as ``inter_token_latency_seconds``). docs/server.md has the table.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pagedkv.errors import ConfigError

#: The prefixes ``--metrics-prefix`` takes.
METRICS_PREFIXES = ("pagedkv", "vllm")

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Seconds; the bounds vLLM uses, which cover a fast GPU and a slow CPU alike.
_TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
)
_E2E_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
)


class _EngineStatsCollector(Collector):
    """Exposes the last engine stats snapshot given to :meth:`ServerMetrics.render`."""

    def __init__(self, model_name: str, prefix: str) -> None:
        self.model_name = model_name
        self.prefix = prefix
        self.stats: Any = None

    def collect(self) -> Iterator[Metric]:
        if self.stats is None:
            return
        stats = self.stats.scheduler  # EngineStats -> SchedulerStats
        labels = ["model_name"]
        values = [self.model_name]
        p = self.prefix
        gauges = (
            (
                f"{p}:num_requests_running",
                "Requests being computed (scheduled).",
                stats.num_running,
            ),
            (
                f"{p}:num_requests_waiting",
                "Requests waiting to be scheduled.",
                stats.num_waiting,
            ),
            (
                f"{p}:kv_cache_usage_perc",
                "Fraction of KV-cache blocks in use (0..1).",
                stats.kv_cache_usage,
            ),
            (
                f"{p}:kv_cache_used_blocks",
                "KV-cache blocks held by requests (0 when idle; cached free blocks not counted).",
                getattr(stats, "num_used_blocks", 0),
            ),
            (
                f"{p}:num_shared_blocks",
                "KV-cache blocks held by more than one request now (the prompt blocks of an n > 1 "
                "request's forked samples, prefix-cache hits on a running request's blocks).",
                getattr(stats, "num_shared_blocks", 0),
            ),
        )
        if p == "vllm":  # the older name vLLM's dashboards may read
            gauges += (
                (
                    "vllm:gpu_cache_usage_perc",
                    "Fraction of KV-cache blocks in use (0..1); vLLM's older name of "
                    "kv_cache_usage_perc.",
                    stats.kv_cache_usage,
                ),
            )
        for name, doc, value in gauges:
            metric = GaugeMetricFamily(name, doc, labels=labels)
            metric.add_metric(values, float(value))
            yield metric
        counters = (
            (
                f"{p}:prefix_cache_queries",
                "Prompt tokens looked up in the prefix cache (each request once, at its first "
                "admission).",
                stats.prefix_cache_queries,
            ),
            (
                f"{p}:prefix_cache_hits",
                "Prompt tokens served from the prefix cache (each request once, at its first "
                "admission).",
                stats.prefix_cache_hits,
            ),
            (
                f"{p}:num_preemptions",
                "Requests preempted (blocks freed, recomputed later).",
                stats.num_preemptions,
            ),
            (
                f"{p}:num_forks",
                "Samples of n > 1 requests forked from their parent (sharing its prompt blocks "
                "instead of computing the prompt).",
                getattr(stats, "num_forks", 0),
            ),
            (
                f"{p}:num_cow_copies",
                "KV-cache blocks copied on write (a forked sample writing into the partially "
                "filled block it shared).",
                getattr(stats, "num_cow_copies", 0),
            ),
        )
        for name, doc, value in counters:
            metric = CounterMetricFamily(name, doc, labels=labels)
            metric.add_metric(values, float(value))
            yield metric
        spec = getattr(stats, "spec_decoding", None)
        if spec is not None:
            yield from _spec_decode_metrics(p, spec, labels, values)
        tier = getattr(self.stats, "kv_tier", None)
        if tier is not None:
            yield from _kv_tier_metrics(tier, labels, values)


def _spec_decode_metrics(
    prefix: str, spec: Any, labels: list[str], values: list[str]
) -> Iterator[Metric]:
    """Speculative decoding's counters, vLLM's names (only when it is on)."""
    for name, doc, value in (
        ("num_drafts", "Verification steps of a request with draft tokens.", spec.num_drafts),
        ("num_draft_tokens", "Draft tokens scheduled.", spec.num_draft_tokens),
        ("num_accepted_tokens", "Draft tokens accepted.", spec.num_accepted_tokens),
    ):
        metric = CounterMetricFamily(f"{prefix}:spec_decode_{name}", doc, labels=labels)
        metric.add_metric(values, float(value))
        yield metric
    per_pos = CounterMetricFamily(
        f"{prefix}:spec_decode_num_accepted_tokens_per_pos",
        "Draft tokens accepted at each draft position (label position, 0 = the first draft).",
        labels=[*labels, "position"],
    )
    for position, count in enumerate(spec.num_accepted_tokens_per_pos):
        per_pos.add_metric([*values, str(position)], float(count))
    yield per_pos


def _kv_tier_metrics(tier: Any, labels: list[str], values: list[str]) -> Iterator[Metric]:
    """The KV tier's series (only with a tier): entries held, hits, bytes moved, load time."""
    gauge = GaugeMetricFamily(
        "pagedkv:kv_tier_used_blocks",
        "Blocks the KV tier below the pool holds now (label medium: CPU or DISK).",
        labels=[*labels, "medium"],
    )
    gauge.add_metric([*values, tier.medium], float(tier.num_used_blocks))
    yield gauge
    for name, doc, value in (
        (
            "pagedkv:kv_tier_hit_blocks",
            "Blocks loaded back from the KV tier into the pool (tier hits).",
            tier.num_hit_blocks,
        ),
        (
            "pagedkv:kv_tier_stored_blocks",
            "Blocks paged out to the KV tier.",
            tier.num_stored_blocks,
        ),
        ("pagedkv:kv_tier_bytes_stored", "Bytes written to the KV tier.", tier.bytes_stored),
        ("pagedkv:kv_tier_bytes_loaded", "Bytes loaded from the KV tier.", tier.bytes_loaded),
        (
            "pagedkv:kv_tier_load_seconds",
            "Seconds the KV tier's loads took (reads and copies into the pool).",
            tier.load_seconds,
        ),
        (
            "pagedkv:kv_tier_failed_loads",
            "KV tier loads that found a missing, truncated or corrupt entry (recomputed).",
            tier.num_failed_loads,
        ),
        (
            "pagedkv:kv_tier_dropped_stores",
            "KV tier stores dropped because the disk writer's queue was full.",
            tier.num_dropped_stores,
        ),
    ):
        metric = CounterMetricFamily(name, doc, labels=labels)
        metric.add_metric(values, float(value))
        yield metric


class ServerMetrics:
    """The metrics of one server; everything lives in ``self.registry``.

    Args:
        model_name: the ``model_name`` label.
        prefix: the names' prefix (:data:`METRICS_PREFIXES`): ``"pagedkv"``, or ``"vllm"`` for
            vLLM's names and its two older aliases (module docstring).

    Raises:
        ConfigError: another prefix.
    """

    def __init__(self, model_name: str, prefix: str = "pagedkv") -> None:
        if prefix not in METRICS_PREFIXES:
            raise ConfigError(
                f"--metrics-prefix must be one of {', '.join(METRICS_PREFIXES)}, got {prefix!r}"
            )
        self.registry = CollectorRegistry(auto_describe=True)
        labels = ["model_name"]
        p = prefix
        self._engine = _EngineStatsCollector(model_name, prefix)
        self.registry.register(self._engine)
        self.prompt_tokens = Counter(
            f"{p}:prompt_tokens",
            "Prompt tokens of finished and running requests.",
            labels,
            registry=self.registry,
        ).labels(model_name)
        self.generation_tokens = Counter(
            f"{p}:generation_tokens",
            "Generated tokens.",
            labels,
            registry=self.registry,
        ).labels(model_name)
        self.time_to_first_token = Histogram(
            f"{p}:time_to_first_token_seconds",
            "Arrival to first generated token.",
            labels,
            buckets=_TTFT_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.inter_token_latency = Histogram(
            f"{p}:inter_token_latency_seconds",
            "Time between successive generated tokens.",
            labels,
            buckets=_ITL_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self.e2e_request_latency = Histogram(
            f"{p}:e2e_request_latency_seconds",
            "Arrival to last token of a request.",
            labels,
            buckets=_E2E_BUCKETS,
            registry=self.registry,
        ).labels(model_name)
        self._request_success = Counter(
            f"{p}:request_success",
            "Finished requests by finish reason.",
            [*labels, "finished_reason"],
            registry=self.registry,
        )
        self._model_name = model_name
        #: vLLM's older name of inter_token_latency_seconds (prefix "vllm" only)
        self._time_per_output_token = None
        if prefix == "vllm":
            self._time_per_output_token = Histogram(
                "vllm:time_per_output_token_seconds",
                "Time between successive generated tokens (vLLM's older name of "
                "inter_token_latency_seconds).",
                labels,
                buckets=_ITL_BUCKETS,
                registry=self.registry,
            ).labels(model_name)

    def observe_inter_token_latency(self, seconds: float) -> None:
        """One gap between two steps that gave a sample tokens."""
        self.inter_token_latency.observe(seconds)
        if self._time_per_output_token is not None:
            self._time_per_output_token.observe(seconds)

    def observe_finished(self, finish_reason: str, e2e_latency: float | None) -> None:
        """Count a finished sample; ``e2e_latency`` (seconds) is None for aborted ones, which
        stay out of the latency histogram."""
        self._request_success.labels(self._model_name, finish_reason).inc()
        if e2e_latency is not None:
            self.e2e_request_latency.observe(e2e_latency)

    def render(self, engine_stats: Any) -> bytes:
        """The Prometheus text exposition, with ``engine_stats`` as the engine's snapshot."""
        self._engine.stats = engine_stats
        return generate_latest(self.registry)
