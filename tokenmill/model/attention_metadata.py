"""Per-forward attention metadata: an explicit argument down to every layer.

The batch is ragged: all scheduled tokens of all requests concatenated, no
padding. Requests are ordered decodes first (query length 1), then prefills
(query length > 1: a whole prompt, a chunk of one, or a recompute):

    tokens:   [d0 d1 d2 | p0 p0 p0 p0 | p1 p1]
    req:        0  1  2    3            4
    query_start_loc = [0, 1, 2, 3, 7, 9]   num_decodes = 3

A request verifying k speculative drafts (its new token and the drafts, k + 1
rows) is k + 1 decode sequences, one a row, over its block table row repeated,
with contexts L + 1 .. L + k + 1 (seq_req says which sequences are one request):

    tokens:   [d0 | s0 s0 s0 | p0 p0]     s0: a new token and 2 drafts
    seq:        0    1  2  3   4          seq_req = [0, 1, 1, 1, 2]
    query_start_loc = [0, 1, 2, 3, 4, 6]   num_decodes = 4

Every K/V of a step is written before any row attends, so a row sees the
drafts before it; and each row runs the decode kernels, which round exactly
as decoding one token a step does (speculation leaves greedy output unchanged).

Cache slots: slot = block_id * block_size + offset_in_block.

KV layer groups (core/kv_layout.py: layers with a sliding window that frees
blocks): each group has its own block tables and slots, stacked in
group_block_tables / group_slot_mapping; block_tables and slot_mapping are
group 0's, and `for_layer(i)` is the metadata layer i reads (its group's).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch


@dataclass
class AttentionMetadata:
    # "Requests" below are the attention's sequences: the scheduled requests,
    # except a request verifying drafts, which is one sequence per row (seq_req).
    num_decodes: int  # the first num_decodes requests each have exactly one query token
    # Python ints, used for slicing without device syncs.
    query_start_loc: list[int]  # [num_reqs + 1] cumulative query lengths
    seq_lens: list[int]  # [num_reqs] context length after this step (computed + scheduled)
    max_decode_seq_len: int  # max of seq_lens over the decodes (0 if none)
    # Device tensors.
    slot_mapping: torch.Tensor  # [num_tokens] int64: cache slot for each new token's K/V
    block_tables: torch.Tensor  # [num_reqs, max_num_blocks] int64, padded with 0
    decode_seq_lens: torch.Tensor  # [num_decodes] int64, seq_lens of the decodes
    block_size: int
    # Per token (for kernels that treat every token as one query, prefills
    # included): its sequence (its row of block_tables), and the context it
    # sees (its position + 1). None where the builder did not provide them.
    token_seq_ids: torch.Tensor | None = None  # [num_tokens] int64
    token_seq_lens: torch.Tensor | None = None  # [num_tokens] int64
    # The one map from sequences to requests: seq_req[i] is sequence i's
    # request, its index among the step's scheduled requests. Set only where
    # some request is several decode sequences (verifying drafts); None: sequence
    # i is request i. Rows of one request must stay on one thread (row i reads
    # the K/V row i - 1 writes).
    seq_req: list[int] | None = None
    # Several KV layer groups: every group's block_tables [G, num_reqs, max_num_blocks]
    # and slot_mapping [G, num_tokens], and layer i's group. None: one group.
    group_block_tables: torch.Tensor | None = None
    group_slot_mapping: torch.Tensor | None = None
    layer_groups: tuple[int, ...] | None = None
    _by_group: list[AttentionMetadata] = field(default_factory=list, init=False, repr=False, compare=False)

    def group_of(self, layer: int) -> int:
        """Layer `layer`'s KV group."""
        return 0 if self.layer_groups is None else self.layer_groups[layer]

    def for_layer(self, layer: int) -> AttentionMetadata:
        """The metadata layer `layer` attends with: its group's tables and slots."""
        if self.group_of(layer) == 0:
            return self
        assert self.group_block_tables is not None and self.group_slot_mapping is not None
        if not self._by_group:
            self._by_group.extend(
                replace(self, block_tables=tables, slot_mapping=slots, group_block_tables=None,
                        group_slot_mapping=None, layer_groups=None)
                for tables, slots in zip(self.group_block_tables, self.group_slot_mapping, strict=True))
        return self._by_group[self.group_of(layer)]

    def tables_by_group(self) -> torch.Tensor:
        """[G, num_reqs, max_num_blocks]: every group's block tables (G = 1: block_tables)."""
        return self.block_tables.unsqueeze(0) if self.group_block_tables is None else self.group_block_tables

    def slots_by_group(self) -> torch.Tensor:
        """[G, num_tokens]: every group's slots (G = 1: slot_mapping)."""
        return self.slot_mapping.unsqueeze(0) if self.group_slot_mapping is None else self.group_slot_mapping

    @property
    def num_reqs(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return self.query_start_loc[-1]
