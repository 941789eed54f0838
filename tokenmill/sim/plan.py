"""`tokenmill simulate plan`: the fewest engines, and their settings, that meet the SLOs.

Replicas are independent engines splitting the arrivals round robin (what a
plain load balancer in front of them does). For each replica count from 1 up,
every combination of max_num_seqs and token budget is simulated on the
workload at the given rate; the first count at which some setting meets both
SLOs (TTFT and TPOT at the chosen percentile, over every replica's requests)
is the answer, and among its settings the one with the most headroom (the
smallest of its larger latency / SLO ratio) is recommended.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from tokenmill.bench.serve import build_report
from tokenmill.sim.cost_model import CostModel
from tokenmill.sim.report import request_results
from tokenmill.sim.simulator import EngineSettings, SimRequest, simulate

DEFAULT_SEQS = (16, 32, 64, 128)
DEFAULT_BUDGETS = (64, 128, 160, 256, 512, 1024, 2048)


@dataclass
class Candidate:
    replicas: int
    max_num_seqs: int
    max_num_batched_tokens: int
    ttft_ms: float  # at the SLO percentile
    tpot_ms: float
    output_tok_s: float  # all replicas together
    meets_slo: bool
    headroom: float  # max(ttft / slo, tpot / slo): below 1 meets both


def evaluate(requests: Sequence[SimRequest], cost: CostModel, settings: EngineSettings,
             replicas: int, rate: float) -> tuple[dict[str, float], dict[str, float], float]:
    """TTFT and TPOT summaries (ms) and output tok/s of `replicas` engines sharing the arrivals."""
    results = []
    duration = 0.0
    for k in range(replicas):
        share = list(requests[k::replicas])
        if not share:
            continue
        sim = simulate(share, settings, cost)
        results += request_results(sim)
        duration = max(duration, max(r.finish_s for r in sim.requests))
    report = build_report(rate, results, duration - min(r.arrival_s for r in requests))
    return report.ttft_ms, report.tpot_ms, report.output_throughput


def plan(requests: Sequence[SimRequest], cost: CostModel, rate: float, slo_ttft_ms: float,
         slo_tpot_ms: float, base: EngineSettings, max_replicas: int = 8,
         seqs: Sequence[int] = DEFAULT_SEQS, budgets: Sequence[int] = DEFAULT_BUDGETS,
         percentile: str = "p99") -> tuple[Candidate | None, list[Candidate]]:
    """The recommended candidate (None: nothing up to max_replicas meets the SLOs)
    and every candidate simulated."""
    tried: list[Candidate] = []
    for replicas in range(1, max_replicas + 1):
        meeting = []
        for num_seqs in seqs:
            for budget in budgets:
                if budget < num_seqs:  # (every running request must be able to decode each step)
                    continue
                settings = EngineSettings(**{**asdict(base), "max_num_seqs": num_seqs,
                                             "max_num_batched_tokens": budget})
                ttft, tpot, tok_s = evaluate(requests, cost, settings, replicas, rate)
                headroom = max(ttft[percentile] / slo_ttft_ms, tpot[percentile] / slo_tpot_ms)
                c = Candidate(replicas, num_seqs, budget, ttft[percentile], tpot[percentile],
                              tok_s, headroom <= 1.0, headroom)
                tried.append(c)
                if c.meets_slo:
                    meeting.append(c)
        if meeting:
            return min(meeting, key=lambda c: c.headroom), tried
    return None, tried


def format_plan(best: Candidate | None, tried: list[Candidate], percentile: str,
                slo: dict[str, Any]) -> str:
    lines = [f"SLOs at {percentile}: TTFT <= {slo['ttft_ms']:g} ms, TPOT <= {slo['tpot_ms']:g} ms",
             "", "| replicas | max_num_seqs | max_num_batched_tokens | TTFT ms | TPOT ms | "
             "out tok/s | meets |", "|---|---|---|---|---|---|---|"]
    shown = sorted(tried, key=lambda c: (c.replicas, c.headroom))
    for c in shown[:12] if best is None else [c for c in shown if c.replicas == best.replicas][:12]:
        lines.append(f"| {c.replicas} | {c.max_num_seqs} | {c.max_num_batched_tokens} | "
                     f"{c.ttft_ms:.0f} | {c.tpot_ms:.1f} | {c.output_tok_s:.0f} | "
                     f"{'yes' if c.meets_slo else 'no'} |")
    lines.append("")
    if best is None:
        lines.append("No setting up to the largest replica count tried meets the SLOs.")
    else:
        lines.append(f"Cheapest: {best.replicas} replica(s) with --max-num-seqs {best.max_num_seqs} "
                     f"--max-num-batched-tokens {best.max_num_batched_tokens} (TTFT "
                     f"{best.ttft_ms:.0f} ms, TPOT {best.tpot_ms:.1f} ms at {percentile}).")
    return "\n".join(lines)
