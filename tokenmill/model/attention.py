"""Paged attention: the backend interface and its portable torch reference (CPU and CUDA).

The KV cache of one layer is a single tensor

    kv_cache: [2, num_blocks, block_size, num_kv_heads, head_dim]   (0: K, 1: V)

(in the model's dtype; an 8-bit cache, `--kv-cache-dtype`, stores each head's
values in the entry model/kv_format.py describes, and is read in float32)

and a request's context lives in the blocks its block table lists, in order:

    block_table = [7, 2, 5], block_size = 4, seq_len = 10
    positions:  0 1 2 3 | 4 5 6 7 | 8 9 . .
    blocks:        7    |    2    |    5      ('.' is unused)

Each step first writes the new tokens' K/V at their slots, then every query
attends to its request's whole context read back from the cache (earlier
chunks and prefix-cache hits included), so both paths see the same data.
A sliding window W lets a query at position p see keys p - W + 1 .. p (HF's);
a logit soft-cap c (Gemma 2) maps each scaled score s to c * tanh(s / c)
before the mask and the softmax; sinks (gpt-oss) add a learned logit per query
head to each softmax's denominator, a key that has no value.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F

from tokenmill.model.attention_metadata import AttentionMetadata
from tokenmill.model.kv_format import gather, values, write_entries


class AttentionBackend(Protocol):
    """What LlamaAttention calls: a backend may run anywhere, as long as it
    reads and writes the cache layout above."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        logit_softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Write this step's k, v [num_tokens, num_kv_heads, head_dim] at their
        slots, then attend q [num_tokens, num_heads, head_dim] -> the same shape."""
        ...

    def attend(
        self,
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        logit_softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attend q to a cache that already holds this step's K/V."""
        ...


def write_kv_cache(
    k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store k, v: [num_tokens, num_kv_heads, head_dim] at their cache slots (in the cache's format)."""
    flat_cache = kv_cache.view(2, -1, *kv_cache.shape[3:])  # [2, num_slots, kv_heads, entry]
    write_entries(flat_cache[0], slot_mapping, k)
    write_entries(flat_cache[1], slot_mapping, v)


class TorchAttentionBackend:
    """Decodes in one batched computation; prefills one request at a time with
    SDPA. The reference that other backends (backends/cpu/attention.py) are
    tested against.

    `batch_invariant`: every query row, a prefill's included, runs the decode's
    computation (`_decode`: one row's bits do not depend on the other rows or
    the padding), in groups of rows, so a row gives the same bits in a decode,
    any chunk of a prompt, a recompute or after a prefix-cache hit. SDPA sums a
    prompt's rows in tiles that depend on the chunk (CpuBackendOptions.batch_invariant)."""

    # Rows per `_decode` call of an invariant prefill: each row gathers its
    # context, so a call holds rows x context x K/V row bytes (~6 MiB for 32
    # rows of 512 tokens of the default model).
    INVARIANT_ROWS = 32

    def __init__(self, batch_invariant: bool = False) -> None:
        self.batch_invariant = batch_invariant

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        v: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
        kv_cache: torch.Tensor,  # [2, num_blocks, block_size, num_kv_heads, head_dim]
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        logit_softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        write_kv_cache(k, v, kv_cache, meta.slot_mapping)
        return self.attend(q, kv_cache, meta, scale, sliding_window, logit_softcap, sinks)

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
        num_decodes = meta.num_decodes
        if (self.batch_invariant and num_decodes < meta.num_reqs and meta.token_seq_ids is not None
                and meta.token_seq_lens is not None):
            return self._rows_as_decodes(q, kv_cache, meta, scale, sliding_window, logit_softcap, sinks)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        if num_decodes == meta.num_reqs:  # decodes only: no copy
            return self._decode(q, kv_cache, meta, scale, sliding_window, logit_softcap, sinks)
        if num_decodes > 0:
            out[:num_decodes] = self._decode(q[:num_decodes], kv_cache, meta, scale, sliding_window,
                                             logit_softcap, sinks)
        for i in range(num_decodes, meta.num_reqs):
            start, end = meta.query_start_loc[i], meta.query_start_loc[i + 1]
            out[start:end] = self._prefill(
                q[start:end],
                kv_cache,
                meta.block_tables[i],
                meta.seq_lens[i],
                scale,
                sliding_window,
                logit_softcap,
                sinks,
            )
        return out

    def _rows_as_decodes(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        sliding_window: int | None,
        logit_softcap: float | None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        """Every token one decode: its sequence's block table row, its position + 1 as seq_len."""
        assert meta.token_seq_ids is not None and meta.token_seq_lens is not None
        tables = meta.block_tables[meta.token_seq_ids]  # [num_tokens, max_num_blocks]
        lens = meta.token_seq_lens
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        for start in range(0, q.shape[0], self.INVARIANT_ROWS):
            end = min(start + self.INVARIANT_ROWS, q.shape[0])
            rows_lens = lens[start:end].tolist()
            rows = AttentionMetadata(
                num_decodes=end - start, query_start_loc=list(range(end - start + 1)), seq_lens=rows_lens,
                max_decode_seq_len=max(rows_lens), slot_mapping=meta.slot_mapping[:0],
                block_tables=tables[start:end], decode_seq_lens=lens[start:end], block_size=meta.block_size)
            out[start:end] = self._decode(q[start:end], kv_cache, rows, scale, sliding_window, logit_softcap,
                                          sinks)
        return out

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
        num_decodes, num_heads, head_dim = q.shape
        num_kv_heads = kv_cache.shape[3]
        group = num_heads // num_kv_heads
        num_ctx_blocks = -(-meta.max_decode_seq_len // meta.block_size)
        block_tables = meta.block_tables[:num_decodes, :num_ctx_blocks]  # [B, nb]
        # [2, B, nb, block_size, kv_heads, head_dim] -> [2, B, kv_heads, L, head_dim]
        kv = values(gather(kv_cache, block_tables), q.dtype).flatten(2, 3).transpose(2, 3)
        key, value = kv[0], kv[1]
        out_dtype, q = q.dtype, q.to(key.dtype)  # (an 8-bit cache: float32)
        ctx_len = key.shape[2]  # L = nb * block_size >= every decode's seq_len

        # GQA without repeating K/V: the `group` query heads that share a KV head
        # are one small matrix. Query head h reads KV head h // group, as in HF.
        q = q.reshape(num_decodes, num_kv_heads, group, head_dim)
        scores = torch.matmul(q, key.transpose(-1, -2)).float() * scale  # [B, kv_heads, group, L]
        if logit_softcap is not None:
            scores = torch.tanh(scores / logit_softcap) * logit_softcap

        key_pos = torch.arange(ctx_len, device=q.device)  # [L]
        seq_lens = meta.decode_seq_lens[:, None]  # [B, 1]; the query sits at seq_len - 1
        visible = key_pos[None, :] < seq_lens  # [B, L]
        if sliding_window is not None:
            visible &= key_pos[None, :] > seq_lens - 1 - sliding_window
        scores.masked_fill_(~visible[:, None, None, :], float("-inf"))
        sink = None if sinks is None else sinks.float().view(1, num_kv_heads, group, 1)
        probs = _softmax(scores, sink).to(value.dtype)
        out = torch.matmul(probs, value)  # [B, kv_heads, group, head_dim]
        return out.reshape(num_decodes, num_heads, head_dim).to(out_dtype)

    def _prefill(
        self,
        q: torch.Tensor,  # [q_len, num_heads, head_dim]
        kv_cache: torch.Tensor,
        block_table: torch.Tensor,  # [max_num_blocks]
        seq_len: int,
        scale: float,
        sliding_window: int | None,
        logit_softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:  # [q_len, num_heads, head_dim]
        q_len = q.shape[0]
        num_blocks = -(-seq_len // kv_cache.shape[2])
        # [2, nb, block_size, kv_heads, head_dim] -> [2, kv_heads, seq_len, head_dim]
        kv = values(gather(kv_cache, block_table[:num_blocks]), q.dtype).flatten(1, 2)[:, :seq_len].transpose(1, 2)
        key, value = kv[0], kv[1]
        out_dtype, q = q.dtype, q.to(key.dtype)  # (an 8-bit cache: float32)

        # The queries are the last q_len tokens of the context: query i sits at
        # position seq_len - q_len + i and sees keys up to that position.
        mask: torch.Tensor | None = None
        if sliding_window is not None or q_len != seq_len:
            query_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)[:, None]
            key_pos = torch.arange(seq_len, device=q.device)[None, :]
            mask = key_pos <= query_pos  # [q_len, seq_len], True = attend
            if sliding_window is not None:
                mask &= key_pos > query_pos - sliding_window
        if logit_softcap is not None or sinks is not None:  # (SDPA has neither) the decode's arithmetic
            group = q.shape[1] // key.shape[0]
            qg = q.transpose(0, 1).reshape(key.shape[0], group, q_len, -1)  # [kv_heads, group, q_len, hd]
            scores = torch.matmul(qg, key[:, None].transpose(-1, -2)).float() * scale
            if logit_softcap is not None:
                scores = torch.tanh(scores / logit_softcap) * logit_softcap
            if mask is None:
                mask = torch.ones(q_len, seq_len, dtype=torch.bool, device=q.device).tril()
            scores.masked_fill_(~mask, float("-inf"))
            sink = None if sinks is None else sinks.float().view(key.shape[0], group, 1, 1)
            probs = _softmax(scores, sink).to(value.dtype)
            out_g = torch.matmul(probs, value[:, None])  # [kv_heads, group, q_len, hd]
            return out_g.reshape(q.shape[1], q_len, -1).transpose(0, 1).to(out_dtype)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None],  # [1, num_heads, q_len, head_dim]
            key[None],  # [1, kv_heads, seq_len, head_dim]
            value[None],
            attn_mask=mask,
            is_causal=mask is None,  # q_len == seq_len: plain causal
            scale=scale,
            enable_gqa=True,
        )
        return out[0].transpose(0, 1).to(out_dtype)  # [q_len, num_heads, head_dim]



def _softmax(scores: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim of float32 scores; with `sink` (gpt-oss: each query
    head's sink logit, float32, broadcastable to scores less their last dim, then 1)
    in the denominator too, as HF's concatenated column that it then drops."""
    if sink is None:
        return torch.softmax(scores, dim=-1)
    full = torch.cat([scores, sink.expand(*scores.shape[:-1], 1)], dim=-1)
    return torch.softmax(full, dim=-1)[..., :-1]
