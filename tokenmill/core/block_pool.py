"""The pool of KV-cache blocks: ref counts, an LRU free queue, a hash map.

A block is in exactly one of two states:
  in use  (ref_cnt > 0): held by one request, or shared read-only by several
  free    (ref_cnt == 0): in the free queue, least recently used first; it may
          still carry a content hash, so a later request can revive it (a
          prefix-cache hit) until it is handed out again and evicted.

    free queue:  head -> [LRU] <-> ... <-> [MRU] <- tail
    get_new_blocks() pops from the head; freed blocks go to the tail.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator


class KVCacheBlock:
    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt}, hash={self.block_hash})"


class FreeBlockQueue:
    """A doubly linked list, so a cached free block can leave from the middle in O(1)."""

    def __init__(self, blocks: list[KVCacheBlock]) -> None:
        self.num_free_blocks = len(blocks)
        self.head: KVCacheBlock | None = blocks[0] if blocks else None
        self.tail: KVCacheBlock | None = blocks[-1] if blocks else None
        for prev, nxt in itertools.pairwise(blocks):
            prev.next_free = nxt
            nxt.prev_free = prev

    def popleft(self) -> KVCacheBlock:
        block = self.head
        if block is None:
            raise RuntimeError("no free blocks")  # callers check num_free_blocks first
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None:
            block.prev_free.next_free = block.next_free
        else:
            self.head = block.next_free
        if block.next_free is not None:
            block.next_free.prev_free = block.prev_free
        else:
            self.tail = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        block.prev_free = self.tail
        block.next_free = None
        if self.tail is not None:
            self.tail.next_free = block
        else:
            self.head = block
        self.tail = block
        self.num_free_blocks += 1

    def __iter__(self) -> Iterator[KVCacheBlock]:
        block = self.head
        while block is not None:
            yield block
            block = block.next_free


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVCacheBlock] = {}  # block hash -> block

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def get_cached_block(self, block_hash: int) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Hand out `num_blocks` blocks from the LRU end, evicting their cached content."""
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        out = []
        for _ in range(num_blocks):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                del self.cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits; a free one leaves the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop a reference; blocks reaching zero join the free queue in the order
        given, so the first given is the first evicted."""
        for block in blocks:
            block.ref_cnt -= 1
            assert block.ref_cnt >= 0, block
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_block(self, block: KVCacheBlock, block_hash: int) -> bool:
        """Register a full block's content. If another block already holds the same
        content (two requests computed it in parallel), keep the first. True
        when `block` now holds `block_hash`."""
        if not self.enable_caching or block.block_hash is not None:
            return block.block_hash == block_hash
        if block_hash in self.cached:
            return False
        block.block_hash = block_hash
        self.cached[block_hash] = block
        return True

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Forget a block's content (it was registered but will not be computed)."""
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.block_hash = None

    def reset_prefix_cache(self) -> bool:
        """Forget all cached content; only allowed when no block is in use."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash = None
        self.cached.clear()
        return True

    def check_integrity(self) -> None:
        free = list(self.free_queue)
        assert len(free) == self.num_free_blocks, "free queue length != its counter"
        assert len({b.block_id for b in free}) == len(free), "a block is twice in the free queue"
        assert all(b.ref_cnt == 0 for b in free), "a free block has references"
        in_use = [b for b in self.blocks if b.ref_cnt > 0]
        assert len(free) + len(in_use) == self.num_blocks, "free + in use != total"
        for block_hash, block in self.cached.items():
            assert block.block_hash == block_hash, "hash map disagrees with the block"
        assert sum(b.block_hash is not None for b in self.blocks) == len(self.cached)
