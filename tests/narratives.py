"""The narratives' helpers: requests, schedulers, a fake runner and a step with
integrity checks, shared by the core/ narratives (test_core_narratives.py,
test_kv_reservation.py, test_scheduler_pressure.py).

Conventions: block_size 4; prompts are runs of small ints (`toks(1, 8)` is
[1, 2, ..., 8]); the fake runner samples token 7 unless told otherwise;
requests have no EOS ids unless a test gives them some.
"""

from __future__ import annotations

from collections.abc import Callable

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.block_pool import BlockPool, KVCacheBlock
from tokenmill.core.contracts import (
    EngineCoreOutput,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from tokenmill.core.kv_layout import KVLayout
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.static_scheduler import make_scheduler as make_policy_scheduler
from tokenmill.sampling_params import SamplingParams

BLOCK_SIZE = 4
SAMPLED = 7  # what the fake runner samples by default

def toks(first: int, last: int) -> list[int]:
    """[first, first + 1, ..., last]"""
    return list(range(first, last + 1))


def make_request(
    request_id: str,
    prompt: list[int],
    *,
    max_tokens: int | None = 16,
    eos: tuple[int, ...] = (),
    priority: int = 0,
    arrival_time: float = 0.0,
    **params: object,
) -> Request:
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt,
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),  # type: ignore[arg-type]
        eos_token_ids=eos,
        arrival_time=arrival_time,
        priority=priority,
    )


def make_scheduler(
    *,
    num_blocks: int = 32,
    max_num_batched_tokens: int = 100,
    max_num_seqs: int = 8,
    policy: str = "fcfs",
    max_model_len: int = 1024,
    enable_prefix_caching: bool = True,
    kv_allocation: str = "paged",
    kv_reserve_output_tokens: int | None = None,
    layout: KVLayout | None = None,
) -> Scheduler:
    return make_policy_scheduler(
        SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            policy=policy,
        ),
        CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=enable_prefix_caching,
                    kv_allocation=kv_allocation,
                    kv_reserve_output_tokens=kv_reserve_output_tokens),
        num_blocks=num_blocks,
        max_model_len=max_model_len,
        layout=layout,
    )


Sampler = int | dict[str, int] | Callable[[str], int]


def fake_runner(out: SchedulerOutput, sample: Sampler = SAMPLED) -> ModelRunnerOutput:
    """What ModelRunner.execute returns: one sampled token per do_sample request,
    in SchedulerOutput order."""
    req_ids = [s.request_id for s in out.scheduled if s.do_sample]
    if isinstance(sample, int):
        sampled = [sample] * len(req_ids)
    elif isinstance(sample, dict):
        sampled = [sample.get(r, SAMPLED) for r in req_ids]
    else:
        sampled = [sample(r) for r in req_ids]
    return ModelRunnerOutput(req_ids=req_ids, runs=[[(t, 0.0, 1, None)] for t in sampled])


def step(
    scheduler: Scheduler, sample: Sampler = SAMPLED
) -> tuple[SchedulerOutput, list[EngineCoreOutput]]:
    """One engine iteration: schedule, fake forward pass, update; integrity after each."""
    out = scheduler.schedule()
    scheduler.check_integrity()
    outputs = scheduler.update_from_output(out, fake_runner(out, sample))
    scheduler.check_integrity()
    return out, outputs


def num_tokens_by_req(out: SchedulerOutput) -> dict[str, int]:
    return {s.request_id: s.num_tokens for s in out.scheduled}


def scheduled(out: SchedulerOutput, request_id: str) -> ScheduledRequest:
    (match,) = [s for s in out.scheduled if s.request_id == request_id]
    return match


def free_ids(pool: BlockPool) -> list[int]:
    """Block ids in the free queue, next to be evicted first."""
    return [b.block_id for b in pool.free_queue]


def ids(blocks: list[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


def by_id(outputs: list[EngineCoreOutput]) -> dict[str, EngineCoreOutput]:
    result = {o.request_id: o for o in outputs}
    assert len(result) == len(outputs), "one output per request per step expected here"
    return result


def run_to_completion(
    scheduler: Scheduler, sample: Sampler = SAMPLED, max_steps: int = 100
) -> list[EngineCoreOutput]:
    outputs: list[EngineCoreOutput] = []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            return outputs
        outputs += step(scheduler, sample)[1]
    raise AssertionError(f"still unfinished after {max_steps} steps")
