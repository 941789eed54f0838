"""The weight formats the CPU plan computes on, as one table (ggml's
type_traits): each row says how to pack a weight of that format, which C++
GEMM serves it (csrc/formats.h, by name), and its bytes per weight.

A weight enters as its module holds it (`source_of`): a float Parameter
(bfloat16, float32) or GGUF blocks kept by model/quantization.py (Q8_0, Q4_1,
and Q4_0, Q5_0, Q4_K, Q5_K, Q6_K as KQUANT_FORMATS). `pack` turns it into a `PackedWeight` (csrc/formats.h:
format, out and in features, data, bias), the one argument every GEMM call
takes; the C++ dispatches on its format, never on a shape.

To add a format: a packer here and its row in FORMATS; in C++ its
WeightFormat, its kFormats row and its kernel (for a block format, a traits
struct for csrc/block_gemm.h: its group size and its tile, the dot product of
its blocks with int8 activations). `bytes_per_weight` is what the packed layout
holds for K a multiple of 64 (the memory rule: weights + KV cache + a bounded
runtime cost).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import nn

from tokenmill.backends.cpu.memory import mapped_zeros
from tokenmill.model.quantization import (
    KQUANT_FORMATS,
    KQuantFormat,
    kquant_of,
    kquant_parts_of,
    q4_0_as_q4_1,
    q4_1_of,
    q8_0_of,
)


class CppPackedWeight(Protocol):
    """A weight packed for the GEMM in one format (csrc/formats.h PackedWeight)."""

    format: int  # csrc/formats.h WeightFormat: the index of its kernel in weight_formats()
    n: int  # output features
    k: int  # input features
    data: torch.Tensor  # the format's packed layout
    bias: torch.Tensor  # [n], or empty: none
    parts: list[CppPackedWeight]  # format "parts": the output rows' parts, in order (else empty)


class PackingOps(Protocol):
    """What `pack` needs of the C++ module (kernels.CpuOps has it)."""

    def weight_formats(self) -> list[str]: ...

    def kq_pack(self, fmt: str, blocks: torch.Tensor, out: torch.Tensor) -> None: ...

    def q8_pack(self, q: torch.Tensor, d: torch.Tensor, out: torch.Tensor) -> None: ...

    def PackedWeight(self, *, format: int, n: int, k: int, data: torch.Tensor,
                     bias: torch.Tensor, parts: list[CppPackedWeight] = ...) -> CppPackedWeight: ...


@dataclass(frozen=True)
class WeightFormat:
    name: str
    kernel: str  # the C++ row that computes on it (csrc/formats.h kFormats' names)
    bytes_per_weight: float
    # (the C++ module, the source as `source_of` gives it) -> (packed data, out features, in features)
    pack: Callable[[PackingOps, Any], tuple[torch.Tensor, int, int]]


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] -> the layout packed_gemm reads front to back, zero rows
    padding N to a multiple of 16: bf16 (K even) [ceil(N/16), K/2, 16, 2] with
    packed[b, k // 2, j, k % 2] = weight[16 b + j, k]; float32
    [ceil(N/16), K, 16] with packed[b, k, j] = weight[16 b + j, k].
    On huge pages (mapped_zeros), which the GEMM streams faster."""
    n, k = weight.shape
    padded = -(-n // 16) * 16
    if padded != n:
        weight = torch.cat([weight, weight.new_zeros(padded - n, k)])
    if weight.dtype == torch.float32:
        packed = weight.reshape(padded // 16, 16, k).permute(0, 2, 1)
    else:
        packed = weight.reshape(padded // 16, 16, k // 2, 2).permute(0, 2, 1, 3)
    if packed.device.type != "cpu":
        return packed.contiguous()
    out = mapped_zeros(tuple(packed.shape), packed.dtype)
    out.copy_(packed)
    return out


def pack_q8_0(ops: PackingOps, q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks (q int8 [N, K], d float16 [N, K / 32]) -> the layout
    csrc/q8_gemm.cpp reads front to back, zero rows padding N to a multiple of
    16: uint8 [ceil(N/16), 64 ceil(K/64) + 16 K]. Groups of 16 outputs, three
    to a task (the last task 1-3); a task's groups interleaved, a pair of blocks
    (64 inputs) at a time: the float16 d of both blocks (block, group, lane:
    64 bytes a group), then for each block and 4 inputs kk the groups' 64-byte
    vpdpbusd operands (lane i's 4 values q + 128 at 4 i). An odd last block
    leaves out the pair's second block (its scales are zero padding). Every
    line holds one operand or scales. Written by csrc/q8_gemm.cpp's q8_pack in one
    pass on all threads, on huge pages (mapped_zeros), as pack_weight."""
    n, k = q.shape
    if k % 32 or tuple(d.shape) != (n, k // 32):
        raise ValueError(f"Q8_0 is q [N, K] with K a multiple of 32 and d [N, K / 32], "
                         f"got q {tuple(q.shape)} and d {tuple(d.shape)}")
    kb = k // 32
    out = mapped_zeros((-(-n // 16), 64 * -(-kb // 2) + 512 * kb), torch.uint8)
    ops.q8_pack(q, d, out)
    return out


def pack_q4_1(blocks: torch.Tensor) -> torch.Tensor:
    """GGUF Q4_1 blocks (uint8 [N, K / 32, 20]: float16 d, float16 m, 16 bytes
    of nibbles, value k < 16 the low nibble of byte k, k >= 16 the high one of
    byte k - 16) -> the layout csrc/q4_gemm.cpp reads front to back, zero rows
    padding N to a multiple of 16: uint8 [ceil(N/16), K/32, 320], each block
    the 16 outputs' d (32 bytes), their m (32 bytes), then for each 8 inputs 64
    bytes, byte 4 j + t holding q[16 g + j, 32 kb + 8 kk + t] in its low nibble
    and q[.., 32 kb + 8 kk + 4 + t] in its high one (two vpdpbusd operands once
    unpacked). On huge pages (mapped_zeros), as pack_weight."""
    n, kb = blocks.shape[0], blocks.shape[1]
    groups = -(-n // 16)
    if groups * 16 != n:
        blocks = torch.cat([blocks, blocks.new_zeros(groups * 16 - n, kb, 20)])
    grouped = blocks.reshape(groups, 16, kb, 20)
    d = grouped[..., 0:2].permute(0, 2, 1, 3).reshape(groups, kb, 32)
    m = grouped[..., 2:4].permute(0, 2, 1, 3).reshape(groups, kb, 32)
    qs = grouped[..., 4:]
    q = torch.cat([qs & 15, qs >> 4], dim=-1)  # [G, 16, KB, 32]: the values 0..15 in order
    q = q.reshape(groups, 16, kb, 4, 2, 4)  # (g, j, kb, kk, low/high, t)
    nibbles = (q[..., 0, :] | (q[..., 1, :] << 4)).permute(0, 2, 3, 1, 4)  # (g, kb, kk, j, t)
    out = mapped_zeros((groups, kb, 320), torch.uint8)
    out[:, :, :32].copy_(d)
    out[:, :, 32:64].copy_(m)
    out[:, :, 64:].copy_(nibbles.reshape(groups, kb, 256))
    return out


def kquant_block_bytes(fmt: KQuantFormat) -> int:
    """Bytes of one packed super-block of 16 outputs (csrc/kq_gemm.cpp's Fmt::BYTES)."""
    subs = fmt.block_values // fmt.sub
    header = 32 * (2 if fmt.mins else 1) + 16 * subs * (int(fmt.scales) + int(fmt.mins))
    return header + fmt.block_values // 32 * (256 + 64 * fmt.high_bits)


def pack_kquant(ops: PackingOps, fmt: KQuantFormat, blocks: torch.Tensor) -> torch.Tensor:
    """GGUF blocks of `fmt` (uint8 [N, K / SB, block_bytes], model/quantization.py's
    layouts) -> the layout csrc/kq_gemm.cpp reads front to back, zero rows padding N
    to a multiple of 16: uint8 [ceil(N/16), K / SB, kquant_block_bytes(fmt)], each
    super-block the 16 outputs' float16 d (and dmin), their sub-blocks' sc a byte each
    in lane order (and mn, a pair of sub-blocks at a time: byte 2 j + t of pair p
    lane j's mn of sub-block 2 p + t), then per 32 inputs the q's low nibbles as q4_gemm's
    operands (for 8 inputs kk, byte 4 j + t: q[j][8 kk + t] low, q[j][8 kk + 4 + t]
    high) and their high bits as 64-bit masks (bit 4 j + t; for each kk and bit, the
    low operand's then the high one's). Written by csrc/kq_pack.cpp in one pass on all
    threads, on huge pages (mapped_zeros), as pack_weight."""
    if blocks.dtype != torch.uint8 or blocks.dim() != 3 or blocks.shape[-1] != fmt.block_bytes:
        raise ValueError(f"{fmt.name} blocks are uint8 [N, K / {fmt.block_values}, {fmt.block_bytes}], "
                         f"got {blocks.dtype} {tuple(blocks.shape)}")
    out = mapped_zeros((-(-blocks.shape[0] // 16), blocks.shape[1], kquant_block_bytes(fmt)), torch.uint8)
    ops.kq_pack(fmt.name, blocks, out)
    return out


def _dense(ops: PackingOps, w: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    return pack_weight(w.detach()), w.shape[0], w.shape[1]


def _q8_0(ops: PackingOps, src: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, int, int]:
    q, d = src
    return pack_q8_0(ops, q, d), q.shape[0], q.shape[1]


def _q4_1(ops: PackingOps, blocks: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    return pack_q4_1(blocks), blocks.shape[0], blocks.shape[1] * 32


def _q4_0(ops: PackingOps, blocks: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    return _q4_1(ops, q4_0_as_q4_1(blocks))  # (m = -8 d: the same values, model/quantization.py)


def _kquant(fmt: KQuantFormat) -> Callable[[PackingOps, torch.Tensor], tuple[torch.Tensor, int, int]]:
    def packer(ops: PackingOps, blocks: torch.Tensor) -> tuple[torch.Tensor, int, int]:
        return pack_kquant(ops, fmt, blocks), blocks.shape[0], blocks.shape[1] * fmt.block_values

    return packer


FORMATS: dict[str, WeightFormat] = {f.name: f for f in (
    WeightFormat("bfloat16", "bfloat16", 2.0, _dense),
    WeightFormat("float32", "float32", 4.0, _dense),
    WeightFormat("q8_0", "q8_0", 1.0625, _q8_0),
    WeightFormat("q4_1", "q4_1", 0.625, _q4_1),
    # (Q4_0 as Q4_1: a fused module holding both; the loader keeps Q4_0 alone as q4_0)
    WeightFormat("q4_0_as_q4_1", "q4_1", 0.625, _q4_0),
    # The GGUF formats csrc/kq_gemm.cpp computes on: a super-block of 16 outputs is
    # 16 of the file's blocks, but Q4_K's / Q5_K's 6-bit scales unpacked (20 bytes for 16).
    *(WeightFormat(fmt.name.lower(), fmt.name.lower(), kquant_block_bytes(fmt) / (16 * fmt.block_values),
                   _kquant(fmt)) for fmt in KQUANT_FORMATS.values()),
)}


# A fused weight whose output rows are parts of different formats (quantization.kquant_parts_of):
# packed part by part, its GEMM each part's into its columns of y (csrc/formats.h kParts).
PARTS = "parts"


def source_of(module: nn.Module) -> tuple[str, Any]:
    """A Linear's weight as it holds it: (format name, what that row's pack takes), or
    (PARTS, [(format name, source), ...] in row order)."""
    parts = kquant_parts_of(module)
    if parts is not None:
        return PARTS, [(fmt.name.lower(), blocks) for fmt, blocks in parts]
    q8, q4, kq = q8_0_of(module), q4_1_of(module), kquant_of(module)
    if q8 is not None:
        return "q8_0", q8
    if q4 is not None:
        return "q4_1", q4
    if kq is not None:
        return kq[0].name.lower(), kq[1]
    weight = module.weight
    assert isinstance(weight, torch.Tensor)
    name = str(weight.dtype).removeprefix("torch.")
    if name not in FORMATS:
        raise ValueError(f"no packed weight format for {name} weights (the formats: {', '.join(FORMATS)})")
    return name, weight.detach()


def pack(ops: PackingOps, name: str, source: Any, bias: torch.Tensor | None = None) -> CppPackedWeight:
    """`source` in format `name` (a FORMATS row, or PARTS) packed for the GEMM, with its bias (or none)."""
    if name == PARTS:
        kernels_here = list(ops.weight_formats())
        if PARTS not in kernels_here:
            raise RuntimeError(f"the C++ kernels have no {PARTS!r} GEMM (they serve {kernels_here}): rebuild them")
        packed, first = [], 0
        for part_name, part_source in source:  # (k-quant blocks: [rows, ...])
            rows = part_source.shape[0]
            packed.append(pack(ops, part_name, part_source, None if bias is None else bias[first:first + rows]))
            first += rows
        return ops.PackedWeight(format=kernels_here.index(PARTS), n=first, k=packed[0].k,
                                data=torch.empty(0, dtype=torch.uint8),
                                bias=torch.empty(0), parts=packed)
    row = FORMATS.get(name)
    if row is None:
        raise ValueError(f"unknown weight format {name!r} (the formats: {', '.join(FORMATS)})")
    if any(t.device.type == "meta" for t in (source if isinstance(source, tuple) else (source,))):
        raise ValueError("this weight was released to a CPU plan (its module holds a meta tensor): load the model again")
    data, n, k = row.pack(ops, source)
    kernels_here = list(ops.weight_formats())
    if row.kernel not in kernels_here:
        raise RuntimeError(f"the C++ kernels have no {row.kernel!r} GEMM (they serve {kernels_here}): rebuild them")
    return ops.PackedWeight(format=kernels_here.index(row.kernel), n=n, k=k, data=data,
                            bias=torch.empty(0) if bias is None else bias.detach())


def pack_module(ops: PackingOps, module: nn.Module) -> CppPackedWeight:
    """A Linear's weight (and bias) packed in the format it holds."""
    bias = module.bias if isinstance(module.bias, torch.Tensor) else None
    return pack(ops, *source_of(module), bias)


def packed_bytes(weight: CppPackedWeight) -> int:
    """The bytes a packed weight holds (its data and bias, and its parts')."""
    return (weight.data.numel() * weight.data.element_size() + weight.bias.numel() * weight.bias.element_size()
            + sum(packed_bytes(part) for part in weight.parts))
