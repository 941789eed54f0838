"""Prometheus metrics, named as vLLM's under a `tokenmill:` prefix (ServerConfig's
`metrics_prefix`: `vllm:` makes vLLM's Grafana dashboards read them unchanged).

Each app has its own CollectorRegistry (tests build several apps). State
(running, waiting, KV usage, cumulative cache and preemption counts) is read
from the engine's last step boundary at scrape time; per-request events
(tokens, latencies) come from the engine loop after every iteration."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from tokenmill.engine.client import EngineClient
from tokenmill.engine.iteration_stats import IterationStats

PREFIX = "tokenmill:"
ENGINE = "0"  # vLLM's `engine` label: the engine core's index; one engine here

# vLLM's bucket families (vllm/v1/metrics/buckets.py), by the same names.
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
REQUEST_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                   50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKENS_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
REQUEST_PARAMS_N_BUCKETS = [1, 2, 5, 10, 20]


def request_tokens_buckets(max_model_len: int) -> list[float]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to max_model_len."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_model_len:
                return buckets
            buckets.append(mantissa * scale)
        scale *= 10


class _SchedulerCollector(Collector):
    def __init__(self, engine: EngineClient, model_name: str, prefix: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.prefix = prefix
        cache = engine.facts.cache
        # vLLM's cache_config_info: an info metric (a gauge at 1) whose labels are
        # the cache's settings, vLLM's names where tokenmill has the same thing.
        self.cache_info = {
            "block_size": str(cache.block_size),
            "cache_dtype": cache.cache_dtype,
            "enable_prefix_caching": str(cache.enable_prefix_caching),
            "kv_cache_memory_bytes": str(cache.kv_cache_memory_bytes),
            "num_gpu_blocks": str(cache.num_blocks),
            "engine": ENGINE,
        }

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        label_names = ["model_name", "engine"]
        labels = [self.model_name, ENGINE]
        prefix = self.prefix

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            g = GaugeMetricFamily(prefix + name, doc, labels=label_names)
            g.add_metric(labels, value)
            return g

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            c = CounterMetricFamily(prefix + name, doc, labels=label_names)
            c.add_metric(labels, value)
            return c

        num_waiting = self.engine.num_waiting_requests()
        yield gauge("num_requests_running", "Requests in the running batch.", stats.num_running)
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled (queued in the "
                    "engine loop included).", num_waiting)
        by_reason = GaugeMetricFamily(
            prefix + "num_requests_waiting_by_reason", "Waiting requests by reason: 'capacity' "
            "= waiting for scheduling capacity; 'deferred' = held back by a transient "
            "constraint (none in tokenmill, so always 0).", labels=[*label_names, "reason"])
        by_reason.add_metric([*labels, "capacity"], num_waiting)
        by_reason.add_metric([*labels, "deferred"], 0)
        yield by_reason
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (1 = full).",
                    stats.kv_cache_usage)
        yield counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.",
                      stats.prefix_cache_queries)
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.",
                      stats.prefix_cache_hits)
        yield counter("num_preemptions", "Preemptions (recompute) since start.",
                      stats.num_preemptions)
        spec = stats.spec_decoding
        if spec is not None:  # vLLM's spec_decode_* counters (speculative decoding on)
            yield counter("spec_decode_num_drafts", "Verifications of drafts (a request's "
                          "drafts in one step).", spec.num_drafts)
            yield counter("spec_decode_num_draft_tokens", "Draft tokens verified.",
                          spec.num_draft_tokens)
            yield counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.",
                          spec.num_accepted_tokens)
            per_pos = CounterMetricFamily(
                prefix + "spec_decode_num_accepted_tokens_per_pos", "Draft tokens accepted, "
                "by their position among the request's drafts.", labels=[*label_names, "position"])
            for pos, num in enumerate(spec.num_accepted_tokens_per_pos):
                per_pos.add_metric([*labels, str(pos)], num)
            yield per_pos
        offload = stats.kv_offload
        if offload is not None:  # the disk tier (kv_offload_dir): vLLM's KV connector families
            yield counter("external_prefix_cache_queries", "Prompt tokens the prefix cache in "
                          "RAM lacked, looked up in the disk tier (kv_offload_dir).", offload.queries)
            yield counter("external_prefix_cache_hits", "Of those, tokens loaded from the disk "
                          "tier; misses are queries - hits.", offload.hits)
            t = offload.transfers
            for name, doc, (load, store) in (
                    ("kv_offload_total_bytes", "Bytes moved between the KV cache and the disk "
                     "tier, by direction.", (t.bytes_loaded, t.bytes_stored)),
                    ("kv_offload_total_time", "Seconds spent moving blocks between the KV cache "
                     "and the disk tier (in the step, before the forward), by direction.",
                     (t.load_s, t.store_s))):
                by_type = CounterMetricFamily(prefix + name, doc,
                                              labels=[*label_names, "transfer_type"])
                by_type.add_metric([*labels, "disk_to_cpu"], load)
                by_type.add_metric([*labels, "cpu_to_disk"], store)
                yield by_type
            yield counter("kv_offload_failed_loads", "Block files found but not loaded: "
                          "missing by then, truncated, corrupt or another engine's (each a "
                          "miss, recomputed).", t.num_failed_loads)
        info = GaugeMetricFamily(prefix + "cache_config_info", "Information of the engine's "
                                 "CacheConfig", labels=list(self.cache_info))
        info.add_metric(list(self.cache_info.values()), 1)
        yield info


class ServerMetrics:
    """The families vLLM's Prometheus logger exports (vllm/v1/metrics/loggers.py),
    with its names, buckets and labels (`model_name`, `engine`), under `prefix`."""

    def __init__(self, engine: EngineClient, model_name: str, prefix: str = PREFIX) -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        labels = ["model_name", "engine"]
        reg = self.registry
        token_buckets = request_tokens_buckets(engine.facts.max_model_len)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(prefix + name, doc, [*labels, *extra], registry=reg)

        def histogram(name: str, doc: str, buckets: Sequence[float]) -> Histogram:
            return Histogram(prefix + name, doc, labels, buckets=buckets, registry=reg)

        self.prompt_tokens = counter("prompt_tokens", "Prefill tokens processed.")
        self.prompt_tokens_cached = counter(
            "prompt_tokens_cached", "Prompt tokens served from the prefix cache.")
        self.generation_tokens = counter("generation_tokens", "Generation tokens processed.")
        self.request_success = counter(
            "request_success", "Finished requests, by finish reason.", ("finished_reason",))
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = histogram("inter_token_latency_seconds", "Time between output tokens.",
                             ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Arrival to finish.", REQUEST_BUCKETS)
        self.queue_time = histogram("request_queue_time_seconds", "Arrival to first scheduled.",
                                    REQUEST_BUCKETS)
        self.iteration_tokens = histogram(
            "iteration_tokens_total", "Tokens per engine step.", ITERATION_TOKENS_BUCKETS)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens per finished request.", token_buckets)
        self.request_generation_tokens = histogram(
            "request_generation_tokens", "Generated tokens per finished request.", token_buckets)
        self.prefill_time = histogram(
            "request_prefill_time_seconds", "First scheduled to first token, per request.",
            REQUEST_BUCKETS)
        self.decode_time = histogram(
            "request_decode_time_seconds", "First token to last token, per request.",
            REQUEST_BUCKETS)
        self.inference_time = histogram(
            "request_inference_time_seconds", "First scheduled to last token, per request.",
            REQUEST_BUCKETS)
        self.time_per_output_token = histogram(
            "request_time_per_output_token_seconds",
            "Decode time / (generated tokens - 1), per request.", ITL_BUCKETS)
        self.params_n = histogram("request_params_n", "The n request parameter.",
                                  REQUEST_PARAMS_N_BUCKETS)
        self.params_max_tokens = histogram(
            "request_params_max_tokens", "The max_tokens request parameter.", token_buckets)
        for metric in (self.prompt_tokens, self.prompt_tokens_cached, self.generation_tokens,
                       self.ttft, self.itl, self.e2e, self.queue_time, self.iteration_tokens,
                       self.request_prompt_tokens, self.request_generation_tokens,
                       self.prefill_time, self.decode_time, self.inference_time,
                       self.time_per_output_token, self.params_n, self.params_max_tokens):
            metric.labels(model_name, ENGINE)  # so every series shows from the first scrape
        # The series record() touches every step, looked up once (labels() takes a lock).
        series = (model_name, ENGINE)
        self._generation_tokens = self.generation_tokens.labels(*series)
        self._iteration_tokens = self.iteration_tokens.labels(*series)
        self._itl = self.itl.labels(*series)
        reg.register(_SchedulerCollector(engine, model_name, prefix))
        engine.add_stat_logger(self.record)

    def record(self, stats: IterationStats) -> None:
        """Called in the engine thread after each iteration (prometheus_client is thread-safe)."""
        labels = (self.model_name, ENGINE)
        if stats.num_prompt_tokens:
            self.prompt_tokens.labels(*labels).inc(stats.num_prompt_tokens)
        if stats.num_cached_prompt_tokens:
            self.prompt_tokens_cached.labels(*labels).inc(stats.num_cached_prompt_tokens)
        if stats.num_generation_tokens:
            self._generation_tokens.inc(stats.num_generation_tokens)
        if stats.num_scheduled_tokens is not None:
            self._iteration_tokens.observe(stats.num_scheduled_tokens)
        for value in stats.time_to_first_tokens_s:
            self.ttft.labels(*labels).observe(value)
        for value in stats.inter_token_latencies_s:
            self._itl.observe(value)
        for value in stats.queue_times_s:
            self.queue_time.labels(*labels).observe(value)
        for finished in stats.finished:
            self.e2e.labels(*labels).observe(finished.e2e_latency_s)
            self.request_success.labels(*labels, finished.finish_reason).inc()
            self.request_prompt_tokens.labels(*labels).observe(finished.num_prompt_tokens)
            self.request_generation_tokens.labels(*labels).observe(finished.num_generation_tokens)
            self.prefill_time.labels(*labels).observe(finished.prefill_time_s)
            self.decode_time.labels(*labels).observe(finished.decode_time_s)
            self.inference_time.labels(*labels).observe(finished.inference_time_s)
            self.time_per_output_token.labels(*labels).observe(
                finished.mean_time_per_output_token_s)
            self.params_n.labels(*labels).observe(finished.n)
            if finished.max_tokens:
                self.params_max_tokens.labels(*labels).observe(finished.max_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)
