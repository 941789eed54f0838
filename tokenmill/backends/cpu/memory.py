"""The memory the CPU kernels read in long streams: the KV cache and the
packed weights, on anonymous maps with transparent huge pages."""

from __future__ import annotations

import ctypes
import math
import mmap
import sys
import threading
from collections.abc import Callable

import torch

from tokenmill.model.quantization import KQuantFormat, kquant_fields


def mapped_zeros(shape: tuple[int, ...], dtype: torch.dtype, populate: bool = False) -> torch.Tensor:
    """A zero-filled CPU tensor on an anonymous memory map that asks for
    transparent huge pages (MADV_HUGEPAGE; Linux's default THP mode gives them
    only where asked): streams over 4 KiB pages read markedly slower
    (docs/perf-notes.md). The OS zero-fills pages on first touch,
    so an unused part costs no memory, unless `populate` faults them all in
    now (populate_pages)."""
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if num_bytes == 0 or not hasattr(mmap, "MAP_ANONYMOUS"):  # (not a POSIX system)
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        buf.madvise(mmap.MADV_HUGEPAGE)
    out = torch.frombuffer(buf, dtype=dtype).view(shape)
    if populate:
        populate_pages(out)
    return out


MADV_POPULATE_WRITE = 23  # Linux >= 5.14 (Python 3.11's mmap module has no name for it)
_POPULATE_CHUNK_BYTES = 2 << 20  # a huge page


def populate_pages(t: torch.Tensor, num_threads: int | None = None) -> None:
    """Fault in every page of a contiguous CPU tensor now, its contents unchanged:
    madvise(MADV_POPULATE_WRITE) on `num_threads` (torch's) threads at once,
    each a run of huge pages (ctypes lets go of the GIL for the call), since
    faulting is slow enough to be worth sharing out; where that call is refused
    (an older kernel), one written byte a page."""
    num_bytes = t.numel() * t.element_size()
    if num_bytes == 0:
        return
    assert t.is_contiguous() and t.device.type == "cpu"
    threads = max(1, num_threads or torch.get_num_threads())
    chunk = -(-num_bytes // threads // _POPULATE_CHUNK_BYTES) * _POPULATE_CHUNK_BYTES
    ranges = [(lo, min(lo + chunk, num_bytes)) for lo in range(0, num_bytes, chunk)]
    refused: list[tuple[int, int]] = []

    def advise(lo: int, hi: int) -> None:
        if _madvise is None or _madvise(t.data_ptr() + lo, hi - lo, MADV_POPULATE_WRITE) != 0:
            refused.append((lo, hi))

    workers = [threading.Thread(target=advise, args=r) for r in ranges[1:]]
    for w in workers:
        w.start()
    advise(*ranges[0])
    for w in workers:
        w.join()
    flat = t.view(-1).view(torch.uint8)
    for lo, hi in refused:  # rewrite one byte of every 4 KiB page with itself
        page_bytes = flat[lo:hi:4096]
        page_bytes.copy_(page_bytes.clone())


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        f = libc.madvise
    except (OSError, AttributeError):
        return None
    f.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    f.restype = ctypes.c_int
    return f


_madvise = _libc_madvise()


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


def pack_q8_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks (q int8 [N, K], d float16 [N, K / 32]) -> the layout
    csrc/q8_gemm.cpp reads front to back, zero rows padding N to a multiple of
    16: uint8 [ceil(N/16), 64 ceil(K/64) + 16 K]. Groups of 16 outputs, three
    to a task (the last task 1-3); a task's groups interleaved, a pair of blocks
    (64 inputs) at a time: the float16 d of both blocks (block, group, lane:
    64 bytes a group), then for each block and 4 inputs kk the groups' 64-byte
    vpdpbusd operands (lane i's 4 values q + 128 at 4 i). An odd last block
    leaves out the pair's second block (its scales are zero padding). Every
    line holds one operand or scales. On huge pages (mapped_zeros), as pack_weight."""
    n, k = q.shape
    groups, kb = -(-n // 16), k // 32
    pairs = -(-kb // 2)
    group_bytes = 64 * pairs + 512 * kb
    q = torch.cat([q, q.new_zeros(groups * 16 - n, k)]) if groups * 16 != n else q
    d = torch.cat([d, d.new_zeros(groups * 16 - n, kb)]) if groups * 16 != n else d
    if kb % 2:  # a zero block completing the last pair (dropped below)
        q = torch.cat([q, q.new_zeros(groups * 16, 32)], 1)
        d = torch.cat([d, d.new_zeros(groups * 16, 1)], 1)
    out = mapped_zeros((groups, group_bytes), torch.uint8)
    flat = out.view(-1)
    full = groups // 3 * 3
    for g0, g1, nb in ((0, full, 3), (full, groups, groups - full)):
        if g1 == g0:
            continue
        tasks = (g1 - g0) // nb
        scales = d[g0 * 16:g1 * 16].reshape(tasks, nb, 16, pairs, 2).permute(0, 3, 4, 1, 2)  # [t, pair, l, j, i]
        scales = scales.contiguous().view(torch.uint8).reshape(tasks, pairs, 64 * nb)
        values = q[g0 * 16:g1 * 16].reshape(tasks, nb, 16, pairs, 2, 8, 4).permute(0, 3, 4, 5, 1, 2, 6)
        values = (values.to(torch.int16) + 128).to(torch.uint8).reshape(tasks, pairs, 1024 * nb)
        stretch = torch.cat([scales, values], 2).reshape(tasks, pairs * 1088 * nb)
        if kb % 2:
            stretch = stretch[:, : -512 * nb]
        flat[g0 * group_bytes:g1 * group_bytes].copy_(stretch.reshape(-1))
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


def pack_kquant(fmt: KQuantFormat, blocks: torch.Tensor) -> torch.Tensor:
    """GGUF blocks of `fmt` (uint8 [N, K / SB, block_bytes], model/quantization.py's
    layouts) -> the layout csrc/kq_gemm.cpp reads front to back, zero rows padding N
    to a multiple of 16: uint8 [ceil(N/16), K / SB, kquant_block_bytes(fmt)], each
    super-block the 16 outputs' float16 d (and dmin), their sub-blocks' sc (and mn) a
    byte each in lane order, then per 32 inputs the q's low nibbles as q4_gemm's
    operands (for 8 inputs kk, byte 4 j + t: q[j][8 kk + t] low, q[j][8 kk + 4 + t]
    high) and their high bits as 64-bit masks (bit 4 j + t; for each kk and bit, the
    low operand's then the high one's). On huge pages (mapped_zeros), as pack_weight."""
    n, nb = blocks.shape[0], blocks.shape[1]
    groups = -(-n // 16)
    if groups * 16 != n:
        blocks = torch.cat([blocks, blocks.new_zeros(groups * 16 - n, nb, fmt.block_bytes)])
    f = kquant_fields(fmt, blocks)
    chunks = fmt.block_values // 32

    def lanes(t: torch.Tensor) -> torch.Tensor:  # [G*16, nb, ...] -> [G, nb, ..., 16] as bytes
        t = t.reshape(groups, 16, nb, -1).permute(0, 2, 3, 1)
        return t.contiguous().view(torch.uint8).reshape(groups, nb, -1)

    parts = [lanes(f.d.unsqueeze(-1))]
    if f.dmin is not None:
        parts.append(lanes(f.dmin.unsqueeze(-1)))
    if f.sc is not None:
        parts.append(lanes(f.sc.to(torch.int8)))
    if f.mn is not None:
        parts.append(lanes(f.mn))
    q = f.q.reshape(groups, 16, nb, chunks, 4, 2, 4)  # (g, j, sb, c, kk, low/high operand, t)
    nibbles = ((q[..., 0, :] & 15) | ((q[..., 1, :] & 15) << 4)).permute(0, 2, 3, 4, 1, 5)  # (g, sb, c, kk, j, t)
    body = [nibbles.reshape(groups, nb, chunks, 256)]
    if fmt.high_bits:
        weights = torch.tensor([1 << i for i in range(8)], dtype=torch.int16)
        bits = torch.stack([(q >> (4 + b)) & 1 for b in range(fmt.high_bits)], dim=5)  # (g, j, sb, c, kk, b, h, t)
        bits = bits.permute(0, 2, 3, 4, 5, 6, 1, 7).reshape(groups, nb, chunks, 4, fmt.high_bits, 2, 8, 8)
        masks = (bits.to(torch.int16) * weights).sum(-1).to(torch.uint8)  # bit p = 4 j + t of 8 bytes
        body.append(masks.reshape(groups, nb, chunks, 64 * fmt.high_bits))
    parts.append(torch.cat(body, dim=-1).reshape(groups, nb, -1))
    packed = torch.cat(parts, dim=-1)
    assert packed.shape[-1] == kquant_block_bytes(fmt), (packed.shape, fmt)
    out = mapped_zeros(tuple(packed.shape), torch.uint8)
    out.copy_(packed)
    return out
