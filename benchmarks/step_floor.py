"""The least a bf16 decode step of the default model can take here with projections and attention one after the other (cold GEMMs + K/V at full bandwidth) against the roofline: PYTHONPATH=. .venv/bin/python benchmarks/step_floor.py [B] [CONTEXT]."""

# The cold GEMMs run both ways a step runs them: split (each of two threads its
# own half of the rows through all layers and the head, one OpenMP thread each,
# as the layer stack does) and team (every GEMM on both threads, as the layer
# loop does). The attention is an ideal kernel: its K/V read at the machine's
# full read bandwidth, no cost of its own. Defaults: B=64, CONTEXT=264.

from __future__ import annotations

import ctypes
import sys
import threading
import time

import torch

from tokenmill.backends.cpu import formats, kernels
from tokenmill.bench.roofline import measure_read_bandwidth

B = int(sys.argv[1]) if len(sys.argv) > 1 else 64
CTX = int(sys.argv[2]) if len(sys.argv) > 2 else 264
LAYERS, HIDDEN, INTER, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 30, 576, 1536, 49152, 9, 3, 64
SHAPES = [(HIDDEN, (HEADS + 2 * KV_HEADS) * HEAD_DIM), (HEADS * HEAD_DIM, HIDDEN),
          (HIDDEN, 2 * INTER), (INTER, HIDDEN)]  # (K, N): qkv, o, gate_up, down
dt = torch.bfloat16
ops = kernels.load()
if ops is None:
    sys.exit("the C++ kernels are not available here")
gomp = ctypes.CDLL("libgomp.so.1")
torch.manual_seed(0)
layers = [[formats.pack(ops, "bfloat16", torch.randn(n, k, dtype=dt) * 0.05) for k, n in SHAPES]
          for _ in range(LAYERS)]
head = formats.pack(ops, "bfloat16", torch.randn(VOCAB, HIDDEN, dtype=dt) * 0.05)
proj_flop = 2.0 * B * LAYERS * sum(k * n for k, n in SHAPES)
head_flop = 2.0 * B * HIDDEN * VOCAB
attn_flop = 4.0 * B * CTX * HEADS * HEAD_DIM * LAYERS
kv_bytes = 2.0 * B * CTX * KV_HEADS * HEAD_DIM * LAYERS * 2


def gemms(rows: int) -> None:
    xs = [torch.randn(rows, k, dtype=dt) for k, _ in SHAPES]
    for layer in layers:
        for x, w in zip(xs, layer, strict=True):
            ops.packed_gemm(x, w, False)
    ops.packed_gemm(xs[0], head, True)


def team_s(reps: int) -> float:
    gemms(B)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        gemms(B)
        best = min(best, time.perf_counter() - t)
    return best


def split_s(reps: int) -> float:
    barrier = threading.Barrier(2)
    times: list[list[float]] = [[], []]

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
        rate = kernels.best_matmul_rate(SHAPES, B, dt)
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
