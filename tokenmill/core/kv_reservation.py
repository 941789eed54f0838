"""Reserved KV allocation: the systems before paging, kept for the batching study.

A request is admitted only when its whole prompt + max_tokens (its
reservation; the context, max_model_len, when max_tokens is None) fits beside
every running request's reservation, and it holds that space until it
finishes: memory for tokens it has not generated yet is promised to it and
lent to nobody. Blocks are still handed out as its tokens need them (the same
block tables, prefix cache and runner as paging), but the rest of every
reservation counts as taken. So a running request always has room for its
next token and is never preempted, and a newcomer waits until a finished
request gives its reservation back.

What a request reserves for its output is `CacheConfig.kv_reserve_output_tokens`
when set (its own max_tokens where that is larger; never past the context): a
server that, like the seed's systems, cannot know how long an answer will be and
holds room for the longest it allows (the vLLM paper's "Max"). Unset, each
request reserves its own max_tokens (the paper's "Oracle", the kindest).

Growing past a reservation (static batching's padding is computed past a
member's max_tokens) takes only blocks that no reservation holds, and can
fail, as under paging; the scheduler then does what it does under paging.

The scheduler knows none of this: it is a KVCacheManager, picked by
`make_kv_cache_manager` from `CacheConfig.kv_allocation`.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenmill.config import CacheConfig
from tokenmill.core.block_pool import KVCacheBlock
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.kv_disk import BlockFiles
from tokenmill.core.kv_hybrid import HybridKVCacheManager
from tokenmill.core.kv_layout import KVLayout
from tokenmill.core.request import Request


class ReservingKVCacheManager(KVCacheManager):
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool,
                 max_model_len: int, reserve_output_tokens: int | None = None,
                 disk: BlockFiles | None = None) -> None:
        super().__init__(num_blocks, block_size, enable_caching, disk)
        self.max_model_len = max_model_len
        self.reserve_output_tokens = reserve_output_tokens
        self.reserved: dict[str, int] = {}  # request id -> blocks reserved at admission
        # Sum over requests of the reserved blocks not handed out yet.
        self._num_unfilled = 0

    def reservation_tokens(self, request: Request) -> int:
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is None:  # it may grow to the context
            return self.max_model_len
        own = request.num_prompt_tokens + max_tokens
        if self.reserve_output_tokens is None:
            return own
        return max(own, min(request.num_prompt_tokens + self.reserve_output_tokens,
                            self.max_model_len))

    @property
    def num_reserved_blocks(self) -> int:
        return self._num_unfilled

    def _unfilled(self, request_id: str) -> int:
        held = len(self.req_to_blocks.get(request_id, ()))
        return max(self.reserved.get(request_id, 0) - held, 0)

    def check_request(self, request: Request) -> None:
        tokens = self.reservation_tokens(request)
        if self.blocks_needed(tokens) <= self.num_blocks:
            return
        # (kv_reserve_output_tokens never reserves past the context, which the pool
        # caps: only the request's own max_tokens can exceed the budget.)
        max_tokens = request.sampling_params.max_tokens
        wanted = (f"prompt {request.num_prompt_tokens} + max_tokens {max_tokens}"
                  if max_tokens is not None else f"max_tokens None: the context, {tokens}")
        raise ValueError(
            f"the request needs {tokens} tokens of KV cache reserved ({wanted}), more than "
            f"the whole KV budget of {self.num_blocks * self.block_size} tokens ({self.num_blocks} "
            f"blocks of {self.block_size}) under kv_allocation='reserved'; lower max_tokens, "
            "raise kv_cache_memory_bytes, or use kv_allocation='paged'"
        )

    def _num_allocatable(self, request: Request) -> int:
        # What other requests were promised is not free, whatever the pool says.
        others = self._num_unfilled - self._unfilled(request.request_id)
        return self.pool.num_free_blocks - others

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock] = (),
    ) -> list[KVCacheBlock] | None:
        request_id = request.request_id
        admitting = request_id not in self.reserved
        if admitting:
            # The whole reservation must fit now. Prefix hits count as held: those
            # another request holds cost nothing, those sitting free are taken.
            reserve = self.blocks_needed(self.reservation_tokens(request))
            num_revived = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
            if reserve - len(new_computed_blocks) + num_revived > (
                    self.pool.num_free_blocks - self._num_unfilled):
                return None
            self.reserved[request_id] = reserve
            self._num_unfilled += reserve
        before = self._unfilled(request_id)
        new_blocks = super().allocate_slots(request, num_new_tokens, new_computed_blocks)
        if new_blocks is None and admitting:  # (asked for more than it reserved)
            del self.reserved[request_id]
            self._num_unfilled -= before
            return None
        self._num_unfilled += self._unfilled(request_id) - before
        return new_blocks

    def rollback(self, request: Request) -> None:
        before = self._unfilled(request.request_id)
        super().rollback(request)
        self._num_unfilled += self._unfilled(request.request_id) - before

    def free(self, request: Request) -> None:
        """Release the request's blocks and what is left of its reservation."""
        self._num_unfilled -= self._unfilled(request.request_id)
        super().free(request)
        self.reserved.pop(request.request_id, None)

    def check_integrity(self) -> None:
        super().check_integrity()
        assert set(self.reserved) == set(self.req_to_blocks), "reservations != block tables"
        unfilled = sum(self._unfilled(r) for r in self.reserved)
        assert self._num_unfilled == unfilled, f"unfilled {self._num_unfilled} != {unfilled}"
        assert self.pool.num_free_blocks >= unfilled, (
            f"{unfilled} blocks promised, {self.pool.num_free_blocks} free")


def make_kv_cache_manager(cache_config: CacheConfig, num_blocks: int,
                          max_model_len: int, disk: BlockFiles | None = None,
                          layout: KVLayout | None = None) -> KVCacheManager:
    """The KV manager for `cache_config.kv_allocation`: paging is KVCacheManager;
    reserving (the batching study's baseline) is its subclass; paging with
    windows that free blocks (a `layout` of several groups, or one windowed)
    is HybridKVCacheManager. `disk`: the prefix cache's second tier, or None."""
    if layout is not None and layout.windows != (None,):
        if cache_config.kv_allocation != "paged" or disk is not None:
            raise ValueError("a KV layout that frees sliding windows' blocks is for paging without "
                             "the disk tier (engine/llm_engine.py keeps one group otherwise)")
        return HybridKVCacheManager(num_blocks, cache_config.block_size,
                                    cache_config.enable_prefix_caching, layout.windows)
    if cache_config.kv_allocation == "reserved":
        return ReservingKVCacheManager(num_blocks, cache_config.block_size,
                                       cache_config.enable_prefix_caching, max_model_len,
                                       cache_config.kv_reserve_output_tokens, disk)
    return KVCacheManager(num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
                          disk)
