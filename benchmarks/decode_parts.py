"""Where a small decode step's time goes outside the weight GEMMs (issue 34).

    PYTHONPATH=. python benchmarks/decode_parts.py [--model M] [--batches 1,4] [--quantization q8_0] [--context 256]

B requests of throughput-A's 128-token prompts decode (greedy) until the
context reaches --context; the last decode step's inputs are kept and each
part is timed alone on them (median of --reps calls, ms):

  step          LLMEngine.step() (the decode steps of the run)
  prepare       ModelRunner._prepare_inputs on the step's requests
  forward       the plan's forward (embedding, the layer loop)
  layer_loop    the C++ layer loop alone
  gemms         the 120 projections in layer order, called one by one from
                Python on the plan's packed weights (as layer_loop calls them)
  head          compute_logits
  rest          layer_loop - gemms: attention, norms, RoPE + K/V writes,
                residual adds, OpenMP forks, allocations (the Python loop's
                per-call cost is in `gemms`, so `rest` is a lower bound)

--perf: loop the layer loop for --seconds under `perf record` from outside
(the script only prints its pid and loops; see docs/perf-notes/py.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch


def median_ms(f: Callable[[], Any], reps: int) -> float:
    f()
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def parts(plan: Any, runner: Any, captured: dict[str, Any], orig_prepare: Callable[..., Any],
          steps: list[float], batch: int, args: argparse.Namespace) -> None:
    """Times each part of the captured decode step alone (or loops it for perf)."""
    input_ids, positions, meta, _ = captured["inputs"]
    kv = runner.kv_caches
    hidden0 = plan.embed(input_ids)

    call = plan.attention.kernel_call(hidden0, kv[0], meta)
    assert call is not None

    def loop() -> torch.Tensor:  # dispatch.Path.LOOP's call
        return plan.ops.layer_loop(plan.weights, hidden0.clone(), positions, kv, meta.slot_mapping, call.tables,
                                   call.seq_lens, call.seq_ids, torch.empty(0, dtype=torch.int64), True,
                                   kv_prefetch=plan.kv_prefetch)

    if args.perf:
        print(f"pid {os.getpid()} looping the layer loop at B={batch}", flush=True)
        end = time.perf_counter() + args.seconds
        with torch.inference_mode():
            while time.perf_counter() < end:
                loop()
        return
    ops = plan.ops
    hidden, inter = plan.layers[0].norm1.numel(), plan.layers[0].down.k
    xs = {k: torch.zeros(batch, k, dtype=torch.bfloat16) for k in (hidden, plan.q_size, inter)}

    def gemms() -> None:
        for lay in plan.layers:
            ops.packed_gemm(xs[hidden], lay.qkv, False)
            ops.packed_gemm(xs[plan.q_size], lay.o, False)
            a = ops.packed_gemm_silu(xs[hidden], lay.gate_up)
            ops.packed_gemm(a, lay.down, False)

    empty = {k: x[:0] for k, x in xs.items()}

    def null_calls() -> None:  # the Python + pybind cost of gemms' calls: the same calls on no rows
        for lay in plan.layers:
            ops.packed_gemm(empty[hidden], lay.qkv, False)
            ops.packed_gemm(empty[plan.q_size], lay.o, False)
            ops.packed_gemm_silu(empty[hidden], lay.gate_up)
            ops.packed_gemm(empty[inter], lay.down, False)

    with torch.inference_mode():
        res = {
            "step": statistics.median(steps[3:]) * 1e3,
            "prepare": median_ms(lambda: orig_prepare(captured["reqs"]), args.reps),
            "embed": median_ms(lambda: plan.embed(input_ids), args.reps),
            "forward": median_ms(lambda: plan(input_ids, positions, kv, meta), args.reps),
            "layer_loop": median_ms(loop, args.reps),
            "gemms": median_ms(gemms, args.reps),
            "null_calls": median_ms(null_calls, args.reps),
            "head": median_ms(lambda: plan.compute_logits(hidden0), args.reps),
        }
    res["rest"] = res["layer_loop"] - (res["gemms"] - res["null_calls"])
    print(f"B={batch} context {meta.seq_lens[0]} ({args.quantization}): "
          + " ".join(f"{k} {v:.3f}" for k, v in res.items()), flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batches", default="1,4")
    ap.add_argument("--model", default=None, help="a GGUF file or HF directory (default: the default model)")
    ap.add_argument("--quantization", default="none")
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--perf", action="store_true")
    ap.add_argument("--seconds", type=float, default=10.0)
    args = ap.parse_args()

    from tokenmill import LLM, SamplingParams
    from tokenmill.backends.cpu.plan import CpuPlan
    from tokenmill.bench.workloads import throughput_a

    llm = LLM(args.model, dtype="bfloat16", quantization=args.quantization)
    eng = llm.engine
    runner = eng.runner
    plan = runner.forward
    assert isinstance(plan, CpuPlan), "the CPU plan serves the model"
    prompts = throughput_a(128).prompts
    captured: dict[str, Any] = {}
    orig_prepare = runner._prepare_inputs

    def prepare(reqs: list[Any]) -> Any:
        out = orig_prepare(reqs)
        captured["reqs"], captured["inputs"] = reqs, out
        return out

    runner._prepare_inputs = prepare  # type: ignore[method-assign]
    for batch in [int(b) for b in args.batches.split(",")]:
        params = SamplingParams(max_tokens=args.context - 127, ignore_eos=True, temperature=0.0)
        for i in range(batch):
            eng.add_request(f"{time.monotonic_ns()}-{i}", {"prompt_token_ids": prompts[i][:128]}, params)
        steps = []
        while True:
            t = time.perf_counter()
            result = eng.step()
            dt = time.perf_counter() - t
            if result.stats.num_scheduled_tokens == batch == result.stats.num_scheduled_reqs:
                steps.append(dt)
            reqs = captured["reqs"]
            if reqs[0].num_computed_tokens + 2 >= args.context:
                break
        parts(plan, runner, captured, orig_prepare, steps, batch, args)
        while eng.has_unfinished_requests():
            eng.step()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
