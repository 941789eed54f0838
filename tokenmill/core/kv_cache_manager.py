"""Which blocks each request holds, prefix-cache lookups, and allocation.

A request's block table covers its tokens in order; block i holds tokens
[i * block_size, (i + 1) * block_size). Once a block is full of computed
tokens its content hash is registered, so later requests with the same prefix
can share it (read-only: a request only ever writes past its shared blocks).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.core.block_pool import BlockPool, KVCacheBlock
from tokenmill.core.request import Request

# The hash of the empty prefix: the parent of every request's first block.
ROOT_HASH = 0


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int]) -> int:
    """Chain a block's token ids onto its parent's hash, so equal hashes mean
    equal whole prefixes (up to 64-bit collisions), not just equal blocks."""
    return hash((parent_hash, tuple(token_ids)))


def update_block_hashes(request: Request, block_size: int) -> None:
    """Extend `request.block_hashes` to cover every full block of its tokens."""
    tokens = request.all_token_ids
    hashes = request.block_hashes
    for i in range(len(hashes), len(tokens) // block_size):
        parent = hashes[-1] if hashes else ROOT_HASH
        hashes.append(hash_block_tokens(parent, tokens[i * block_size : (i + 1) * block_size]))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    def usage(self) -> float:
        return self.pool.usage()

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    @property
    def num_reserved_blocks(self) -> int:
        """Blocks promised to running requests and not handed out yet: none when
        paging (kv_reservation.py's policy promises some)."""
        return 0

    def check_request(self, request: Request) -> None:
        """Raise ValueError (saying what to do) if the request can never get its
        memory. Paging gives blocks as tokens need them, so a prompt that fits the
        context (the scheduler checks that) is enough."""

    def _num_allocatable(self, request: Request) -> int:
        """Blocks `request` may take now: every free one when paging."""
        return self.pool.num_free_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest chain of cached full blocks that prefixes this request, and
        the number of tokens it covers. At least one token is always left to
        compute, since the last position's logits are needed to sample. A request
        that asked for prompt_logprobs gets no hits: every prompt position's
        logits must be computed (as in vLLM), nor does a pooling request whose
        pooler reads every row (mean, CLS)."""
        if (not self.enable_caching or request.sampling_params.prompt_logprobs is not None
                or request.pool_every_row):
            return [], 0
        update_block_hashes(request, self.block_size)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the request's computed
        ones (and after `new_computed_blocks`, prefix hits being taken now).
        Returns the newly allocated blocks, or None when the pool is short: a
        normal outcome, the scheduler then preempts or waits."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size
        num_required = self.blocks_needed(num_computed + num_new_tokens)
        num_new_blocks = num_required - len(blocks) - len(new_computed_blocks)
        # Hits sitting in the free queue stop being free once touched.
        num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_revived > self._num_allocatable(request):
            return None

        self.pool.touch(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(max(num_new_blocks, 0))
        blocks = [*blocks, *new_computed_blocks, *new_blocks]
        self.req_to_blocks[request.request_id] = blocks

        if self.enable_caching:
            # Register the blocks that will be full of computed tokens after this step;
            # draft tokens (past num_tokens) are not the request's yet: never registered.
            self._cache_full_blocks(request, min(num_computed + num_new_tokens, request.num_tokens))
        return new_blocks

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Register the request's blocks that are full within its first `num_tokens` tokens."""
        update_block_hashes(request, self.block_size)
        blocks = self.req_to_blocks[request.request_id]
        num_full = min(num_tokens // self.block_size, len(blocks), len(request.block_hashes))
        for i in range(num_full):
            self.pool.cache_block(blocks[i], request.block_hashes[i])

    def rollback(self, request: Request) -> None:
        """Speculative decoding: the scheduler has lowered `num_computed_tokens`
        past rejected drafts. Blocks that held only rejected slots go back to the
        pool (tail first). (Registered blocks never hold drafts, see
        allocate_slots, so none is freed with a hash.)"""
        blocks = self.req_to_blocks[request.request_id]
        num_keep = self.blocks_needed(request.num_computed_tokens)
        if len(blocks) > num_keep:
            self.pool.free_blocks(reversed(blocks[num_keep:]))
            del blocks[num_keep:]

    def cache_accepted(self, request: Request) -> None:
        """Speculative decoding: accepted drafts were appended to the request's
        tokens; full blocks of them become prefix-cache entries, as if they had
        been decoded one at a time."""
        if self.enable_caching:
            self._cache_full_blocks(request, min(request.num_computed_tokens, request.num_tokens))

    def free(self, request: Request) -> None:
        """Release a request's blocks, tail first, so that its tail is evicted
        before its head (the head is the likelier shared prefix).

        Blocks are registered in the prefix cache when they are allocated, for
        the tokens the step will compute; a request preempted within that same
        step never computes them, so blocks past its computed tokens are
        forgotten here. (No other request can have hit them yet: hits happen only
        at admission, which a step with a preemption skips.)"""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        for block in blocks[request.num_computed_tokens // self.block_size :]:
            if block.ref_cnt == 1:
                self.pool.uncache_block(block)
        self.pool.free_blocks(reversed(blocks))

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        for blocks in self.req_to_blocks.values():
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != "
                f"{refs.get(block.block_id, 0)} block tables holding it"
            )
