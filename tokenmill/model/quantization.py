"""Weight quantization (opt-in `quantization="q8_0"`): GGUF's Q8_0 blocks kept
quantized in memory instead of dequantized to the compute dtype.

Q8_0 (llama.cpp's rule): each run of 32 values of a weight row is one block,
a float16 scale d = max|x| / 127 and 32 int8 q = round(x / d) (half away from
zero); the value it stands for is q * d. A quantized Linear or Embedding keeps
`qweight` (int8 [out, in]) and `qscale` (float16 [out, in / 32]) as buffers in
place of its `weight` Parameter; this reference model dequantizes them on the
fly (correctness only: slow); the CPU plan computes on the blocks themselves.
Norms and biases stay float.
"""

from __future__ import annotations

import torch
from torch import nn

Q8_0_BLOCK = 32  # values per block


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


def dense_weight(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The module's weight as a float tensor: its Parameter, or its blocks dequantized."""
    q8 = q8_0_of(module)
    if q8 is None:
        weight = module.weight
        assert isinstance(weight, torch.Tensor)
        return weight
    return dequantize_q8_0(*q8).to(dtype)


def embed_rows(module: nn.Module, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A quantized Embedding's rows for `ids`, dequantized (only those rows)."""
    q8 = q8_0_of(module)
    assert q8 is not None
    q, d = q8
    flat = ids.reshape(-1)
    rows = dequantize_q8_0(q.index_select(0, flat), d.index_select(0, flat)).to(dtype)
    return rows.reshape(*ids.shape, q.shape[-1])
