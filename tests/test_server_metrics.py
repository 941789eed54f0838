"""/metrics through real HTTP: vLLM's request-level families, with vLLM's
buckets and labels, move with real requests; `metrics_prefix="vllm:"` names
them as vLLM does. Default model (float32), one engine, two apps."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from tests.server_harness import ServerThread
from tokenmill import LLM
from tokenmill.config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.server import build_app

TIMEOUT_S = 60.0
# Long enough to fill blocks of 16 tokens, so the repeat hits the prefix cache.
SHARED = "The quick brown fox jumps over the lazy dog near the river bank at dawn. " * 3
REQUESTS = [
    {"prompt": SHARED + "First,", "max_tokens": 5, "temperature": 0},
    {"prompt": SHARED + "Second,", "max_tokens": 7, "temperature": 0},
    {"prompt": "Count to three:", "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 1},
]

# vLLM's buckets (vllm/v1/metrics/buckets.py), written out here so the test
# fails if the server's drift.
LATENCY = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]
ITL = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
       2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0]
ITERATION = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
PARAMS_N = [1, 2, 5, 10, 20]


def tokens_buckets(max_model_len: int) -> list[float]:
    out = []
    for exponent in range(12):
        out += [m * 10**exponent for m in (1, 2, 5) if m * 10**exponent <= max_model_len]
    return sorted(out)


@dataclass
class Served:
    engine: AsyncEngine
    main: ServerThread
    vllm: ServerThread


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    llm = LLM(dtype="float32", kv_cache_memory_bytes=128 << 20)
    engine = AsyncEngine(llm.engine)
    main = ServerThread(build_app(engine, ServerConfig())).start()
    vllm = ServerThread(build_app(engine, ServerConfig(metrics_prefix="vllm:"))).start()
    try:
        for body in REQUESTS:
            r = httpx.post(main.url + "/v1/completions", json=body, timeout=TIMEOUT_S)
            assert r.status_code == 200, r.text
        yield Served(engine, main, vllm)
    finally:
        main.stop()
        vllm.stop()
        engine.shutdown()


def families(url: str) -> dict[str, Metric]:
    text = httpx.get(url + "/metrics", timeout=TIMEOUT_S).text
    return {f.name: f for f in text_string_to_metric_families(text)}


def histogram(fams: dict[str, Metric], name: str) -> tuple[list[float], float, float]:
    """(bucket bounds without +Inf, count, sum) of a histogram's one series;
    checks it carries model_name and engine="0"."""
    fam = fams[name]
    assert fam.type == "histogram", name
    bounds, count, total = [], None, None
    for s in fam.samples:
        assert s.labels.get("engine") == "0" and "model_name" in s.labels, (name, s.labels)
        if s.name.endswith("_bucket") and s.labels["le"] != "+Inf":
            bounds.append(float(s.labels["le"]))
        elif s.name.endswith("_count"):
            count = s.value
        elif s.name.endswith("_sum"):
            total = s.value
    assert count is not None and total is not None
    return bounds, count, total


def value(fams: dict[str, Metric], name: str, suffix: str = "", **labels: str) -> float:
    for s in fams[name].samples:
        if s.name == name + suffix and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    raise AssertionError(f"no sample {name}{suffix} {labels}")


def test_vllm_request_families_with_vllm_buckets(served: Served) -> None:
    fams = families(served.main.url)
    p = "tokenmill:"
    num_finished = len(REQUESTS)
    tokens = tokens_buckets(served.engine.facts.max_model_len)
    expected_buckets = {
        "request_prompt_tokens": tokens, "request_generation_tokens": tokens,
        "request_params_max_tokens": tokens, "request_params_n": PARAMS_N,
        "iteration_tokens_total": ITERATION,
        "request_prefill_time_seconds": LATENCY, "request_decode_time_seconds": LATENCY,
        "request_inference_time_seconds": LATENCY, "request_time_per_output_token_seconds": ITL,
    }
    for name, buckets in expected_buckets.items():
        bounds, count, _ = histogram(fams, p + name)
        assert bounds == [float(b) for b in buckets], name
        if name != "iteration_tokens_total":
            assert count == num_finished, name
    # What the requests asked for and got.
    assert histogram(fams, p + "request_params_n")[2] == 1 + 1 + 2
    assert histogram(fams, p + "request_params_max_tokens")[2] == 5 + 7 + 4
    generated = histogram(fams, p + "request_generation_tokens")[2]
    assert generated == value(fams, p + "generation_tokens", "_total") <= 5 + 7 + 2 * 4
    assert histogram(fams, p + "request_prompt_tokens")[2] == value(fams, p + "prompt_tokens", "_total")
    # Every token the model ran was in some step; the steps ran prompts and outputs.
    _, num_steps, step_tokens = histogram(fams, p + "iteration_tokens_total")
    assert num_steps >= 7 and step_tokens >= generated
    # The second prompt shares whole blocks with the first.
    cached = value(fams, p + "prompt_tokens_cached", "_total")
    assert cached >= 16 and cached == value(fams, p + "prefix_cache_hits", "_total")
    # Phases: decode + prefill = inference, per request, so also summed.
    _, _, prefill = histogram(fams, p + "request_prefill_time_seconds")
    _, _, decode = histogram(fams, p + "request_decode_time_seconds")
    _, _, inference = histogram(fams, p + "request_inference_time_seconds")
    assert prefill > 0 and decode > 0 and prefill + decode == pytest.approx(inference)
    assert histogram(fams, p + "request_time_per_output_token_seconds")[2] > 0


def test_gauges_and_info(served: Served) -> None:
    fams = families(served.main.url)
    p = "tokenmill:"
    assert value(fams, p + "num_requests_waiting_by_reason", reason="capacity", engine="0") == 0
    assert value(fams, p + "num_requests_waiting_by_reason", reason="deferred", engine="0") == 0
    info = fams[p + "cache_config_info"]
    assert info.type == "gauge" and len(info.samples) == 1
    labels = info.samples[0].labels
    assert info.samples[0].value == 1
    assert labels["block_size"] == "16" and labels["enable_prefix_caching"] == "True"
    assert labels["engine"] == "0" and int(labels["num_gpu_blocks"]) > 0
    for name in ("num_requests_running", "kv_cache_usage_perc", "prefix_cache_queries"):
        assert fams[p + name].samples[0].labels["engine"] == "0"


def test_vllm_prefix(served: Served) -> None:
    text = httpx.get(served.vllm.url + "/metrics", timeout=TIMEOUT_S).text
    names = {f.name for f in text_string_to_metric_families(text)}
    assert not any(n.startswith("tokenmill:") for n in names)
    # Names a vLLM Grafana dashboard queries.
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
                 "prompt_tokens", "generation_tokens", "time_to_first_token_seconds",
                 "inter_token_latency_seconds", "e2e_request_latency_seconds",
                 "request_prompt_tokens", "request_generation_tokens", "iteration_tokens_total",
                 "request_params_n", "request_params_max_tokens", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds",
                 "request_inference_time_seconds", "request_time_per_output_token_seconds",
                 "prompt_tokens_cached", "num_requests_waiting_by_reason", "cache_config_info",
                 "request_success"):
        assert "vllm:" + name in names, name
    fams = families(served.vllm.url)
    # Both apps saw the same engine's requests.
    assert histogram(fams, "vllm:request_prompt_tokens")[1] == len(REQUESTS)


def test_bad_prefix_is_refused() -> None:
    with pytest.raises(ValueError, match="metrics_prefix"):
        ServerConfig(metrics_prefix="bad prefix")
