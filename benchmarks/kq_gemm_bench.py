"""The block formats' GEMMs alone on a Llama-3.2-1B layer's projections (qkv 2048 ->
3072, o 2048 -> 2048, gate_up 2048 -> 16384, down 8192 -> 2048), L layers of
random blocks each (cold, as in a decode step: 3 layers are past any L3 here),
bf16 x (the served path: int8 activations, VNNI), one call a projection in layer
order; best of R rounds, the formats alternating. Prints ms a layer and the GB/s
of the packed bytes read:
  PYTHONPATH=. python benchmarks/kq_gemm_bench.py [rows, default 1,4] [formats]
"""

from __future__ import annotations

import os
import sys
import time

import torch

from tests.test_quantization_kquants import _random_blocks
from tokenmill.backends.cpu import kernels
from tokenmill.backends.cpu.formats import pack
from tokenmill.model.quantization import KQUANT_FORMATS

SHAPES = [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048)]  # (K, N)


def source(name: str, n: int, k: int, seed: int) -> object:
    """Random weights of format `name` as formats.pack takes them."""
    if name == "q8_0":
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        return q, (torch.rand(n, k // 32) * 1e-3 + 1e-4).to(torch.float16)
    if name == "q4_1":
        blocks = torch.randint(0, 256, (n, k // 32, 20), dtype=torch.uint8)
        blocks[:, :, 0:4] = (torch.rand(n, k // 32, 2) * 1e-3 + 1e-4).to(torch.float16).view(torch.uint8)
        return blocks
    return _random_blocks(KQUANT_FORMATS[name.upper()], n, k, seed)


def main() -> None:
    rows = [int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "1,4").split(",")]
    names = (sys.argv[2] if len(sys.argv) > 2 else "q8_0,q4_1,q4_0,q5_0,q4_k,q5_k,q6_k").split(",")
    layers, rounds = int(os.environ.get("L", "3")), int(os.environ.get("R", "5"))
    ops = kernels.load()
    assert ops is not None
    torch.manual_seed(0)
    weights = {name: [[pack(ops, name, source(name, n, k, 16 * i + j)) for j, (k, n) in enumerate(SHAPES)]
                      for i in range(layers)] for name in names}
    nbytes = {name: sum(w.data.numel() for layer in ws for w in layer) for name, ws in weights.items()}
    for m in rows:
        xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in (2048, 8192)}
        best = dict.fromkeys(weights, float("inf"))
        for _ in range(rounds):
            for name, ws in weights.items():
                t0 = time.perf_counter()
                for layer in ws:
                    for w in layer:
                        ops.packed_gemm(xs[w.k], w, False)
                best[name] = min(best[name], time.perf_counter() - t0)
        for name, t in best.items():
            print(f"rows {m} {name}: {t * 1e3 / layers:.2f} ms a layer, {nbytes[name] / t / 1e9:.1f} GB/s, "
                  f"{nbytes[name] / layers / 1e6:.1f} MB a layer", flush=True)


if __name__ == "__main__":
    main()
