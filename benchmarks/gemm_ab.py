"""A/B of two kernel builds' packed GEMM over the default model's 30 layers of projections, alternating (median GFLOP/s of each): PYTHONPATH=. .venv/bin/python benchmarks/gemm_ab.py name_a,name_b 8,32,64 [split]."""

# name_a, name_b: builds as kernels.load() names them (see step_ab.py). Checks
# that both give the same bits first. Without `split`: one call a projection on
# the whole OpenMP team (the layer loop's way); with `split`: two Python threads
# of one OpenMP thread each, each its own rows over all the weights (the layer
# stack's way). R=8 rounds; TOKENMILL_AB_DTYPE=bfloat16 (default float32);
# TOKENMILL_AB_SILU=1 runs the gate_up projection through packed_gemm_silu.

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from types import ModuleType

import torch

from tokenmill.backends.cpu import formats

from ab_modules import load_module

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (K, N): qkv, o, gate_up, down
LAYERS = 30


def main() -> None:
    rounds = int(os.environ.get("R", 8))
    mods = [load_module(n) for n in sys.argv[1].split(",")]
    row_counts = [int(r) for r in sys.argv[2].split(",")]
    split = sys.argv[3:] == ["split"]
    dtype = getattr(torch, os.environ.get("TOKENMILL_AB_DTYPE", "float32"))
    silu = os.environ.get("TOKENMILL_AB_SILU") == "1"
    torch.manual_seed(0)
    # Distinct weights a layer: cold, as in a step.
    weights = [[(torch.randn(n, k) * 0.05).to(dtype) for k, n in SHAPES] for _ in range(LAYERS)]
    name = str(dtype).removeprefix("torch.")
    # Each build's own PackedWeight (formats.pack), the same packed data.
    packed = {id(m): [[formats.pack(m, name, w) for w in layer] for layer in weights] for m in mods}

    def project(module: ModuleType, j: int, x: torch.Tensor, w: object) -> torch.Tensor:
        if silu and j == 2:
            return module.packed_gemm_silu(x, w)
        return module.packed_gemm(x, w, False)

    def run_layers(module: ModuleType, xs: list[torch.Tensor]) -> None:
        for layer in range(LAYERS):
            for j in range(len(SHAPES)):
                project(module, j, xs[j], packed[id(module)][layer][j])

    def timed(module: ModuleType, inputs: list[list[torch.Tensor]]) -> float:
        """Seconds for every projection of every layer: on the team, or split."""
        if not split:
            t = time.perf_counter()
            run_layers(module, inputs[0])
            return time.perf_counter() - t
        spans = [0.0, 0.0]
        barrier = threading.Barrier(2)

        def work(i: int) -> None:
            torch.set_num_threads(1)
            barrier.wait()
            t = time.perf_counter()
            run_layers(module, inputs[i])
            spans[i] = time.perf_counter() - t

        threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        return max(spans)

    for rows in row_counts:
        inputs = [[torch.randn(rows, k).to(dtype) for k, _ in SHAPES]
                  for _ in range(2 if split else 1)]
        outs = [[project(m, j, x, packed[id(m)][0][j]) for j, x in enumerate(inputs[0])] for m in mods]
        if not all(torch.equal(a, b) for a, b in zip(*outs, strict=True)):
            sys.exit(f"rows {rows}: the two builds give different bits")
        flops = sum(2 * k * n for k, n in SHAPES) * LAYERS * rows * len(inputs)
        rates: list[list[float]] = [[], []]
        for _ in range(rounds):
            for side, module in enumerate(mods):
                rates[side].append(flops / timed(module, inputs) / 1e9)
        wins = sum(b > a for a, b in zip(*rates, strict=True))
        print(f"{'split 2 x ' if split else ''}{rows} rows: A {statistics.median(rates[0]):.1f}"
              f" B {statistics.median(rates[1]):.1f} GFLOP/s (B faster in {wins} of {rounds})")


if __name__ == "__main__":
    main()
