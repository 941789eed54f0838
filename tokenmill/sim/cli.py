"""`tokenmill simulate [calibrate | plan]`: the command line of the simulator.

`tokenmill simulate` runs a workload through the simulator and writes the
reports `tokenmill bench` writes for it (throughput-A: the static vs
continuous table and plot; serve-B or a JSON of requests: the latency table
and plot), plus a timeline per run, all as JSON and PNG.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tokenmill.bench import extras
from tokenmill.bench import serve as serve_bench
from tokenmill.bench import throughput as throughput_bench
from tokenmill.bench.throughput import POLICIES, ThroughputRow, baseline_policy, positive_ints
from tokenmill.config import CPU_SERVE_MAX_NUM_BATCHED_TOKENS
from tokenmill.sim import plan as planner
from tokenmill.sim import report
from tokenmill.sim.cost_model import CostModel
from tokenmill.sim.simulator import EngineSettings, SimRequest, simulate
from tokenmill.sim.workloads import (
    chat_prefix_requests,
    load_requests,
    serve_b_requests,
    throughput_a_requests,
)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--cost-model", default="sim-cost-model.json",
                   help="a cost model JSON from `tokenmill simulate calibrate`")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="default: 32 for throughput-A (as bench throughput), else 128")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="default: 2048 for throughput-A, else the server's CPU default "
                        f"(max({CPU_SERVE_MAX_NUM_BATCHED_TOKENS}, max_num_seqs))")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=4 << 30,
                   help="KV cache size when --num-kv-blocks is not given (default 4 GiB, the "
                        "CPU engine's)")
    p.add_argument("--num-speculative-tokens", type=int, default=0,
                   help="speculative decoding: drafts per decoding request and step")
    p.add_argument("--draft-acceptance-rate", type=float, default=0.5,
                   help="each draft's chance to be accepted (given the one before it was)")
    throughput_bench.add_reserve_arg(p)
    p.add_argument("--num-requests", type=int, default=64, help="serve-B: requests per rate")
    p.add_argument("--offline", action="store_true",
                   help="serve-B / a JSON workload as LLM.generate would run it: without the "
                        "server's costs (calibrate --serve)")
    p.add_argument("--output-dir", default="bench-results")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workload", default="throughput-A",
                   help="throughput-A, serve-B, chat-prefix, or a JSON file of requests "
                        "(tokenmill/sim/workloads.py says its shape)")
    p.add_argument("--caps", default="32,128,512", type=positive_ints, help="throughput-A")
    p.add_argument("--policies", default=None,
                   help=f"of {list(POLICIES)}; default: static,continuous for throughput-A, "
                        "continuous otherwise")
    p.add_argument("--rates", default="1,2,4", help="serve-B: request rates (req/s)")
    p.add_argument("--label", default="sim", help="name in the output files")
    p.add_argument("--compare", default=None, metavar="BENCH_JSON",
                   help="a `tokenmill bench throughput` or `bench serve` JSON of the same "
                        "workload: print the predictions beside those measurements")
    add_engine_args(p)
    sub = p.add_subparsers(dest="simulate_command")
    from tokenmill.sim import calibrate

    cal = sub.add_parser("calibrate", help="time real steps here and fit a cost model")
    calibrate.add_args(cal)
    cal.set_defaults(func=calibrate.main_calibrate)
    pl = sub.add_parser("plan", help="the fewest replicas and settings that meet the SLOs")
    pl.add_argument("--rate", type=float, required=True, help="requests per second, all replicas")
    pl.add_argument("--slo-ttft-ms", type=float, required=True)
    pl.add_argument("--slo-tpot-ms", type=float, required=True)
    pl.add_argument("--slo-percentile", default="p99", choices=("p50", "p90", "p99"))
    pl.add_argument("--workload", dest="plan_workload", default="serve-B",
                    help="serve-B (its shape at --rate) or a JSON file of requests")
    pl.add_argument("--max-replicas", type=int, default=8)
    pl.add_argument("--seqs", default=",".join(map(str, planner.DEFAULT_SEQS)), type=positive_ints,
                    help="max_num_seqs values to try")
    pl.add_argument("--budgets", default=",".join(map(str, planner.DEFAULT_BUDGETS)),
                    type=positive_ints, help="max_num_batched_tokens values to try")
    add_engine_args(pl)
    pl.set_defaults(func=main_plan, num_requests=256)


def settings_for(args: argparse.Namespace, throughput: bool, policy: str = "continuous",
                 cap: int = 128) -> EngineSettings:
    """The engine settings of `policy` (at throughput-A's `cap`; serve-B's requests
    are CAP 128's, which is what a reserving server reserves for)."""
    seqs = args.max_num_seqs or (32 if throughput else 128)
    budget = args.max_num_batched_tokens or (
        2048 if throughput else max(CPU_SERVE_MAX_NUM_BATCHED_TOKENS, seqs))
    opts = throughput_bench.engine_options(policy, cap, getattr(args, "reserve", "cap"))
    return EngineSettings(scheduling_policy=opts["scheduling_policy"], max_num_seqs=seqs,
                          max_num_batched_tokens=budget, block_size=args.block_size,
                          enable_prefix_caching=opts["enable_prefix_caching"],
                          kv_allocation=opts["kv_allocation"],
                          kv_reserve_output_tokens=opts.get("kv_reserve_output_tokens"),
                          num_kv_blocks=args.num_kv_blocks,
                          kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                          num_speculative_tokens=args.num_speculative_tokens,
                          draft_acceptance_rate=args.draft_acceptance_rate,
                          serving=not throughput and not getattr(args, "offline", False))


def _policies(args: argparse.Namespace, default: str) -> list[str]:
    policies = (args.policies or default).split(",")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"--policies: unknown {unknown}; choose from {list(POLICIES)}")
    return policies


def main_simulate(args: argparse.Namespace) -> int:
    extras.require("matplotlib")
    cost = CostModel.load(args.cost_model)
    dtype = {2: "bfloat16", 4: "float32"}.get(cost.model.element_bytes, "?")
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    timelines: dict[str, Any] = {}

    def run(requests: list[SimRequest], settings: EngineSettings, label: str) -> Any:
        result = simulate(requests, settings, cost)
        timelines[label] = {"settings": asdict(settings), **report.timeline(result)}
        report.plot_timeline(result, out / f"{args.label}-timeline-{label}.png",
                             f"simulated {label}: {settings.scheduling_policy}, max_num_seqs "
                             f"{settings.max_num_seqs}, budget {settings.max_num_batched_tokens}")
        return result

    if args.workload == "throughput-A":
        rows: list[ThroughputRow] = []
        for cap in (int(c) for c in args.caps.split(",")):
            for policy in _policies(args, "static,continuous"):
                result = run(throughput_a_requests(cap), settings_for(args, True, policy, cap),
                             f"throughput-A-cap{cap}-{policy}")
                rows.append(report.throughput_row(result, policy, cap, dtype))
        baseline = baseline_policy([r.policy for r in rows])
        for r in rows:
            base = next((b for b in rows if b.policy == baseline and b.cap == r.cap), None)
            if base is not None:
                r.ratio_vs_static = r.generated_tok_s / base.generated_tok_s
        stem = f"{args.label}-throughput-{dtype}"
        (out / f"{stem}.json").write_text(json.dumps(
            {"rows": [asdict(r) for r in rows], "timelines": timelines}, indent=2))
        throughput_bench.plot(rows, out / f"{stem}.png")
        print(throughput_bench.format_table(rows).replace("vs static", f"vs {baseline}"))
        if args.compare:
            data = json.loads(Path(args.compare).read_text())
            if isinstance(data, dict):  # `bench study`'s JSON: its rows beside its budget
                data = data["rows"]
            measured = [ThroughputRow(**d) for d in data]
            print("\n" + compare_throughput(rows, measured))
            if baseline == throughput_bench.NAIVE_STATIC:
                print("\nThe seed's decomposition, measured / predicted:\n"
                      + compare_decomposition(rows, measured))
    else:
        reports = []
        policy = _policies(args, "continuous")[0]
        if args.workload == "serve-B":
            cases = [(float(r), serve_b_requests(float(r), args.num_requests))
                     for r in args.rates.split(",")]
        elif args.workload == "chat-prefix":
            cases = [(float("inf"), chat_prefix_requests())]
        else:
            reqs = load_requests(args.workload)
            span = max(r.arrival_s for r in reqs)
            cases = [((len(reqs) - 1) / span if span > 0 else float("inf"), reqs)]
        for rate, requests in cases:
            result = run(requests, settings_for(args, False, policy), f"{policy}-rate{rate:g}")
            reports.append(report.rate_report(result, rate))
        stem = f"{args.label}-serve"
        (out / f"{stem}.json").write_text(json.dumps(
            {"reports": [asdict(r) for r in reports], "timelines": timelines}, indent=2))
        serve_bench.plot(reports, out / f"{stem}.png", f"simulated {args.workload}")
        print(serve_bench.format_table(reports))
        if args.compare:
            measured_reports = [serve_bench.RateReport(**d)
                                for d in json.loads(Path(args.compare).read_text())]
            print("\n" + compare_serve(reports, measured_reports))
    print(f"\nwrote {out / stem}.json and .png, and a timeline per run ({args.label}-timeline-*.png)")
    return 0


def _err(predicted: float, measured: float) -> str:
    return f"{100 * (predicted / measured - 1):+.1f}%"


def compare_throughput(predicted: list[ThroughputRow], measured: list[ThroughputRow]) -> str:
    """Generated tok/s, predicted beside measured, per (policy, CAP) both have; the
    ratios against naive static where the rows have it (`bench study`), else static."""
    baseline = baseline_policy([r.policy for r in predicted])
    lines = ["| policy | cap | measured gen tok/s | predicted gen tok/s | error | "
             f"measured / predicted vs {baseline} |", "|---|---|---|---|---|---|"]
    for p in predicted:
        m = next((r for r in measured if r.policy == p.policy and r.cap == p.cap), None)
        if m is None:
            continue
        m_base = next((r for r in measured if r.policy == baseline and r.cap == p.cap), None)
        ratios = (f"{m.generated_tok_s / m_base.generated_tok_s:.2f}x / {p.ratio_vs_static:.2f}x"
                  if m_base is not None and p.ratio_vs_static else "-")
        lines.append(f"| {p.policy} | {p.cap} | {m.generated_tok_s:.1f} | {p.generated_tok_s:.1f} | "
                     f"{_err(p.generated_tok_s, m.generated_tok_s)} | {ratios} |")
    return "\n".join(lines)


def compare_decomposition(predicted: list[ThroughputRow], measured: list[ThroughputRow]) -> str:
    """`bench study`'s decomposition per CAP, each factor measured / predicted."""
    from tokenmill.bench import study

    def x(v: float | None) -> str:
        return f"{v:.2f}x" if v is not None else "-"

    keys = ("scheduling", "memory", "total")
    lines = ["| CAP | scheduling: continuous / static (reserved) | memory: paged / reserved "
             "(continuous) | total: continuous paged / naive static |", "|---|---|---|---|"]
    by_cap = {d["cap"]: d for d in study.decomposition(predicted)}
    for m in study.decomposition(measured):
        p = by_cap.get(m["cap"])
        if p is None:
            continue
        lines.append(f"| {m['cap']} | " + " | ".join(f"{x(m[k])} / {x(p[k])}" for k in keys) + " |")
    return "\n".join(lines)


def compare_serve(predicted: list[Any], measured: list[Any]) -> str:
    """TTFT and TPOT p50 / p99 (ms), predicted beside measured, per rate both have."""
    lines = ["| rate req/s | metric | measured p50 / p99 ms | predicted p50 / p99 ms | "
             "error p50 / p99 |", "|---|---|---|---|---|"]
    for p in predicted:
        m = next((r for r in measured if r.rate == p.rate), None)
        if m is None:
            continue
        for name, key in (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"),
                          ("E2E", "e2e_ms")):
            mp, pp = getattr(m, key), getattr(p, key)
            lines.append(f"| {p.rate:g} | {name} | {mp['p50']:.1f} / {mp['p99']:.1f} | "
                         f"{pp['p50']:.1f} / {pp['p99']:.1f} | {_err(pp['p50'], mp['p50'])} / "
                         f"{_err(pp['p99'], mp['p99'])} |")
    return "\n".join(lines)


def main_plan(args: argparse.Namespace) -> int:
    cost = CostModel.load(args.cost_model)
    if args.plan_workload == "serve-B":
        requests = serve_b_requests(args.rate, args.num_requests)
    else:
        requests = load_requests(args.plan_workload)
    base = settings_for(args, False)
    best, tried = planner.plan(
        requests, cost, args.rate, args.slo_ttft_ms, args.slo_tpot_ms, base,
        max_replicas=args.max_replicas, seqs=[int(x) for x in args.seqs.split(",")],
        budgets=[int(x) for x in args.budgets.split(",")], percentile=args.slo_percentile)
    slo = {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms,
           "percentile": args.slo_percentile}
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sim-plan.json").write_text(json.dumps(
        {"rate": args.rate, "slo": slo, "best": asdict(best) if best else None,
         "tried": [asdict(c) for c in tried]}, indent=2))
    print(planner.format_plan(best, tried, args.slo_percentile, slo))
    return 0 if best is not None else 1


def dispatch(args: argparse.Namespace) -> int:
    """`tokenmill simulate` with no subcommand simulates; its subcommands set their own func."""
    return main_simulate(args)
