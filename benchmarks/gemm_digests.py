"""Digests of the packed GEMMs' output bits per weight format, activation dtype
and row count (random weights, fixed seeds), to show a refactor of the C++
kernels changes no bit: run it on two trees and diff the lines.
PYTHONPATH=. .venv/bin/python benchmarks/gemm_digests.py"""

from __future__ import annotations

import hashlib

import torch

from tokenmill.backends.cpu import kernels, memory
from tokenmill.model.quantization import q4_0_as_q4_1, quantize_q8_0

ROWS = (1, 3, 4, 17, 64, 4100)
N, K, INTER = 200, 256, 48  # N not a multiple of 16 or 48: padded groups and short tasks


def weights(fmt: str, n: int, gen: torch.Generator) -> object:
    w = torch.randn(n, K, generator=gen) * 0.05
    if fmt in ("bfloat16", "float32"):
        return w.to(getattr(torch, fmt))
    q, d = quantize_q8_0(w)
    if fmt == "q8_0":
        return q, d
    blocks = torch.randint(0, 256, (n, K // 32, 18), dtype=torch.uint8, generator=gen)
    blocks[..., 0:2] = (torch.rand(n, K // 32, generator=gen) * 0.01).to(torch.float16).view(torch.uint8).view(
        n, K // 32, 2)
    if fmt == "q4_0":
        return blocks  # (GGUF's Q4_0 blocks as the file has them)
    q41 = torch.cat([blocks[..., 0:2], (torch.rand(n, K // 32, generator=gen) * -0.05).to(torch.float16)
                     .view(torch.uint8).view(n, K // 32, 2), blocks[..., 2:]], dim=-1)
    return q41


def main() -> None:
    ops = kernels.load()
    assert ops is not None
    try:  # the format table (after the refactor)
        from tokenmill.backends.cpu import formats
        pack_api = formats.pack
    except ImportError:
        pack_api = None
    for fmt in ("bfloat16", "float32", "q8_0", "q4_1", "q4_0"):
        gen = torch.Generator().manual_seed(1)
        w, w_silu = weights(fmt, N, gen), weights(fmt, 2 * INTER, gen)
        bias = torch.randn(N, generator=gen)
        xdtypes = (torch.float32,) if fmt == "float32" else (torch.bfloat16,) if fmt == "bfloat16" else (
            torch.bfloat16, torch.float32)
        for xd in xdtypes:
            for rows in ROWS:
                x = torch.randn(rows, K, generator=gen).to(xd)
                h = hashlib.sha256()
                if pack_api is not None:
                    pw = pack_api(ops, fmt, w, bias.to(xd))
                    ps = pack_api(ops, fmt, w_silu)
                    h.update(ops.packed_gemm(x, pw, False).view(torch.uint8).numpy().tobytes())
                    h.update(ops.packed_gemm(x, pw, True).view(torch.uint8).numpy().tobytes())
                    h.update(ops.packed_gemm_silu(x, ps).view(torch.uint8).numpy().tobytes())
                else:
                    def old_pack(v: object, fmt: str = fmt) -> torch.Tensor:
                        if fmt == "q8_0":
                            return memory.pack_q8_0(*v)  # type: ignore[misc]
                        if fmt == "q4_0":
                            return memory.pack_q4_1(q4_0_as_q4_1(v))  # type: ignore[arg-type]
                        if fmt == "q4_1":
                            return memory.pack_q4_1(v)  # type: ignore[arg-type]
                        return memory.pack_weight(v)  # type: ignore[arg-type]
                    pw, ps = old_pack(w), old_pack(w_silu)
                    h.update(ops.packed_gemm(x, pw, N, bias.to(xd), False).view(torch.uint8).numpy().tobytes())
                    h.update(ops.packed_gemm(x, pw, N, bias.to(xd), True).view(torch.uint8).numpy().tobytes())
                    h.update(ops.packed_gemm_silu(x, ps, INTER).view(torch.uint8).numpy().tobytes())
                print(f"{fmt:9s} x={str(xd).removeprefix('torch.'):9s} rows={rows:5d} {h.hexdigest()[:16]}")


if __name__ == "__main__":
    with torch.inference_mode():
        main()
