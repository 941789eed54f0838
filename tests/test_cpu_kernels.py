"""The C++ kernels agree with the reference torch code they stand in for: the paged
decode kernel within rounding, the fused elementwise ops bit for bit in bfloat16."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F

from tests.test_quantization_kquants import _random_blocks
from tokenmill.backends.cpu import formats, kernels, memory
from tokenmill.backends.cpu.attention import CpuAttentionBackend
from tokenmill.backends.cpu.plan import norm_weight
from tokenmill.model.attention import TorchAttentionBackend, write_kv_cache
from tokenmill.model.attention_metadata import AttentionMetadata
from tokenmill.model.llama import RMSNorm
from tokenmill.model.quantization import KQUANT_FORMATS, q4_0_as_q4_1, quantize_q8_0
from tokenmill.model.rope import RotaryEmbedding, apply_rotary_emb


@pytest.fixture(scope="module")
def kernel_available() -> None:
    if kernels.paged_attention_kernel() is None:
        pytest.skip(f"C++ kernels could not be built here: {kernels._failed}")


def decode_case(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, sliding_window: int | None,
    head_dim: int = 16,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size = 48, 4
    seq_lens = [1, 5, 17, 33, 8, 60, 2, 31]
    max_blocks = -(-max(seq_lens) // block_size)
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    # Each request gets its own scattered blocks; unused table entries are 0.
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in seq_lens:
        need = -(-n // block_size)
        tables.append(perm[:need] + [0] * (max_blocks - need))
        perm = perm[need:] + perm[:need]
    q = torch.randn(len(seq_lens), num_heads, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata(
        num_decodes=len(seq_lens),
        query_start_loc=list(range(len(seq_lens) + 1)),
        seq_lens=seq_lens,
        max_decode_seq_len=max(seq_lens),
        slot_mapping=torch.zeros(len(seq_lens), dtype=torch.int64),
        block_tables=torch.tensor(tables, dtype=torch.int64),
        decode_seq_lens=torch.tensor(seq_lens, dtype=torch.int64),
        block_size=block_size,
    )
    return q, kv_cache, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(6, 2), (4, 4)])
@pytest.mark.parametrize("sliding_window", [None, 7])
# 8: the plain C++ loop; 16: AVX-512 on float32 rows; 64, 128, 256: AVX512-BF16 for bf16.
@pytest.mark.parametrize("head_dim", [8, 16, 32, 64, 128, 256])
# A logit soft-cap (Gemma 2's) low enough to bend these scores.
@pytest.mark.parametrize("softcap", [None, 1.5])
# Attention sinks (gpt-oss's): a logit per head in the softmax, large enough to take most of it.
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_paged_attention_kernel_matches_torch(
    kernel_available: None, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
    sliding_window: int | None, head_dim: int, softcap: float | None, sinks: bool,
) -> None:
    q, kv_cache, meta = decode_case(dtype, num_heads, num_kv_heads, sliding_window, head_dim)
    sink = torch.linspace(-2.0, 3.0, num_heads).to(dtype) if sinks else None
    # (The bf16 reference rounds q.k to bf16 before scaling: at 256 dims and 0.25 the
    # scores' steps reach ~0.1, so the head's own scale there, as a model has it.)
    scale = 0.25 if head_dim <= 128 else head_dim**-0.5
    ours = CpuAttentionBackend()._decode(q, kv_cache, meta, scale, sliding_window, softcap, sink)
    ref = TorchAttentionBackend()._decode(q, kv_cache, meta, scale, sliding_window, softcap, sink)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("sliding_window", [None, 7])
@pytest.mark.parametrize("per_query_row", [True, False])
def test_kv_prefetch_stream_visits_the_rows_attention_reads(
    kernel_available: None, sliding_window: int | None, per_query_row: bool,
) -> None:
    """The stream of K/V rows that layer_stack's projections prefetch for the
    next layer (csrc/kv_prefetch.h) visits exactly the cache rows each query
    attends to, query by query in the kernel's order: a wrong row would only
    cost speed, silently, so it is checked here."""
    _, kv_cache, meta = decode_case(torch.bfloat16, 4, 2, sliding_window)
    bs = meta.block_size
    lens = meta.decode_seq_lens.tolist()
    # Queries read table rows 0..n-1 in order, or (as a step's seq_ids) other rows.
    req = list(range(len(lens))) if per_query_row else [3, 3, 0, 7, 5, 5, 1, 2]
    lens = lens if per_query_row else [meta.seq_lens[r] - (1 if i in (0, 4) else 0)
                                       for i, r in enumerate(req)]
    expected = []
    for r, n in zip(req, lens, strict=True):
        first = max(0, n - sliding_window) if sliding_window else 0
        expected += [int(meta.block_tables[r, t // bs]) * bs + t % bs for t in range(first, n)]
    visited = kernels.load().kv_prefetch_rows(
        kv_cache, meta.block_tables, torch.tensor(lens),
        torch.empty(0, dtype=torch.int64) if per_query_row else torch.tensor(req), sliding_window or 0)
    assert visited.tolist() == expected


def _fused_or_skip(x: torch.Tensor) -> object:
    ops = kernels.fused_ops(x)
    if ops is None:
        pytest.skip(f"C++ kernels could not be built here: {kernels._failed}")
    return ops


def _same(ours: torch.Tensor, ref: torch.Tensor) -> None:
    if ours.dtype == torch.bfloat16:  # every rounding step is torch's: equal bits
        assert torch.equal(ours, ref), (ours.float() - ref.float()).abs().max()
    else:  # float32: only the order of a sum (or exp's last bit) may differ
        torch.testing.assert_close(ours, ref, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("unit_offset", [False, True], ids=["w", "1+w"])
@pytest.mark.parametrize("exact_sums", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norms_match_torch(dtype: torch.dtype, exact_sums: bool, unit_offset: bool) -> None:
    """The norms round where torch's code rounds. The mean of squares is summed
    in another order than torch's (whose order depends on the machine's vector
    width): with random values the last bit of that sum can move a bf16
    rounding by one step; with values whose squares add up exactly in float32
    (multiples of 1/8 up to 2) the order cannot matter, and every bit must agree.
    Gemma's (1 + w) norms: the kernels take float32 1 + w and scale in float32."""
    gen = torch.Generator().manual_seed(1)
    if exact_sums:
        x = (torch.randint(-16, 17, (37, 576), generator=gen) / 8).to(dtype)
        residual = (torch.randint(-16, 17, (37, 576), generator=gen) / 8).to(dtype)
    else:
        x = (torch.randn(37, 576, generator=gen) * 3).to(dtype)
        residual = torch.randn(37, 576, generator=gen).to(dtype)
    norm = RMSNorm(576, 1e-5, None, dtype, unit_offset)
    norm.weight.data.copy_(torch.rand(576, generator=gen) + (-0.5 if unit_offset else 0.5))
    weight = norm_weight(norm)
    ops: Any = _fused_or_skip(x)
    same = _same if exact_sums or dtype == torch.float32 else _same_but_sum_order
    same(ops.rms_norm(x, weight, norm.eps), _torch_rms(norm, x))
    ref_residual = x + residual
    ref = _torch_rms(norm, ref_residual)
    xx, rr = x.clone(), residual.clone()
    ops.fused_add_rms_norm(xx, rr, weight, norm.eps)
    assert torch.equal(rr, ref_residual)
    same(xx, ref)


def _same_but_sum_order(ours: torch.Tensor, ref: torch.Tensor) -> None:
    """bf16 results whose only difference may be the last bit of a float32 sum
    before them: at most two bf16 steps apart, and nearly all equal."""
    # One step of bf16(x * inv) may become two of the result after the weight's product.
    steps = torch.maximum(ours.float().abs(), ref.float().abs()).clamp_min(2**-126) * 2**-6
    diff = (ours.float() - ref.float()).abs()
    assert bool((diff <= steps).all()), diff.max()
    assert (diff > 0).float().mean().item() < 0.02


def _torch_rms(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    return norm(x)  # (the reference model's RMSNorm: torch code only)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_silu_and_mul_matches_torch(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    gate_up = (torch.randn(33, 2 * 96, generator=gen) * 6).to(dtype)  # tails: exp clamps
    ops: Any = _fused_or_skip(gate_up)
    _same(ops.silu_and_mul(gate_up), F.silu(gate_up[:, :96]) * gate_up[:, 96:])


def test_fused_gelu_tanh_and_mul_gives_torchs_bits_in_bf16() -> None:
    """GeGLU (Gemma): bf16(gelu_tanh(gate)) * up, rounded, for every bf16 gate
    value (the kernel's table is torch's own GELU of each), up random."""
    gen = torch.Generator().manual_seed(4)
    gate = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(128, 512)
    up = torch.randn(128, 512, generator=gen).to(torch.bfloat16)
    gate_up = torch.cat([gate, up], dim=1)
    ops: Any = _fused_or_skip(gate_up)
    ours, ref = ops.gelu_tanh_and_mul(gate_up), F.gelu(gate, approximate="tanh") * up
    nan = ref.isnan()
    assert torch.equal(ours.isnan(), nan)  # (NaN gates; a NaN's payload aside)
    assert torch.equal(ours[~nan].view(torch.int16), ref[~nan].view(torch.int16))


def test_fused_gelu_tanh_and_mul_matches_torch_in_float32() -> None:
    """float32: torch's formula, a tanh of ~1e-7 absolute error: within a few
    float32 steps of the result's scale (where 1 + tanh cancels, torch's own
    rounding is the larger one)."""
    gen = torch.Generator().manual_seed(5)
    gate_up = torch.randn(33, 2 * 96, generator=gen) * 6
    ops: Any = _fused_or_skip(gate_up)
    ours = ops.gelu_tanh_and_mul(gate_up)
    ref = F.gelu(gate_up[:, :96], approximate="tanh") * gate_up[:, 96:]
    torch.testing.assert_close(ours, ref, atol=1e-6 * ref.abs().max().item(), rtol=1e-6)


@pytest.mark.parametrize("rows", [1, 3, 40])
def test_argmax_rows_matches_torch(rows: int) -> None:
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(rows, 1000, generator=gen)
    logits[:, 500] = logits.max(dim=-1).values  # ties: the first index wins
    if rows > 2:
        logits[1, 7] = float("nan")  # NaN counts as the largest
        logits[2] = float("-inf")  # a fully masked row: index 0
        logits[2, 900:] = float("inf")
    ops: Any = _fused_or_skip(logits)
    assert torch.equal(ops.argmax_rows(logits), logits.argmax(dim=-1))
    assert torch.equal(ops.argmax_rows(logits[:, :37]), logits[:, :37].argmax(dim=-1))  # strided


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [16, 64])
@pytest.mark.parametrize("qk_norm", [None, "w", "1+w"])
def test_fused_rope_and_cache_write_match_torch(dtype: torch.dtype, head_dim: int, qk_norm: str | None) -> None:
    """RoPE on q and k and the K/V write, after Qwen3's per-head q/k norms where
    given (Gemma 3's (1 + w): float32 1 + w, scaled in float32) (values whose
    squares add up exactly: every bit agrees, as in test_fused_norms_match_torch)."""
    gen = torch.Generator().manual_seed(3)
    tokens, heads, kv_heads = 29, 6, 2
    rope = RotaryEmbedding(head_dim, 10000.0, None, 4096)
    width = (heads + 2 * kv_heads) * head_dim
    qkv = (torch.randint(-16, 17, (tokens, width), generator=gen) / 8 if qk_norm
           else torch.randn(tokens, width, generator=gen)).to(dtype)
    positions = torch.randint(0, 4096, (tokens,), generator=gen)
    slots = torch.randperm(8 * 16, generator=gen)[:tokens]
    ops: Any = _fused_or_skip(qkv)
    offset = qk_norm == "1+w"
    q_norm, k_norm = (RMSNorm(head_dim, 1e-6, None, dtype, offset), RMSNorm(head_dim, 1e-6, None, dtype, offset))
    for norm in (q_norm, k_norm):
        norm.weight.data.copy_(torch.rand(head_dim, generator=gen) + (-0.5 if offset else 0.5))

    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = q.reshape(tokens, heads, head_dim), k.reshape(tokens, kv_heads, head_dim)
    if qk_norm:
        q, k = _torch_rms(q_norm, q), _torch_rms(k_norm, k)
    cos, sin = rope.cos_sin(positions, dtype)
    ref_q = apply_rotary_emb(q, cos, sin)
    ref_k = apply_rotary_emb(k, cos, sin)
    ref_cache = torch.zeros(2, 8, 16, kv_heads, head_dim, dtype=dtype)
    write_kv_cache(ref_k, v.reshape(tokens, kv_heads, head_dim), ref_cache, slots)

    ours = qkv.clone()
    cache = torch.zeros_like(ref_cache)
    none = torch.empty(0, dtype=dtype)
    ops.rope_qkv_cache(ours, heads, kv_heads, head_dim, positions, rope.cos_cache, rope.sin_cache, cache, slots,
                       norm_weight(q_norm) if qk_norm else none, norm_weight(k_norm) if qk_norm else none,
                       1e-6)
    _same(ours[:, : heads * head_dim].reshape(tokens, heads, head_dim), ref_q)
    _same(cache, ref_cache)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_weight_layout_on_a_mapped_tensor(dtype: torch.dtype) -> None:
    """pack_weight puts W[16 b + j, k] where packed_gemm reads it (zero rows
    padding N to 16), in a tensor of its own memory map (mapped_zeros: huge
    pages asked for), which outlives the weight it was packed from."""
    weight = torch.randn(40, 12).to(dtype)
    packed = formats.pack_weight(weight.clone())
    padded = torch.cat([weight, torch.zeros(8, 12, dtype=dtype)])
    if dtype == torch.float32:
        assert packed.shape == (3, 12, 16)
        for b, k, j in [(0, 0, 0), (1, 5, 3), (2, 11, 7), (2, 4, 15)]:
            assert packed[b, k, j] == padded[16 * b + j, k]
    else:
        assert packed.shape == (3, 6, 16, 2)
        for b, k, j in [(0, 0, 0), (1, 5, 3), (2, 11, 7), (2, 4, 15)]:
            assert packed[b, k // 2, j, k % 2] == padded[16 * b + j, k]
    assert packed.is_contiguous() and packed.dtype == dtype
    assert torch.equal(packed[2, :, 8:], torch.zeros_like(packed[2, :, 8:]))  # the padding rows
    zeros = memory.mapped_zeros((3, 5), dtype)
    assert zeros.shape == (3, 5) and zeros.dtype == dtype and not zeros.any()
    zeros[1, 2] = 7  # writable
    assert zeros.sum() == 7


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 13, 32, 200])
@pytest.mark.parametrize(("outputs", "bias"), [(48, False), (48, True), (40, True), (100, False)])
def test_packed_gemm_matches_float32_matmul(rows: int, outputs: int, bias: bool) -> None:
    # 48 outputs: one group of three 16-row blocks; 40 and 100: a short last
    # block (masked stores) and groups of one and two blocks; 32 rows: tiles
    # of 6 and 5 rows (AVX2); 200 rows of a small N: the rows split between threads.
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(rows, 96, generator=gen).to(torch.bfloat16)
    weight = (torch.randn(outputs, 96, generator=gen) * 0.1).to(torch.bfloat16)
    b = torch.randn(outputs, generator=gen).to(torch.bfloat16) if bias else None
    ops = kernels.packed_gemm_ops(x)
    if ops is None:
        pytest.skip("no packed bf16 kernel here (no AVX2 with FMA, or the kernels could not be built)")
    packed = formats.pack(ops, "bfloat16", weight, b)
    assert packed.data.shape == (-(-outputs // 16), 48, 16, 2) and (packed.n, packed.k) == (outputs, 96)
    ours = ops.packed_gemm(x, packed, False)
    # Exact products, float32 sums, one rounding to bf16: equal to the float32
    # matmul rounded once, up to the order of the sum (at most one bf16 step).
    ref = x.float() @ weight.float().T + (b.float() if b is not None else 0.0)
    assert ours.dtype == torch.bfloat16 and ours.shape == (rows, outputs)
    torch.testing.assert_close(ours.float(), ref, rtol=2**-8, atol=1e-3)
    torch.testing.assert_close(ours, F.linear(x, weight, b), rtol=2**-7, atol=1e-2)
    logits = ops.packed_gemm(x, packed, True)
    assert logits.dtype == torch.float32  # float32 out: the unrounded sums
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-4)
    # A row's bits do not depend on the rows beside it (other tiles, threads).
    for lo, hi in [(rows - 1, rows), (0, min(rows, 4)), (rows // 2, rows)]:
        assert torch.equal(ops.packed_gemm(x[lo:hi], packed, True), logits[lo:hi])


@pytest.mark.parametrize("rows", [1, 5, 6, 200])
@pytest.mark.parametrize(("outputs", "bias"), [(48, True), (40, False), (100, True)])
def test_packed_gemm_float32_matches_torch(rows: int, outputs: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(rows, 96, generator=gen)
    weight = torch.randn(outputs, 96, generator=gen) * 0.1
    b = torch.randn(outputs, generator=gen) if bias else None
    ops = kernels.packed_gemm_ops(x)
    if ops is None:
        pytest.skip("no AVX2/AVX-512 GEMM here (or the kernels could not be built)")
    packed = formats.pack(ops, "float32", weight, b)
    assert packed.data.shape == (-(-outputs // 16), 96, 16)
    ours = ops.packed_gemm(x, packed, False)
    assert ours.dtype == torch.float32 and ours.shape == (rows, outputs)
    # float32 sums in another order than torch's: equal up to rounding.
    torch.testing.assert_close(ours, F.linear(x, weight, b), rtol=1e-5, atol=1e-5)
    # A row's bits do not depend on the rows beside it (the tiles it falls in, threads).
    for lo, hi in [(rows - 1, rows), (0, min(rows, 4)), (rows // 2, rows)]:
        assert torch.equal(ops.packed_gemm(x[lo:hi], packed, False), ours[lo:hi])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 5, 6, 7, 8, 13, 32, 200, 600])
@pytest.mark.parametrize("inter", [16, 48, 96])
def test_packed_gemm_silu_gives_silu_and_mul_bits(rows: int, inter: int, dtype: torch.dtype) -> None:
    # silu(gate) * up straight from the gate_up GEMM's tiles: the bits of
    # silu_and_mul over the GEMM's output (LlamaMLP's two steps). 48: a group
    # of two (gate, up) pairs and one of one; 200 rows of a small N: rows
    # split between threads; 600: two stretches of rows.
    gen = torch.Generator().manual_seed(6)
    x = (torch.randn(rows, 96, generator=gen) * 2).to(dtype)
    weight = (torch.randn(2 * inter, 96, generator=gen) * 0.3).to(dtype)
    if dtype == torch.float32:  # (and activations past exp_approx's clamps, both ways)
        x[0, :4] = torch.tensor([300.0, -300.0, 0.0, -0.0])
    ops = kernels.packed_gemm_ops(x)
    if ops is None:
        pytest.skip(f"no packed kernel for {dtype} here (or the kernels could not be built)")
    name = str(dtype).removeprefix("torch.")
    packed = formats.pack(ops, name, weight)
    two_steps = ops.silu_and_mul(ops.packed_gemm(x, packed, False))
    fused = ops.packed_gemm_silu(x, packed)
    assert fused.shape == (rows, inter) and fused.dtype == dtype and torch.equal(fused, two_steps)
    gate_up = F.linear(x, weight).float()  # and near torch's own MLP activation
    torch.testing.assert_close(fused.float(), F.silu(gate_up[:, :inter]) * gate_up[:, inter:],
                               rtol=2**-6 if dtype == torch.bfloat16 else 1e-4,
                               atol=2e-2 if dtype == torch.bfloat16 else 1e-3)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        ops.packed_gemm_silu(x, formats.pack(ops, name, weight[:24]))


def test_packed_gemm_refuses_mismatched_shapes() -> None:
    x = torch.randn(3, 64).to(torch.bfloat16)
    ops = kernels.packed_gemm_ops(x)
    if ops is None:
        pytest.skip("no packed bf16 kernel here (no AVX2 with FMA, or the kernels could not be built)")
    weight = torch.randn(32, 96).to(torch.bfloat16)
    packed = formats.pack(ops, "bfloat16", weight)
    with pytest.raises(RuntimeError, match="K = 64"):
        ops.packed_gemm(x, packed, False)
    with pytest.raises(RuntimeError, match="n does not fit"):
        ops.packed_gemm(torch.randn(3, 96).to(torch.bfloat16), ops.PackedWeight(
            format=packed.format, n=33, k=96, data=packed.data, bias=torch.empty(0)), False)
    with pytest.raises(RuntimeError, match="weight's dtype"):  # the format says bf16: float32 x is refused
        ops.packed_gemm(torch.randn(3, 96), packed, False)
    with pytest.raises(RuntimeError, match="unknown format"):
        ops.PackedWeight(format=99, n=32, k=96, data=packed.data, bias=torch.empty(0))
    q8 = formats.pack(ops, "q8_0", quantize_q8_0(weight))  # a block format checks its bytes
    with pytest.raises(RuntimeError, match="groups of"):
        ops.packed_gemm(x, ops.PackedWeight(format=q8.format, n=32, k=64, data=q8.data, bias=torch.empty(0)),
                        False)


def test_the_format_table_matches_the_kernels() -> None:
    """Every row of formats.FORMATS names a C++ GEMM that exists, and packs to
    its bytes per weight (K a multiple of 64)."""
    ops = kernels.load()
    if ops is None or kernels.packed_gemm_ops(torch.empty(1, 2, dtype=torch.bfloat16)) is None:
        pytest.skip("the kernels could not be built here")
    # PARTS is no row: it runs a weight's parts, each through its own row's GEMM.
    assert set(ops.weight_formats()) == {row.kernel for row in formats.FORMATS.values()} | {formats.PARTS}
    gen = torch.Generator().manual_seed(9)
    w = torch.randn(48, 128, generator=gen)
    q, d = quantize_q8_0(w)
    q4_0 = torch.randint(0, 256, (48, 4, 18), dtype=torch.uint8, generator=gen)
    q4_0[..., 0:2] = torch.full((48, 4, 1), 0.01, dtype=torch.float16).view(torch.uint8)
    sources = {"bfloat16": w.to(torch.bfloat16), "float32": w, "q8_0": (q, d), "q4_1": q4_0_as_q4_1(q4_0),
               "q4_0_as_q4_1": q4_0, "q4_0": q4_0}
    for fmt in KQUANT_FORMATS.values():  # (the k-quants' rows a super-block of 256: K = 256)
        if fmt.name != "Q4_0":
            sources[fmt.name.lower()] = _random_blocks(fmt, 48, 256 if fmt.block_values == 256 else 128)
    for name, row in formats.FORMATS.items():
        packed = formats.pack(ops, name, sources[name])
        assert packed.n == 48 and packed.k in (128, 256)
        assert formats.packed_bytes(packed) == row.bytes_per_weight * 48 * packed.k, name
        x = torch.randn(2, packed.k, generator=gen).to(torch.float32 if name == "float32" else torch.bfloat16)
        assert ops.packed_gemm(x, packed, True).shape == (2, 48)


def mixed_step_case(
    dtype: torch.dtype, head_dim: int, block_size: int = 4,
    reqs: list[tuple[int, int]] | None = None, num_heads: int = 6, num_kv_heads: int = 2,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """Three decodes, then prefill chunks: a fresh prompt (7 tokens), a chunk of 5
    after 9 cached tokens, and a one-token chunk after 3 (a chunk, not a decode).
    `reqs`: other (tokens computed before this step, tokens scheduled now), decodes first."""
    gen = torch.Generator().manual_seed(5)
    # (tokens computed before this step, tokens scheduled now)
    reqs = reqs or [(10, 1), (1, 1), (20, 1), (0, 7), (9, 5), (3, 1)]
    num_blocks = sum(-(-(c + n) // block_size) for c, n in reqs) + 4
    seq_lens = [c + n for c, n in reqs]
    max_blocks = -(-max(seq_lens) // block_size)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in seq_lens:
        need = -(-n // block_size)
        tables.append(perm[:need] + [0] * (max_blocks - need))
        perm = perm[need:]
    query_start_loc = [0]
    for _, n in reqs:
        query_start_loc.append(query_start_loc[-1] + n)
    token_seq_ids = torch.tensor([i for i, (_, n) in enumerate(reqs) for _ in range(n)])
    positions = torch.tensor([c + j for c, n in reqs for j in range(n)])
    kv_cache = torch.randn(2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    q = torch.randn(query_start_loc[-1], num_heads, head_dim, generator=gen).to(dtype)
    num_decodes = next((i for i, (_, n) in enumerate(reqs) if n > 1), len(reqs))
    meta = AttentionMetadata(
        num_decodes=num_decodes,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        max_decode_seq_len=max(seq_lens[:num_decodes], default=0),
        slot_mapping=torch.zeros(len(token_seq_ids), dtype=torch.int64),  # unused by attend
        block_tables=torch.tensor(tables, dtype=torch.int64),
        decode_seq_lens=torch.tensor(seq_lens[:num_decodes], dtype=torch.int64),
        block_size=block_size,
        token_seq_ids=token_seq_ids,
        token_seq_lens=positions + 1,
    )
    return q, kv_cache, meta


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [8, 16, 64])
@pytest.mark.parametrize("sliding_window", [None, 5])
@pytest.mark.parametrize("sinks", [False, True], ids=["", "sinks"])
def test_one_kernel_call_serves_decodes_and_prefill_chunks(
    kernel_available: None, dtype: torch.dtype, head_dim: int, sliding_window: int | None, sinks: bool
) -> None:
    q, kv_cache, meta = mixed_step_case(dtype, head_dim)
    sink = torch.linspace(-1.0, 2.0, q.shape[1]).to(dtype) if sinks else None
    ours = CpuAttentionBackend().attend(q, kv_cache, meta, 0.3, sliding_window, None, sink)
    ref = TorchAttentionBackend().attend(q, kv_cache, meta, 0.3, sliding_window, None, sink)
    # (bf16: probabilities rounded to bf16 on both sides from float32 sums in two orders,
    # a sink's share normalised in the sum here and in the max there: an output's last bits.)
    tol = 1e-5 if dtype == torch.float32 else 3e-2 if sinks else 2e-2
    torch.testing.assert_close(ours.float(), ref.float(), atol=tol, rtol=tol)


# Long chunks: several 16-query tiles, keys past one 8-key group, odd and even
# contexts, 3 and 1 query heads a KV head.
LONG_CHUNKS = [(40, 1), (7, 1), (0, 37), (30, 40), (100, 2), (5, 17)]


@pytest.mark.parametrize("head_dim", [64, 128, 256])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (4, 4)])
@pytest.mark.parametrize("invariant", [True, False], ids=["as-decodes", "tiles"])
@pytest.mark.parametrize("softcap", [None, 1.5])
def test_prefill_chunks_match_torch(
    kernel_available: None, head_dim: int, num_heads: int, num_kv_heads: int, invariant: bool,
    softcap: float | None,
) -> None:
    """Batch-invariant (the default), a chunk's queries run as decodes; opted
    out, in 16-query tiles where the build has AVX512-BF16; a soft-cap on both."""
    q, kv_cache, meta = mixed_step_case(torch.bfloat16, head_dim, 16, LONG_CHUNKS, num_heads,
                                        num_kv_heads)
    ours = CpuAttentionBackend(batch_invariant=invariant).attend(q, kv_cache, meta, 0.125, None, softcap)
    ref = TorchAttentionBackend().attend(q, kv_cache, meta, 0.125, None, softcap)
    torch.testing.assert_close(ours.float(), ref.float(), atol=2e-2, rtol=2e-2)
    # With sinks the tiles stand aside: every query as a decode.
    sink = torch.linspace(-1.0, 2.0, num_heads).to(torch.bfloat16)
    ours = CpuAttentionBackend(batch_invariant=invariant).attend(q, kv_cache, meta, 0.125, None, softcap, sink)
    ref = TorchAttentionBackend().attend(q, kv_cache, meta, 0.125, None, softcap, sink)
    torch.testing.assert_close(ours.float(), ref.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("group", [1, 2, 3, 4, 5, 8])
def test_heads_sharing_a_kv_head_get_the_bits_of_one_head_alone(
    kernel_available: None, dtype: torch.dtype, head_dim: int, group: int
) -> None:
    """Decode scores several query heads of a KV head from one read of K (bf16
    with AVX512-BF16: up to 3 a pass; AVX2: up to 4 in one sweep over the rows,
    more in passes of 4): each head gets the bits it gets when it has a KV head
    of its own (the cache repeated once per head)."""
    kernel = kernels.paged_attention_kernel()
    assert kernel is not None
    q, kv_cache, meta = decode_case(dtype, 2 * group, 2, None, head_dim)
    args = (meta.block_tables, meta.decode_seq_lens, 0.125, 0, torch.empty(0, dtype=torch.int64))
    grouped = kernel(q, kv_cache, *args)
    alone = kernel(q, kv_cache.repeat_interleave(group, dim=3).contiguous(), *args)
    assert torch.equal(grouped, alone)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(9, 3), (6, 2), (4, 1)])
@pytest.mark.parametrize("sliding_window", [0, 7])
def test_fewer_queries_than_threads_give_the_bits_of_a_full_step(
    kernel_available: None, dtype: torch.dtype, num_heads: int, num_kv_heads: int, sliding_window: int
) -> None:
    """With fewer queries than threads the threads split each query's KV heads
    (paged_attention_avx512bf16); every query still gets the bits it gets among
    eight, where each thread takes whole queries."""
    kernel = kernels.paged_attention_kernel()
    assert kernel is not None
    q, kv_cache, meta = decode_case(dtype, num_heads, num_kv_heads, None, 64)
    none = torch.empty(0, dtype=torch.int64)
    before = torch.get_num_threads()
    try:
        for threads in (2, 3, 4):
            torch.set_num_threads(threads)
            whole = kernel(q, kv_cache, meta.block_tables, meta.decode_seq_lens, 0.125, sliding_window, none)
            for b in range(q.shape[0]):
                for width in range(1, threads):
                    rows = slice(b, min(b + width, q.shape[0]))
                    part = kernel(q[rows], kv_cache, meta.block_tables[rows], meta.decode_seq_lens[rows], 0.125,
                                  sliding_window, none)
                    assert torch.equal(part, whole[rows]), (threads, b, width)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("tiles", [False, True])
def test_a_chunk_query_does_not_depend_on_its_neighbours(kernel_available: None, tiles: bool) -> None:
    """A query of a prefill chunk gets the same bits whichever queries share its
    step or tile: here the chunk alone, and the chunk after other requests' queries
    (which moves where its tiles and the threads' shares start); without the
    tiles (batch invariance, the default) also each query alone, as a decode."""
    kernel = kernels.paged_attention_kernel()
    assert kernel is not None
    q, kv_cache, meta = mixed_step_case(torch.bfloat16, 64, 16, LONG_CHUNKS, 9, 3)
    assert meta.token_seq_ids is not None and meta.token_seq_lens is not None
    whole = kernel(q, kv_cache, meta.block_tables, meta.token_seq_lens, 0.125, 0, meta.token_seq_ids, tiles)
    start, end = meta.query_start_loc[3], meta.query_start_loc[4]  # the 40-token chunk after 30
    alone = kernel(q[start:end], kv_cache, meta.block_tables, meta.token_seq_lens[start:end], 0.125, 0,
                   meta.token_seq_ids[start:end], tiles)
    assert torch.equal(alone, whole[start:end])
    shifted = kernel(q[start + 5:end], kv_cache, meta.block_tables, meta.token_seq_lens[start + 5:end],
                     0.125, 0, meta.token_seq_ids[start + 5:end], tiles)
    assert torch.equal(shifted, whole[start + 5:end])
    if not tiles:
        for i in range(start, end):
            decode = kernel(q[i:i + 1], kv_cache, meta.block_tables, meta.token_seq_lens[i:i + 1], 0.125, 0,
                            meta.token_seq_ids[i:i + 1])
            assert torch.equal(decode, whole[i:i + 1]), i


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_reads_q_in_place_from_wider_rows(kernel_available: None, dtype: torch.dtype) -> None:
    # The model passes q as a view of its fused qkv rows (no copy): the same
    # numbers as a contiguous q.
    q, kv_cache, meta = mixed_step_case(dtype, 64)
    tokens, heads, head_dim = q.shape
    wide = torch.randn(tokens, heads * head_dim + 2 * kv_cache.shape[3] * head_dim).to(dtype)
    wide[:, : heads * head_dim] = q.reshape(tokens, -1)
    view = wide[:, : heads * head_dim].view(tokens, heads, head_dim)
    assert not view.is_contiguous()
    backend = CpuAttentionBackend()
    assert torch.equal(backend.attend(view, kv_cache, meta, 0.3, None), backend.attend(q, kv_cache, meta, 0.3, None))


def _faults_writing_every_page(t: torch.Tensor) -> int:
    """Minor page faults of this thread while one byte of every 4 KiB page of t is written."""
    import resource

    flat = t.view(-1).view(torch.uint8)
    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    flat[::4096].add_(0)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


@pytest.mark.parametrize("madvise", ["kernel", "refused"])
def test_populated_pages_take_no_faults_later(madvise: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """populate_pages faults a mapped tensor's pages in at once (the KV cache's, at
    start: worker/model_runner.zeros), contents unchanged, also where the kernel
    refuses MADV_POPULATE_WRITE (one byte a page written instead)."""
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("page faults counted through Linux's getrusage")
    if madvise == "refused":
        monkeypatch.setattr(memory, "_madvise", lambda addr, length, advice: -1)
    lazy = memory.mapped_zeros((16 << 20,), torch.int16)  # [32 MiB]
    assert _faults_writing_every_page(lazy) >= 16  # (16 huge pages, or 8192 small ones)

    t = memory.mapped_zeros((16 << 20,), torch.int16)
    t[::1000] = 7
    memory.populate_pages(t, num_threads=3)  # (ranges of whole huge pages, the last short)
    assert _faults_writing_every_page(t) <= 2
    assert t[::1000].eq(7).all() and t.ne(0).sum() == t[::1000].numel()

    populated = memory.mapped_zeros((5, 1000), torch.float32, populate=True)  # (one short range)
    assert _faults_writing_every_page(populated) == 0 and not populated.any()
