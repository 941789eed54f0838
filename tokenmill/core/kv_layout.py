"""Which layers share a block table: the KV cache's layer groups.

Layers with a sliding window need only the blocks their window still sees;
full-attention layers need every block. So the layers are split into groups of
one attention kind and equal size (vLLM's hybrid KV cache groups), and each
request has a block table per group (core/kv_hybrid.py frees a window group's
blocks as its window moves past them). The cache is `slots` tensors, each
`[2, num_blocks, block_size, kv_heads, head_dim]`: block b of group g holds
layer `groups[g].layers[s]`'s K/V in tensor s, so one pool of blocks serves
every group. Layers of one kind in a count that is not a multiple of the size
leave a group short (its blocks' last slots unused).

One group of every layer (no window freed) is the layout of a model without
windows, and of a cache the disk tier, reservations or a draft model share.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroup:
    window: int | None  # its layers' sliding window; None: full attention
    layers: tuple[int, ...]


@dataclass(frozen=True)
class KVLayout:
    groups: tuple[KVGroup, ...]

    @property
    def slots(self) -> int:
        """The cache's tensors: the size of the largest group."""
        return max(len(g.layers) for g in self.groups)

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    def place(self, layer: int) -> tuple[int, int]:
        """(group, slot) of `layer`."""
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g, group.layers.index(layer)
        raise ValueError(f"layer {layer} is in no KV group")

    def max_tokens_alone(self, num_blocks: int, block_size: int, step_tokens: int) -> int:
        """The longest request the pool holds alone, whatever it computes in a
        step (at most `step_tokens`): n blocks of tokens take n blocks in each
        full group and at most the window and a step's tokens in a window group."""
        caps = [-(-(g.window - 1 + step_tokens) // block_size) + 1
                for g in self.groups if g.window is not None]
        num_full = len(self.groups) - len(caps)

        def fits(n: int) -> bool:
            return num_full * n + sum(min(n, cap) for cap in caps) <= num_blocks

        if num_full == 0 and fits(max(caps)):
            return 1 << 62
        lo, hi = 0, num_blocks + 1  # fits(lo), not fits(hi)
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo * block_size


def one_group(num_layers: int) -> KVLayout:
    return KVLayout((KVGroup(None, tuple(range(num_layers))),))


def make_kv_layout(windows: Sequence[int | None], free_windows: bool) -> KVLayout:
    """The groups for layers with these windows (None: full attention): one
    group of all layers unless `free_windows` and some layer has a window;
    else each kind's layers in order, in groups of the smallest kind's count,
    full attention first."""
    if not free_windows or all(w is None for w in windows):
        return one_group(len(windows))
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        kinds.setdefault(window, []).append(layer)
    size = min(len(layers) for layers in kinds.values())
    groups = []
    for window in sorted(kinds, key=lambda w: -1 if w is None else w):
        layers = kinds[window]
        groups += [KVGroup(window, tuple(layers[s:s + size])) for s in range(0, len(layers), size)]
    return KVLayout(tuple(groups))
