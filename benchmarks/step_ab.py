"""A/B of decode steps in one engine, alternating step by step (medians of each side): PYTHONPATH=. MODS=a,b | ATTR=name:a:b .venv/bin/python benchmarks/step_ab.py B."""

# Alternating within one process is how a 5-10% change shows on a machine whose
# speed drifts 10-50% within minutes. What alternates:
#   MODS=name_a,name_b  two kernel builds as kernels.load() names them; build a
#                       variant from a copy of the tree with PYTHONPATH=/tmp/copy python -c
#                       "from tokenmill.backends.cpu import kernels; kernels.load()"
#   ATTR=name:a:b       a number field of the plan's dispatch.PathFacts, a on even steps,
#                       b on odd ones (e.g. ATTR=split_min_rows:8:16)
# Both sides must give the same bits: one token sequence runs on through both.
# Environment: CTX=264 (prompt tokens), STEPS=24, DTYPE=float32.

from __future__ import annotations

import dataclasses
import os
import statistics
import sys
import time

from tokenmill import LLM, SamplingParams
from tokenmill.backends.cpu import plan

from ab_modules import load_module


def main() -> None:
    batch = int(sys.argv[1])
    ctx = int(os.environ.get("CTX", 264))
    steps = int(os.environ.get("STEPS", 24))
    mods = [load_module(n) for n in os.environ["MODS"].split(",")] if os.environ.get("MODS") else []
    attr = os.environ["ATTR"].split(":") if os.environ.get("ATTR") else []
    if len(mods) not in (0, 2) or len(attr) not in (0, 3) or not (mods or attr):
        sys.exit("set MODS=a,b or ATTR=name:a:b")

    llm = LLM(dtype=os.environ.get("DTYPE", "float32"), quantization="none", max_num_seqs=batch,
              max_num_batched_tokens=batch * ctx + 64, enable_prefix_caching=False)
    engine = llm.engine
    if (mods or attr) and not isinstance(engine.runner.forward, plan.CpuPlan):
        sys.exit("MODS and ATTR need the CPU plan (the C++ kernels built, a plain Llama model)")
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    for i in range(batch):
        prompt = [100 + (i * 7 + j) % 40000 for j in range(ctx)]
        engine.add_request(engine.new_request_id(), {"prompt_token_ids": prompt}, params)

    times: dict[int, list[float]] = {0: [], 1: []}
    step = 0
    while engine.has_unfinished_requests():
        side = step % 2
        if mods:
            module = mods[side]
            engine.runner.forward.ops = module  # the plan calls its own ops
        if attr:
            forward = engine.runner.forward
            forward.path_facts = dataclasses.replace(forward.path_facts, **{attr[0]: float(attr[1 + side])})
        t = time.perf_counter()
        result = engine.step()
        dt = time.perf_counter() - t
        if result.stats.num_scheduled_tokens == batch:  # decode steps of all B rows
            times[side].append(dt * 1e3)
        step += 1
    for side, name in ((0, "A"), (1, "B")):
        print(f"{name}: median {statistics.median(times[side]):.1f} ms over {len(times[side])} "
              "steps:", " ".join(f"{x:.0f}" for x in times[side]))


if __name__ == "__main__":
    main()
