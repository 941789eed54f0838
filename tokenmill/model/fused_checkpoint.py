"""Checkpoints that fuse what the loader reads apart (Phi-3's qkv_proj and
gate_up_proj, in a config.json's directory and in llama.cpp's `phi3` files alike),
and the q/k row order partial rotary embeddings need.

A fused tensor is split by rows into the Llama names the loader maps
(model/loader.FUSED_WEIGHTS), so the quantized formats, tensor parallelism and
the CPU plan see the Llama layer unchanged:

    ...self_attn.qkv_proj.W  ->  q_proj.W  (heads * hd rows), k_proj.W, v_proj.W  (kv * hd each)
    ...mlp.gate_up_proj.W    ->  gate_proj.W  (intermediate rows), up_proj.W  (intermediate)

A row split is exact in every form a tensor arrives in (float values, Q8_0 blocks,
a GGUF type's blocks): each row is quantized on its own.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import torch

from tokenmill.config import ModelSpec

Thunk = Callable[[], Any]  # loader.TensorThunk: a tensor, (q, d) Q8_0 blocks, or loader.GgufBlocks


def fused_parts(spec: ModelSpec) -> dict[str, tuple[tuple[str, int], ...]]:
    """Fused name fragment -> (part fragment, rows) of each part, in row order."""
    q, kv, inter = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.intermediate_size
    return {
        ".self_attn.qkv_proj.": ((".self_attn.q_proj.", q), (".self_attn.k_proj.", kv),
                                 (".self_attn.v_proj.", kv)),
        ".mlp.gate_up_proj.": ((".mlp.gate_proj.", inter), (".mlp.up_proj.", inter)),
    }


def map_rows(value: Any, index: slice | torch.Tensor) -> Any:
    """`value`'s rows `index` (dim 0), whatever its form."""
    if isinstance(value, torch.Tensor):
        return value[index]
    if isinstance(value, tuple):  # Q8_0: (q [rows, in], d [rows, in / 32])
        return tuple(part[index] for part in value)
    return dataclasses.replace(value, blocks=value.blocks[index])  # GGUF blocks [rows, ...]


def split_fused(tensors: Mapping[str, Thunk], storage: Mapping[str, str],
                spec: ModelSpec) -> tuple[dict[str, Thunk], dict[str, str]]:
    """The checkpoint with each fused tensor as its parts (`storage`: a GGUF
    tensor's type by name, each part keeping its tensor's). The fused tensor is
    read once for all its parts, which the loader asks for one after another."""
    out: dict[str, Thunk] = {}
    types: dict[str, str] = dict(storage)
    all_parts = fused_parts(spec)
    for name, load in tensors.items():
        fused = next((frag for frag in all_parts if frag in name), None)
        if fused is None:
            out[name] = load
            continue
        parts = all_parts[fused]
        reader = _SharedRead(name, load, sum(rows for _, rows in parts), len(parts))
        start = 0
        for frag, rows in parts:
            part_name = name.replace(fused, frag)
            out[part_name] = reader.part(slice(start, start + rows))
            if name in storage:
                types[part_name] = storage[name]
            start += rows
        types.pop(name, None)
    return out, types


class _SharedRead:
    """One fused tensor read once and handed out as parts (dropped after the last)."""

    def __init__(self, name: str, load: Thunk, rows: int, parts: int) -> None:
        self.name, self.load, self.rows, self.left = name, load, rows, parts
        self.value: Any = None

    def part(self, index: slice) -> Thunk:
        def load() -> Any:
            if self.value is None:
                self.value = self.load()
                shape = self.value[0].shape if isinstance(self.value, tuple) else self.value.shape
                if shape[0] != self.rows:
                    raise ValueError(f"tensor {self.name} has {shape[0]} rows; the config makes it "
                                     f"{self.rows} (its parts' rows summed)")
            value = map_rows(self.value, index)
            self.left -= 1
            if self.left == 0:
                self.value = None
            return value

        return load


def rotary_row_order(num_heads: int, head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The q or k rows in the order partial rotary runs as full rotary: per head,
    HF rotates pairs (i, i + rotary_dim / 2) of its first rotary_dim dimensions and
    passes the rest through; here the first half of a head is the rotated pairs'
    first members and then the passed dimensions' first half, the second half the
    same with the second members, so every pair sits head_dim / 2 apart and the
    passed ones turn by angle 0 (model/rope.py). q and k take the same order, so
    every score q . k is unchanged (the values' rows keep theirs)."""
    r, p = rotary_dim // 2, (head_dim - rotary_dim) // 2
    head = torch.cat([torch.arange(0, r), torch.arange(rotary_dim, rotary_dim + p),
                      torch.arange(r, rotary_dim), torch.arange(rotary_dim + p, head_dim)])
    return torch.cat([h * head_dim + head for h in range(num_heads)])


def reorder_rotary_rows(tensors: Mapping[str, Thunk], spec: ModelSpec) -> dict[str, Thunk]:
    """`tensors` with q_proj's and k_proj's rows in rotary_row_order (partial rotary)."""
    rotary = spec.rotary_dim
    assert rotary is not None
    out = dict(tensors)
    for name, load in tensors.items():
        heads = spec.num_heads if ".self_attn.q_proj." in name else (
            spec.num_kv_heads if ".self_attn.k_proj." in name else None)
        if heads is not None:
            out[name] = _reordered(load, rotary_row_order(heads, spec.head_dim, rotary))
    return out


def _reordered(load: Thunk, order: torch.Tensor) -> Thunk:
    def reordered() -> Any:
        value = load()
        rows = (value[0] if isinstance(value, tuple) else value).shape[0]
        # (a tensor of another size is left as it is, for the loader's shape check to name)
        return map_rows(value, order) if rows == len(order) else value

    return reordered
