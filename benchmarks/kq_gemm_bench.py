"""The packed GEMMs alone on a Llama-3.2-1B layer's projections (qkv 2048 -> 3072,
o 2048 -> 2048, gate_up 2048 -> 16384, down 8192 -> 2048) and its head (2048 ->
49152, SmolLM2's vocabulary), per weight format: one call a projection in layer
order through L layers, then the head, bf16 x (the served path: int8 activations
and VNNI for the block formats). The first layer is packed from random blocks, the
other L - 1 are copies of it at their own addresses, so the L layers (16, as the
1B model: past this machine's L3) are read cold, as in a decode step. Best of R
rounds, the formats alternating. Prints ms a layer and the GB/s of the packed bytes
read, the layers' and the head's:
  PYTHONPATH=. python benchmarks/kq_gemm_bench.py [rows, default 1,4] [formats]
"""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch

from tests.test_quantization_kquants import _random_blocks
from tokenmill.backends.cpu import kernels
from tokenmill.backends.cpu.formats import PackingOps, pack
from tokenmill.backends.cpu.memory import mapped_zeros
from tokenmill.model.quantization import KQUANT_FORMATS

SHAPES = [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048)]  # (K, N)
HEAD = (2048, 49152)
FORMATS = "bfloat16,q8_0,q4_0,q5_0,q4_k,q5_k,q6_k"


def source(name: str, n: int, k: int, seed: int) -> object:
    """Random weights of format `name` as formats.pack takes them."""
    if name == "bfloat16":
        return (torch.randn(n, k) * 0.02).to(torch.bfloat16)
    if name == "q8_0":
        q = torch.randint(-127, 128, (n, k), dtype=torch.int8)
        return q, (torch.rand(n, k // 32) * 1e-3 + 1e-4).to(torch.float16)
    if name == "q4_1":
        blocks = torch.randint(0, 256, (n, k // 32, 20), dtype=torch.uint8)
        blocks[:, :, 0:4] = (torch.rand(n, k // 32, 2) * 1e-3 + 1e-4).to(torch.float16).view(torch.uint8)
        return blocks
    return _random_blocks(KQUANT_FORMATS[name.upper()], n, k, seed)


def copy_of(ops: PackingOps, w: Any) -> Any:
    """The packed weight w again, at an address of its own."""
    data = mapped_zeros(tuple(w.data.shape), w.data.dtype)
    data.copy_(w.data)
    return ops.PackedWeight(format=w.format, n=w.n, k=w.k, data=data, bias=w.bias)


def run(ops: Any, rows: list[int], names: list[str], layers: int, rounds: int) -> dict[tuple[int, str], Any]:
    """{(rows, format): (best seconds a layer, layer GB/s, head seconds, head GB/s)}, printed as it goes."""
    torch.manual_seed(0)
    weights, heads = {}, {}
    for name in names:
        first = [pack(ops, name, source(name, n, k, j)) for j, (k, n) in enumerate(SHAPES)]
        weights[name] = [first] + [[copy_of(ops, w) for w in first] for _ in range(layers - 1)]
        heads[name] = pack(ops, name, source(name, HEAD[1], HEAD[0], 99))
    layer_bytes = {name: sum(w.data.numel() * w.data.element_size() for w in ws[0]) for name, ws in weights.items()}
    head_bytes = {name: h.data.numel() * h.data.element_size() for name, h in heads.items()}
    results = {}
    for m in rows:
        xs = {k: torch.randn(m, k).to(torch.bfloat16) for k in (2048, 8192)}
        best = dict.fromkeys(names, float("inf"))
        best_head = dict.fromkeys(names, float("inf"))
        for _ in range(rounds):
            for name in names:
                t0 = time.perf_counter()
                for layer in weights[name]:
                    for w in layer:
                        ops.packed_gemm(xs[w.k], w, False)
                t1 = time.perf_counter()
                ops.packed_gemm(xs[HEAD[0]], heads[name], True)
                t2 = time.perf_counter()
                best[name] = min(best[name], (t1 - t0) / layers)
                best_head[name] = min(best_head[name], t2 - t1)
        for name in names:
            t, th = best[name], best_head[name]
            results[(m, name)] = (t, layer_bytes[name] / t / 1e9, th, head_bytes[name] / th / 1e9)
            print(f"rows {m} {name}: {t * 1e3:.2f} ms a layer, {layer_bytes[name] / t / 1e9:.1f} GB/s "
                  f"({layer_bytes[name] / 1e6:.1f} MB); head {th * 1e3:.2f} ms, {head_bytes[name] / th / 1e9:.1f} GB/s "
                  f"({head_bytes[name] / 1e6:.1f} MB)", flush=True)
    return results


def main() -> None:
    rows = [int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "1,4").split(",")]
    names = (sys.argv[2] if len(sys.argv) > 2 else FORMATS).split(",")
    ops = kernels.load()
    assert ops is not None
    run(ops, rows, names, int(os.environ.get("L", "16")), int(os.environ.get("R", "7")))


if __name__ == "__main__":
    main()
