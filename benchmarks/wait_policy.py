"""Decode-step time under each OpenMP wait policy, quiet and beside busy cores: PYTHONPATH=. .venv/bin/python benchmarks/wait_policy.py [--rounds 3 --busy 0,1 --batches 1,64]."""

# libgomp reads its wait policy once, when torch loads it, so every setting runs
# in a fresh subprocess with its environment (the engine's own choice,
# engine/openmp_wait.py, is not applied by LLM). The settings alternate within
# each round (the order rotates), so a drift of the machine's speed spreads over
# all of them. A child builds the default model's engine, runs B requests of CTX
# prompt tokens to their decode steps, and times STEPS steps where all B rows
# decode; it prints one JSON line per batch. "--busy 1" starts one spinning
# process beside the child for the whole measurement: another job on the machine.
# The table gives, per setting: the median over rounds of each child's median step,
# and the worst p90 and max seen.

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict

SETTINGS: dict[str, dict[str, str]] = {
    "libgomp": {},
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
    "spin-1000": {"GOMP_SPINCOUNT": "1000"},
    "spin-10000": {"GOMP_SPINCOUNT": "10000"},
    "spin-100000": {"GOMP_SPINCOUNT": "100000"},
}
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def child(batches: list[int], ctx: int, steps: int) -> None:
    from tokenmill import LLM, SamplingParams

    # A KV pool just big enough (1 GiB holds 64 x 160 tokens even in float32): no time
    # spent faulting in the default pool.
    llm = LLM(max_num_seqs=max(batches), enable_prefix_caching=False,
              max_num_batched_tokens=max(batches) * ctx + 64, skip_tokenizer_init=True,
              kv_cache_memory_bytes=1 << 30)
    engine = llm.engine
    for batch in batches:
        params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
        for i in range(batch):
            prompt = [100 + (i * 7 + j) % 40000 for j in range(ctx)]
            engine.add_request(engine.new_request_id(), {"prompt_token_ids": prompt}, params)
        times = []
        while engine.has_unfinished_requests():
            t = time.perf_counter()
            result = engine.step()
            dt = time.perf_counter() - t
            if result.stats.num_scheduled_tokens == batch:  # a decode step of all B rows
                times.append(dt * 1e3)
        times.sort()
        print(json.dumps({"batch": batch, "median_ms": statistics.median(times),
                          "p90_ms": times[int(0.9 * (len(times) - 1))], "max_ms": times[-1]}),
              flush=True)


def run_child(setting: str, args: argparse.Namespace) -> list[dict[str, float]]:
    env = {k: v for k, v in os.environ.items() if k not in WAIT_VARIABLES}
    env.update(SETTINGS[setting])
    cmd = [sys.executable, __file__, "--child", "--batches", args.batches, "--ctx", str(args.ctx),
           "--steps", str(args.steps)]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--ctx", type=int, default=128, help="prompt tokens per request")
    p.add_argument("--steps", type=int, default=32, help="decode steps timed per batch")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--busy", default="0,1", help="spinning processes beside the engine, per run")
    p.add_argument("--settings", default=",".join(SETTINGS))
    p.add_argument("--output", default=None, help="write every child's numbers here (JSON)")
    args = p.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.child:
        child(batches, args.ctx, args.steps)
        return

    settings = args.settings.split(",")
    rows: dict[tuple[int, str, int], list[dict[str, float]]] = defaultdict(list)
    for num_busy in [int(b) for b in args.busy.split(",")]:
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
                for _ in range(num_busy)]
        try:
            for r in range(args.rounds):
                order = settings[r % len(settings):] + settings[: r % len(settings)]
                for setting in order:
                    for result in run_child(setting, args):
                        rows[(num_busy, setting, int(result["batch"]))].append(result)
                        print(f"busy={num_busy} round {r} {setting:>10} B={result['batch']:<3}"
                              f" median {result['median_ms']:7.1f} ms  p90 {result['p90_ms']:7.1f}"
                              f"  max {result['max_ms']:7.1f}", flush=True)
        finally:
            for process in busy:
                process.kill()
                process.wait()
    print("\nbusy  setting       B   median of medians   worst p90   worst max  (ms)")
    for (num_busy, setting, batch), results in sorted(rows.items()):
        print(f"{num_busy:>4}  {setting:<11} {batch:>3}   "
              f"{statistics.median(x['median_ms'] for x in results):17.1f}   "
              f"{max(x['p90_ms'] for x in results):9.1f}   {max(x['max_ms'] for x in results):9.1f}")
    if args.output:
        with open(args.output, "w") as f:
            json.dump([{"busy": k[0], "setting": k[1], "batch": k[2], "runs": v}
                       for k, v in sorted(rows.items())], f, indent=1)


if __name__ == "__main__":
    main()
