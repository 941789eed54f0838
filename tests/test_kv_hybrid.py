"""Layer groups and sliding windows that give their blocks back
(core/kv_layout.py, core/kv_hybrid.py), as CPU narratives (tests/narratives.py:
block_size 4, integrity checked after every schedule and update), then on a
real model against transformers."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.hf_models import TEST_DEVICE, build_hf_model, hf_greedy, save_hf_model
from tests.narratives import BLOCK_SIZE, make_request, make_scheduler, run_to_completion, step, toks
from tokenmill import LLM, SamplingParams
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.kv_hybrid import NULL_BLOCK, HybridKVCacheManager
from tokenmill.core.kv_layout import KVGroup, make_kv_layout, one_group
from tokenmill.core.scheduler import Scheduler
from tokenmill.outputs import RequestOutput

WINDOW = 8
# Layer 0 slides over 8 tokens, layer 1 attends to everything: a group each.
TWO_GROUPS = make_kv_layout([WINDOW, None], free_windows=True)


def hybrid(num_blocks: int = 64, budget: int = 8, **kw: object) -> Scheduler:
    sched = make_scheduler(num_blocks=num_blocks, max_num_batched_tokens=budget, layout=TWO_GROUPS,
                           **kw)  # type: ignore[arg-type]
    assert isinstance(sched.kv, HybridKVCacheManager)
    return sched


def tables(sched: Scheduler, request_id: str) -> list[list[int | None]]:
    """Each group's table, None where the window has given the block back."""
    assert isinstance(sched.kv, HybridKVCacheManager)
    return [[None if b is NULL_BLOCK else b.block_id for b in blocks]
            for blocks in sched.kv.req_groups[request_id]]


def test_layouts() -> None:
    gemma3 = [None if (i + 1) % 6 == 0 else 512 for i in range(18)]  # Gemma 3 270M: one global in six
    layout = make_kv_layout(gemma3, free_windows=True)
    assert layout.groups[0] == KVGroup(None, (5, 11, 17))
    assert [g.layers for g in layout.groups[1:]] == [(0, 1, 2), (3, 4, 6), (7, 8, 9), (10, 12, 13),
                                                     (14, 15, 16)]
    assert layout.slots == 3 and layout.place(11) == (0, 1) and layout.place(6) == (2, 2)
    assert make_kv_layout(gemma3, free_windows=False) == one_group(18)
    assert make_kv_layout([None, None], free_windows=True) == one_group(2)
    # Every layer windowed (Mistral's): one group, and no request too long for the pool.
    assert make_kv_layout([16, 16], free_windows=True).groups == (KVGroup(16, (0, 1)),)
    assert make_kv_layout([16, 16], free_windows=True).max_tokens_alone(24, 4, 64) == 1 << 62
    # 24 blocks, a 64-token step: the window group holds at most ceil((8 - 1 + 64) / 4) + 1 = 19.
    assert TWO_GROUPS.max_tokens_alone(24, 4, 64) == 12 * 4  # 12 + min(12, 19) = 24
    assert TWO_GROUPS.max_tokens_alone(64, 4, 8) == (64 - 5) * 4  # the window's 5 at most
    assert one_group(2).max_tokens_alone(24, 4, 64) == 96


def test_the_window_gives_its_blocks_back_as_it_moves() -> None:
    sched = hybrid()
    sched.add_request(make_request("a", toks(1, 20), max_tokens=6))
    step(sched)  # tokens 0-7
    assert tables(sched, "a") == [[0, 1], [2, 3]]
    step(sched)  # tokens 8-15: the next token (8) still sees 1..8, so block 0 stays
    assert tables(sched, "a") == [[0, 1, 4, 5], [2, 3, 6, 7]]
    step(sched)  # tokens 16-19: token 16 sees 9..16, blocks 0 and 1 (tokens 0-7) go back
    assert tables(sched, "a") == [[0, 1, 4, 5, 8], [None, None, 6, 7, 9]]
    assert sched.kv.pool.num_free_blocks == 64 - 8
    step(sched)  # the decode at 20 (block 5): token 20 sees 13..20, block 2 goes back
    assert tables(sched, "a") == [[0, 1, 4, 5, 8, 10], [None, None, None, 7, 9, 11]]
    for _ in range(3):  # decodes at 21-23: the window holds at most 3 blocks
        step(sched)
        assert sum(b is not None for b in tables(sched, "a")[1]) <= 3
    run_to_completion(sched)
    assert sched.kv.pool.num_free_blocks == 64


def test_a_prefix_hit_takes_each_group_s_visible_blocks_only() -> None:
    sched = hybrid()
    sched.add_request(make_request("a", toks(1, 24), max_tokens=1))
    run_to_completion(sched)
    sched.add_request(make_request("b", [*toks(1, 24), 90, 91], max_tokens=4))
    out, _ = step(sched)
    # 24 tokens hit (6 blocks): the window group needs only what token 24 sees (17..24: blocks 4, 5).
    assert out.scheduled[0].num_computed_tokens == 24
    full, window = tables(sched, "b")
    assert len(full) == len(window) == 7 and None not in full
    assert window[:4] == [None] * 4 and None not in window[4:]


def test_an_evicted_window_block_shortens_the_hit_to_what_is_all_there() -> None:
    """Hits checked against a brute-force search of the pool's cached blocks, over
    random prompts sharing prefixes, a small pool (evictions, preemptions) and
    a step budget of 8."""
    rng = random.Random(3)
    for trial in range(20):
        sched = hybrid(num_blocks=rng.randint(26, 40))
        kv = sched.kv
        assert isinstance(kv, HybridKVCacheManager)
        heads = [toks(1 + 40 * h, 30 + 40 * h) for h in range(3)]
        for i in range(12):
            prompt = rng.choice(heads)[: rng.randint(5, 30)] + [200 + i] * rng.randint(0, 6)
            request = make_request(f"{trial}-{i}", prompt, max_tokens=rng.randint(1, 8))
            _, num_hit = kv.get_computed_blocks(request)
            assert num_hit == _longest_hit(kv, request) * BLOCK_SIZE
            sched.add_request(request)
            for _ in range(rng.randint(0, 3)):
                step(sched)
        run_to_completion(sched, max_steps=400)
        assert kv.pool.num_free_blocks == kv.num_blocks


def _longest_hit(kv: HybridKVCacheManager, request: object) -> int:
    hashes = request.block_hashes[:(request.num_tokens - 1) // BLOCK_SIZE]  # type: ignore[attr-defined]

    def there(i: int, g: int) -> bool:
        return kv.pool.get_cached_block(kv._key(hashes[i], g)) is not None

    for n in range(len(hashes), 0, -1):
        if all(there(i, 0) for i in range(n)) and all(
                there(i, 1) for i in range(max(0, n * BLOCK_SIZE - WINDOW + 1) // BLOCK_SIZE, n)):
            return n
    return 0


def test_preemption_and_integrity_with_a_small_pool() -> None:
    sched = hybrid(num_blocks=20, budget=16)
    for i in range(6):
        sched.add_request(make_request(str(i), toks(1 + 3 * i, 30 + 3 * i), max_tokens=10))
    run_to_completion(sched, max_steps=400)
    assert sched.num_preemptions > 0
    assert sched.kv.pool.num_free_blocks == 20


def test_one_group_is_the_plain_manager() -> None:
    assert type(make_scheduler(layout=one_group(2)).kv) is KVCacheManager
    with pytest.raises(ValueError, match="for paging without the disk tier"):
        make_scheduler(layout=TWO_GROUPS, kv_allocation="reserved")


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[object, Path]:
    model = build_hf_model("gemma3")  # layer 0 slides over 8 tokens, layer 1 is global
    return model, save_hf_model(model, Path(tmp_path_factory.mktemp("gemma3")))


def test_a_windowed_model_holds_less_and_gives_transformers_tokens(gemma3_dir: tuple[object, Path]) -> None:
    model, path = gemma3_dir
    prompt = [(i * 37) % 250 + 3 for i in range(160)]
    ref = hf_greedy(model, prompt, 24)[0]
    held = {}
    for off in (False, True):
        llm = LLM(path, dtype="float32", device=TEST_DEVICE, skip_tokenizer_init=True, check_integrity=True,
                  block_size=4, max_num_batched_tokens=16, kv_cache_memory_bytes=1 << 20,
                  disable_hybrid_kv_cache_manager=off)
        engine = llm.engine
        kv = engine.scheduler.kv
        assert isinstance(kv, HybridKVCacheManager) != off
        runner = engine.runner
        assert len({t.data_ptr() for t in runner.kv_caches}) == runner.layout.slots
        assert runner.kv_cache_bytes() <= 1 << 20
        engine.add_request("r", {"prompt_token_ids": prompt},
                           SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
        peak, tokens = 0, []
        while engine.has_unfinished_requests():
            for out in engine.step().outputs:
                assert isinstance(out, RequestOutput)
                tokens = out.outputs[0].token_ids
            peak = max(peak, kv.num_blocks - kv.pool.num_free_blocks)
        assert tokens == ref
        held[off] = peak * runner.kv_cache_bytes() // kv.num_blocks  # bytes
    # 184 tokens: 46 blocks of the global layer and at most 8 of the windowed one, against 46 of both.
    assert held[False] <= held[True] * (46 + 8) // (2 * 46)
