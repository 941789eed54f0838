"""serve-B's arrivals replayed straight into LLMEngine (no HTTP): TTFT / TPOT of the engine alone and the steps around the slowest first tokens: PYTHONPATH=. .venv/bin/python benchmarks/serve_replay.py [RATE] [--budget N]."""

# Compare with `tokenmill bench serve` against the server to see what serving adds.

from __future__ import annotations

import argparse
import time

import numpy as np

from tokenmill import LLM, SamplingParams
from tokenmill.bench.workloads import throughput_a


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("rate", type=float, nargs="?", default=2.0)
    p.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    p.add_argument("--num", type=int, default=64)
    args = p.parse_args()

    workload = throughput_a(128)
    prompts, lens = workload.prompts[: args.num], workload.output_lens[: args.num]
    gaps = np.random.default_rng(2).exponential(1.0 / args.rate, size=len(prompts))
    gaps[0] = 0.0
    arrivals = np.cumsum(gaps)

    llm = LLM(dtype="bfloat16", quantization="none", max_num_seqs=128, max_num_batched_tokens=args.budget,
              enable_prefix_caching=False)
    llm.generate([{"prompt_token_ids": [7] * 128}] * 2,
                 SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)
    engine = llm.engine
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    steps: list[tuple[float, float, int, int]] = []  # start, seconds, tokens, requests
    nxt = 0
    t0 = time.perf_counter()
    while nxt < len(prompts) or engine.has_unfinished_requests():
        now = time.perf_counter() - t0
        while nxt < len(prompts) and arrivals[nxt] <= now:
            engine.add_request(str(nxt), {"prompt_token_ids": prompts[nxt]},
                               SamplingParams(temperature=0, max_tokens=lens[nxt], ignore_eos=True))
            nxt += 1
        if not engine.has_unfinished_requests():
            time.sleep(max(0.0, arrivals[nxt] - now))
            continue
        start = time.perf_counter() - t0
        result = engine.step()
        end = time.perf_counter() - t0
        steps.append((start, end - start, result.stats.num_scheduled_tokens,
                      result.stats.num_scheduled_reqs))
        for o in result.outputs:
            if o.outputs and o.outputs[0].token_ids and o.request_id not in first:
                first[o.request_id] = end
            if o.finished:
                done[o.request_id] = end
    ttft = np.array([first[str(i)] - arrivals[i] for i in range(len(prompts))]) * 1e3
    tpot = np.array([(done[str(i)] - first[str(i)]) / (lens[i] - 1) for i in range(len(prompts))
                     if lens[i] > 1]) * 1e3
    print(f"rate {args.rate}, budget {args.budget}: TTFT p50/p90/p99/max "
          f"{np.percentile(ttft, 50):.0f}/{np.percentile(ttft, 90):.0f}/"
          f"{np.percentile(ttft, 99):.0f}/{ttft.max():.0f} ms; TPOT p50/p99 "
          f"{np.percentile(tpot, 50):.1f}/{np.percentile(tpot, 99):.1f} ms; {len(steps)} steps")
    big = [s for s in steps if s[2] >= 64]
    print(f"prefill steps: {len(big)}, ms p50/max {np.median([s[1] for s in big]) * 1e3:.0f}/"
          f"{max(s[1] for s in big) * 1e3:.0f}; tokens p50/max "
          f"{np.median([s[2] for s in big]):.0f}/{max(s[2] for s in big)}")
    for i in np.argsort(ttft)[-4:]:
        a = arrivals[i]
        print(f"request {i}: arrived {a:.3f} s, TTFT {ttft[i]:.0f} ms; steps:")
        for s in steps:
            if a - 0.2 <= s[0] <= a + ttft[i] / 1e3:
                print(f"   {s[0]:.3f} +{s[1] * 1e3:.0f} ms  {s[2]} tokens  {s[3]} requests")


if __name__ == "__main__":
    main()
