"""A simulated run in the shapes `tokenmill bench` reports (bench/throughput.py,
bench/serve.py), so predictions and measurements print and plot alike, plus a
timeline (batch size, queue, KV usage, preemptions over simulated time)."""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

from tokenmill.bench.serve import RateReport, RequestResult, build_report
from tokenmill.bench.throughput import ThroughputRow
from tokenmill.sim.simulator import SimResult


def throughput_row(result: SimResult, policy: str, cap: int, dtype: str) -> ThroughputRow:
    """bench throughput's row: the wall time from the first submit to the last completion."""
    wall = result.wall_s
    generated = result.num_output_tokens
    prompt = sum(r.prompt_tokens for r in result.requests)
    return ThroughputRow(
        policy=policy, cap=cap, dtype=dtype, num_requests=len(result.requests),
        prompt_tokens=prompt, generated_tokens=generated, wall_s=wall,
        generated_tok_s=generated / wall, total_tok_s=(generated + prompt) / wall,
        computed_tokens=result.num_computed_tokens, mean_batch_size=result.mean_batch_size,
        num_steps=len(result.steps), num_preemptions=result.num_preemptions,
        peak_rss_mib=float("nan"), settings={"simulated": True})


def request_results(result: SimResult) -> list[RequestResult]:
    """bench serve's per-request timings: TTFT, e2e (to the last token) and the gaps."""
    out = []
    for r in result.requests:
        times = r.token_times_s
        if not times:
            out.append(RequestResult(ok=False, prompt_tokens=r.prompt_tokens, error="no tokens"))
            continue
        out.append(RequestResult(
            ok=True, prompt_tokens=r.prompt_tokens, output_tokens=len(times),
            ttft_s=times[0] - r.arrival_s, e2e_s=times[-1] - r.arrival_s,
            itl_s=[b - a for a, b in itertools.pairwise(times)]))
    return out


def rate_report(result: SimResult, rate: float, slo_ttft_ms: float | None = None,
                slo_tpot_ms: float | None = None) -> RateReport:
    """bench serve's report: the duration is first send to last token, as its client sees it."""
    return build_report(rate, request_results(result), result.wall_s, slo_ttft_ms, slo_tpot_ms)


def timeline(result: SimResult, max_points: int = 300) -> dict[str, Any]:
    """The per-step series (every k-th step past `max_points`), for the JSON."""
    every = max(1, len(result.steps) // max_points)
    steps = result.steps[::every]
    return {
        "every_kth_step": every,
        "end_s": [round(s.end_s, 6) for s in steps],
        "num_rows": [s.num_rows for s in steps],
        "num_tokens": [s.num_tokens for s in steps],
        "num_waiting": [s.num_waiting for s in steps],
        "kv_cache_usage": [round(s.kv_cache_usage, 4) for s in steps],
        "preemption_times_s": [round(s.end_s, 6) for s in result.steps if s.num_preempted],
    }


def plot_timeline(result: SimResult, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t = [s.end_s for s in result.steps]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(9, 5.5), sharex=True)
    ax1.step(t, [s.num_rows for s in result.steps], where="pre", label="requests in the step")
    ax1.step(t, [s.num_waiting for s in result.steps], where="pre", label="waiting")
    ax1.set_ylabel("requests")
    ax1.legend(loc="upper right")
    ax1.grid(True, alpha=0.3)
    ax2.step(t, [100 * s.kv_cache_usage for s in result.steps], where="pre", color="tab:green")
    for s in result.steps:
        if s.num_preempted:
            ax2.axvline(s.end_s, color="tab:red", alpha=0.4)
    ax2.set_ylabel("KV blocks in use (%)\n(red: preemptions)")
    ax2.set_xlabel("simulated time (s)")
    ax2.set_ylim(0, 100)
    ax2.grid(True, alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
