"""`tokenmill bench throughput`: the static-vs-continuous batching study.

Every (policy, cap) run happens in a fresh subprocess, so peak memory is its
own and nothing (allocator state, caches) leaks between runs; the model load
and a short warm-up are excluded from the timed part. All policies share the
same max_num_seqs (default 32, the static baseline's batch size).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.bench import extras
from tokenmill.bench.workloads import Workload, throughput_a

# The engine options of each configuration. "+reserved": KV memory reserved for a
# request's whole prompt + max_tokens at admission (the systems before paging).
POLICIES: dict[str, dict[str, Any]] = {
    "static": {"scheduling_policy": "static", "enable_prefix_caching": False,
               "kv_allocation": "paged"},
    "continuous": {"scheduling_policy": "fcfs", "enable_prefix_caching": False,
                   "kv_allocation": "paged"},
    "continuous+prefix": {"scheduling_policy": "fcfs", "enable_prefix_caching": True,
                          "kv_allocation": "paged"},
    "static+reserved": {"scheduling_policy": "static", "enable_prefix_caching": False,
                        "kv_allocation": "reserved"},
    "continuous+reserved": {"scheduling_policy": "fcfs", "enable_prefix_caching": False,
                            "kv_allocation": "reserved"},
}
# What a "+reserved" configuration reserves for a request's output: "cap", the
# workload's cap (a server that cannot know an answer's length holds room for the
# longest it allows, as the seed's systems did: the vLLM paper's "Max"), or
# "exact", the request's own max_tokens, its drawn length (the paper's "Oracle").
RESERVES = ("cap", "exact")


def engine_options(policy: str, cap: int, reserve: str) -> dict[str, Any]:
    """The engine options of `policy` on throughput-A at `cap` (EngineArgs' names)."""
    if reserve not in RESERVES:
        raise ValueError(f"reserve={reserve!r}: choose from {RESERVES}")
    opts = dict(POLICIES[policy])
    if opts["kv_allocation"] == "reserved" and reserve == "cap":
        opts["kv_reserve_output_tokens"] = cap
    return opts


# `bench throughput`'s default: the scheduling study on paged memory.
DEFAULT_POLICIES = "static,continuous,continuous+prefix"
# The seed's baseline: static batching on memory reserved per request (the HF pipeline).
NAIVE_STATIC = "static+reserved"


def baseline_policy(policies: list[str]) -> str:
    """The configuration every ratio is taken against: naive static where the rows
    have it (`bench study`), else static on paged memory (`bench throughput`)."""
    return NAIVE_STATIC if NAIVE_STATIC in policies else "static"


@dataclass
class ThroughputRow:
    policy: str
    cap: int
    dtype: str
    num_requests: int
    prompt_tokens: int
    generated_tokens: int
    wall_s: float
    generated_tok_s: float
    total_tok_s: float
    computed_tokens: int  # tokens run through the model (static padding, recomputes included)
    mean_batch_size: float
    num_steps: int
    num_preemptions: int
    peak_rss_mib: float
    ratio_vs_static: float | None = None
    # The KV pool's mean fraction over steps: holding tokens, and held (those plus
    # reservations not filled yet); None where not measured (peers).
    mean_kv_used: float | None = None
    mean_kv_held: float | None = None
    num_kv_blocks: int | None = None  # the pool, where the run set it
    kv_reserve_output_tokens: int | None = None  # what a reserving run reserved per output
    # What a peer ran with that the columns do not say (environment variables,
    # scheduler limits, how peak RSS was measured); empty for tokenmill's rows.
    settings: dict[str, Any] = field(default_factory=dict)
    # The speed reference's seconds around this run (reference_speed of the runs
    # timed before and after it), where timed; and each side's median, apart.
    reference_s: float | None = None
    reference_before_s: float | None = None
    reference_after_s: float | None = None


# A fixed reference timed right before and after a study run, and in the
# simulator's calibration: how fast the machine is that minute, since this VM
# drifts 10-40% between minutes, more than the simulator's 10% (docs/WORKLOADS.md
# "study"). A batch of continuous-batching prefill and decode steps, the shapes
# the workload's steps have, on an engine of its own: the run's own engine
# (static, reserved) would schedule it differently.
REFERENCE_REQUESTS, REFERENCE_PROMPT_TOKENS, REFERENCE_OUTPUT_TOKENS = 16, 32, 32
REFERENCE_REPEATS = 5


def reference_engine(model: str | None, dtype: str, quantization: str = "none") -> Any:
    from tokenmill import LLM

    return LLM(model, dtype=dtype, quantization=quantization, max_num_seqs=32,
               max_num_batched_tokens=2048, enable_prefix_caching=False, num_kv_blocks=512,
               skip_tokenizer_init=True)  # token ids in and out: any model times alike


def reference_speed(before: list[float], after: list[float]) -> float:
    """The reference's seconds for a run or a fit: the median of every run timed
    before and after it (one slow run on either side moves it little; the last
    study's misses were single slow references)."""
    import statistics

    return statistics.median(before + after)


def time_reference(llm: Any) -> list[float]:
    """The seconds of REFERENCE_REPEATS runs of the reference batch on `llm`
    (reference_engine), after one untimed run."""
    from tokenmill import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=REFERENCE_OUTPUT_TOKENS, ignore_eos=True)
    vocab = min(llm.model_info()["vocab_size"], 30000)
    times = []
    for r in range(REFERENCE_REPEATS + 1):
        prompts = [{"prompt_token_ids": [3 + (r * 7919 + i * 131 + j * 17) % (vocab - 3)
                                         for j in range(REFERENCE_PROMPT_TOKENS)]}
                   for i in range(REFERENCE_REQUESTS)]
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        times.append(time.perf_counter() - start)
    return times[1:]


def run_one(model: str | None, policy: str, cap: int, dtype: str, max_num_seqs: int,
            max_num_batched_tokens: int, device: str = "cpu",
            num_kv_blocks: int | None = None, reserve: str = "cap",
            reference: bool = False) -> ThroughputRow:
    """One timed run in this process (num_kv_blocks None: the engine's default pool;
    `reference`: time_reference before and after it, reference_speed kept)."""
    from tokenmill import LLM, SamplingParams

    workload: Workload = throughput_a(cap)
    ref = reference_engine(model, dtype) if reference else None
    before = time_reference(ref) if ref is not None else []
    opts = engine_options(policy, cap, reserve)
    llm = LLM(model, dtype=dtype, quantization="none", device=device, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=max_num_batched_tokens, num_kv_blocks=num_kv_blocks, **opts)
    # Warm-up: first-call costs (thread pools, allocator) stay out of the timing. Its
    # prompts share no block with the workload's, so the prefix cache gains nothing.
    warmup = [[(i * 131 + j) % 90 + 1 for j in range(128)] for i in range(4)]
    llm.generate([{"prompt_token_ids": p} for p in warmup],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in workload.output_lens]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=True)
    wall = time.perf_counter() - start
    generated = sum(len(o.outputs[0].token_ids) for o in outputs)
    if generated != workload.num_output_tokens:
        raise RuntimeError(f"generated {generated} tokens, the workload asks {workload.num_output_tokens}")
    stats = llm.last_generate_stats
    row = make_row(policy, cap, dtype, workload, wall, stats.num_computed_tokens,
                   stats.mean_batch_size, stats.num_steps, stats.num_preemptions)
    row.mean_kv_used, row.mean_kv_held = stats.mean_kv_used, stats.mean_kv_held
    row.num_kv_blocks = num_kv_blocks
    row.kv_reserve_output_tokens = opts.get("kv_reserve_output_tokens")
    if ref is not None:
        import statistics

        after = time_reference(ref)
        row.reference_s = reference_speed(before, after)
        row.reference_before_s, row.reference_after_s = statistics.median(before), statistics.median(after)
    if device != "cpu":
        import torch

        # Peak RSS is the host's; the GPU's own peak is what the allocator held.
        row.settings = {"device": device,
                        "peak_gpu_mib": round(torch.cuda.max_memory_reserved() / 2**20)}
    return row


def make_row(policy: str, cap: int, dtype: str, workload: Workload, wall: float, computed: int,
             mean_batch_size: float, num_steps: int, num_preemptions: int) -> ThroughputRow:
    """A row for a run that delivered the whole workload in `wall` seconds;
    peak RSS is this process's."""
    generated = workload.num_output_tokens
    return ThroughputRow(
        policy=policy, cap=cap, dtype=dtype, num_requests=len(workload.prompts),
        prompt_tokens=workload.num_prompt_tokens, generated_tokens=generated, wall_s=wall,
        generated_tok_s=generated / wall,
        total_tok_s=(generated + workload.num_prompt_tokens) / wall,
        computed_tokens=computed, mean_batch_size=mean_batch_size, num_steps=num_steps,
        num_preemptions=num_preemptions,
        peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    )


# The parts of a step, in order (GenerateStats.phase_s; torch.profiler labels "tokenmill::NAME").
STEP_PHASES = ("schedule", "prepare_inputs", "forward", "head", "sample", "update", "detokenize")


def profile_one(args: argparse.Namespace) -> int:
    """One continuous-batching run of the first CAP, timed part by part on the
    path timed runs take (scheduling, input building, forward, the head,
    sampling, the scheduler's update, detokenizing: GenerateStats.phase_s), then
    the same run under torch.profiler for the forward's split between
    attention and linear layers (under the profiler the model runs its per-op
    path, not the C++ layer stack, so that split is the per-op path's)."""
    from torch.profiler import ProfilerActivity, profile

    from tokenmill import LLM, SamplingParams

    cap = int(args.caps.split(",")[0])
    workload = throughput_a(cap)
    llm = LLM(args.model, dtype=args.dtype, quantization="none", device=getattr(args, "device", "cpu"),
              max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, enable_prefix_caching=False)
    prompts = [{"prompt_token_ids": p} for p in workload.prompts]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in workload.output_lens]
    llm.generate(prompts[:4], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                 use_tqdm=False)
    llm.generate(prompts, params, use_tqdm=False)
    stats = llm.last_generate_stats
    steps, wall = max(stats.num_steps, 1), stats.wall_time_s
    print(f"continuous, cap {cap}, {args.dtype}: {wall:.1f} s wall, {stats.num_steps} steps, "
          f"{stats.mean_batch_size:.1f} requests a step")
    print("| part | total ms | ms / step | % of wall |")
    print("|---|---|---|---|")
    for name in (*STEP_PHASES, "other"):
        seconds = (stats.phase_s.get(name, 0.0) if name != "other"
                   else wall - sum(stats.phase_s.values()))  # between the parts, outside step()
        print(f"| {name} | {seconds * 1e3:.0f} | {seconds * 1e3 / steps:.2f} | "
              f"{100 * seconds / max(wall, 1e-9):.1f} |")

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
    totals = {e.key: e.cpu_time_total / 1e3 for e in prof.key_averages()}
    forward = totals.get("tokenmill::forward", 0.0)
    print(f"\nThe same run under torch.profiler ({llm.last_generate_stats.wall_time_s:.1f} s wall): "
          f"the per-op path's forward {forward / steps:.2f} ms a step, of which")
    for name in ("attention", "linear"):
        ms = totals.get(f"tokenmill::{name}", 0.0)
        print(f"  {name}: {ms / steps:.2f} ms a step ({100 * ms / max(forward, 1e-9):.0f}% of it)")
    return 0


def one_run_command(args: argparse.Namespace, policy: str, cap: int) -> list[str]:
    """The command of one timed run; `args` may come from `bench throughput`,
    `bench peers` or `bench all` (only the first has --device)."""
    cmd = [sys.executable, "-m", "tokenmill.bench.throughput", "--one",
           "--policy", policy, "--cap", str(cap), "--dtype", args.dtype,
           "--max-num-seqs", str(args.max_num_seqs),
           "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--device", getattr(args, "device", "cpu"),
           "--reserve", getattr(args, "reserve", "cap")]
    if getattr(args, "time_reference", False):
        cmd.append("--time-reference")
    if args.model:
        cmd += ["--model", args.model]
    if getattr(args, "num_kv_blocks", None):
        cmd += ["--num-kv-blocks", str(args.num_kv_blocks)]
    return cmd


def run_in_subprocess(args: argparse.Namespace, policy: str, cap: int) -> ThroughputRow:
    cmd = one_run_command(args, policy, cap)
    print(f"== {policy}, cap {cap}, {args.dtype}", file=sys.stderr, flush=True)
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"the run {policy}/cap {cap} failed (exit {proc.returncode})")
    return ThroughputRow(**json.loads(proc.stdout.strip().splitlines()[-1]))


def format_table(rows: list[ThroughputRow]) -> str:
    head = ("| policy | cap | dtype | wall s | gen tok/s | total tok/s | vs static | "
            "computed / delivered tokens | mean batch | preemptions | peak RSS MiB |")
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        ratio = f"{r.ratio_vs_static:.2f}x" if r.ratio_vs_static else "-"
        delivered = r.prompt_tokens + r.generated_tokens
        dtype = r.dtype if "device" not in r.settings else f"{r.dtype} ({r.settings['device']})"
        lines.append(
            f"| {r.policy} | {r.cap} | {dtype} | {r.wall_s:.1f} | {r.generated_tok_s:.1f} | "
            f"{r.total_tok_s:.1f} | {ratio} | {r.computed_tokens} / {delivered} | "
            f"{r.mean_batch_size:.1f} | {r.num_preemptions} | {r.peak_rss_mib:.0f} |"
        )
    return "\n".join(lines)


def plot(rows: list[ThroughputRow], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for policy in dict.fromkeys(r.policy for r in rows):
        pts = sorted((r.cap, r.generated_tok_s) for r in rows if r.policy == policy)
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=policy)
    ax.set_xscale("log", base=2)
    caps = sorted({r.cap for r in rows})
    ax.set_xticks(caps, [str(c) for c in caps])
    ax.set_xlabel("max output tokens (CAP): higher = more variance in output length")
    ax.set_ylabel("generated tokens / s")
    ax.set_title(f"throughput-A, {rows[0].num_requests} requests, {rows[0].dtype}")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


BENCH_DTYPES = ("bfloat16", "float32", "float16", "auto")  # float16: CUDA only


def positive_ints(text: str) -> str:
    """An argparse type: comma-separated positive integers ("32,128"), kept as given."""
    try:
        ok = all(int(x) >= 1 for x in text.split(","))
    except ValueError:
        ok = False
    if not ok:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {text!r}")
    return text


def add_reserve_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reserve", default="cap", choices=RESERVES,
                   help="what the +reserved configurations reserve for a request's output: the "
                        "workload's cap (the seed's systems) or its own drawn length (exact)")


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--workload", default="throughput-A", choices=["throughput-A"])
    p.add_argument("--caps", default="32,128,512", type=positive_ints)
    p.add_argument("--policies", default=DEFAULT_POLICIES, help=f"of {', '.join(POLICIES)}")
    p.add_argument("--dtype", default="bfloat16", choices=BENCH_DTYPES)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--max-num-seqs", type=int, default=32)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--output-dir", default="bench-results")
    add_reserve_arg(p)
    p.add_argument("--profile", action="store_true",
                   help="profile one continuous run of the first CAP instead (time per part)")


def main_throughput(args: argparse.Namespace) -> int:
    extras.require("matplotlib")
    if getattr(args, "profile", False):
        return profile_one(args)
    caps = [int(c) for c in args.caps.split(",")]
    policies = args.policies.split(",")
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policies {unknown}; choose from {list(POLICIES)}")
    rows = [run_in_subprocess(args, policy, cap) for cap in caps for policy in policies]
    baseline = baseline_policy(policies)
    for r in rows:
        base = next((b for b in rows if b.policy == baseline and b.cap == r.cap), None)
        if base is not None:
            r.ratio_vs_static = r.generated_tok_s / base.generated_tok_s
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    device = getattr(args, "device", "cpu")
    stem = f"throughput-{args.dtype}" + ("" if device == "cpu" else f"-{device}")
    (out / f"{stem}.json").write_text(json.dumps([asdict(r) for r in rows], indent=2))
    plot(rows, out / f"{stem}.png")
    print(format_table(rows))
    print(f"\nwrote {out / stem}.json and .png")
    return 0


def _main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    add_args(p)
    p.add_argument("--one", action="store_true", help="(internal) one timed run, JSON on stdout")
    p.add_argument("--policy", default="continuous")
    p.add_argument("--cap", type=int, default=128)
    p.add_argument("--num-kv-blocks", type=int, default=None)
    p.add_argument("--time-reference", action="store_true",
                   help="(internal) time the speed reference before and after the run")
    args = p.parse_args()
    if args.one:
        os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
        row = run_one(args.model, args.policy, args.cap, args.dtype, args.max_num_seqs,
                      args.max_num_batched_tokens, args.device, args.num_kv_blocks, args.reserve,
                      args.time_reference)
        print(json.dumps(asdict(row)))
        return 0
    return main_throughput(args)


if __name__ == "__main__":
    sys.exit(_main())
