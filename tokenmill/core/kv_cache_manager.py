"""Which blocks each request holds, prefix-cache lookups, and allocation.

A request's block table covers its tokens in order; block i holds tokens
[i * block_size, (i + 1) * block_size). Once a block is full of computed
tokens its content hash is registered, so later requests with the same prefix
can share it (read-only: a request only ever writes past its shared blocks).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.core.block_pool import BlockPool, KVCacheBlock
from tokenmill.core.contracts import KVBlockTransfer
from tokenmill.core.kv_disk import BlockFiles
from tokenmill.core.request import Request

# The hash of the empty prefix: the parent of every request's first block.
ROOT_HASH = 0


def hash_block_tokens(parent_hash: int, token_ids: Sequence[int], extra_keys: tuple[int, ...] = ()) -> int:
    """Chain a block's token ids onto its parent's hash, so equal hashes mean
    equal whole prefixes (up to 64-bit collisions), not just equal blocks.
    `extra_keys`: what else decides the block's K/V (a LoRA adapter's id, as
    vLLM's extra keys): two adapters' equal prompts never share a block."""
    if extra_keys:
        return hash((parent_hash, tuple(token_ids), extra_keys))
    return hash((parent_hash, tuple(token_ids)))


def update_block_hashes(request: Request, block_size: int) -> None:
    """Extend `request.block_hashes` to cover every full block of its tokens."""
    tokens = request.all_token_ids
    hashes = request.block_hashes
    extra_keys = (request.lora_int_id,) if request.lora_int_id else ()
    for i in range(len(hashes), len(tokens) // block_size):
        parent = hashes[-1] if hashes else ROOT_HASH
        hashes.append(hash_block_tokens(parent, tokens[i * block_size : (i + 1) * block_size], extra_keys))


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True,
                 disk: BlockFiles | None = None) -> None:
        """`disk`: the prefix cache's second tier (kv_offload_dir), or None."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.disk = disk if enable_caching else None
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # The disk tier's loads: chosen in this schedule (taken into the
        # SchedulerOutput by take_loads), then sent to the runner, then held one
        # schedule more so that the request they were for finds them as hits.
        self._loads: list[tuple[KVCacheBlock, KVBlockTransfer]] = []
        self._in_flight: list[tuple[KVCacheBlock, KVBlockTransfer]] = []
        self._held: list[KVCacheBlock] = []
        # The RAM hits before the loaded blocks, held alongside them (so that the
        # loads' own allocations cannot evict the head of the chain they extend).
        self._pinned: list[KVCacheBlock] = []

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
        if not self._takes_hits(request):
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

    def _takes_hits(self, request: Request) -> bool:
        return (self.enable_caching and request.sampling_params.prompt_logprobs is None
                and not request.pool_every_row)

    # ---- the disk tier -------------------------------------------------------------

    def load_from_disk(self, request: Request, hits: Sequence[KVCacheBlock], budget: int) -> int:
        """Choose the blocks of `request` to load from the disk tier: those past
        its RAM hits (`hits`, from get_computed_blocks) whose files are there, as
        many as fit beside its first chunk (`budget` tokens). Each gets a fresh
        block, held by this manager until the schedule after next; the scheduler
        admits the request in the next step, when the loaded blocks are
        prefix-cache hits like any other. The number of blocks chosen.

        Every other call for a request looks nothing up (`request.skip_disk_lookup`):
        the admission right after a load is a plain one, so a file that keeps
        failing to load cannot hold a request back."""
        if self.disk is None or not self._takes_hits(request):
            return 0
        if request.skip_disk_lookup:
            request.skip_disk_lookup = False
            return 0
        bs = self.block_size
        max_hit_blocks = (request.num_tokens - 1) // bs
        candidates = request.block_hashes[len(hits):max_hit_blocks]
        request.disk_query_tokens = len(candidates) * bs
        num_revived = sum(1 for b in hits if b.ref_cnt == 0)
        first_chunk = min(request.num_tokens - max_hit_blocks * bs, budget)
        room = self._num_allocatable(request) - num_revived - self.blocks_needed(first_chunk)
        num_load = self.disk.count_present(candidates[:max(room, 0)])
        if num_load == 0:
            return 0
        self.pool.touch(hits)
        self._pinned.extend(hits)
        blocks = self.pool.get_new_blocks(num_load)
        tokens = request.all_token_ids
        for i, block in enumerate(blocks, start=len(hits)):
            parent = request.block_hashes[i - 1] if i else ROOT_HASH
            self._loads.append((block, KVBlockTransfer(
                block.block_id, request.block_hashes[i], parent, tuple(tokens[i * bs:(i + 1) * bs]))))
        request.skip_disk_lookup = True
        return num_load

    def take_loads(self) -> list[KVBlockTransfer]:
        """This schedule's loads, for the SchedulerOutput (now in flight)."""
        assert not self._in_flight, "the last step's loads were not finished"
        self._in_flight, self._loads = self._loads, []
        return [t for _, t in self._in_flight]

    def stores(self, request: Request, start: int, num_tokens: int) -> list[KVBlockTransfer]:
        """The blocks of `request` that its tokens [start, start + num_tokens),
        computed in this step, fill, where this request's block is the one the
        prefix cache holds for that content: the runner writes them to files
        once the step's forward has computed them (write-through, so that a
        restart or another engine finds every block, those still in RAM too).
        Blocks that the last step's accepted drafts filled (after what that
        step offered) come too: their K/V is computed, their hash registered."""
        if self.disk is None:
            return []
        update_block_hashes(request, self.block_size)
        bs, hashes, tokens = self.block_size, request.block_hashes, request.all_token_ids
        blocks = self.req_to_blocks[request.request_id]
        first = min(start, request.disk_offered_tokens)
        request.disk_offered_tokens = start + num_tokens
        out = []
        for i in range(first // bs, min((start + num_tokens) // bs, len(hashes), len(blocks))):
            if blocks[i].block_hash == hashes[i]:
                out.append(KVBlockTransfer(blocks[i].block_id, hashes[i],
                                           hashes[i - 1] if i else ROOT_HASH,
                                           tuple(tokens[i * bs:(i + 1) * bs])))
        return out

    def finish_loads(self, loaded_block_ids: Sequence[int]) -> int:
        """The runner's answer for the loads in flight: those that loaded become
        prefix-cache entries (held until release_held); the others go back to
        the pool. The number that loaded."""
        loaded = set(loaded_block_ids)
        num_loaded = 0
        self._held.extend(self._pinned)
        self._pinned = []
        for block, t in self._in_flight:
            if block.block_id in loaded and self.pool.cache_block(block, t.block_hash):
                self._held.append(block)
                num_loaded += 1
            else:
                self.pool.free_blocks([block])
        self._in_flight = []
        return num_loaded

    def release_held(self) -> None:
        """Let go of the loaded blocks held since the last step (a request that
        took them as hits holds them itself now); a chain's tail first, so its
        head stays cached longest."""
        held, self._held = self._held, []
        self.pool.free_blocks(reversed(held))

    # ---- allocation --------------------------------------------------------------------

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

    def group_block_ids(self, request_id: str) -> list[list[int]]:
        """The block tables of the layer groups after the first (core/kv_hybrid.py):
        none with one group."""
        return []

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        refs: dict[int, int] = {}
        loading = [b for b, _ in self._loads] + [b for b, _ in self._in_flight] + self._pinned
        for blocks in [*self.req_to_blocks.values(), loading, self._held]:
            for b in blocks:
                refs[b.block_id] = refs.get(b.block_id, 0) + 1
        for block in self.pool.blocks:
            assert block.ref_cnt == refs.get(block.block_id, 0), (
                f"block {block.block_id}: ref_cnt {block.ref_cnt} != "
                f"{refs.get(block.block_id, 0)} block tables holding it"
            )
