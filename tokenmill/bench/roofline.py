"""`tokenmill bench roofline`: how far a decode step is from this machine's limits.

It measures the ceilings on the machine it runs on (read bandwidth: a sum
over a large tensor; matmul rate: the model's own projection shapes at the
batch size), then times a real decode step through the public API:

    t_decode = (time of the last token - time of the first token) / K

for B requests of context ~L that all prefill in one step, then decode K steps
together (RequestOutput.metrics; the better of two runs).
The roofline of one step is max(bytes / bandwidth, FLOPs / matmul rate), with
bytes = all weights once + the K/V of every request's context (a decode step
only reads them, so the bandwidth is the read bandwidth: a sum over 1 GiB),
and FLOPs = 2 * parameters * B + attention (4 * B * L * heads * head_dim per
layer). The matmul rate is the best that torch's matmul or tokenmill's packed
kernel reaches on the model's projection shapes at batch B with the weights
in cache, so the roofline is a ceiling no step can beat on this machine.

The no-overlap bound is the limit of a step that runs its two phases one
after the other, each at its own ceiling: the projections (max(weight bytes /
bandwidth, their FLOPs / matmul rate)) and then attention (max(K/V bytes /
bandwidth, its FLOPs / matmul rate)). A step under it must overlap attention's
reads with the projections' arithmetic; tokenmill's CPU step does not (on two
cores without SMT, prefetching the next layer's K/V during the projections
made steps slower: docs/perf-notes.md), so there this bound, not the roofline,
is what the step can approach. A shared VM's speed moves from minute to
minute, so the ceilings and the steps are measured back to back, each ceiling
before and after a batch's steps, the higher kept.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from tokenmill.bench.throughput import positive_ints


@dataclass
class Ceilings:
    bandwidth_gb_s: float  # read bandwidth, the one a decode step's bytes meet
    copy_bandwidth_gb_s: float  # read + write of a copy, for reference
    matmul_gflop_s: dict[int, float]  # per batch size, over the model's projection shapes


@dataclass
class RooflineRow:
    batch: int
    context: int
    dtype: str
    step_ms: float
    roofline_ms: float
    ratio: float  # step / roofline; 1.0 is the machine's limit
    bound: str  # "memory" or "compute"
    bytes_mb: float
    gflop: float
    # Projections then attention, each at its ceiling (the module's docstring);
    # NaN in files written before it was reported.
    no_overlap_ms: float = float("nan")
    no_overlap_ratio: float = float("nan")  # step / no_overlap


def measure_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Copy bandwidth: (read + write) bytes per second of a large tensor copy."""
    import torch

    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t)
    return 2 * num_bytes / best / 1e9  # read + write


def measure_read_bandwidth(num_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """Read bandwidth: bytes per second of a sum over a large tensor (all threads)."""
    import torch

    src = torch.ones(num_bytes // 4, dtype=torch.float32)
    src.sum()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        src.sum()
        best = min(best, time.perf_counter() - t)
    return num_bytes / best / 1e9


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    p.add_argument("--batches", default="64,128", type=positive_ints)
    p.add_argument("--context", type=int, default=256, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=16, help="decode steps timed (K)")
    p.add_argument("--output-dir", default="bench-results")


def main_roofline(args: argparse.Namespace) -> int:
    import torch

    from tokenmill import LLM, SamplingParams

    dtype = getattr(torch, args.dtype)
    max_batch = max(int(b) for b in args.batches.split(","))
    # Every prompt prefilled in one step, so all requests decode together from then on.
    llm = LLM(args.model, dtype=args.dtype, quantization="none", max_num_seqs=max_batch,
              max_num_batched_tokens=max(8192, max_batch * args.context),
              enable_prefix_caching=False)
    info = llm.model_info()
    q_out = info["num_heads"] * info["head_dim"]
    copy_bandwidth = measure_bandwidth()
    bandwidth = measure_read_bandwidth()
    element = torch.empty((), dtype=dtype).element_size()
    ctx = args.context + args.steps // 2  # mean context over the timed steps
    step_seconds: dict[int, float] = {}
    rates: dict[int, float] = {}
    for batch in (int(b) for b in args.batches.split(",")):
        rate = llm.matmul_rate(batch)
        prompts = [{"prompt_token_ids": [100 + (i * 7 + j) % 40000 for j in range(args.context)]}
                   for i in range(batch)]

        def decode_step_s(steps: int, prompts: list[dict[str, list[int]]] = prompts) -> float:
            """Mean time of `steps` decode steps of the whole batch: from the step
            that gave every request its first token to the one that gave the last."""
            params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
            outs = llm.generate(prompts, params, use_tqdm=False)
            metrics = [o.metrics for o in outs if o.metrics is not None]
            first = [m.first_token_time for m in metrics if m.first_token_time is not None]
            last = [m.last_token_time for m in metrics if m.last_token_time is not None]
            if len(first) != len(prompts) or len(last) != len(prompts):
                raise RuntimeError("requests came back without token times")
            return (max(last) - max(first)) / steps

        decode_step_s(2)  # warm-up
        step_seconds[batch] = min(decode_step_s(args.steps) for _ in range(2))
        # Measured again after the steps, the better kept: a ceiling is the best
        # the machine shows, and a slow spell while measuring only lowers it.
        rate = rates[batch] = max(rate, llm.matmul_rate(batch))
        bandwidth = max(bandwidth, measure_read_bandwidth())
        print(f"batch {batch}: matmul {rate:.0f} GFLOP/s", file=sys.stderr)
    rows = [make_row(batch, ctx, args.dtype, step_s, info["num_params"] * element,
                     batch * ctx * info["kv_bytes_per_token"] * element,
                     2.0 * info["num_params"] * batch, 4.0 * batch * ctx * q_out * info["num_layers"],
                     bandwidth, rates[batch])
            for batch, step_s in step_seconds.items()]  # (with the final bandwidth ceiling)
    ceilings = Ceilings(bandwidth_gb_s=bandwidth, copy_bandwidth_gb_s=copy_bandwidth,
                        matmul_gflop_s=rates)
    print(format_table(ceilings, rows))
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"roofline-{args.dtype}.json").write_text(
        json.dumps({"ceilings": asdict(ceilings), "rows": [asdict(r) for r in rows]}, indent=2))
    return 0


def make_row(batch: int, context: int, dtype: str, step_s: float, weight_bytes: float,
             kv_bytes: float, proj_flop: float, attn_flop: float, bandwidth_gb_s: float,
             rate_gflop_s: float) -> RooflineRow:
    """A step of `step_s` seconds against the ceilings: the roofline and the no-overlap bound."""
    t_mem = (weight_bytes + kv_bytes) / (bandwidth_gb_s * 1e9)
    t_cmp = (proj_flop + attn_flop) / (rate_gflop_s * 1e9)
    roof = max(t_mem, t_cmp)
    serial = no_overlap_s(weight_bytes, kv_bytes, proj_flop, attn_flop, bandwidth_gb_s, rate_gflop_s)
    return RooflineRow(batch=batch, context=context, dtype=dtype, step_ms=step_s * 1e3,
                       roofline_ms=roof * 1e3, ratio=step_s / roof,
                       bound="memory" if t_mem >= t_cmp else "compute",
                       bytes_mb=(weight_bytes + kv_bytes) / 1e6,
                       gflop=(proj_flop + attn_flop) / 1e9,
                       no_overlap_ms=serial * 1e3, no_overlap_ratio=step_s / serial)


def no_overlap_s(weight_bytes: float, kv_bytes: float, proj_flop: float, attn_flop: float,
                 bandwidth_gb_s: float, rate_gflop_s: float) -> float:
    """Seconds of a step whose projections and attention run one after the
    other, each at its ceiling (bytes / bandwidth or FLOPs / rate, the larger)."""
    bw, rate = bandwidth_gb_s * 1e9, rate_gflop_s * 1e9
    return max(weight_bytes / bw, proj_flop / rate) + max(kv_bytes / bw, attn_flop / rate)


def format_table(ceilings: Ceilings, rows: list[RooflineRow]) -> str:
    rates = ", ".join(f"batch {b}: {r:.0f}" for b, r in ceilings.matmul_gflop_s.items())
    lines = [
        f"Ceilings measured here: read bandwidth {ceilings.bandwidth_gb_s:.1f} GB/s (copy "
        f"{ceilings.copy_bandwidth_gb_s:.1f} GB/s read + write); {rows[0].dtype if rows else ''} "
        f"matmul at the model's shapes (the faster of torch and the packed kernel), GFLOP/s: {rates}.",
        "",
        "| batch | context | dtype | decode step ms | roofline ms | step / roofline | bound | "
        "bytes MB | GFLOP | no-overlap ms | step / no-overlap |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        serial = ("- | -" if math.isnan(r.no_overlap_ms)
                  else f"{r.no_overlap_ms:.1f} ({r.no_overlap_ms / r.roofline_ms:.2f}x roofline) | "
                       f"{r.no_overlap_ratio:.2f}x")
        lines.append(f"| {r.batch} | {r.context} | {r.dtype} | {r.step_ms:.1f} | "
                     f"{r.roofline_ms:.1f} | {r.ratio:.2f}x | {r.bound} | {r.bytes_mb:.0f} | "
                     f"{r.gflop:.1f} | {serial} |")
    return "\n".join(lines)


def load_results(path: Path) -> tuple[Ceilings, list[RooflineRow]]:
    data = json.loads(path.read_text())
    c = data["ceilings"]
    ceilings = Ceilings(bandwidth_gb_s=c["bandwidth_gb_s"],
                        copy_bandwidth_gb_s=c.get("copy_bandwidth_gb_s", float("nan")),
                        matmul_gflop_s={int(k): v for k, v in c["matmul_gflop_s"].items()})
    return ceilings, [RooflineRow(**r) for r in data["rows"]]
