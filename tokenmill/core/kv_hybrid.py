"""A block table per layer group, and windows that give their blocks back.

With layers of a sliding window (Gemma 2 / 3, gpt-oss, Mistral's window), a
request has one block table per group of core/kv_layout.py, all of one length:
entry i of each holds tokens [i * block_size, (i + 1) * block_size) for that
group's layers. A full-attention group's table is the single-group one. A
window group's entries that no token still to compute can see are NULL_BLOCK:
before each allocation, the blocks wholly below the window of the request's
next token go back to the pool (still cached, evicted in LRU order), so a
request holds about window / block_size blocks a window group, whatever its
length. vLLM's hybrid KV cache manager is the idea.

Prefix caching per group: a block's content hash is keyed by its group. A hit
of h blocks needs every full group's first h blocks cached and, for each window
group, the blocks the token at h * block_size can see; the others are NULL.
Hits pass through the scheduler as one flat list, each group's h entries in
group order (`_by_group` splits it).

Not with the disk tier or reservations: those keep one group (engine/
llm_engine.py chooses the layout).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.core.block_pool import KVCacheBlock
from tokenmill.core.kv_cache_manager import KVCacheManager, update_block_hashes
from tokenmill.core.request import Request

# A window group's entry for tokens its window has passed: in no pool's
# accounting, never read (the attention kernels start at the window), block 0
# in the tables the runner builds.
NULL_BLOCK = KVCacheBlock(0)


class HybridKVCacheManager(KVCacheManager):
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 windows: Sequence[int | None]) -> None:
        """`windows`: each group's window (None: full attention), as KVLayout.windows."""
        super().__init__(num_blocks, block_size, enable_caching)
        self.windows = tuple(windows)
        # request id -> a block list per group; req_to_blocks holds group 0's list.
        self.req_groups: dict[str, list[list[KVCacheBlock]]] = {}
        self._num_registered: dict[str, int] = {}  # full blocks registered in the prefix cache

    def _key(self, block_hash: int, group: int) -> int:
        return block_hash if group == 0 else hash((block_hash, group))

    def _num_skipped(self, group: int, num_computed: int) -> int:
        """Leading blocks of `group` that no token from `num_computed` on sees."""
        window = self.windows[group]
        return 0 if window is None else max(0, num_computed - window + 1) // self.block_size

    def _by_group(self, flat: Sequence[KVCacheBlock]) -> list[list[KVCacheBlock]]:
        n = len(flat) // len(self.windows)
        return [list(flat[g * n:(g + 1) * n]) for g in range(len(self.windows))]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        if not self._takes_hits(request):
            return [], 0
        update_block_hashes(request, self.block_size)
        hashes = request.block_hashes[:(request.num_tokens - 1) // self.block_size]
        cached = self.pool.get_cached_block
        n = len(hashes)
        for g, window in enumerate(self.windows):  # full groups: the longest chain
            if window is None:
                n = next((i for i in range(n) if cached(self._key(hashes[i], g)) is None), n)
        while n > 0:  # window groups: the longest hit whose visible blocks are all there
            missing = max((i for g, window in enumerate(self.windows) if window is not None
                           for i in range(self._num_skipped(g, n * self.block_size), n)
                           if cached(self._key(hashes[i], g)) is None), default=None)
            if missing is None:
                break
            n = missing  # (a shorter hit that still needs block `missing` fails too)
        hits: list[KVCacheBlock] = []
        for g in range(len(self.windows)):
            skipped = self._num_skipped(g, n * self.block_size)
            hits += [NULL_BLOCK] * skipped
            for i in range(skipped, n):
                block = cached(self._key(hashes[i], g))
                assert block is not None
                hits.append(block)
        return hits, n * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> list[KVCacheBlock] | None:
        rid = request.request_id
        groups = self.req_groups.get(rid) or [[] for _ in self.windows]
        hits = self._by_group(new_computed_blocks)
        num_computed = request.num_computed_tokens + len(hits[0]) * self.block_size
        # The window has passed these blocks for good: back to the pool first.
        for g, blocks in enumerate(groups):
            skipped = min(self._num_skipped(g, num_computed), len(blocks))
            passed = [b for b in blocks[:skipped] if b is not NULL_BLOCK]
            if passed:
                blocks[:skipped] = [NULL_BLOCK] * skipped
                self.pool.free_blocks(reversed(passed))
        num_required = self.blocks_needed(num_computed + num_new_tokens)
        num_new = [max(num_required - len(blocks) - len(hits[g]), 0) for g, blocks in enumerate(groups)]
        num_revived = sum(1 for b in new_computed_blocks if b is not NULL_BLOCK and b.ref_cnt == 0)
        if sum(num_new) + num_revived > self.pool.num_free_blocks:
            return None
        self.pool.touch(b for b in new_computed_blocks if b is not NULL_BLOCK)
        new_blocks: list[KVCacheBlock] = []
        for g, blocks in enumerate(groups):
            fresh = self.pool.get_new_blocks(num_new[g])
            blocks += hits[g] + fresh
            new_blocks += fresh
        self.req_groups[rid] = groups
        self.req_to_blocks[rid] = groups[0]
        if self.enable_caching:
            self._cache_full_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        update_block_hashes(request, self.block_size)
        rid = request.request_id
        groups = self.req_groups[rid]
        num_full = min(num_tokens // self.block_size, len(groups[0]), len(request.block_hashes))
        for i in range(self._num_registered.get(rid, 0), num_full):
            for g, blocks in enumerate(groups):
                if blocks[i] is not NULL_BLOCK:
                    self.pool.cache_block(blocks[i], self._key(request.block_hashes[i], g))
        self._num_registered[rid] = max(num_full, self._num_registered.get(rid, 0))

    def rollback(self, request: Request) -> None:
        num_keep = self.blocks_needed(request.num_computed_tokens)
        for blocks in self.req_groups[request.request_id]:
            if len(blocks) > num_keep:
                self.pool.free_blocks(b for b in reversed(blocks[num_keep:]) if b is not NULL_BLOCK)
                del blocks[num_keep:]

    def free(self, request: Request) -> None:
        """As KVCacheManager.free, each group's blocks tail first, the window
        groups' before the full ones' (the full groups' head is the likelier
        shared prefix)."""
        rid = request.request_id
        self.req_to_blocks.pop(rid, None)
        self._num_registered.pop(rid, None)
        first_uncomputed = request.num_computed_tokens // self.block_size
        for blocks in reversed(self.req_groups.pop(rid, [])):
            held = [b for b in blocks if b is not NULL_BLOCK]
            for block in blocks[first_uncomputed:]:
                if block is not NULL_BLOCK and block.ref_cnt == 1:
                    self.pool.uncache_block(block)
            self.pool.free_blocks(reversed(held))

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        return [[b.block_id for b in blocks] for blocks in self.req_groups.get(request_id, [[]])[1:]]

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for groups in self.req_groups.values():
            assert len({len(blocks) for blocks in groups}) == 1, "a request's group tables differ in length"
            for blocks in groups:
                for b in blocks:
                    if b is not NULL_BLOCK:
                        refs[b.block_id] = refs.get(b.block_id, 0) + 1
        assert set(self.req_groups) == set(self.req_to_blocks), "group tables != block tables"
        for block in self.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != {refs.get(block.block_id, 0)} "
                "group tables holding it")
