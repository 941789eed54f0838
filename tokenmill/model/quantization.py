"""Weight quantization (opt-in `quantization="q8_0"` or `"gguf"`): GGUF's
quantized blocks kept in memory instead of dequantized to the compute dtype.

Q8_0 (llama.cpp's rule): each run of 32 values of a weight row is one block,
a float16 scale d = max|x| / 127 and 32 int8 q = round(x / d) (half away from
zero); the value it stands for is q * d. A quantized Linear or Embedding keeps
`qweight` (int8 [out, in]) and `qscale` (float16 [out, in / 32]) as buffers in
place of its `weight` Parameter; this reference model dequantizes them on the
fly (correctness only: slow); the CPU plan computes on the blocks themselves.
Norms and biases stay float.

Q4_1 (quantization="gguf": a GGUF file's Q4_1 tensors as they are): each run
of 32 values is one 20-byte block, float16 d and m, then 16 bytes of 4-bit q
(value k < 16 in byte k's low nibble, k >= 16 in byte k - 16's high one); the
value is d * q + m. A module keeps the file's blocks as `q4_1` (uint8 [out,
in / 32, 20]). Q4_0 (18 bytes: d, then q, standing for (q - 8) d) fused with
Q4_1 becomes Q4_1 with m = -8 d, the same values: 8 d is exact in float16, and
d q + (-8 d) is exact in float32.

Q4_0, Q5_0, Q4_K, Q5_K, Q6_K (quantization="gguf", KQUANT_FORMATS below): a
module whose tensors are all of one of these types keeps the file's blocks as
they are, as the buffer named after the type (`q4_k`: uint8 [out, in / 256,
144]); dequantize_kquant gives gguf-py's values.
"""

from __future__ import annotations

from dataclasses import dataclass

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
    """Whether `module` holds quantized blocks (Q8_0, Q4_1 or a KQUANT_FORMATS type)
    instead of a float weight."""
    return (q8_0_of(module) is not None or q4_1_of(module) is not None or kquant_of(module) is not None
            or kquant_parts_of(module) is not None)


def dense_weight(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """The module's weight as a float tensor: its Parameter, or its blocks dequantized."""
    q8, q4, kq, parts = q8_0_of(module), q4_1_of(module), kquant_of(module), kquant_parts_of(module)
    if kq is not None:
        return dequantize_kquant(*kq).to(dtype)
    if parts is not None:
        return torch.cat([dequantize_kquant(fmt, blocks) for fmt, blocks in parts]).to(dtype)
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
    kq = kquant_of(module)
    if kq is not None:
        fmt, blocks = kq
        return dequantize_kquant(fmt, blocks.index_select(0, flat)).to(dtype).reshape(*ids.shape, -1)
    q4 = q4_1_of(module)
    if q4 is not None:
        return dequantize_q4_1(q4.index_select(0, flat)).to(dtype).reshape(*ids.shape, -1)
    q8 = q8_0_of(module)
    assert q8 is not None
    q, d = q8
    rows = dequantize_q8_0(q.index_select(0, flat), d.index_select(0, flat)).to(dtype)
    return rows.reshape(*ids.shape, q.shape[-1])


@dataclass(frozen=True)
class KQuantFormat:
    """A GGUF block type that quantization="gguf" keeps as the file has it and
    csrc/kq_gemm.cpp computes on (backends/cpu/formats.pack_kquant repacks it). A block of
    `block_values` values (`block_bytes` bytes) stands for integers q of 4 +
    `high_bits` bits and the value of one is (d sc) (q - offset) - (dmin mn),
    sc and mn per `sub` values (1 and 0 where the type has none)."""

    name: str
    block_values: int
    block_bytes: int
    sub: int
    high_bits: int
    offset: int
    scales: bool  # a 6-bit (Q6_K: int8) scale per sub-block
    signed_scales: bool
    mins: bool  # dmin and a 6-bit min per sub-block


# GGUF's layouts (gguf-py's quants.py, llama.cpp's ggml-common.h), a block each:
#   Q4_0 (18 bytes): f16 d, 16 bytes of q (value k < 16 the low nibble of byte k, else
#        the high nibble of byte k - 16); d (q - 8)
#   Q5_0 (22): f16 d, u32 qh (bit k: q's bit 4 of value k), 16 bytes as Q4_0; d (q - 16)
#   Q4_K (144): f16 d, f16 dmin, 12 bytes of eight 6-bit sc and mn, 128 bytes of q:
#        values 64 c + i the low nibble of byte 32 c + i, 64 c + 32 + i its high one;
#        (d sc) q - (dmin mn), sc and mn of value k's sub-block k // 32
#   Q5_K (176): as Q4_K with 32 bytes qh before the 128 of q (bit b of byte i: bit 4
#        of value 32 b + i)
#   Q6_K (210): 128 bytes ql, 64 bytes qh, 16 int8 sc, f16 d; value 128 h + 64 p + i's
#        low 4 bits in byte 64 h + i (p: high nibble), value 128 h + 32 p + i's top 2
#        bits at bit 2 p of byte 32 h + i; (d sc) (q - 32), sc per 16 values
KQUANT_FORMATS: dict[str, KQuantFormat] = {
    f.name: f for f in (
        KQuantFormat("Q4_0", 32, 18, 32, 0, 8, False, False, False),
        KQuantFormat("Q5_0", 32, 22, 32, 1, 16, False, False, False),
        KQuantFormat("Q4_K", 256, 144, 32, 0, 0, True, False, True),
        KQuantFormat("Q5_K", 256, 176, 32, 1, 0, True, False, True),
        KQuantFormat("Q6_K", 256, 210, 16, 2, 32, True, True, False),
    )
}


@dataclass
class KQuantFields:
    """A tensor's blocks unpacked: q uint8 [..., nb, block_values] (the unsigned
    integers), d and dmin float16 [..., nb], sc int16 and mn uint8 [..., nb, subs]
    (None where the format has none)."""

    q: torch.Tensor
    d: torch.Tensor
    dmin: torch.Tensor | None
    sc: torch.Tensor | None
    mn: torch.Tensor | None


def _half(b: torch.Tensor) -> torch.Tensor:
    return b.contiguous().view(torch.float16).squeeze(-1)


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """Bytes [..., n] -> [..., 2 n]: the low nibbles, then the high ones."""
    return torch.cat([qs & 15, qs >> 4], dim=-1)


def _bits(b: torch.Tensor, shifts: range, width: int) -> torch.Tensor:
    """[..., n] bytes -> [..., len(shifts), n]: (b >> shift) & (2^width - 1) for each shift."""
    return torch.stack([(b >> s) & ((1 << width) - 1) for s in shifts], dim=-2)


def kquant_fields(fmt: KQuantFormat, blocks: torch.Tensor) -> KQuantFields:
    """uint8 blocks [..., nb, block_bytes] of `fmt` -> their fields (layouts above)."""
    if blocks.dtype != torch.uint8 or blocks.shape[-1] != fmt.block_bytes:
        raise ValueError(f"{fmt.name} blocks are uint8 [..., {fmt.block_bytes}], got {blocks.dtype} {tuple(blocks.shape)}")
    lead = blocks.shape[:-1]
    if fmt.name in ("Q4_0", "Q5_0"):
        q = _nibbles(blocks[..., -16:])
        if fmt.name == "Q5_0":
            q = q | (_bits(blocks[..., 2:6], range(8), 1).transpose(-1, -2).reshape(*lead, 32) << 4)
        return KQuantFields(q, _half(blocks[..., 0:2]), None, None, None)
    if fmt.name in ("Q4_K", "Q5_K"):
        raw = blocks[..., 4:16].reshape(*lead, 3, 4)
        dd, mm, md = raw[..., 0, :], raw[..., 1, :], raw[..., 2, :]
        sc = torch.cat([dd & 63, (md & 15) | ((dd >> 2) & 0x30)], dim=-1)
        mn = torch.cat([mm & 63, (md >> 4) | ((mm >> 2) & 0x30)], dim=-1)
        q = _nibbles(blocks[..., -128:].reshape(*lead, 4, 32)).reshape(*lead, 256)
        if fmt.name == "Q5_K":
            q = q | (_bits(blocks[..., 16:48], range(8), 1).reshape(*lead, 256) << 4)
        return KQuantFields(q, _half(blocks[..., 0:2]), _half(blocks[..., 2:4]), sc.to(torch.int16), mn)
    assert fmt.name == "Q6_K", fmt.name
    low = _nibbles(blocks[..., 0:128].reshape(*lead, 2, 64)).reshape(*lead, 256)
    high = _bits(blocks[..., 128:192].reshape(*lead, 2, 32), range(0, 8, 2), 2).reshape(*lead, 256)
    sc = blocks[..., 192:208].contiguous().view(torch.int8).to(torch.int16)
    return KQuantFields(low | (high << 4), _half(blocks[..., 208:210]), None, sc, None)


def dequantize_kquant(fmt: KQuantFormat, blocks: torch.Tensor) -> torch.Tensor:
    """uint8 blocks [..., nb, block_bytes] -> float32 [..., nb * block_values], each
    value computed as gguf-py's dequantize does (float32, its order of operations)."""
    f = kquant_fields(fmt, blocks)
    lead, subs = blocks.shape[:-1], fmt.block_values // fmt.sub
    q = (f.q.to(torch.int16) - fmt.offset).to(torch.float32).reshape(*lead, subs, fmt.sub)
    scale = f.d.to(torch.float32).unsqueeze(-1)  # [..., nb, 1]
    if f.sc is not None:
        scale = scale * f.sc.to(torch.float32)  # d sc: exact (11 + 8 significant bits)
    w = scale.unsqueeze(-1) * q
    if f.mn is not None and f.dmin is not None:
        w = w - (f.dmin.to(torch.float32).unsqueeze(-1) * f.mn.to(torch.float32)).unsqueeze(-1)
    return w.reshape(*blocks.shape[:-2], blocks.shape[-2] * fmt.block_values)


def kquant_of(module: nn.Module) -> tuple[KQuantFormat, torch.Tensor] | None:
    """A module's blocks of a KQUANT_FORMATS type (its buffer is the type's name in
    lower case: `q4_k` ...) with their format, or None where it holds none."""
    for fmt in KQUANT_FORMATS.values():
        blocks = module._buffers.get(fmt.name.lower())
        if blocks is not None:
            return fmt, blocks
    return None


def kquant_parts_of(module: nn.Module) -> list[tuple[KQuantFormat, torch.Tensor]] | None:
    """A fused module's parts of different KQUANT_FORMATS types, in the order of their
    output rows (buffers `<type>_part<i>`: `q4_k_part0`, `q6_k_part1` ...), or None."""
    parts: dict[int, tuple[KQuantFormat, torch.Tensor]] = {}
    for name, blocks in module._buffers.items():
        kind, _, index = name.partition("_part")
        if index.isdigit() and kind.upper() in KQUANT_FORMATS and blocks is not None:
            parts[int(index)] = (KQUANT_FORMATS[kind.upper()], blocks)
    return [parts[i] for i in sorted(parts)] or None


def is_kquant_part(name: str) -> bool:
    """Whether a buffer's name is one of kquant_parts_of's."""
    kind, _, index = name.partition("_part")
    return index.isdigit() and kind.upper() in KQUANT_FORMATS


def set_kquant_parts(module: nn.Module, parts: list[tuple[KQuantFormat, torch.Tensor]]) -> None:
    """Make a fused `module` (a Linear) hold its output rows as consecutive parts, each
    of its own type's blocks as the file has them, instead of its float weight."""
    if "weight" in module._parameters:
        del module._parameters["weight"]
    for i, (fmt, blocks) in enumerate(parts):
        module.register_buffer(f"{fmt.name.lower()}_part{i}", blocks)


def set_kquant(module: nn.Module, fmt: KQuantFormat, blocks: torch.Tensor) -> None:
    """Make `module` (a Linear or Embedding) hold `fmt`'s blocks (uint8 [out, in /
    block_values, block_bytes], as the file has them) instead of its float weight."""
    if "weight" in module._parameters:
        del module._parameters["weight"]
    module.register_buffer(fmt.name.lower(), blocks)
