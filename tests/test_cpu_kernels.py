"""The C++ paged decode kernel agrees with the portable torch code it replaces."""

from __future__ import annotations

import pytest
import torch

from tokenmill.model import cpu_kernels
from tokenmill.model.attention import TorchAttentionBackend
from tokenmill.model.attention_metadata import AttentionMetadata


@pytest.fixture(scope="module")
def kernel_available() -> None:
    if cpu_kernels.paged_decode_kernel() is None:
        pytest.skip(f"C++ kernels could not be built here: {cpu_kernels._failed}")


def decode_case(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, sliding_window: int | None
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    gen = torch.Generator().manual_seed(0)
    num_blocks, block_size, head_dim = 40, 4, 16
    seq_lens = [1, 5, 17, 33, 8, 60]
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
def test_paged_decode_kernel_matches_torch(
    kernel_available: None, dtype: torch.dtype, num_heads: int, num_kv_heads: int,
    sliding_window: int | None,
) -> None:
    q, kv_cache, meta = decode_case(dtype, num_heads, num_kv_heads, sliding_window)
    scale = 0.25
    ours = TorchAttentionBackend(use_cpp_kernels=True)._decode(q, kv_cache, meta, scale, sliding_window)
    ref = TorchAttentionBackend(use_cpp_kernels=False)._decode(q, kv_cache, meta, scale, sliding_window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(ours.float(), ref.float(), atol=tol, rtol=tol)
