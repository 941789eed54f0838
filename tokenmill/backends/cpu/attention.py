"""Paged attention on the C++ kernel (csrc/paged_attention.cpp): one call per
layer serves a whole step, every token one query reading K/V in place from its
blocks (no gathered copies), a prefill chunk's tokens each seeing the context
up to its own position (a logit soft-cap, Gemma 2's, and attention sinks,
gpt-oss's, included). Where the kernel does not apply (another device or
dtype, per-request metadata with prefills), the torch reference serves."""

from __future__ import annotations

from typing import NamedTuple

import torch

from tokenmill.backends.cpu import kernels
from tokenmill.model.attention import TorchAttentionBackend
from tokenmill.model.attention_metadata import AttentionMetadata
from tokenmill.model.kv_format import format_of

_ROW_PER_QUERY = torch.empty(0, dtype=torch.int64)  # the kernel's "query i uses row i"


def kernel_reads(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the kernel serves q on this cache: on the CPU, the cache in q's
    dtype or an 8-bit format (model/kv_format.py), the kernels built."""
    return (q.device.type == "cpu" and (q.dtype == kv_cache.dtype or format_of(kv_cache).quantized)
            and kernels.load() is not None)


class KernelCall(NamedTuple):
    """paged_attention's per-step arguments: the same for every layer of a step."""

    tables: torch.Tensor  # block tables [KV groups, num_reqs, max_num_blocks] (AttentionMetadata.tables_by_group)
    seq_lens: torch.Tensor  # each query's seq_len (it sits at seq_len - 1)
    seq_ids: torch.Tensor  # each query's sequence (its row of tables); empty: query i is sequence i

    def rows(self, output_rows: torch.Tensor) -> KernelCall:
        """The same call for the queries in `output_rows` only."""
        rows = self.seq_ids[output_rows] if self.seq_ids.numel() else output_rows
        return KernelCall(self.tables, self.seq_lens[output_rows], rows)


class CpuAttentionBackend(TorchAttentionBackend):
    """An AttentionBackend (model/attention.py) with the C++ kernel; the CPU plan
    also asks it for `kernel_call` once a step and calls `run` per layer."""

    def kernel_call(self, q: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata) -> KernelCall | None:
        """The kernel's arguments for this step where one call per layer serves
        the whole step, else None (the torch code serves)."""
        if not kernel_reads(q, kv_cache):
            return None
        if meta.token_seq_ids is not None and meta.token_seq_lens is not None:
            # Every token one query, prefill chunks included.
            return KernelCall(meta.tables_by_group(), meta.token_seq_lens, meta.token_seq_ids)
        if meta.num_decodes == meta.num_reqs:  # decodes only: query i is request i
            return KernelCall(meta.tables_by_group()[:, : q.shape[0]], meta.decode_seq_lens, _ROW_PER_QUERY)
        return None

    def run(self, call: KernelCall, q: torch.Tensor, kv_cache: torch.Tensor, scale: float,
            sliding_window: int | None, logit_softcap: float | None = None, group: int = 0,
            sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [num_queries, num_heads, head_dim] -> the same shape, through the kernel, on
        KV group `group`'s tables; `sinks`: [num_heads], any float dtype."""
        ops = kernels.load()
        assert ops is not None, "kernel_call gave a call: the kernels are loaded"
        return ops.paged_attention(q, kv_cache, call.tables[group], call.seq_lens, scale, sliding_window or 0,
                                   call.seq_ids, prefill_tiles=not self.batch_invariant,
                                   logit_softcap=logit_softcap or 0.0,
                                   sinks=None if sinks is None else sinks.float().contiguous())

    def attend(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,  # this step's K/V already written
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        logit_softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        call = self.kernel_call(q, kv_cache, meta)
        if call is not None:
            return self.run(call, q, kv_cache, scale, sliding_window, logit_softcap, sinks=sinks)
        return super().attend(q, kv_cache, meta, scale, sliding_window, logit_softcap, sinks)

    def _decode(
        self,
        q: torch.Tensor,  # [num_decodes, num_heads, head_dim]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        logit_softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_decodes, num_heads, head_dim]
        # The decodes of a mixed step with per-request metadata: the kernel, the prefills torch's.
        if kernel_reads(q, kv_cache):
            call = KernelCall(meta.block_tables[: q.shape[0]].unsqueeze(0), meta.decode_seq_lens, _ROW_PER_QUERY)
            return self.run(call, q, kv_cache, scale, sliding_window, logit_softcap, sinks=sinks)
        return super()._decode(q, kv_cache, meta, scale, sliding_window, logit_softcap, sinks)
