"""Reserved KV allocation (core/kv_reservation.py) as CPU narratives.

The narratives' helpers and conventions (tests/narratives.py: block_size 4, the
fake runner samples token 7, integrity checked after every schedule and update): each
story asserts exact block ids, ref counts, what is reserved, and who is
admitted and when, against the pool's budget. The production scheduler runs
these stories unchanged: the policy is the KV manager's.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.hf_models import TEST_DEVICE, build_hf_model, save_hf_model
from tests.narratives import (
    SAMPLED,
    free_ids,
    make_request,
    make_scheduler,
    num_tokens_by_req,
    run_to_completion,
    step,
    toks,
)
from tokenmill import LLM, SamplingParams
from tokenmill.config import CacheConfig
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.kv_reservation import ReservingKVCacheManager, make_kv_cache_manager
from tokenmill.core.request import RequestStatus
from tokenmill.core.scheduler import Scheduler


def reserving(*, num_blocks: int, kv_allocation: str = "reserved", policy: str = "fcfs",
              max_num_seqs: int = 8, enable_prefix_caching: bool = False,
              reserve_output: int | None = None, max_model_len: int = 1024) -> Scheduler:
    """The narratives' scheduler, reserving and without the prefix cache unless told."""
    return make_scheduler(num_blocks=num_blocks, kv_allocation=kv_allocation, policy=policy,
                          max_num_seqs=max_num_seqs, enable_prefix_caching=enable_prefix_caching,
                          kv_reserve_output_tokens=reserve_output, max_model_len=max_model_len)


def held(sched: Scheduler, request_id: str) -> list[int]:
    return sched.kv.block_ids(request_id)


def test_the_option_picks_the_kv_manager_and_nothing_else() -> None:
    paged = reserving(num_blocks=8, kv_allocation="paged")
    reserved = reserving(num_blocks=8)
    assert type(paged.kv) is KVCacheManager
    assert type(reserved.kv) is ReservingKVCacheManager
    assert type(paged) is type(reserved) is Scheduler
    assert type(reserving(num_blocks=8, policy="static")).__name__ == "StaticBatchScheduler"
    with pytest.raises(ValueError, match="kv_allocation='pooled' is not supported"):
        CacheConfig(kv_allocation="pooled")
    kv = make_kv_cache_manager(CacheConfig(block_size=4, kv_allocation="reserved"), 5, 20)
    assert isinstance(kv, ReservingKVCacheManager) and kv.max_model_len == 20


def test_a_request_is_admitted_only_when_its_whole_reservation_fits() -> None:
    # 10 blocks of 4 tokens. a reserves 8 + 8 = 16 tokens (4 blocks), b 8 + 12 = 20
    # (5 blocks), c 4 + 4 = 8 (2 blocks): a and b leave 1 block unpromised.
    sched = reserving(num_blocks=10)
    a = make_request("a", toks(1, 8), max_tokens=8)
    b = make_request("b", toks(11, 18), max_tokens=12)
    c = make_request("c", toks(21, 24), max_tokens=4)
    for r in (a, b, c):
        sched.add_request(r)

    out, _ = step(sched)
    assert num_tokens_by_req(out) == {"a": 8, "b": 8}
    assert (held(sched, "a"), held(sched, "b")) == ([0, 1], [2, 3])
    # Blocks are still handed out as tokens need them; the rest is promised.
    assert sched.kv.reserved == {"a": 4, "b": 5}
    assert sched.kv.num_reserved_blocks == 2 + 3
    assert sched.kv.pool.num_free_blocks == 6  # free, but only 1 is unpromised
    assert [r.request_id for r in sched.waiting] == ["c"]
    assert sched.stats().num_reserved_blocks == 5

    out, _ = step(sched)
    assert num_tokens_by_req(out) == {"a": 1, "b": 1}  # c still waits: 4 free, 3 promised
    assert (held(sched, "a"), held(sched, "b")) == ([0, 1, 4], [2, 3, 5])
    assert sched.kv.num_reserved_blocks == 1 + 2
    assert [r.request_id for r in sched.waiting] == ["c"]

    # a's 8th token (step 8) finishes it: it computed 15 tokens, filling its 4 blocks.
    for _ in range(6):
        step(sched)
    assert a.status is RequestStatus.FINISHED_LENGTH
    assert held(sched, "b") == [2, 3, 5, 7]
    assert free_ids(sched.kv.pool) == [8, 9, 6, 4, 1, 0]  # a's freed tail first
    assert sched.kv.num_reserved_blocks == 1  # b's last block

    # Its reservation back, c is admitted at the next step, into the LRU end.
    out, _ = step(sched)
    assert num_tokens_by_req(out) == {"b": 1, "c": 4}
    assert held(sched, "c") == [8]
    assert sched.kv.reserved == {"b": 5, "c": 2}
    assert sched.kv.num_reserved_blocks == 1 + 1

    run_to_completion(sched)
    assert sched.num_preemptions == 0
    assert sched.kv.pool.num_free_blocks == 10 and sched.kv.num_reserved_blocks == 0
    assert sched.kv.reserved == {}
    assert [r.output_token_ids for r in (a, b, c)] == [[SAMPLED] * 8, [SAMPLED] * 12, [SAMPLED] * 4]


def test_paging_admits_the_same_requests_at_once() -> None:
    # The story above under paging: c needs 1 block now, and 6 are free.
    sched = reserving(num_blocks=10, kv_allocation="paged")
    for rid, prompt, n in (("a", toks(1, 8), 8), ("b", toks(11, 18), 12), ("c", toks(21, 24), 4)):
        sched.add_request(make_request(rid, prompt, max_tokens=n))
    out, _ = step(sched)
    assert num_tokens_by_req(out) == {"a": 8, "b": 8, "c": 4}
    assert (held(sched, "a"), held(sched, "b"), held(sched, "c")) == ([0, 1], [2, 3], [4])
    assert sched.kv.num_reserved_blocks == 0


def test_a_full_pool_of_promises_never_preempts() -> None:
    # Every block promised at admission: the running requests fill their
    # reservations to the last block, and nobody is preempted or waits for one.
    sched = reserving(num_blocks=6)
    a = make_request("a", toks(1, 4), max_tokens=8)  # 12 tokens: 3 blocks
    b = make_request("b", toks(11, 14), max_tokens=8)  # 3 blocks
    sched.add_request(a)
    sched.add_request(b)
    step(sched)
    assert sched.kv.pool.num_free_blocks == 4 and sched.kv.num_reserved_blocks == 4
    outputs = run_to_completion(sched)
    assert sched.num_preemptions == 0 and a.num_preemptions == b.num_preemptions == 0
    assert {o.request_id: o.finish_reason for o in outputs if o.finished} == {
        "a": "length", "b": "length"}


def test_a_request_that_can_never_fit_is_refused_naming_max_tokens_and_the_budget() -> None:
    sched = reserving(num_blocks=10)  # 40 tokens
    with pytest.raises(ValueError) as err:
        sched.add_request(make_request("a", toks(1, 8), max_tokens=33))
    message = str(err.value)
    assert "prompt 8 + max_tokens 33" in message
    assert "KV budget of 40 tokens (10 blocks of 4)" in message
    assert "kv_allocation='paged'" in message
    assert not sched.requests and not sched.waiting  # nothing was queued
    # 32 fits exactly (10 blocks), and paging accepts 33 (it stops at the context).
    sched.add_request(make_request("b", toks(1, 8), max_tokens=32))
    paged = reserving(num_blocks=10, kv_allocation="paged")
    paged.add_request(make_request("a", toks(1, 8), max_tokens=33))
    # max_tokens None reserves the context, capped by the pool: 40 tokens.
    sched.add_request(make_request("c", toks(1, 8), max_tokens=None))
    assert sched.kv.reservation_tokens(sched.requests["c"]) == 40


def test_reserving_for_the_cap_holds_room_for_outputs_nobody_generates() -> None:
    # kv_reserve_output_tokens 8, as a server that cannot know an answer's length:
    # each 4-token prompt with max_tokens 2 reserves 4 + 8 = 12 tokens (3 blocks),
    # so 10 blocks admit 3 where exact reservations (2 blocks each) admit all 4.
    sched = reserving(num_blocks=10, reserve_output=8)
    exact = reserving(num_blocks=10)
    for s in (sched, exact):
        for i in range(4):
            s.add_request(make_request(f"r{i}", toks(10 * i + 1, 10 * i + 4), max_tokens=2))
    out, _ = step(sched)
    assert num_tokens_by_req(out) == {"r0": 4, "r1": 4, "r2": 4}
    assert sched.kv.reserved == {"r0": 3, "r1": 3, "r2": 3}
    assert sched.kv.num_reserved_blocks == 3 * 2  # one block each is handed out
    out, _ = step(exact)
    assert num_tokens_by_req(out) == {"r0": 4, "r1": 4, "r2": 4, "r3": 4}
    # r3 waits for a finished request's reservation, never for a block: r0..r2
    # finish after 2 tokens, having used 2 of their 3 blocks.
    out, outputs = step(sched)
    assert {o.request_id for o in outputs if o.finished} == {"r0", "r1", "r2"}
    assert [r.request_id for r in sched.waiting] == ["r3"]
    out, _ = step(sched)
    assert num_tokens_by_req(out) == {"r3": 4}
    outputs = run_to_completion(sched)
    assert {o.request_id for o in outputs if o.finished} == {"r3"}
    assert sched.num_preemptions == 0 and sched.kv.reserved == {}
    assert sched.kv.pool.num_free_blocks == 10
    # A request that asks for more than the cap reserves its own; none past the context.
    wide = reserving(num_blocks=10, reserve_output=8, max_model_len=10)
    wide.add_request(make_request("long", toks(1, 4), max_tokens=12))
    wide.add_request(make_request("short", toks(1, 4), max_tokens=2))
    assert wide.kv.reservation_tokens(wide.requests["long"]) == 16
    assert wide.kv.reservation_tokens(wide.requests["short"]) == 10


def test_reserving_for_the_cap_stops_at_the_context_and_only_applies_when_reserving() -> None:
    # The context is capped by the pool (40 tokens): a cap past it reserves the
    # context, so only a request's own max_tokens can be refused.
    sched = reserving(num_blocks=10, reserve_output=64)
    sched.add_request(make_request("a", toks(1, 8), max_tokens=4))
    assert sched.kv.reservation_tokens(sched.requests["a"]) == 40
    with pytest.raises(ValueError, match="prompt 8 \\+ max_tokens 33"):
        sched.add_request(make_request("b", toks(1, 8), max_tokens=33))
    with pytest.raises(ValueError, match="applies to kv_allocation='reserved' only"):
        CacheConfig(kv_reserve_output_tokens=8)
    with pytest.raises(ValueError, match="kv_reserve_output_tokens must be >= 1"):
        CacheConfig(kv_allocation="reserved", kv_reserve_output_tokens=0)


def test_prefix_hits_held_by_another_request_cost_no_reservation() -> None:
    # 6 blocks. a holds 3 (prompt 1..10 + 2). b shares a's first 8 tokens: of its
    # 4 reserved blocks, the 2 it hits are a's, so it needs only 2 of the 3 free.
    # Without the prefix cache it needs 4 and waits for a.
    for caching, admitted in ((True, {"a": 10, "b": 2}), (False, {"a": 10})):
        sched = reserving(num_blocks=6, enable_prefix_caching=caching)
        a = make_request("a", toks(1, 10), max_tokens=2)
        b = make_request("b", [*toks(1, 8), 50, 51], max_tokens=6)
        sched.add_request(a)
        sched.add_request(b)
        out, _ = step(sched)
        assert num_tokens_by_req(out) == admitted
        if caching:
            assert (held(sched, "a"), held(sched, "b")) == ([0, 1, 2], [0, 1, 3])
            assert [blk.ref_cnt for blk in sched.kv.pool.blocks[:4]] == [2, 2, 1, 1]
            assert sched.kv.reserved == {"a": 3, "b": 4}
            assert sched.kv.num_reserved_blocks == 0 + 1
        run_to_completion(sched)
        assert sched.num_preemptions == 0
        assert a.output_token_ids == [SAMPLED] * 2 and b.output_token_ids == [SAMPLED] * 6


def test_static_batch_with_reserved_memory_runs_its_members_as_reservations_allow() -> None:
    # Naive static batching on reserved memory: a batch of 2, but the pool (6
    # blocks) holds a's reservation (3) or b's (4), not both. b waits; a done
    # becomes padding and grows past its reservation into blocks nobody was
    # promised; when b still cannot fit, the padding gives its blocks up (as under
    # paging) and b runs alone. c, the next batch, waits for b.
    sched = reserving(num_blocks=6, policy="static", max_num_seqs=2)
    a = make_request("a", toks(1, 4), max_tokens=8)  # 12 tokens: 3 blocks
    b = make_request("b", toks(11, 14), max_tokens=12)  # 16 tokens: 4 blocks
    c = make_request("c", toks(21, 24), max_tokens=1)
    for r in (a, b, c):
        sched.add_request(r)

    out, _ = step(sched)
    assert num_tokens_by_req(out) == {"a": 4}
    assert [r.request_id for r in sched.waiting] == ["b", "c"]
    for _ in range(7):
        out, _ = step(sched)
        assert num_tokens_by_req(out) == {"a": 1}
    assert a.output_token_ids == [SAMPLED] * 8  # done: padding from now on
    assert held(sched, "a") == [0, 1, 2] and sched.kv.num_reserved_blocks == 0

    # b needs 4 of 3 free: the padding member is preempted and b admitted.
    out, _ = step(sched)
    assert num_tokens_by_req(out) == {"b": 4}
    assert out.preempted_req_ids == ["a"] and a.num_preemptions == 1
    assert held(sched, "a") == [] and held(sched, "b") == [3]
    # Admitted in the step that preempted the padding: the runner gets b's prompt.
    assert out.scheduled[0].prompt_token_ids == toks(11, 14)
    assert sched.kv.reserved == {"b": 4}
    assert [r.request_id for r in sched.waiting] == ["a", "c"]  # a waits for its batch's end

    outputs = run_to_completion(sched)
    assert b.output_token_ids == [SAMPLED] * 12 and b.num_preemptions == 0
    assert c.output_token_ids == [SAMPLED]
    assert [o.request_id for o in outputs if o.finished] == ["a", "b", "c"]
    assert sched.kv.pool.num_free_blocks == 6 and sched.kv.reserved == {}


# ---- the engine: the policy changes who runs when, never a token ----------------------


def test_reserved_memory_gives_paging_s_greedy_tokens_on_a_tiny_model(tmp_path: Path) -> None:
    path = save_hf_model(build_hf_model("llama"), tmp_path)
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 250 + 1 for j in range(5 + 3 * i)]}
               for i in range(6)]
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
              for n in (12, 3, 20, 7, 16, 5)]
    # 20 blocks of 4 tokens: reserving holds 2 or 3 of these at a time, paging more.
    tokens, stats = {}, {}
    for policy in ("fcfs", "static"):
        for allocation in ("paged", "reserved"):
            llm = LLM(path, dtype="float32", device=TEST_DEVICE, skip_tokenizer_init=True,
                      num_kv_blocks=20, block_size=4, max_num_seqs=4,
                      enable_prefix_caching=False, scheduling_policy=policy,
                      kv_allocation=allocation, check_integrity=True)
            outs = llm.generate(prompts, params, use_tqdm=False)
            tokens[policy, allocation] = [o.outputs[0].token_ids for o in outs]
            stats[policy, allocation] = llm.last_generate_stats
    first = tokens["fcfs", "paged"]
    assert [len(t) for t in first] == [12, 3, 20, 7, 16, 5]
    assert all(t == first for t in tokens.values())
    reserved, paged = stats["fcfs", "reserved"], stats["fcfs", "paged"]
    # Reserving runs fewer at a time, holds more than it uses, and never preempts.
    assert reserved.mean_batch_size < paged.mean_batch_size
    assert reserved.kv_blocks_held > reserved.kv_blocks_used
    assert paged.kv_blocks_held == paged.kv_blocks_used
    assert reserved.num_preemptions == 0
    assert 0 < reserved.mean_kv_used < reserved.mean_kv_held <= 1
