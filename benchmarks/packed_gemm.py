"""The packed GEMM against torch's matmul over the default model's 30 layers of projections (cold weights), per row count: PYTHONPATH=. .venv/bin/python benchmarks/packed_gemm.py [float32]."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import torch

from tokenmill.backends.cpu import formats, kernels

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (K, N): qkv, o, gate_up, down
LAYERS = 30


def main() -> None:
    ops = kernels.load()
    if ops is None:
        sys.exit("the C++ kernels are not available here")
    dt = torch.float32 if sys.argv[1:] == ["float32"] else torch.bfloat16
    torch.manual_seed(0)
    # Distinct weights per layer: cold, as in a real step.
    ws = [[torch.randn(n, k, dtype=dt) * 0.05 for k, n in SHAPES] for _ in range(LAYERS)]
    packed = [[formats.pack(ops, str(dt).removeprefix("torch."), w) for w in layer] for layer in ws]
    nbytes = sum(w.numel() * w.element_size() for w in ws[0]) * LAYERS
    flops_a_row = sum(2 * k * n for k, n in SHAPES) * LAYERS

    def best(f: Callable[[torch.Tensor, int, int], torch.Tensor], xs: list[torch.Tensor],
             reps: int) -> float:
        def run() -> None:
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

    def ours(x: torch.Tensor, layer: int, j: int) -> torch.Tensor:
        return ops.packed_gemm(x, packed[layer][j], False)

    def torchs(x: torch.Tensor, layer: int, j: int) -> torch.Tensor:
        return torch.nn.functional.linear(x, ws[layer][j])

    for rows in (1, 4, 8, 16, 32, 64, 96, 128, 256, 2048):
        xs = [torch.randn(rows, k, dtype=dt) for k, _ in SHAPES]
        reps = 2 if rows > 256 else 5
        line = f"rows={rows:5d}"
        for name, f in (("torch", torchs), ("packed", ours)):
            d = best(f, xs, reps)
            line += (f" | {name} {d * 1e3:7.1f} ms {nbytes / d / 1e9:5.1f} GB/s "
                     f"{flops_a_row * rows / d / 1e9:4.0f} GFLOP/s")
        print(line)


if __name__ == "__main__":
    main()
