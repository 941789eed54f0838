"""Which way a forward goes through the CPU plan's layers: `choose_path`, one
pure function of the step's metadata and the plan's facts, so that the path a
step takes is read (and tested) in one place. Every path gives the same bits
(each kernel computes a row alone; tests/test_model_numerics.py).

| path | runs | when |
|---|---|---|
| SPLIT | `layer_stack` (csrc/layer_stack.cpp): each thread its own requests through every layer | decode-only steps that divide well between threads (`split_bounds`), every row sampled |
| LOOP | `layer_loop` (csrc/layer_loop.cpp): every kernel on the whole OpenMP team | any other step one attention call per layer serves |
| TP_LOOP | `layer_loop_tp`: LOOP on a tensor-parallel shard, all-reducing over shared memory | a shard whose group has a live shared-memory handle |
| PYTHON | `CpuPlan._python_loop`: the same kernels called from Python | under the profiler (a row per op), where the attention kernel cannot serve the step in one call, a shard over gloo (or with `tp_layer_loop` off) |
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import NamedTuple

from tokenmill.model.attention_metadata import AttentionMetadata

# Split the rows between threads only from this many rows a thread for each
# byte of a weight (16 rows in bf16, 32 in float32): a split thread reads all
# of the weights for itself, which pays only once each weight serves enough
# rows (docs/perf-notes.md). A model with experts: E / top_k times as many, an
# expert's weights serving only top_k / E of a thread's rows (the plan's split_min_rows).
SPLIT_ROWS_PER_WEIGHT_BYTE = 8
SPLIT_MAX_SHARE = 0.6  # no split where one thread would get more than this share of the work


class Path(enum.Enum):
    SPLIT = "split"
    LOOP = "loop"
    TP_LOOP = "tp_loop"
    PYTHON = "python"


@dataclass(frozen=True)
class PathFacts:
    """What choose_path knows of a plan: fixed when the plan is built."""

    has_layers: bool
    shard: bool  # a tensor-parallel shard (o/down all-reduce after their GEMMs)
    tp_layer_loop: bool  # a shard may take TP_LOOP (CpuBackendOptions.tp_layer_loop)
    row_cost: float  # a query row's cost in context tokens read (split_bounds)
    split_min_rows: float  # the fewest rows a thread for SPLIT (SPLIT_ROWS_PER_WEIGHT_BYTE x weight bytes
    # x E / top_k with experts)
    split_max_share: float = SPLIT_MAX_SHARE


class Route(NamedTuple):
    """choose_path's answer: the path, and for SPLIT the row bounds of each thread."""

    path: Path
    split_bounds: list[int] | None = None


def one_attention_call(meta: AttentionMetadata) -> bool:
    """Whether one paged_attention call per layer serves the step (the rule of
    CpuAttentionBackend.kernel_call): every token its own query, or decodes only."""
    return (meta.token_seq_ids is not None and meta.token_seq_lens is not None) or meta.num_decodes == meta.num_reqs


def choose_path(meta: AttentionMetadata, facts: PathFacts, *, profiling: bool, all_rows: bool,
                threads: int, shm_group: bool, lora: bool = False) -> Route:
    """The path of one forward. Per forward: `profiling` (the autograd
    profiler is on: the per-op rows of `bench --profile`), `all_rows` (no
    `output_rows`: every row is sampled), `threads` (the forward's OpenMP
    threads), `shm_group` (a shard's group all-reduces over shared memory now),
    `lora` (rows of LoRA adapters: the layer loop, or each thread of the split
    stack on its own rows, adds their deltas after each projection, on every
    row; never on a shard)."""
    if profiling or not facts.has_layers or not one_attention_call(meta):
        return Route(Path.PYTHON)
    if lora and facts.shard:
        return Route(Path.PYTHON)
    if facts.shard:
        return Route(Path.TP_LOOP if shm_group and facts.tp_layer_loop else Path.PYTHON)
    if all_rows:
        bounds = split_bounds(meta, threads, facts.row_cost, facts.split_min_rows, facts.split_max_share)
        if bounds is not None:
            return Route(Path.SPLIT, bounds)
    return Route(Path.LOOP)


def split_bounds(meta: AttentionMetadata, threads: int, row_cost: float, min_rows: float,
                 max_share: float = SPLIT_MAX_SHARE) -> list[int] | None:
    """Row bounds [0, ..., num_tokens] giving each of `threads` threads whole
    requests of about equal cost (a query row costs `row_cost`, each context
    token it attends to 1), or None where the step does not divide well (fewer
    than `min_rows` rows a thread, a thread over `max_share` of the work) or
    has prefills.

    Decodes only: a prefill may read K/V that another request writes in the
    same step (a prefix-cache hit on a block registered when allocated, as
    kv_cache_manager does), which the layer loop orders (every row's K/V of a
    layer is written before any row attends) and separate threads would not.
    A decode reads only blocks computed in earlier steps, and its own new slot;
    a speculative verification row also the slots of its request's rows before
    it (meta.seq_req), so a request's rows go to one thread, which writes all of
    its rows' K/V of a layer before they attend."""
    if (threads < 2 or meta.num_tokens < min_rows * threads
            or meta.num_decodes != meta.num_reqs):
        return None
    costs = [row_cost + seq_len for seq_len in meta.seq_lens]  # one query row each (decodes)
    total = float(sum(costs))
    bounds, shares, acc, last = [0], [], 0.0, 0.0
    seq_req = meta.seq_req
    for r, c in enumerate(costs):
        if (len(bounds) < threads and acc + c / 2 >= total * len(bounds) / threads
                and (seq_req is None or r == 0 or seq_req[r] != seq_req[r - 1])):
            bounds.append(r)  # decodes only: request r is row r
            shares.append(acc - last)
            last = acc
        acc += c
    bounds.append(len(costs))
    shares.append(acc - last)
    if len(bounds) != threads + 1 or max(shares) > max_share * total:
        return None
    return bounds
