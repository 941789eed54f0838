"""Weight quantization (opt-in `quantization="q8_0"` or `"gguf"`): GGUF's
quantized blocks kept in memory instead of dequantized to the compute dtype.

Q8_0 (llama.cpp's rule): each run of 32 values of a weight row is one block,
a float16 scale d = max|x| / 127 and 32 int8 q = round(x / d) (half away from
zero); the value it stands for is q * d. A quantized Linear or Embedding keeps
`qweight` (int8 [out, in]) and `qscale` (float16 [out, in / 32]) as buffers in
place of its `weight` Parameter; this reference model dequantizes them on the
fly (correctness only: slow); the CPU plan computes on the blocks themselves.
Norms and biases stay float.

Q4_1 (quantization="gguf": a GGUF file's Q4_1 and Q4_0 tensors as they are):
each run of 32 values is one 20-byte block, float16 d and m, then 16 bytes of
4-bit q (value k < 16 in byte k's low nibble, k >= 16 in byte k - 16's high
one); the value is d * q + m. A module keeps the file's blocks as `q4_1`
(uint8 [out, in / 32, 20]). Q4_0 (18 bytes: d, then q, standing for (q - 8) d)
becomes Q4_1 with m = -8 d, the same values: 8 d is exact in float16, and
d q + (-8 d) is exact in float32.
"""

from __future__ import annotations

import torch
from torch import nn

Q8_0_BLOCK = 32  # values per block (Q4_1's too)
Q4_1_BYTES = 20  # a Q4_1 block: float16 d, float16 m, 32 nibbles


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [..., K], d float16 [..., K/32]) of `weight` [..., K] by llama.cpp's
    quantize_row_q8_0: q from the float32 d, then d stored as float16."""
    x = weight.detach().to(torch.float32)
    k = x.shape[-1]
    if k % Q8_0_BLOCK:
        raise ValueError(f"Q8_0 needs rows of a multiple of {Q8_0_BLOCK} values, got {k}")
    blocks = x.reshape(*x.shape[:-1], k // Q8_0_BLOCK, Q8_0_BLOCK)
    d = blocks.abs().amax(dim=-1) / 127.0
    inv = torch.where(d > 0, 1.0 / torch.where(d > 0, d, 1.0), 0.0)
    v = blocks * inv.unsqueeze(-1)
    q = torch.sign(v) * torch.floor(v.abs() + 0.5)  # C's roundf: half away from zero
    return q.to(torch.int8).reshape(x.shape), d.to(torch.float16)


def dequantize_q8_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """float32 q * d (exact: 8 and 11 significant bits), shaped as q."""
    k = q.shape[-1]
    blocks = q.reshape(*q.shape[:-1], k // Q8_0_BLOCK, Q8_0_BLOCK).to(torch.float32)
    return (blocks * d.to(torch.float32).unsqueeze(-1)).reshape(q.shape)


def q8_0_of(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A quantized module's (qweight, qscale), or None where it holds a float weight."""
    buffers = module._buffers
    q, d = buffers.get("qweight"), buffers.get("qscale")
    return None if q is None or d is None else (q, d)


def set_q8_0(module: nn.Module, q: torch.Tensor, d: torch.Tensor) -> None:
    """Make `module` (a Linear or Embedding) hold Q8_0 blocks instead of its float weight."""
    if "weight" in module._parameters:
        del module._parameters["weight"]
    module.register_buffer("qweight", q)
    module.register_buffer("qscale", d)


def dequantize_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_1 blocks uint8 [..., K/32, 20] -> float32 [..., K]: d * q (exact) + m,
    rounded once (as gguf's dequantize and csrc/q4_gemm.cpp's float path)."""
    d = blocks[..., 0:2].contiguous().view(torch.float16).to(torch.float32)  # [..., K/32, 1]
    m = blocks[..., 2:4].contiguous().view(torch.float16).to(torch.float32)
    qs = blocks[..., 4:]
    q = torch.cat([qs & 15, qs >> 4], dim=-1).to(torch.float32)  # [..., K/32, 32]
    return (q * d + m).reshape(*blocks.shape[:-2], blocks.shape[-2] * Q8_0_BLOCK)


def q4_0_as_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """Q4_0 blocks uint8 [..., 18] (d, 16 bytes of q) -> Q4_1 blocks [..., 20]
    with m = -8 d: the same values (module docstring)."""
    d = blocks[..., 0:2].contiguous().view(torch.float16)
    m = (d.to(torch.float32) * -8.0).to(torch.float16)
    if not bool(torch.isfinite(m).all()):
        raise ValueError("a Q4_0 block's scale is too large to keep as Q4_1 (|8 d| > 65504)")
    return torch.cat([blocks[..., 0:2], m.view(torch.uint8), blocks[..., 2:]], dim=-1)


def q4_1_of(module: nn.Module) -> torch.Tensor | None:
    """A module's Q4_1 blocks, or None where it holds none."""
    return module._buffers.get("q4_1")


def set_q4_1(module: nn.Module, blocks: torch.Tensor) -> None:
    """Make `module` (a Linear or Embedding) hold Q4_1 blocks instead of its float weight."""
    if "weight" in module._parameters:
        del module._parameters["weight"]
    module.register_buffer("q4_1", blocks)


def is_quantized(module: nn.Module) -> bool:
    """Whether `module` holds quantized blocks (Q8_0 or Q4_1) instead of a float weight."""
    return q8_0_of(module) is not None or q4_1_of(module) is not None


def dense_weight(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The module's weight as a float tensor: its Parameter, or its blocks dequantized."""
    q8, q4 = q8_0_of(module), q4_1_of(module)
    if q4 is not None:
        return dequantize_q4_1(q4).to(dtype)
    if q8 is None:
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        return weight
    return dequantize_q8_0(*q8).to(dtype)


def embed_rows(module: nn.Module, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A quantized Embedding's rows for `ids`, dequantized (only those rows)."""
    flat = ids.reshape(-1)
    q4 = q4_1_of(module)
    if q4 is not None:
        return dequantize_q4_1(q4.index_select(0, flat)).to(dtype).reshape(*ids.shape, -1)
    q8 = q8_0_of(module)
    assert q8 is not None
    q, d = q8
    rows = dequantize_q8_0(q.index_select(0, flat), d.index_select(0, flat)).to(dtype)
    return rows.reshape(*ids.shape, q.shape[-1])
