"""A/B of decode steps in one engine, alternating step by step: the way to see a
5-10% change on a machine whose speed drifts 10-50% within minutes (two
processes run one after the other measure the drift as much as the change).

Adds B requests of CTX prompt tokens (all prefilled in one step), then times
the decode steps that run exactly B rows: even steps with A, odd steps with B,
and prints the medians of each. What alternates:

    MODS=name_a,name_b   two built kernel modules, as cpu_kernels.load() names
                         them (~/.cache/torch_extensions/py311_cpu/<name>/<name>.so):
                         build a variant from a copy of the tree with
                         PYTHONPATH=/tmp/copy python -c "from tokenmill.model import
                         cpu_kernels; print(cpu_kernels.load().__name__)"
    ATTR=name:a:b        a module attribute of tokenmill.model.cpu_layers set to
                         int a on even steps, b on odd ones (e.g.
                         ATTR=SPLIT_ROWS_PER_WEIGHT_BYTE:4:8)

Both sides must give the same bits (the sequence runs on through both).

    PYTHONPATH=. MODS=... .venv/bin/python scripts/step_ab.py 64      (CTX=264 DTYPE=float32 STEPS=24)

Used on a Zen 3 on 2026-12-01 for the float32 split threshold (cpu_layers.py)
and the float32 K/V prefetch (csrc/layer_stack.cpp), whose comments give the numbers.
"""
import os
import statistics
import sys
import time

from ab_modules import load_module  # (scripts/ab_modules.py)

from tokenmill import LLM, SamplingParams
from tokenmill.model import cpu_kernels, cpu_layers

B = int(sys.argv[1])
CTX = int(os.environ.get("CTX", 264))
STEPS = int(os.environ.get("STEPS", 24))
mods = [load_module(n) for n in os.environ["MODS"].split(",")] if os.environ.get("MODS") else []
attr = os.environ.get("ATTR", "").split(":") if os.environ.get("ATTR") else []
if len(mods) not in (0, 2) or len(attr) not in (0, 3) or not (mods or attr):
    sys.exit("set MODS=a,b or ATTR=name:a:b")

llm = LLM(dtype=os.environ.get("DTYPE", "float32"), max_num_seqs=B,
          max_num_batched_tokens=B * CTX + 64, enable_prefix_caching=False)
engine = llm.engine
params = SamplingParams(temperature=0, max_tokens=STEPS + 1, ignore_eos=True)
for i in range(B):
    prompt = [100 + (i * 7 + j) % 40000 for j in range(CTX)]
    engine.add_request(engine.new_request_id(), {"prompt_token_ids": prompt}, params)

times: dict[int, list[float]] = {0: [], 1: []}
step = 0
while engine.has_unfinished_requests():
    side = step % 2
    if mods:
        module = mods[side]
        cpu_kernels.load = lambda module=module: module  # what CpuLayers.forward calls each step
    if attr:
        setattr(cpu_layers, attr[0], int(attr[1 + side]))
    t = time.perf_counter()
    engine.step()
    dt = time.perf_counter() - t
    if engine.last_step.num_scheduled_tokens == B:
        times[side].append(dt * 1e3)
    step += 1
for side, name in ((0, "A"), (1, "B")):
    print(f"{name}: median {statistics.median(times[side]):.1f} ms over {len(times[side])} steps:",
          " ".join(f"{x:.0f}" for x in times[side]))
