"""Tensor parallelism's layers: one rank's shard of a loaded model.

Each of N ranks holds a contiguous share of every projection (Megatron's split,
as vLLM's):

    qkv_proj, gate_up_proj   column-parallel: the rank's q/k/v heads, its share of gate and up
    o_proj, down_proj        row-parallel: the matching input columns; each rank's partial
                             product is summed by an all-reduce (the bias on rank 0 only)
    lm_head                  vocabulary-parallel: the rank's rows of the vocabulary; the
                             caller gathers the logits (tokenmill/distributed/)
    embed_tokens, norms      replicated (a lookup and per-row scales: nothing to split)

Heads are split in whole KV groups (a q head stays with its K/V head), so a
rank's KV cache holds its own K/V heads only, and the split may be uneven (the
default model's 3 KV heads over 2 ranks: 2 and 1). Nothing here talks to other
processes: the all-reduce is a callable the caller supplies.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenmill.config import ModelSpec
from tokenmill.model.llama import Linear, LlamaDecoderLayer, LlamaForCausalLM, linear

# Sums a tensor over the ranks, in place. distributed/group.py's also carries
# `native` (a shared-memory group the C++ layer loop all-reduces with, or None)
# and `stopped(e)` (the error a failure inside that loop becomes): plan.py reads both.
AllReduce = Callable[[torch.Tensor], None]


def split_range(total: int, rank: int, size: int, unit: int = 1) -> tuple[int, int]:
    """Rank `rank`'s [start, end) of `total` items split over `size` ranks, in
    whole `unit`s where `total` has whole units (the packed GEMM's 16-wide tiles)."""
    if total % unit:
        unit = 1
    units = total // unit
    return units * rank // size * unit, units * (rank + 1) // size * unit


@dataclass(frozen=True)
class ShardLayout:
    """What rank `rank` of `size` holds: [start, end) of each split dimension."""

    rank: int
    size: int
    kv_heads: tuple[int, int]
    heads: tuple[int, int]
    intermediate: tuple[int, int]
    vocab: tuple[int, int]

    @classmethod
    def of(cls, spec: ModelSpec, rank: int, size: int) -> ShardLayout:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is outside the group of {size}")
        if spec.num_experts:
            raise ValueError(f"tensor parallelism does not split {spec.architecture}'s experts yet; "
                             "drop --tensor-parallel-size")
        if size > spec.num_kv_heads:
            raise ValueError(
                f"tensor_parallel_size={size} is more than the model's {spec.num_kv_heads} KV "
                f"heads; each rank holds whole KV heads, so use at most {spec.num_kv_heads}"
            )
        group = spec.num_heads // spec.num_kv_heads
        k0, k1 = split_range(spec.num_kv_heads, rank, size)
        return cls(
            rank=rank, size=size, kv_heads=(k0, k1), heads=(k0 * group, k1 * group),
            intermediate=split_range(spec.intermediate_size, rank, size, unit=16),
            vocab=split_range(spec.vocab_size, rank, size),
        )

    def shard_spec(self, spec: ModelSpec) -> ModelSpec:
        """The spec of this rank's model: its heads and MLP share; vocabulary and
        hidden size whole (the embedding is replicated, the head is not tied)."""
        return dataclasses.replace(
            spec, num_heads=self.heads[1] - self.heads[0],
            num_kv_heads=self.kv_heads[1] - self.kv_heads[0],
            intermediate_size=self.intermediate[1] - self.intermediate[0],
            tie_word_embeddings=False,
        )


def vocab_widths(spec: ModelSpec, size: int) -> list[int]:
    """Each rank's number of vocabulary rows, in rank order."""
    return [end - start for start, end in (split_range(spec.vocab_size, r, size) for r in range(size))]


class RowParallelLinear(Linear):
    """A Linear over this rank's share of the input features: the rank's
    partial product, summed over the ranks by `all_reduce`. Only rank 0 holds
    the bias (the sum must add it once). The CPU plan reads `all_reduce` too."""

    def __init__(self, in_features: int, out_features: int, bias: bool, all_reduce: AllReduce,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, out_features, bias, device=device, dtype=dtype)
        self.all_reduce = all_reduce

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight, self.bias, self.batch_invariant)
        self.all_reduce(out)
        return out


def shard_model(model: LlamaForCausalLM, layout: ShardLayout,
                all_reduce: AllReduce) -> LlamaForCausalLM:
    """Rank `layout.rank`'s model, its weights sliced (copied) from the whole
    `model`; replicated weights are shared, not copied."""
    spec = model.spec
    hd = spec.head_dim
    (h0, h1), (k0, k1) = layout.heads, layout.kv_heads
    i0, i1 = layout.intermediate
    v0, v1 = layout.vocab
    inter = spec.intermediate_size
    q_size, kv_size = spec.num_heads * hd, spec.num_kv_heads * hd
    weight = next(model.parameters())
    shard = LlamaForCausalLM(layout.shard_spec(spec), device="meta", dtype=weight.dtype)
    state: dict[str, torch.Tensor] = {}
    whole = dict(model.named_parameters())

    def qkv_rows(t: torch.Tensor) -> torch.Tensor:
        return torch.cat([t[h0 * hd : h1 * hd], t[q_size + k0 * hd : q_size + k1 * hd],
                          t[q_size + kv_size + k0 * hd : q_size + kv_size + k1 * hd]])

    for name, param in whole.items():
        if ".qkv_proj." in name:
            state[name] = qkv_rows(param).clone()
        elif ".gate_up_proj." in name:
            state[name] = torch.cat([param[i0:i1], param[inter + i0 : inter + i1]]).clone()
        elif name.endswith("o_proj.weight"):
            state[name] = param[:, h0 * hd : h1 * hd].clone()
        elif name.endswith("down_proj.weight"):
            state[name] = param[:, i0:i1].clone()
        elif name.endswith("o_proj.bias"):
            state[name] = param.clone() if layout.rank == 0 else torch.zeros_like(param)
        else:
            state[name] = param  # replicated: norms, the embedding
    head = model.lm_head.weight  # (the embedding's own tensor when tied)
    state["lm_head.weight"] = head[v0:v1].clone()
    for layer in shard.model.layers:
        assert isinstance(layer, LlamaDecoderLayer)
        for parent, attr in ((layer.self_attn, "o_proj"), (layer.mlp, "down_proj")):
            old = getattr(parent, attr)
            setattr(parent, attr, RowParallelLinear(
                old.in_features, old.out_features, old.bias is not None, all_reduce, device="meta"))
    shard.lm_head = Linear(spec.hidden_size, v1 - v0, bias=False, device="meta")
    shard.load_state_dict(state, strict=True, assign=True)
    shard.model.rotary_emb = model.model.rotary_emb  # (its tables: buffers the meta build lacks)
    shard.model.local_rotary_emb = model.model.local_rotary_emb
    shard.eval()
    shard.requires_grad_(False)
    return shard
