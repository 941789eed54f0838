"""Prometheus metrics, named as vLLM's under a `tokenmill:` prefix.

Each app has its own CollectorRegistry (tests build several apps). State
(running, waiting, KV usage, cumulative cache and preemption counts) is read
from the engine's last step boundary at scrape time; per-request events
(tokens, latencies) come from the engine loop after every iteration."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.iteration_stats import IterationStats

PREFIX = "tokenmill:"

TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]


class _SchedulerCollector(Collector):
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        labels = [self.model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(PREFIX + name, doc, labels=["model_name"])
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(PREFIX + name, doc, labels=["model_name"])
            c.add_metric(labels, value)
            return c

        yield gauge("num_requests_running", "Requests in the running batch.", stats.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled (queued in the "
                    "engine loop included).", self.engine.num_waiting_requests())
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).",
                    stats.kv_cache_usage)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      stats.prefix_cache_hits)
        yield counter("num_preemptions", "Preemptions (recompute) since start.",
                      stats.num_preemptions)


class ServerMetrics:
    def __init__(self, engine: AsyncEngine, model_name: str, prefix: str = PREFIX) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name"]
        reg = self.registry
        self.prompt_tokens = Counter(
            PREFIX + "prompt_tokens", "Prefill tokens processed.", labels, registry=reg)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Generation tokens processed.", labels, registry=reg)
        self.request_success = Counter(
            PREFIX + "request_success", "Finished requests, by finish reason.",
            [*labels, "finished_reason"], registry=reg)
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Time to first token.", labels,
            buckets=TTFT_BUCKETS, registry=reg)
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds", "Time between output tokens.", labels,
            buckets=ITL_BUCKETS, registry=reg)
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Arrival to finish.", labels,
            buckets=REQUEST_BUCKETS, registry=reg)
        self.queue_time = Histogram(
            PREFIX + "request_queue_time_seconds", "Arrival to first scheduled.", labels,
            buckets=REQUEST_BUCKETS, registry=reg)
        for metric in (self.prompt_tokens, self.generation_tokens, self.ttft, self.itl,
                       self.e2e, self.queue_time):
            metric.labels(model_name)  # so every series shows from the first scrape
        reg.register(_SchedulerCollector(engine, model_name))
        engine.add_stat_logger(self.record)

    def record(self, stats: IterationStats) -> None:
        """Called in the engine thread after each iteration (prometheus_client is thread-safe)."""
        name = self.model_name
        if stats.num_prompt_tokens:
            self.prompt_tokens.labels(name).inc(stats.num_prompt_tokens)
        if stats.num_generation_tokens:
            self.generation_tokens.labels(name).inc(stats.num_generation_tokens)
        for value in stats.time_to_first_tokens_s:
            self.ttft.labels(name).observe(value)
        for value in stats.inter_token_latencies_s:
            self.itl.labels(name).observe(value)
        for value in stats.queue_times_s:
            self.queue_time.labels(name).observe(value)
        for finished in stats.finished:
            self.e2e.labels(name).observe(finished.e2e_latency_s)
            self.request_success.labels(name, finished.finish_reason).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
