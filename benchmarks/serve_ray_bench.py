"""tokenmill on Ray Serve against `tokenmill serve` alone (docs/perf-notes.md).

  python benchmarks/serve_ray_bench.py serve-b      # serve-B: serve alone (1 core),
                                                    # Ray 1 replica, Ray 2 replicas (1 core each)
  python benchmarks/serve_ray_bench.py chat-prefix  # 2 replicas: prefix-aware vs round-robin
  python benchmarks/serve_ray_bench.py serve-b-tp --rates 1  # serve-B: `serve -tp 2` alone
                                                    # (1 core a rank), Ray 1 replica of TP=2
                                                    # (rank 1 a Ray actor, 1 CPU a bundle)

serve-B (docs/WORKLOADS.md) runs at the rates given (--rates, default 2,4), prefix
caching off as the workload says. chat-prefix sends its 128 requests at time 0, then
chat-prefix-8: 8 system prompts of 512 tokens (default_rng(5)), 16 requests each,
interleaved; both with prefix caching on, reporting throughput and the replicas'
prefix-cache hit rate (hit tokens / looked-up tokens, from GET /ray/replicas).
One local Ray cluster of 2 CPUs; `tokenmill serve` alone runs first, before Ray starts,
with OMP_NUM_THREADS=1 (one core, as one replica). Results go to --output-dir as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from tokenmill.bench.serve import build_report, format_table, run_rate
from tokenmill.bench.workloads import Workload, chat_prefix, throughput_a

HOST = "127.0.0.1"


def wait_up(url: str, timeout_s: float = 300.0) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            r = httpx.get(url + "/v1/models", timeout=5)
            if r.status_code == 200:
                return str(r.json()["data"][0]["id"])
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not come up")


def warm_up(url: str, model: str) -> None:
    """Two requests at once, so each of two replicas has run a step (first-call
    costs stay out of the numbers); their prompts share no block with the workloads'."""
    results, _ = asyncio.run(run_rate(url, model, [[7, 8, 9, 10], [11, 12, 13, 14]], [4, 4],
                                      float("inf")))
    assert all(r.ok for r in results), [r.error for r in results]


def serve_b(url: str, label: str, rates: list[float], n: int) -> list[dict[str, Any]]:
    workload = throughput_a(128)
    prompts, lens = workload.prompts[:n], workload.output_lens[:n]
    model = wait_up(url)
    warm_up(url, model)
    rows = []
    for rate in rates:
        results, duration = asyncio.run(run_rate(url, model, prompts, lens, rate))
        report = build_report(rate, results, duration)
        print(f"== {label} rate {rate}\n{format_table([report])}", file=sys.stderr, flush=True)
        rows.append({"label": label, **dataclasses.asdict(report)})
    return rows


def replica_counters(url: str) -> tuple[int, int]:
    replicas = httpx.get(url + "/ray/replicas", timeout=30).json()["replicas"]
    return (sum(r["prefix_cache_hits"] for r in replicas),
            sum(r["prefix_cache_queries"] for r in replicas))


def chat_prefix_8(per_prefix: int = 16, system_len: int = 512, unique_len: int = 32,
                  output_len: int = 64, num_prefixes: int = 8) -> Workload:
    rng = np.random.default_rng(5)
    systems = rng.integers(100, 49000, size=(num_prefixes, system_len)).tolist()
    prompts = []
    for i in range(per_prefix * num_prefixes):  # interleaved: 0, 1, ..., 7, 0, 1, ...
        tail = rng.integers(100, 49000, size=unique_len).tolist()
        prompts.append(systems[i % num_prefixes] + tail)
    return Workload("chat-prefix-8", prompts, [output_len] * len(prompts))


def run_prefix_workload(url: str, label: str, workload: Workload) -> dict[str, Any]:
    model = wait_up(url)
    warm_up(url, model)
    hits0, queries0 = replica_counters(url)
    results, duration = asyncio.run(
        run_rate(url, model, workload.prompts, workload.output_lens, float("inf")))
    hits1, queries1 = replica_counters(url)
    report = build_report(float("inf"), results, duration)
    row = {"label": label, "workload": workload.name, "num_ok": report.num_ok,
           "duration_s": duration, "output_throughput": report.output_throughput,
           "hit_rate": (hits1 - hits0) / max(1, queries1 - queries0),
           "ttft_ms": report.ttft_ms, "e2e_ms": report.e2e_ms}
    print(f"== {label} {workload.name}: {json.dumps(row)}", file=sys.stderr, flush=True)
    return row


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["serve-b", "chat-prefix", "serve-b-tp"])
    p.add_argument("--rates", default="2,4")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--output-dir", default="bench-results/serve-ray")
    p.add_argument("--scale", type=float, default=1.0, help="fewer requests (a smoke run)")
    args = p.parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    url = f"http://{HOST}:{args.port}"
    rows: list[dict[str, Any]] = []
    n_serve_b = max(2, int(64 * args.scale))
    tp = 2 if args.what == "serve-b-tp" else 1
    if args.what in ("serve-b", "serve-b-tp"):
        rates = [float(r) for r in args.rates.split(",")]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        alone = subprocess.Popen(
            [sys.executable, "-m", "tokenmill.cli", "serve", "--host", HOST, "--port",
             str(args.port), "--no-enable-prefix-caching", "--tensor-parallel-size", str(tp)],
            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            label = "serve alone (1 core)" if tp == 1 else f"serve -tp {tp} alone (1 core a rank)"
            rows += serve_b(url, label, rates, n_serve_b)
        finally:
            alone.terminate()
            alone.wait(60)

    import ray
    from ray import serve

    from tokenmill.config import ServerConfig
    from tokenmill.engine.arg_utils import EngineArgs
    from tokenmill.serve_ray.app import RayServeOptions, build_ray_app

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": HOST, "port": args.port})
    try:
        if args.what == "serve-b":
            engine_args = EngineArgs(enable_prefix_caching=False).with_serve_defaults()
            for n in (1, 2):
                app = build_ray_app(engine_args, ServerConfig(),
                                    RayServeOptions(num_replicas=n, num_cpus_per_replica=1), 2)
                serve.run(app, name="tokenmill", route_prefix="/", blocking=False)
                rows += serve_b(url, f"Ray Serve, {n} replica{'s' if n > 1 else ''} (1 core each)",
                                rates, n_serve_b)
                serve.delete("tokenmill")
        elif args.what == "serve-b-tp":
            engine_args = EngineArgs(enable_prefix_caching=False,
                                     tensor_parallel_size=tp).with_serve_defaults()
            app = build_ray_app(engine_args, ServerConfig(),
                                RayServeOptions(num_replicas=1, num_cpus_per_replica=tp), 2)
            serve.run(app, name="tokenmill", route_prefix="/", blocking=False)
            rows += serve_b(url, f"Ray Serve, 1 replica of TP={tp} (1 CPU a rank)", rates, n_serve_b)
            serve.delete("tokenmill")
        else:
            engine_args = EngineArgs().with_serve_defaults()
            for router in ("prefix", "round_robin"):
                for workload in (chat_prefix(max(2, int(128 * args.scale))),
                                 chat_prefix_8(max(1, int(16 * args.scale)))):
                    app = build_ray_app(engine_args, ServerConfig(), RayServeOptions(
                        num_replicas=2, num_cpus_per_replica=1, router=router), 2)
                    serve.run(app, name="tokenmill", route_prefix="/", blocking=False)
                    rows.append(run_prefix_workload(url, router, workload))
                    (out / f"{args.what}.json").write_text(json.dumps(rows, indent=1, default=str))
                    serve.delete("tokenmill")  # fresh caches for the next run
    finally:
        (out / f"{args.what}.json").write_text(json.dumps(rows, indent=1, default=str))
        serve.shutdown()
        ray.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
