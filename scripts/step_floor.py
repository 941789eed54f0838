"""The least a bf16 decode step of the default model can take on this machine if its
projections and its attention run one after the other (as tokenmill's CPU step does):
the projections and head at the rate the packed GEMM reaches with the weights coming
from memory (as in a real step: 270 MB of weights do not fit the caches), plus the
attention's K/V read at the machine's full read bandwidth (an ideal kernel), nothing
else. Set against `bench roofline`'s roofline (FLOPs at the hot-weight matmul rate).

    PYTHONPATH=. .venv/bin/python scripts/step_floor.py [B] [CONTEXT]     (64 264)

The cold GEMMs run both ways a step can run them: split (each of the two threads its
own half of the rows through all 30 layers and the head, one OpenMP thread each, as
csrc/layer_stack.cpp does) and team (every GEMM on both threads, as the layer loop does).

Measured on the 2-core Zen 5, 2026-12-03 07:01-07:11 UTC (24 runs at B=64, 13 at B=128;
the machine's read bandwidth 39-58 GB/s then, its hot matmul 786-971 GFLOP/s), two slow
spells left out (a hot or cold rate near half the others):
    B=64:  cold GEMMs 20.0-26.3 ms (654-862 GFLOP/s; 0.83-0.95 of the same run's hot rate),
           K/V at full bandwidth 6.7-10.0 ms: floor 27.9-36.2 ms = 1.37-1.67x roofline
    B=128: cold GEMMs 38.4-51.2 ms (0.78-0.93), K/V 16.5-19.6 ms: floor 55.8-70.7 ms =
           1.43-1.67x
`bench roofline` at 07:09 UTC (41.3 GB/s): steps 44.0 / 78.2 ms, 2.02x / 1.75x the
roofline. At the best this machine showed (72-75 GB/s, 890-930 GFLOP/s hot, earlier runs
in BENCHMARKS.md) the K/V takes 5.2-5.4 ms and the cold GEMMs, at 0.83-0.95 of the hot
rate, 20.4-23.4 ms: floor 25.8-28.8 ms at B=64 against a 20.4-20.7 ms roofline, 1.25-1.39x.
So a step within 1.3x of the roofline here leaves nothing for the attention kernel's own
work and everything else in a step, unless its attention's reads overlap the projections'
arithmetic (BENCHMARKS.md says what was tried).
"""
import ctypes
import sys
import threading
import time

import torch

from tokenmill.bench.roofline import measure_read_bandwidth
from tokenmill.model import cpu_kernels

B = int(sys.argv[1]) if len(sys.argv) > 1 else 64
CTX = int(sys.argv[2]) if len(sys.argv) > 2 else 264
LAYERS, HIDDEN, INTER, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 30, 576, 1536, 49152, 9, 3, 64
SHAPES = [(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM), (HEADS * HEAD_DIM, HIDDEN),
          (HIDDEN, 2 * INTER), (INTER, HIDDEN)]  # (K, N): qkv, o, gate_up, down
dt = torch.bfloat16
m = cpu_kernels.load()
gomp = ctypes.CDLL("libgomp.so.1")
torch.manual_seed(0)
layers = [[cpu_kernels.pack_weight(torch.randn(n, k, dtype=dt) * 0.05) for k, n in SHAPES]
          for _ in range(LAYERS)]
head = cpu_kernels.pack_weight(torch.randn(VOCAB, HIDDEN, dtype=dt) * 0.05)
proj_flop = 2.0 * B * LAYERS * sum(k * n for k, n in SHAPES)
head_flop = 2.0 * B * HIDDEN * VOCAB
attn_flop = 4.0 * B * CTX * HEADS * HEAD_DIM * LAYERS
kv_bytes = 2.0 * B * CTX * KV_HEADS * HEAD_DIM * LAYERS * 2


def gemms(rows: int) -> None:
    xs = [torch.randn(rows, k, dtype=dt) for k, _ in SHAPES]
    for layer in layers:
        for (_, n), x, w in zip(SHAPES, xs, layer, strict=True):
            m.packed_gemm(x, w, n, torch.empty(0), False)
    m.packed_gemm(xs[0], head, VOCAB, torch.empty(0), True)


def team_s(reps: int) -> float:
    gemms(B)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        gemms(B)
        best = min(best, time.perf_counter() - t)
    return best


def split_s(reps: int) -> float:
    barrier, times = threading.Barrier(2), [[], []]

    def run(i: int, rows: int) -> None:
        gomp.omp_set_num_threads(1)
        gemms(rows)
        for _ in range(reps):
            barrier.wait()
            t = time.perf_counter()
            gemms(rows)
            times[i].append(time.perf_counter() - t)
            barrier.wait()

    threads = [threading.Thread(target=run, args=(i, B // 2 + i * (B % 2))) for i in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return min(max(a, b) for a, b in zip(*times, strict=True))


with torch.inference_mode():
    for _ in range(2):
        rate = cpu_kernels.best_matmul_rate(SHAPES, B, dt)
        bandwidth = measure_read_bandwidth()
        team, split = team_s(5), split_s(5)
        cold = min(team, split)
        roofline = max((proj_flop + head_flop + attn_flop) / (rate * 1e9),
                       (sum(w.numel() for layer in layers for w in layer) * 2 + head.numel() * 2 + kv_bytes)
                       / (bandwidth * 1e9))
        attention = kv_bytes / (bandwidth * 1e9)
        floor = cold + attention
        print(f"B={B} context {CTX}: hot matmul {rate:.0f} GFLOP/s, read bandwidth {bandwidth:.1f} GB/s; "
              f"roofline {roofline * 1e3:.1f} ms; projections + head with weights from memory "
              f"{cold * 1e3:.1f} ms ({(proj_flop + head_flop) / cold / 1e9:.0f} GFLOP/s; team "
              f"{team * 1e3:.1f}, split {split * 1e3:.1f}) + K/V at full "
              f"bandwidth {attention * 1e3:.1f} ms = floor {floor * 1e3:.1f} ms = {floor / roofline:.2f}x roofline")
