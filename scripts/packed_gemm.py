"""The packed bf16 GEMM (csrc/packed_gemm.cpp) against torch's matmul over the 30
layers' projections of the default model (distinct weights per layer: cold, as
in a real step), per number of rows.

    PYTHONPATH=. .venv/bin/python scripts/packed_gemm.py [float32]
"""
import sys
import time

import torch

from tokenmill.model import cpu_kernels

m = cpu_kernels.load()
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (K, N): qkv, o, gate_up, down
LAYERS = 30
dt = torch.float32 if sys.argv[1:] == ["float32"] else torch.bfloat16
torch.manual_seed(0)
ws = [[torch.randn(n, k, dtype=dt) * 0.05 for k, n in SHAPES] for _ in range(LAYERS)]
packed = [[cpu_kernels.pack_weight(w) for w in layer] for layer in ws]
nbytes = sum(w.numel() * w.element_size() for w in ws[0]) * LAYERS
flops1 = sum(2 * k * n for k, n in SHAPES) * LAYERS


def best(f, xs, reps=5):
    def run():
        for layer in range(LAYERS):
            for j, x in enumerate(xs):
                f(x, layer, j)

    run()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        run()
        times.append(time.perf_counter() - t)
    return min(times)


def ours(x, layer, j):
    return m.packed_gemm(x, packed[layer][j], SHAPES[j][1], torch.empty(0), False)


def torchs(x, layer, j):
    return torch.nn.functional.linear(x, ws[layer][j])


for rows in (1, 4, 8, 16, 32, 64, 96, 128, 256, 2048):
    xs = [torch.randn(rows, k, dtype=dt) for k, _ in SHAPES]
    reps = 2 if rows > 256 else 5
    line = f"rows={rows:5d}"
    for name, f in (("torch", torchs), ("packed", ours)):
        d = best(f, xs, reps)
        line += f" | {name} {d * 1e3:7.1f} ms {nbytes / d / 1e9:5.1f} GB/s {flops1 * rows / d / 1e9:4.0f} GFLOP/s"
    print(line)
