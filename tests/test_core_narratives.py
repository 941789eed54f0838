"""core/ as CPU narratives: tiny pools, tiny budgets, exact numbers.

Each test tells one story step by step and asserts the exact block ids, ref
counts, free-queue (eviction) order and per-request token counts that
docs/ARCHITECTURE.md §3 and §4 promise. No model runs here: a fake runner "samples"
a fixed token for every request the scheduler asks to sample, and
`check_integrity()` runs after every schedule and every update.

The helpers and their conventions (block_size 4, `toks(1, 8)` is [1, ..., 8],
the fake runner samples token 7) are tests/narratives.py's.
"""

from __future__ import annotations

import pytest

from tests.narratives import (
    BLOCK_SIZE,
    SAMPLED,
    Sampler,
    by_id,
    free_ids,
    ids,
    make_request,
    make_scheduler,
    num_tokens_by_req,
    run_to_completion,
    scheduled,
    step,
    toks,
)
from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.block_pool import BlockPool
from tokenmill.core.contracts import EngineCoreOutput
from tokenmill.core.kv_cache_manager import (
    ROOT_HASH,
    KVCacheManager,
    hash_block_tokens,
    update_block_hashes,
)
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.request_queue import FCFSRequestQueue, PriorityRequestQueue, RequestQueue
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.static_scheduler import StaticBatchScheduler

# ---- BlockPool -------------------------------------------------------------------


def test_block_pool_hands_out_from_head_and_frees_to_tail_in_given_order() -> None:
    pool = BlockPool(6)
    pool.check_integrity()
    assert free_ids(pool) == [0, 1, 2, 3, 4, 5]

    b0, b1, b2 = pool.get_new_blocks(3)
    assert ids([b0, b1, b2]) == [0, 1, 2]
    assert [b.ref_cnt for b in (b0, b1, b2)] == [1, 1, 1]
    assert free_ids(pool) == [3, 4, 5]
    assert pool.num_free_blocks == 3
    assert pool.usage() == 0.5
    pool.check_integrity()

    # Freed blocks join the tail in the order given: 2 before 0.
    pool.free_blocks([b2, b0])
    assert free_ids(pool) == [3, 4, 5, 2, 0]
    assert (b0.ref_cnt, b1.ref_cnt, b2.ref_cnt) == (0, 1, 0)
    pool.check_integrity()

    # The least recently freed go first.
    assert ids(pool.get_new_blocks(4)) == [3, 4, 5, 2]
    assert free_ids(pool) == [0]
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(2)
    assert free_ids(pool) == [0], "a failed request for blocks must change nothing"
    pool.check_integrity()


def test_block_pool_touch_counts_references_and_revives_from_the_middle() -> None:
    pool = BlockPool(4)
    b0, b1 = pool.get_new_blocks(2)
    pool.touch([b0])  # a second request shares block 0
    assert (b0.ref_cnt, b1.ref_cnt) == (2, 1)

    pool.free_blocks([b0])  # one holder lets go: still in use
    assert b0.ref_cnt == 1
    assert free_ids(pool) == [2, 3]
    pool.free_blocks([b1, b0])
    assert free_ids(pool) == [2, 3, 1, 0]
    pool.check_integrity()

    # A prefix hit on a free block takes it out of the queue, wherever it is.
    pool.touch([b1])
    assert b1.ref_cnt == 1
    assert free_ids(pool) == [2, 3, 0]
    assert pool.num_free_blocks == 3
    pool.check_integrity()
    pool.touch([pool.blocks[2]])  # the head
    pool.touch([b0])  # the tail
    assert free_ids(pool) == [3]
    assert pool.free_queue.head is pool.free_queue.tail is pool.blocks[3]
    pool.check_integrity()


def test_block_pool_evicts_a_cached_hash_only_when_the_block_is_handed_out() -> None:
    pool = BlockPool(3)
    b0, b1 = pool.get_new_blocks(2)
    pool.cache_block(b0, 111)
    pool.cache_block(b1, 222)
    assert pool.get_cached_block(111) is b0
    assert pool.get_cached_block(222) is b1

    # Freed but still cached: a later request could revive them.
    pool.free_blocks([b0, b1])
    assert free_ids(pool) == [2, 0, 1]
    assert pool.get_cached_block(111) is b0
    assert b0.block_hash == 111
    pool.check_integrity()

    # Handing block 0 out again evicts its content; block 1 keeps its own.
    assert ids(pool.get_new_blocks(2)) == [2, 0]
    assert b0.block_hash is None
    assert pool.get_cached_block(111) is None
    assert pool.get_cached_block(222) is b1
    assert pool.cached == {222: b1}
    pool.check_integrity()


def test_block_pool_cache_block_keeps_the_first_holder_and_respects_disable() -> None:
    pool = BlockPool(4)
    b0, b1, b2 = pool.get_new_blocks(3)
    pool.cache_block(b0, 5)
    pool.cache_block(b1, 5)  # same content computed twice: keep the first
    assert pool.get_cached_block(5) is b0
    assert b1.block_hash is None
    pool.cache_block(b0, 6)  # a block's hash never changes while it holds it
    assert b0.block_hash == 5
    assert pool.get_cached_block(6) is None
    pool.check_integrity()

    # reset_prefix_cache refuses while blocks are in use, then forgets everything.
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(5) is b0
    pool.free_blocks([b0, b1, b2])
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {}
    assert all(b.block_hash is None for b in pool.blocks)
    pool.check_integrity()

    no_cache = BlockPool(2, enable_caching=False)
    (blk,) = no_cache.get_new_blocks(1)
    no_cache.cache_block(blk, 9)
    assert no_cache.get_cached_block(9) is None
    assert blk.block_hash is None


def test_block_pool_rejects_an_empty_pool() -> None:
    with pytest.raises(ValueError, match="at least one block"):
        BlockPool(0)


def test_block_pool_check_integrity_catches_corruption() -> None:
    pool = BlockPool(3)
    (b0,) = pool.get_new_blocks(1)
    pool.blocks[1].ref_cnt = 1  # a free block with a reference
    with pytest.raises(AssertionError):
        pool.check_integrity()
    pool.blocks[1].ref_cnt = 0
    pool.check_integrity()
    b0.block_hash = 42  # a hash the map does not know
    with pytest.raises(AssertionError):
        pool.check_integrity()


# ---- KVCacheManager ----------------------------------------------------------------


def test_hashes_chain_the_whole_prefix() -> None:
    req = make_request("r", toks(1, 10))
    update_block_hashes(req, BLOCK_SIZE)
    h0 = hash_block_tokens(ROOT_HASH, [1, 2, 3, 4])
    h1 = hash_block_tokens(h0, [5, 6, 7, 8])
    assert req.block_hashes == [h0, h1]  # tokens 9, 10 fill no block yet
    # Equal blocks under different parents hash differently.
    assert hash_block_tokens(ROOT_HASH, [5, 6, 7, 8]) != h1
    req.append_token(11)
    req.append_token(12)
    update_block_hashes(req, BLOCK_SIZE)
    assert req.block_hashes == [h0, h1, hash_block_tokens(h1, [9, 10, 11, 12])]


def test_allocate_slots_returns_exact_new_blocks_and_registers_full_ones() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    req = make_request("r", toks(1, 10))

    new = kv.allocate_slots(req, 10)
    assert new is not None
    assert ids(new) == [0, 1, 2]
    assert kv.block_ids("r") == [0, 1, 2]
    # Blocks 0 and 1 will be full after this step, so they are registered; 2 is not.
    assert [b.block_hash for b in new] == [req.block_hashes[0], req.block_hashes[1], None]
    assert free_ids(kv.pool) == [3, 4, 5, 6, 7]
    kv.check_integrity()

    # Decoding into the room left in block 2 needs no new block...
    req.num_computed_tokens = 10
    req.append_token(11)
    req.append_token(12)
    assert kv.allocate_slots(req, 2) == []
    assert kv.pool.blocks[2].block_hash == req.block_hashes[2]
    # ... the 13th token does.
    req.num_computed_tokens = 12
    req.append_token(13)
    new = kv.allocate_slots(req, 1)
    assert new is not None
    assert ids(new) == [3]
    assert kv.block_ids("r") == [0, 1, 2, 3]
    kv.check_integrity()


def test_allocate_slots_returns_none_when_short_and_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_request("a", toks(1, 12))
    assert ids(kv.allocate_slots(a, 12) or []) == [0, 1, 2]
    b = make_request("b", toks(21, 28))
    assert kv.allocate_slots(b, 8) is None  # needs 2 blocks, 1 is free
    assert kv.block_ids("b") == []
    assert "b" not in kv.req_to_blocks
    assert free_ids(kv.pool) == [3]
    kv.check_integrity()
    # Chunked to what fits, it goes in.
    assert ids(kv.allocate_slots(b, 4) or []) == [3]
    kv.check_integrity()


def test_free_forgets_registered_blocks_that_were_never_computed() -> None:
    # Preempted in the very step that allocated them: the K/V was never written.
    kv = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)
    req = make_request("r", toks(1, 12))
    kv.allocate_slots(req, 12)
    assert len(kv.pool.cached) == 3
    req.num_computed_tokens = 4  # only block 0 was computed before this step
    kv.free(req)
    assert [b.block_hash is not None for b in kv.pool.blocks[:3]] == [True, False, False]
    assert len(kv.pool.cached) == 1
    kv.check_integrity()


def test_free_releases_tail_first() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)
    req = make_request("r", toks(1, 12))
    assert ids(kv.allocate_slots(req, 12) or []) == [0, 1, 2]
    kv.free(req)
    # The tail is evicted before the head (the head is the likelier shared prefix).
    assert free_ids(kv.pool) == [3, 4, 2, 1, 0]
    assert kv.block_ids("r") == []
    assert all(b.ref_cnt == 0 for b in kv.pool.blocks)
    kv.check_integrity()
    kv.free(req)  # freeing twice is harmless
    assert kv.pool.num_free_blocks == 5


def test_prefix_hit_shares_the_first_requests_blocks() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    a = make_request("a", toks(1, 10))
    assert ids(kv.allocate_slots(a, 10) or []) == [0, 1, 2]

    # Same first two full blocks, different tail.
    b = make_request("b", [*toks(1, 8), 50, 51, 52])
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert ids(hits) == [0, 1]
    assert num_hit_tokens == 8
    new = kv.allocate_slots(b, 3, hits)
    assert new is not None
    assert ids(new) == [3]
    assert kv.block_ids("b") == [0, 1, 3]
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    kv.check_integrity()

    # The shared blocks stay in use until both holders let go.
    kv.free(a)
    assert [kv.pool.blocks[i].ref_cnt for i in range(4)] == [1, 1, 0, 1]
    assert free_ids(kv.pool) == [4, 5, 6, 7, 2]
    kv.free(b)
    assert free_ids(kv.pool) == [4, 5, 6, 7, 2, 3, 1, 0]
    kv.check_integrity()


def test_prefix_hit_needs_the_whole_chain_not_just_an_equal_block() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    a = make_request("a", toks(1, 9))
    kv.allocate_slots(a, 9)
    # Second block equal to a's, first block different: no hit at all.
    c = make_request("c", [9, 9, 9, 9, 5, 6, 7, 8, 9])
    assert kv.get_computed_blocks(c) == ([], 0)
    # First block equal, second different: one block.
    d = make_request("d", [1, 2, 3, 4, 5, 6, 7, 0, 9])
    hits, num_hit_tokens = kv.get_computed_blocks(d)
    assert (ids(hits), num_hit_tokens) == ([0], 4)


def test_a_fully_cached_prompt_still_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE)
    a = make_request("a", toks(1, 8))
    kv.allocate_slots(a, 8)
    assert kv.pool.blocks[1].block_hash is not None  # both blocks are cached

    # The same 8 tokens: the last position's logits are needed, so only block 0 hits.
    b = make_request("b", toks(1, 8))
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert (ids(hits), num_hit_tokens) == ([0], 4)
    # One more token and both blocks hit.
    c = make_request("c", toks(1, 9))
    hits, num_hit_tokens = kv.get_computed_blocks(c)
    assert (ids(hits), num_hit_tokens) == ([0, 1], 8)


def test_a_freed_cached_block_is_revived_by_a_hit() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=BLOCK_SIZE)
    a = make_request("a", toks(1, 8))
    assert ids(kv.allocate_slots(a, 8) or []) == [0, 1]
    a.num_computed_tokens = 8  # the step ran (the scheduler advances this)
    kv.free(a)
    assert free_ids(kv.pool) == [2, 3, 4, 5, 1, 0]
    kv.check_integrity()

    b = make_request("b", toks(1, 9))
    hits, num_hit_tokens = kv.get_computed_blocks(b)
    assert (ids(hits), num_hit_tokens) == ([0, 1], 8)
    new = kv.allocate_slots(b, 1, hits)
    assert new is not None
    assert ids(new) == [2]
    assert kv.block_ids("b") == [0, 1, 2]
    # The revived blocks left the free queue from its tail; the new one from its head.
    assert free_ids(kv.pool) == [3, 4, 5]
    assert [kv.pool.blocks[i].ref_cnt for i in range(3)] == [1, 1, 1]
    kv.check_integrity()


def test_reviving_hits_counts_against_the_free_blocks() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=BLOCK_SIZE)
    a = make_request("a", toks(1, 8))
    kv.allocate_slots(a, 8)  # blocks 0, 1
    a.num_computed_tokens = 8  # the step ran (the scheduler advances this)
    x = make_request("x", toks(31, 34))
    kv.allocate_slots(x, 4)  # block 2
    kv.free(a)
    assert free_ids(kv.pool) == [3, 1, 0]

    # 13 tokens need 4 blocks: 2 hits (both free, so both leave the queue) + 2 new
    # = 4 blocks out of the 3 free ones.
    b = make_request("b", toks(1, 13))
    hits, _ = kv.get_computed_blocks(b)
    assert ids(hits) == [0, 1]
    assert kv.allocate_slots(b, 5, hits) is None
    assert free_ids(kv.pool) == [3, 1, 0]
    assert [blk.ref_cnt for blk in kv.pool.blocks] == [0, 0, 1, 0]
    kv.check_integrity()
    # Chunked to 4 tokens it fits: 2 revived + 1 new.
    assert ids(kv.allocate_slots(b, 4, hits) or []) == [3]
    assert free_ids(kv.pool) == []
    kv.check_integrity()


def test_no_prefix_caching_means_no_hits() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=BLOCK_SIZE, enable_caching=False)
    a = make_request("a", toks(1, 9))
    kv.allocate_slots(a, 9)
    assert all(b.block_hash is None for b in kv.pool.blocks)
    assert kv.get_computed_blocks(make_request("b", toks(1, 9))) == ([], 0)


# ---- Request queues -----------------------------------------------------------------


def _queued(queue: RequestQueue) -> list[str]:
    return [r.request_id for r in queue]


def test_fcfs_queue_serves_in_order_and_takes_a_preempted_request_back_at_the_front() -> None:
    queue = FCFSRequestQueue()
    a, b, c = (make_request(rid, toks(1, 3)) for rid in "abc")
    for req in (a, b, c):
        queue.add(req)
    assert (_queued(queue), len(queue), queue.peek()) == (["a", "b", "c"], 3, a)
    assert queue.pop() is a
    queue.add_front(a)  # a preempted request goes ahead of the ones it came before
    assert _queued(queue) == ["a", "b", "c"]
    queue.remove(b)
    assert _queued(queue) == ["a", "c"]
    # The queue's order picks the victim: the latest admitted goes first.
    assert queue.preemption_victim([c, b, a]) is a
    assert [queue.pop().request_id for _ in range(2)] == ["a", "c"]
    assert len(queue) == 0
    with pytest.raises(IndexError):
        queue.peek()


def test_priority_queue_orders_by_priority_then_arrival_then_adding() -> None:
    queue = PriorityRequestQueue()
    spec = (("a", 2, 0.0), ("b", 0, 5.0), ("c", 1, 1.0), ("d", 0, 3.0), ("e", 0, 3.0))
    reqs = {
        rid: make_request(rid, toks(1, 3), priority=priority, arrival_time=arrival)
        for rid, priority, arrival in spec
    }
    for req in reqs.values():
        queue.add(req)
    assert _queued(queue) == ["d", "e", "b", "c", "a"]  # d and e tie: added first, first
    assert queue.pop() is reqs["d"]

    # Preempted, d takes back its own place: ahead of e, its later equal.
    queue.add_front(reqs["d"])
    assert _queued(queue) == ["d", "e", "b", "c", "a"]
    # Preempted, a low-priority request does not jump the queue.
    assert queue.pop() is reqs["d"]
    queue.remove(reqs["a"])
    queue.add_front(reqs["a"])
    assert _queued(queue) == ["e", "b", "c", "a"]
    # The victim is the running request the queue would admit last.
    assert queue.preemption_victim([reqs["a"], reqs["d"], reqs["c"]]) is reqs["a"]
    assert queue.preemption_victim([reqs["e"], reqs["d"]]) is reqs["e"]


def test_the_policy_picks_the_queue() -> None:
    assert isinstance(make_scheduler(policy="priority").queue, PriorityRequestQueue)
    assert isinstance(make_scheduler(policy="fcfs").queue, FCFSRequestQueue)
    assert isinstance(make_scheduler(policy="static").queue, FCFSRequestQueue)
    assert type(make_scheduler(policy="static")) is StaticBatchScheduler
    assert type(make_scheduler(policy="fcfs")) is Scheduler


def test_add_request_writes_nothing_into_the_request() -> None:
    # The length limit stays the scheduler's (capped by the pool) and is passed
    # to check_stop; a queued request is as its producer built it.
    sched = make_scheduler(num_blocks=4, max_model_len=1000)
    req = make_request("r", toks(1, 15), max_tokens=None)
    before = dict(vars(req))
    sched.add_request(req)
    assert vars(req) == before
    req.append_token(SAMPLED)
    assert req.check_stop(sched.max_model_len) is RequestStatus.FINISHED_LENGTH  # 16 tokens
    assert req.check_stop(17) is None


# ---- Scheduler: the token budget ---------------------------------------------------


def test_decodes_first_then_a_waiting_prompt_chunked_to_what_is_left() -> None:
    sched = make_scheduler(max_num_batched_tokens=10)
    sched.add_request(make_request("r1", toks(1, 3), max_tokens=10))
    sched.add_request(make_request("r2", toks(11, 13), max_tokens=10))
    out, outputs = step(sched)
    assert num_tokens_by_req(out) == {"r1": 3, "r2": 3}
    assert out.num_scheduled_tokens == 6
    assert [o.new_token_ids for o in outputs] == [[SAMPLED], [SAMPLED]]

    sched.add_request(make_request("w", toks(21, 40), max_tokens=10))  # 20 tokens

    # Mixed step: two decodes (1 token each), then 8 of w's 20 prompt tokens.
    out, outputs = step(sched)
    assert [s.request_id for s in out.scheduled] == ["r1", "r2", "w"]
    assert num_tokens_by_req(out) == {"r1": 1, "r2": 1, "w": 8}
    assert out.num_scheduled_tokens == 10
    r1 = scheduled(out, "r1")
    assert (r1.token_ids, r1.num_computed_tokens, r1.do_sample) == ([SAMPLED], 3, True)
    w = scheduled(out, "w")
    assert (w.token_ids, w.num_computed_tokens, w.do_sample) == (toks(21, 28), 0, False)
    assert w.block_ids == [2, 3]
    assert sorted(o.request_id for o in outputs) == ["r1", "r2"]  # w sampled nothing

    out, outputs = step(sched)
    assert num_tokens_by_req(out) == {"r1": 1, "r2": 1, "w": 8}
    w = scheduled(out, "w")
    assert (w.token_ids, w.num_computed_tokens, w.do_sample) == (toks(29, 36), 8, False)
    # r1 and r2 crossed into their second blocks first (4 and 5): running goes first.
    assert w.block_ids == [2, 3, 6, 7]

    # The last chunk reaches the end of the prompt: w samples; budget left over.
    out, outputs = step(sched)
    assert num_tokens_by_req(out) == {"r1": 1, "r2": 1, "w": 4}
    assert out.num_scheduled_tokens == 6
    w = scheduled(out, "w")
    assert (w.token_ids, w.num_computed_tokens, w.do_sample) == (toks(37, 40), 16, True)
    assert by_id(outputs)["w"].new_token_ids == [SAMPLED]

    # Now everyone decodes.
    out, _ = step(sched)
    assert num_tokens_by_req(out) == {"r1": 1, "r2": 1, "w": 1}
    assert scheduled(out, "w").num_computed_tokens == 20


def test_a_long_prompt_alone_is_chunked() -> None:
    sched = make_scheduler(max_num_batched_tokens=10)
    req = make_request("p", toks(1, 25), max_tokens=2)
    sched.add_request(req)
    seen = []
    for _ in range(3):
        out, outputs = step(sched)
        s = scheduled(out, "p")
        seen.append((s.num_tokens, s.num_computed_tokens, s.do_sample, len(outputs)))
    assert seen == [(10, 0, False, 0), (10, 10, False, 0), (5, 20, True, 1)]
    assert req.num_computed_tokens == 25
    assert req.output_token_ids == [SAMPLED]


def test_a_chunk_stops_short_of_the_budget_when_a_running_prefill_uses_it() -> None:
    # A running request in the middle of its prefill takes the whole budget before
    # any waiting request is looked at.
    sched = make_scheduler(max_num_batched_tokens=10)
    sched.add_request(make_request("a", toks(1, 15), max_tokens=1))
    sched.add_request(make_request("b", toks(21, 23), max_tokens=1))
    out, _ = step(sched)
    assert num_tokens_by_req(out) == {"a": 10}
    out, _ = step(sched)
    assert num_tokens_by_req(out) == {"a": 5, "b": 3}
    assert sched.requests == {}


def test_max_num_seqs_caps_the_running_set() -> None:
    sched = make_scheduler(max_num_seqs=2)
    for rid, n in (("a", 2), ("b", 5), ("c", 5)):
        sched.add_request(make_request(rid, toks(1, 3), max_tokens=n))

    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["a", "b"]
    assert [r.request_id for r in sched.waiting] == ["c"]
    out, outputs = step(sched)  # a's second token ends it
    assert [s.request_id for s in out.scheduled] == ["a", "b"]
    assert by_id(outputs)["a"].finish_reason == "length"

    out, _ = step(sched)  # the freed slot goes to c at once
    assert out.finished_req_ids == ["a"]
    assert num_tokens_by_req(out) == {"b": 1, "c": 3}
    assert sched.waiting == []


def _admission_order(policy: str) -> list[str]:
    sched = make_scheduler(policy=policy, max_num_seqs=1)
    for rid, priority, arrival in (("a", 2, 0.0), ("b", 0, 5.0), ("c", 1, 1.0), ("d", 0, 3.0)):
        sched.add_request(
            make_request(rid, toks(1, 3), max_tokens=1, priority=priority, arrival_time=arrival)
        )
    order = []
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        order += [s.request_id for s in out.scheduled]
    return order


def test_fcfs_admits_in_the_order_requests_were_added() -> None:
    assert _admission_order("fcfs") == ["a", "b", "c", "d"]


def test_priority_admits_lower_values_first_ties_by_arrival() -> None:
    assert _admission_order("priority") == ["d", "b", "c", "a"]


def test_prefix_hit_through_the_scheduler_shares_blocks() -> None:
    sched = make_scheduler(num_blocks=8)
    a = make_request("a", toks(1, 10), max_tokens=3)
    sched.add_request(a)
    out, _ = step(sched)
    assert scheduled(out, "a").block_ids == [0, 1, 2]

    b = make_request("b", [*toks(1, 8), 50, 51, 52], max_tokens=3)
    sched.add_request(b)
    out, outputs = step(sched)
    s = scheduled(out, "b")
    assert (s.num_computed_tokens, s.token_ids, s.block_ids) == (8, [50, 51, 52], [0, 1, 3])
    assert [sched.kv.pool.blocks[i].ref_cnt for i in range(4)] == [2, 2, 1, 1]
    assert b.num_cached_tokens == 8
    assert by_id(outputs)["b"].num_cached_tokens == 8
    assert by_id(outputs)["a"].num_cached_tokens == 0
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (10 + 11, 8)
    stats = sched.stats()
    assert (stats.num_running, stats.num_free_blocks, stats.prefix_cache_hits) == (2, 4, 8)

    run_to_completion(sched)
    assert sched.kv.pool.num_free_blocks == 8
    assert [b.ref_cnt for b in sched.kv.pool.blocks] == [0] * 8


# ---- Scheduler: preemption -----------------------------------------------------------


def test_fcfs_preempts_the_latest_admitted_and_recomputes_it_from_prefix_hits() -> None:
    # 6 blocks of 4: two 8-token prompts fill 4 blocks; their decodes take the last
    # two at token 9, and at token 13 both need a fourth block.
    sched = make_scheduler(num_blocks=6)
    a = make_request("a", toks(1, 8), max_tokens=7)
    b = make_request("b", toks(11, 18), max_tokens=7)
    sched.add_request(a)
    sched.add_request(b)

    out, _ = step(sched)
    assert {s.request_id: s.block_ids for s in out.scheduled} == {"a": [0, 1], "b": [2, 3]}
    out, _ = step(sched)
    assert {s.request_id: s.block_ids for s in out.scheduled} == {
        "a": [0, 1, 4],
        "b": [2, 3, 5],
    }
    for _ in range(3):  # tokens 10..12 fit in the third blocks
        out, _ = step(sched)
        assert num_tokens_by_req(out) == {"a": 1, "b": 1}
    assert sched.kv.pool.num_free_blocks == 0
    assert (a.num_tokens, b.num_tokens) == (13, 13)

    # a needs a 4th block; b, the most recently admitted, is preempted.
    out, _ = step(sched)
    assert out.preempted_req_ids == ["b"]
    assert num_tokens_by_req(out) == {"a": 1}
    assert scheduled(out, "a").block_ids == [0, 1, 4, 5]  # b's tail block, evicted
    assert sched.waiting == [b]
    assert b.status is RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.num_preemptions == 1
    assert sched.num_preemptions == 1
    assert sched.kv.block_ids("b") == []
    # b's first two blocks are free but still cached.
    assert free_ids(sched.kv.pool) == [3, 2]
    assert sched.kv.pool.get_cached_block(b.block_hashes[0]) is sched.kv.pool.blocks[2]
    assert sched.kv.pool.get_cached_block(b.block_hashes[1]) is sched.kv.pool.blocks[3]

    # b does not fit yet (2 hits + 2 new > 2 free); newcomers never preempt.
    out, outputs = step(sched)
    assert num_tokens_by_req(out) == {"a": 1}
    assert out.preempted_req_ids == []
    assert by_id(outputs)["a"].finish_reason == "length"
    assert free_ids(sched.kv.pool) == [3, 2, 5, 4, 1, 0]

    # a is gone; b comes back with its first 8 tokens as prefix hits.
    out, outputs = step(sched)
    assert out.finished_req_ids == ["a"]
    s = scheduled(out, "b")
    assert s.num_computed_tokens == 8
    assert s.token_ids == b.all_token_ids[8:13] == [SAMPLED] * 5
    assert s.block_ids == [2, 3, 5, 4]
    assert s.do_sample
    assert (b.num_computed_tokens, b.status) == (13, RequestStatus.RUNNING)
    assert sched.prefix_cache_hits == 8
    assert sched.prefix_cache_queries == 8 + 8 + 13
    assert b.num_cached_tokens == 0  # the hits at its first schedule
    assert by_id(outputs)["b"].num_preemptions == 1

    outputs = run_to_completion(sched)
    assert [o.finish_reason for o in outputs] == ["length"]
    assert b.output_token_ids == [SAMPLED] * 7
    assert a.output_token_ids == [SAMPLED] * 7
    assert sched.kv.pool.num_free_blocks == 6


@pytest.mark.parametrize(("policy", "victim"), [("priority", "low"), ("fcfs", "high")])
def test_priority_preempts_the_lowest_priority_even_if_admitted_first(
    policy: str, victim: str
) -> None:
    sched = make_scheduler(num_blocks=6, policy=policy)
    low = make_request("low", toks(1, 8), priority=5, max_tokens=8)
    sched.add_request(low)
    step(sched)  # low: blocks 0, 1
    high = make_request("high", toks(21, 32), priority=0, max_tokens=3, arrival_time=1.0)
    sched.add_request(high)
    out, _ = step(sched)  # low decodes into block 2; high takes 3, 4, 5
    assert {s.request_id: s.block_ids for s in out.scheduled} == {
        "low": [0, 1, 2],
        "high": [3, 4, 5],
    }

    # high needs a 4th block. Priority: low (5) goes although it was admitted first.
    # FCFS: the latest admitted, high itself, goes.
    out, _ = step(sched)
    assert out.preempted_req_ids == [victim]
    assert sched.num_preemptions == 1
    assert out.num_scheduled_tokens == 1  # a victim's slot this step is given back
    if policy == "fcfs":
        assert num_tokens_by_req(out) == {"low": 1}
        return
    assert num_tokens_by_req(out) == {"high": 1}
    assert scheduled(out, "high").block_ids == [3, 4, 5, 2]
    assert sched.waiting == [low]
    assert (low.status, low.num_computed_tokens) == (RequestStatus.PREEMPTED, 0)
    assert free_ids(sched.kv.pool) == [1, 0]

    out, _ = step(sched)  # high's last token; low still does not fit
    assert num_tokens_by_req(out) == {"high": 1}
    out, _ = step(sched)
    assert out.finished_req_ids == ["high"]
    s = scheduled(out, "low")
    assert (s.num_computed_tokens, s.token_ids, s.block_ids) == (8, [SAMPLED] * 2, [0, 1, 2])
    assert sched.prefix_cache_hits == 8
    run_to_completion(sched)
    assert low.output_token_ids == [SAMPLED] * 8
    assert sched.kv.pool.num_free_blocks == 6


def test_preempting_an_already_scheduled_request_caches_nothing_uncomputed() -> None:
    # Priority policy; running = [low, x, high] in admission order. In one step low
    # (admitted first, lowest priority) decodes its 8th token, which fills its
    # block 1, so allocate_slots registers block 1's hash. Then high cannot get 5
    # blocks: low is preempted (after having been given its slot), then high
    # itself. Only x runs that step, so position 7 of low's block 1 is never
    # computed, yet block 1 stays in the prefix cache under that content.
    sched = make_scheduler(num_blocks=8, max_num_batched_tokens=20, policy="priority")
    low = make_request("low", toks(1, 6), priority=9, max_tokens=30)
    sched.add_request(low)
    step(sched)  # low: 6 tokens, blocks 0, 1
    sched.add_request(make_request("x", toks(101, 115), priority=0, max_tokens=30))
    sched.add_request(make_request("high", toks(201, 224), priority=5, max_tokens=30))
    out, _ = step(sched)
    assert num_tokens_by_req(out) == {"low": 1, "x": 15, "high": 4}
    assert [r.request_id for r in sched.running] == ["low", "x", "high"]

    out, _ = step(sched)
    assert out.preempted_req_ids == ["low", "high"]
    assert num_tokens_by_req(out) == {"x": 1}
    assert low.num_tokens == 8  # its 8th token's K/V were never computed

    # A new request whose prompt starts with low's 8 tokens may reuse block 0
    # (positions 0..3, computed), but not block 1 (position 7 was never written).
    probe = make_request("probe", [*low.all_token_ids, 99], priority=-1, max_tokens=1)
    sched.add_request(probe)
    out, _ = step(sched)
    assert scheduled(out, "probe").num_computed_tokens <= 4


# ---- Scheduler: admission errors ----------------------------------------------------


def test_rejections_say_why_and_the_others_are_still_served() -> None:
    sched = make_scheduler(num_blocks=4, max_model_len=1000)
    # 4 blocks of 4: a request can never have more than 16 tokens.
    assert sched.max_model_len == 16

    sched.add_request(make_request("ok", toks(1, 3), max_tokens=2))
    with pytest.raises(ValueError, match=r"17 tokens.*16 tokens.*max_model_len"):
        sched.add_request(make_request("long", toks(1, 17)))
    with pytest.raises(ValueError, match="prompt is empty"):
        sched.add_request(make_request("empty", []))
    with pytest.raises(ValueError, match="'ok' is already in use"):
        sched.add_request(make_request("ok", toks(1, 3)))
    assert sorted(sched.requests) == ["ok"]
    assert [r.request_id for r in sched.waiting] == ["ok"]
    sched.check_integrity()

    # A prompt of exactly max_model_len fits; it can generate one token only.
    edge = make_request("edge", toks(1, 16), max_tokens=None)
    sched.add_request(edge)
    outputs = run_to_completion(sched)
    assert {o.request_id: o.finish_reason for o in outputs if o.finished} == {
        "ok": "length",
        "edge": "length",
    }
    assert edge.output_token_ids == [SAMPLED]
    assert sched.kv.pool.num_free_blocks == 4

    # Once finished, an id can be used again.
    sched.add_request(make_request("ok", toks(1, 3), max_tokens=1))
    run_to_completion(sched)


def test_max_model_len_below_the_pool_is_kept_and_caps_generation() -> None:
    sched = make_scheduler(num_blocks=32, max_model_len=10)
    assert sched.max_model_len == 10
    req = make_request("r", toks(1, 4), max_tokens=None)
    sched.add_request(req)
    outputs = run_to_completion(sched)
    assert req.num_tokens == 10
    assert len(req.output_token_ids) == 6
    assert outputs[-1].finish_reason == "length"


# ---- Scheduler: stops -----------------------------------------------------------------


def _finish_after(request: Request, sample: Sampler = SAMPLED) -> tuple[int, EngineCoreOutput]:
    sched = make_scheduler()
    sched.add_request(request)
    outputs = run_to_completion(sched, sample)
    assert all(o.new_token_ids == [request.output_token_ids[i]] for i, o in enumerate(outputs))
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks
    return len(outputs), outputs[-1]


def test_eos_stops_a_request() -> None:
    req = make_request("r", toks(1, 3), eos=(SAMPLED,), max_tokens=5)
    n, last = _finish_after(req)
    assert (n, last.finish_reason, last.stop_reason) == (1, "stop", None)
    assert req.status is RequestStatus.FINISHED_STOPPED


def test_ignore_eos_runs_to_max_tokens() -> None:
    req = make_request("r", toks(1, 3), eos=(SAMPLED,), max_tokens=5, ignore_eos=True)
    n, last = _finish_after(req)
    assert (n, last.finish_reason, last.stop_reason) == (5, "length", None)
    assert req.status is RequestStatus.FINISHED_LENGTH


def test_min_tokens_suppresses_eos_until_reached() -> None:
    req = make_request("r", toks(1, 3), eos=(SAMPLED,), max_tokens=5, min_tokens=3)
    n, last = _finish_after(req)
    assert (n, last.finish_reason) == (3, "stop")


def test_a_stop_token_id_sets_stop_reason() -> None:
    tokens = iter([5, 6, 9, 5])
    req = make_request("r", toks(1, 3), eos=(2,), max_tokens=10, stop_token_ids=[9])
    n, last = _finish_after(req, lambda _rid: next(tokens))
    assert (n, last.finish_reason, last.stop_reason) == (3, "stop", 9)
    assert req.output_token_ids == [5, 6, 9]


def test_min_tokens_suppresses_stop_token_ids_too() -> None:
    req = make_request("r", toks(1, 3), max_tokens=10, min_tokens=2, stop_token_ids=[SAMPLED])
    n, last = _finish_after(req)
    assert (n, last.finish_reason, last.stop_reason) == (2, "stop", SAMPLED)


def test_max_tokens_ends_with_length() -> None:
    req = make_request("r", toks(1, 3), max_tokens=4)
    n, last = _finish_after(req)
    assert (n, last.finish_reason, last.stop_reason) == (4, "length", None)


def test_finished_ids_come_in_the_next_schedule_and_every_block_is_freed() -> None:
    sched = make_scheduler(num_blocks=8)
    sched.add_request(make_request("short", toks(1, 5), max_tokens=1))
    sched.add_request(make_request("long", toks(11, 15), max_tokens=3))
    out, outputs = step(sched)
    assert out.finished_req_ids == []
    assert by_id(outputs)["short"].finish_reason == "length"
    assert sched.kv.block_ids("short") == []
    assert sched.kv.pool.num_free_blocks == 6  # long holds 2

    out, _ = step(sched)
    assert out.finished_req_ids == ["short"]
    out, _ = step(sched)
    assert out.finished_req_ids == []
    out = sched.schedule()
    assert out.finished_req_ids == ["long"]
    assert out.is_empty
    assert out.num_scheduled_tokens == 0
    assert sched.kv.pool.num_free_blocks == 8
    assert not sched.has_unfinished_requests()
    sched.check_integrity()


# ---- Scheduler: static batching ------------------------------------------------------


def test_static_batch_runs_until_its_longest_member_ends() -> None:
    sched = make_scheduler(policy="static", max_num_seqs=2)
    a = make_request("a", toks(1, 4), max_tokens=1)
    b = make_request("b", toks(11, 14), max_tokens=3)
    c = make_request("c", toks(21, 24), max_tokens=2)
    for req in (a, b, c):
        sched.add_request(req)

    out, outputs = step(sched)
    assert num_tokens_by_req(out) == {"a": 4, "b": 4}
    assert [r.request_id for r in sched.waiting] == ["c"]
    # a's only token is delivered, but a is not reported finished yet.
    assert {o.request_id: (o.new_token_ids, o.finish_reason) for o in outputs} == {
        "a": ([SAMPLED], None),
        "b": ([SAMPLED], None),
    }

    # a keeps its slot and keeps being computed; its tokens are discarded.
    out, outputs = step(sched)
    assert num_tokens_by_req(out) == {"a": 1, "b": 1}
    assert scheduled(out, "a").do_sample
    assert [(o.request_id, o.new_token_ids) for o in outputs] == [("b", [SAMPLED])]
    assert a.output_token_ids == [SAMPLED]
    assert a.num_tokens == 6
    assert a.status is RequestStatus.RUNNING
    assert [r.request_id for r in sched.waiting] == ["c"]

    # b's third token ends the batch: both finish in this step.
    out, outputs = step(sched)
    assert num_tokens_by_req(out) == {"a": 1, "b": 1}
    assert scheduled(out, "a").do_sample
    assert [o for o in outputs if o.new_token_ids] == [
        EngineCoreOutput("b", [SAMPLED], [0.0], [None], [1])
    ]
    finals = {o.request_id: (o.new_token_ids, o.finish_reason) for o in outputs if o.finished}
    assert finals == {"a": ([], "length"), "b": ([], "length")}
    assert sched.kv.pool.num_free_blocks == sched.kv.num_blocks
    assert [r.request_id for r in sched.waiting] == ["c"]

    # Only now is c admitted.
    out, outputs = step(sched)
    assert sorted(out.finished_req_ids) == ["a", "b"]
    assert num_tokens_by_req(out) == {"c": 4}
    assert a.output_token_ids == [SAMPLED]
    assert b.output_token_ids == [SAMPLED] * 3
    outputs += run_to_completion(sched)
    assert [(o.new_token_ids, o.finish_reason) for o in outputs] == [
        ([SAMPLED], None),
        ([SAMPLED], None),
        ([], "length"),
    ]


def test_static_batch_member_stopped_from_outside_keeps_its_slot() -> None:
    # A matched stop string is reported by the engine through finish_requests.
    sched = make_scheduler(policy="static", max_num_seqs=2)
    sched.add_request(make_request("a", toks(1, 4), max_tokens=5))
    sched.add_request(make_request("b", toks(11, 14), max_tokens=2))
    step(sched)
    sched.finish_requests(["a"], RequestStatus.FINISHED_STOPPED)
    sched.check_integrity()
    out, outputs = step(sched)
    assert num_tokens_by_req(out) == {"a": 1, "b": 1}
    finals = {o.request_id: o.finish_reason for o in outputs if o.finished}
    assert finals == {"a": "stop", "b": "length"}


def test_static_batch_padding_member_gives_its_blocks_to_one_still_generating() -> None:
    # 4 blocks of 4 tokens: b alone needs all of them by its end. a is done after
    # one token and, as padding, keeps growing: it gives its blocks up (and waits,
    # not computed again) rather than hold what b needs (which once hung the batch).
    sched = make_scheduler(policy="static", max_num_seqs=2, num_blocks=4)
    a = make_request("a", toks(1, 4), max_tokens=1)
    b = make_request("b", toks(11, 14), max_tokens=10)
    sched.add_request(a)
    sched.add_request(b)
    outputs = run_to_completion(sched, max_steps=40)
    assert b.output_token_ids == [SAMPLED] * 10 and b.num_preemptions == 0
    assert a.output_token_ids[:1] == [SAMPLED] and a.num_preemptions >= 1
    finals = {o.request_id: o.finish_reason for o in outputs if o.finished}
    assert finals == {"a": "length", "b": "length"}
    assert sched.kv.pool.num_free_blocks == 4


def test_static_batch_member_stop_token_goes_out_with_its_reason() -> None:
    # A stop token's text is left out of the output only beside finish_reason
    # "stop": under the static policy both go out when the batch ends.
    sched = make_scheduler(policy="static", max_num_seqs=2)
    sched.add_request(make_request("a", toks(1, 4), max_tokens=5, eos=(9,)))
    sched.add_request(make_request("b", toks(11, 14), max_tokens=3))
    _, outputs = step(sched, {"a": 9})
    assert [o.request_id for o in outputs] == ["b"]
    outputs = run_to_completion(sched, {"a": 9})
    assert [(o.new_token_ids, o.finish_reason) for o in outputs if o.request_id == "a"] == [([9], "stop")]


def test_the_plain_scheduler_has_no_static_path_even_when_told_static() -> None:
    # Built directly with policy "static", Scheduler batches continuously: a done
    # request finishes at once and its slot goes to the next waiting request.
    # Static batching lives only in StaticBatchScheduler.
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=100, policy="static")
    sched = Scheduler(config, CacheConfig(block_size=BLOCK_SIZE), num_blocks=32, max_model_len=64)
    for rid, n in (("a", 1), ("b", 3), ("c", 2)):
        sched.add_request(make_request(rid, toks(1, 4), max_tokens=n, stop_token_ids=[9]))
    out, outputs = step(sched)
    assert by_id(outputs)["a"].finish_reason == "length"
    out, outputs = step(sched, {"b": 9})  # a stop token goes out at once, with its reason
    assert num_tokens_by_req(out) == {"b": 1, "c": 4}
    assert (by_id(outputs)["b"].new_token_ids, by_id(outputs)["b"].finish_reason) == ([9], "stop")
    sched.add_request(make_request("d", toks(1, 4), max_tokens=4))
    sched.finish_requests(["d", "c"], RequestStatus.FINISHED_STOPPED)  # finished, not padding
    sched.check_integrity()
    assert not sched.has_unfinished_requests()


def test_padding_is_named_only_in_the_static_scheduler() -> None:
    # No identifier or string in scheduler.py's or request.py's code (docstrings
    # aside) speaks of padding or static batches.
    import ast
    import inspect

    import tokenmill.core.request as request_module
    import tokenmill.core.scheduler as scheduler_module

    for module in (scheduler_module, request_module):
        tree = ast.parse(inspect.getsource(module))
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef)
            and node.body
            and isinstance(node.body[0], ast.Expr)
        }
        words: list[str] = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                words.append(node.id)
            elif isinstance(node, ast.Attribute):
                words.append(node.attr)
            elif isinstance(node, ast.FunctionDef | ast.ClassDef):
                words.append(node.name)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str):
                words += [] if id(node) in docstrings else [node.value]
        assert not [w for w in words if any(x in w.lower() for x in ("padding", "static"))]


# ---- Scheduler: aborts -----------------------------------------------------------------


def test_abort_frees_a_running_and_a_waiting_request() -> None:
    sched = make_scheduler(num_blocks=8, max_num_seqs=1)
    run = make_request("run", toks(1, 6), max_tokens=5)
    wait = make_request("wait", toks(11, 16), max_tokens=5)
    other = make_request("other", toks(21, 23), max_tokens=1)
    for req in (run, wait, other):
        sched.add_request(req)
    step(sched)
    assert sched.kv.block_ids("run") == [0, 1]
    assert [r.request_id for r in sched.waiting] == ["wait", "other"]

    sched.finish_requests(["run", "wait", "no-such-id"], RequestStatus.FINISHED_ABORTED)
    sched.check_integrity()
    assert (run.status, wait.status) == (RequestStatus.FINISHED_ABORTED,) * 2
    assert run.status.finish_reason == "abort"
    assert sched.running == []
    assert sched.waiting == [other]
    assert sched.kv.block_ids("run") == []
    assert sched.kv.pool.num_free_blocks == 8

    out, _ = step(sched)
    assert out.finished_req_ids == ["run", "wait"]
    assert num_tokens_by_req(out) == {"other": 3}


def test_abort_a_preempted_request() -> None:
    sched = make_scheduler(num_blocks=2, max_num_batched_tokens=16)
    a = make_request("a", toks(1, 4), max_tokens=8)
    b = make_request("b", toks(11, 14), max_tokens=8)
    sched.add_request(a)
    sched.add_request(b)
    step(sched)  # a: block 0, b: block 1
    out, _ = step(sched)  # a needs a second block: b is preempted
    assert out.preempted_req_ids == ["b"]
    assert b.status is RequestStatus.PREEMPTED
    sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED)
    sched.check_integrity()
    assert (sched.waiting, b.status) == ([], RequestStatus.FINISHED_ABORTED)
    assert sched.schedule().finished_req_ids == ["b"]
