"""core/ narratives of LoRA adapters: the prefix cache keyed by adapter, and
the scheduler's max_loras limit (admitted as slots free, nobody starves)."""

from __future__ import annotations

from tests.narratives import BLOCK_SIZE, make_request, run_to_completion, step, toks
from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.static_scheduler import make_scheduler
from tokenmill.sampling_params import LoRARequest


def lora_request(request_id: str, prompt: list[int], lora: int, **kw: object) -> Request:
    request = make_request(request_id, prompt, **kw)  # type: ignore[arg-type]
    if lora:
        request.lora_request = LoRARequest(f"adapter{lora}", lora, "/nowhere")
    return request


def scheduler(max_loras: int, **config: int) -> Scheduler:
    return make_scheduler(SchedulerConfig(max_num_seqs=config.get("max_num_seqs", 8),
                                          max_num_batched_tokens=100),
                          CacheConfig(block_size=BLOCK_SIZE), num_blocks=64, max_model_len=1024,
                          max_loras=max_loras)


def test_prefix_cache_is_keyed_by_adapter() -> None:
    """The same prompt under two adapters shares no block; under one adapter
    (or the base model twice) its full blocks are hits."""
    sched = scheduler(max_loras=2)
    prompt = toks(1, 12)  # three full blocks
    sched.add_request(lora_request("a1", prompt, 1, max_tokens=1))
    run_to_completion(sched)
    held_by = {}
    for request_id, lora in (("a2", 2), ("base", 0), ("a1-again", 1), ("base-again", 0)):
        sched.add_request(lora_request(request_id, prompt, lora, max_tokens=2))
        out, _ = step(sched)
        (scheduled,) = out.scheduled
        held_by[request_id] = scheduled.block_ids
        assert scheduled.num_computed_tokens == {"a2": 0, "base": 0, "a1-again": 8,
                                                 "base-again": 8}[request_id], request_id
        run_to_completion(sched)
    # a2 and base computed their own blocks: none of a1's (which a1-again reused).
    assert not set(held_by["a2"][:2]) & set(held_by["a1-again"][:2])
    assert not set(held_by["base"][:2]) & set(held_by["a1-again"][:2])
    assert held_by["base"][:2] == held_by["base-again"][:2]


def test_at_most_max_loras_adapters_run_and_none_starves() -> None:
    """max_loras=1: a request for a second adapter waits while the first runs;
    base requests pass it; a later request for the running adapter does not
    (else a stream of them could hold the slot forever); as the slot frees,
    the waiting adapter runs."""
    sched = scheduler(max_loras=1)
    sched.add_request(lora_request("a", toks(1, 4), 1, max_tokens=3))
    sched.add_request(lora_request("b", toks(5, 8), 2, max_tokens=3))
    sched.add_request(lora_request("base", toks(9, 12), 0, max_tokens=3))
    sched.add_request(lora_request("a-later", toks(13, 16), 1, max_tokens=3))
    out, _ = step(sched)
    assert [s.request_id for s in out.scheduled] == ["a", "base"]
    admitted_order = ["a", "base"]
    for _ in range(20):
        if not sched.has_unfinished_requests():
            break
        out, _ = step(sched)
        loras = {s.lora_int_id for s in out.scheduled} - {0}
        assert len(loras) <= 1, loras
        for s in out.scheduled:
            if s.prompt_token_ids is not None:
                admitted_order.append(s.request_id)
    assert admitted_order == ["a", "base", "b", "a-later"]
    assert not sched.has_unfinished_requests()


def test_lora_is_refused_where_it_cannot_run() -> None:
    """Tensor parallelism, static batching and the disk tier (whose blocks
    outlive the adapter ids they are keyed by) refuse enable_lora, saying so."""
    import pytest

    from tokenmill.engine.arg_utils import EngineArgs

    for option, value, phrase in (("tensor_parallel_size", 2, "one process"),
                                  ("scheduling_policy", "static", "static"),
                                  ("kv_offload_dir", "/tmp/kv", "kv_offload_dir")):
        with pytest.raises(ValueError, match=phrase):
            EngineArgs(enable_lora=True, **{option: value}).create_lora_config()  # type: ignore[arg-type]
    assert EngineArgs().create_lora_config() is None
