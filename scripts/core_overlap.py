"""Would a decode step gain from one core running attention while the other runs
GEMMs (the two threads' layer phases staggered) rather than both running the same
phase at once (as csrc/layer_stack.cpp's split steps do: equal rows, equal work)?
Each side is timed while the other core loops on attention or on GEMMs: the
attention kernel (one OpenMP thread) on a thread's share of a B=64 step (32 queries,
context 264, 8 layers of cold K/V, blocks in order) and the packed GEMMs of 8 layers
of the default model's projections at 32 rows.

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python scripts/core_overlap.py

Measured on the 2-core Zen 5, 2026-12-03 ~07:00 UTC (read bandwidth ~40-46 GB/s then),
two rounds, medians, ms for 8 layers:
    attention, other core idle / on attention / on GEMMs: 2.33 / 2.74 / 2.52; 2.74 / 3.14 / 2.86
    GEMMs, other core idle / on GEMMs / on attention:     4.50 / 4.58 / 4.70; 4.50 / 4.69 / 4.92
Phases in step (both cores attention, then both GEMMs): 2.74 + 4.58 = 7.32 and 3.14 + 4.69
= 7.82; staggered (each phase beside the other kind): 2.52 + 4.70 = 7.22 and 2.86 + 4.92 =
7.78. At most 1.5% of a step: what attention gains beside GEMMs, the GEMMs lose beside
attention. Not built.
"""
import os, threading, time, torch, numpy as np
from tokenmill.model import cpu_kernels
m = cpu_kernels.load(); att = cpu_kernels.paged_decode_kernel()
torch.manual_seed(0)
B, L, bs, H, KV, D, NL = 32, 264, 16, 9, 3, 64, 8
nb = -(-L // bs)
def kvset():
    return [torch.from_numpy(np.zeros(2 * (B * nb + 1) * bs * KV * D * 2, dtype=np.uint8)).view(torch.bfloat16)
            .view(2, B * nb + 1, bs, KV, D).normal_() for _ in range(NL)]
kvA, kvB = kvset(), kvset()
bt = torch.arange(B * nb).reshape(B, nb); seq = torch.full((B,), L, dtype=torch.int64)
q = torch.randn(B, H, D).to(torch.bfloat16); E = torch.empty(0, dtype=torch.int64)
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]
packed = [[cpu_kernels.pack_weight(torch.randn(n, k, dtype=torch.bfloat16) * .05) for k, n in SHAPES] for _ in range(30)]
xs = [torch.randn(32, k, dtype=torch.bfloat16) for k, _ in SHAPES]
def attn_work(kvs):
    for kv in kvs: att(q, kv, bt, seq, 0.125, 0, E)
def gemm_work():
    for layer in packed[:8]:
        for j, x in enumerate(xs): m.packed_gemm(x, layer[j], SHAPES[j][1], torch.empty(0), False)
stop = threading.Event()
def background(fn):
    while not stop.is_set(): fn()
def timed(fn, reps=15):
    fn(); ts = []
    for _ in range(reps):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return sorted(ts)[len(ts)//2] * 1e3
def scenario(name, fg, bg):
    global stop
    stop = threading.Event(); th = None
    if bg:
        th = threading.Thread(target=background, args=(bg,)); th.start(); time.sleep(0.05)
    r = timed(fg)
    if th: stop.set(); th.join()
    print(f"{name:40s} {r:7.3f} ms (per 8 layers)")
    return r
for rnd in range(2):
    scenario("attn alone", lambda: attn_work(kvA), None)
    scenario("attn | other core attn", lambda: attn_work(kvA), lambda: attn_work(kvB))
    scenario("attn | other core gemm", lambda: attn_work(kvA), gemm_work)
    scenario("gemm alone", gemm_work, None)
    scenario("gemm | other core gemm", gemm_work, gemm_work)
    scenario("gemm | other core attn", gemm_work, lambda: attn_work(kvB))
