"""Each real step of one throughput-A run beside the simulator's price for it.

    python benchmarks/step_prices.py POLICY CAP COST.json [--reserve cap|exact]

Runs the study's engine settings (512 KV blocks, max_num_seqs 32, bf16) step by
step, as `simulate calibrate` times steps, and prints measured and predicted
seconds per kind of step (prefill / decode, with or without static padding):
where the cost model misprices a configuration, this says which steps.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path

from tokenmill import LLM, SamplingParams
from tokenmill.bench.throughput import RESERVES, engine_options
from tokenmill.bench.workloads import throughput_a
from tokenmill.sim.cost_model import CostModel, StepShape


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("policy")
    p.add_argument("cap", type=int)
    p.add_argument("cost_model")
    p.add_argument("--reserve", default="cap", choices=RESERVES)
    p.add_argument("--dump", default=None, help="write every step's shape and seconds here (JSON)")
    args = p.parse_args()
    cost = CostModel.load(args.cost_model)
    w = throughput_a(args.cap)
    llm = LLM(None, dtype="bfloat16", quantization="none", max_num_seqs=32,
              max_num_batched_tokens=2048, num_kv_blocks=512,
              **engine_options(args.policy, args.cap, args.reserve))
    warm = [[(i * 131 + j) % 90 + 1 for j in range(128)] for i in range(4)]
    llm.generate([{"prompt_token_ids": q} for q in warm],
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    engine = llm.engine
    for prompt, n in zip(w.prompts, w.output_lens, strict=True):
        engine.add_request(engine.new_request_id(), {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
    groups: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])
    steps: list[dict[str, object]] = []
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        step = engine.schedule()
        result = engine.execute(step)
        elapsed = time.perf_counter() - t
        out = step.scheduler_output
        if not out.scheduled:
            continue
        num_out = sum(1 for o in result.outputs if o.outputs and o.outputs[0].token_ids)
        shape = StepShape.of(out, num_out)
        kind = ("prefill" if shape.num_tokens > shape.num_rows else "decode") + (
            "+padding" if num_out < shape.num_sampled_rows else "")
        steps.append({**asdict(shape), "seconds": elapsed})
        g = groups[kind]
        g[0] += 1
        g[1] += elapsed
        g[2] += cost.step_s(shape)
    wall = time.perf_counter() - start
    if args.dump:
        Path(args.dump).write_text(json.dumps(steps) + "\n")
    print(f"{args.policy} CAP {args.cap}: {wall:.1f} s, {w.num_output_tokens / wall:.1f} gen tok/s")
    for kind, (n, measured, predicted) in sorted(groups.items()):
        print(f"  {kind:16s} {int(n):5d} steps  measured {measured:7.2f} s  predicted "
              f"{predicted:7.2f} s  predicted / measured {predicted / measured:.3f}")


if __name__ == "__main__":
    main()
