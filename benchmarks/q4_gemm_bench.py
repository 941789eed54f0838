"""q4_gemm (Q4_1, quantization="gguf") against q8_gemm (Q8_0) over the default
model's 120 projections, one call each in layer order (a decode step's GEMMs
without the head), random blocks distinct for each of the 30 layers (cold, as
in a step), bf16 x (the served path: VNNI); best of R rounds, the two formats
alternating: PYTHONPATH=. python benchmarks/q4_gemm_bench.py [1,4]."""

from __future__ import annotations

import os
import sys
import time

import torch

from tokenmill.backends.cpu import formats, kernels
from tokenmill.backends.cpu.kernels import CppPackedWeight, CpuOps

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (K, N): qkv, o, gate_up, down
LAYERS = 30


def q4(ops: CpuOps, n: int, k: int) -> CppPackedWeight:
    blocks = torch.randint(0, 256, (n, k // 32, 20), dtype=torch.uint8)
    blocks[:, :, 0:4] = (torch.rand(n, k // 32, 2) * 1e-3 + 1e-4).to(torch.float16).view(torch.uint8)
    return formats.pack(ops, "q4_1", blocks)


def q8(ops: CpuOps, n: int, k: int) -> CppPackedWeight:
    q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
    d = (torch.rand(n, k // 32) * 1e-3 + 1e-4).to(torch.float16)
    return formats.pack(ops, "q8_0", (q, d))


def main() -> None:
    rows = [int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "1,4").split(",")]
    rounds = int(os.environ.get("R", "7"))
    ops = kernels.load()
    assert ops is not None
    torch.manual_seed(0)
    weights = {name: [[make(ops, n, k) for k, n in SHAPES] for _ in range(LAYERS)]
               for name, make in (("q4_1", q4), ("q8_0", q8))}
    nbytes = {name: sum(formats.packed_bytes(p) for layer in w for p in layer) for name, w in weights.items()}
    for m in rows:
        xs = {k: (torch.randn(m, k) * 0.5).to(torch.bfloat16) for k in (576, 1536)}
        best = dict.fromkeys(weights, float("inf"))
        for _ in range(rounds):
            for name, layers in weights.items():
                t0 = time.perf_counter()
                for layer in layers:
                    for packed, (k, _) in zip(layer, SHAPES, strict=True):
                        ops.packed_gemm(xs[k], packed, False)
                best[name] = min(best[name], time.perf_counter() - t0)
        print(f"rows {m}: " + ", ".join(f"{name} {t * 1e3:.2f} ms ({nbytes[name] / t / 1e9:.1f} GB/s, "
                                        f"{nbytes[name] / 1e6:.0f} MB)" for name, t in best.items()))


if __name__ == "__main__":
    main()
