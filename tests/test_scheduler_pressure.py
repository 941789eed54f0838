"""core/ under permanent KV pressure: every admitted request finishes, and none
is preempted more than a bound fixed when it arrives (issue 39).

The policy (FCFS, as vLLM): the running request admitted last is the victim, a
preempted request goes back to the front of the queue, and a newcomer never
preempts. Together they keep one invariant, checked after every step: every
running request arrived before every waiting one. From it, the bound:

- a request R is preempted only when a request that arrived before R needs a
  block it does not hold (a later one would pick a victim later than R, or
  itself), and such older requests are all running while R runs;
- R is admitted (first or again) only when every older request holds blocks
  for all of its tokens, and a request's token count never goes down, so each
  preemption of R is paid for by an older request growing into a block index
  it never held since R was admitted;
- so R's preemptions <= the blocks the requests ahead of it still had to grow
  into when R arrived: sum over them of ceil(max_len / B) - ceil(num_tokens / B),
  with max_len = prompt + max_tokens and B the block size. Newcomers (behind R)
  add nothing to it: no starvation, however long the traffic goes on.

Helpers (fake runner, step with integrity checks) are the narratives' own.
"""

from __future__ import annotations

import random

from tests.narratives import BLOCK_SIZE, make_request, make_scheduler, step
from tokenmill.core.request import Request, RequestStatus


def blocks(num_tokens: int) -> int:
    return -(-num_tokens // BLOCK_SIZE)


def max_len(request: Request) -> int:
    max_tokens = request.sampling_params.max_tokens
    assert max_tokens is not None
    return request.num_prompt_tokens + max_tokens


def test_every_request_finishes_under_permanent_pressure_within_its_preemption_bound() -> None:
    rng = random.Random(39)
    # 24 blocks of 4 = 96 tokens for up to 8 requests of up to 20 + 60 tokens each: the
    # pool runs short all the time, and the queue never empties while arrivals go on.
    scheduler = make_scheduler(num_blocks=24, max_num_batched_tokens=32, max_num_seqs=8)
    order: dict[str, int] = {}  # request id -> arrival rank
    bound: dict[str, int] = {}
    preemptions: dict[str, int] = {}
    finished: dict[str, RequestStatus] = {}
    live: dict[str, Request] = {}
    num_arrivals_steps = 1500

    for step_index in range(20_000):
        if step_index < num_arrivals_steps and rng.random() < 0.35:
            request_id = f"r{len(order)}"
            # Prompts over a small alphabet: prefix-cache hits (and revived blocks) happen.
            prompt = [rng.randint(1, 3) for _ in range(rng.randint(1, 20))]
            request = make_request(request_id, prompt, max_tokens=rng.randint(1, 60))
            # The bound, fixed now: what the requests ahead of it still grow into.
            bound[request_id] = sum(blocks(max_len(o)) - blocks(o.num_tokens) for o in live.values())
            order[request_id] = len(order)
            scheduler.add_request(request)
            live[request_id] = request
        if step_index < num_arrivals_steps and rng.random() < 0.02 and live:
            # A client goes away (a dropped stream): its request is aborted.
            gone = rng.choice(sorted(live))
            scheduler.finish_requests([gone], RequestStatus.FINISHED_ABORTED)
        if not scheduler.has_unfinished_requests():
            if step_index >= num_arrivals_steps:
                break
            continue

        out, _ = step(scheduler)

        # The FCFS invariant: every running request arrived before every waiting one.
        running = [order[r.request_id] for r in scheduler.running]
        waiting = [order[r.request_id] for r in scheduler.waiting]
        if running and waiting:
            assert max(running) < min(waiting), (running, waiting)
        # The oldest request is never the victim while it shares the pool.
        if out.preempted_req_ids:
            oldest = min(live, key=order.__getitem__)
            assert oldest not in out.preempted_req_ids
        for request_id in list(live):
            request = live[request_id]
            preemptions[request_id] = request.num_preemptions
            assert request.num_preemptions <= bound[request_id], (request_id, bound[request_id])
            if request.status.finished:
                finished[request_id] = request.status
                del live[request_id]
    else:
        raise AssertionError(f"the requests did not drain: {sorted(live)} still run")

    # Every request finished: by length, except those the clients dropped.
    assert not live and set(finished) == set(order)
    assert all(s in (RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)
               for s in finished.values())
    assert sum(s is RequestStatus.FINISHED_LENGTH for s in finished.values()) > 400
    # The pressure was real: many preemptions, requests preempted again and again.
    assert scheduler.num_preemptions > 300
    assert max(preemptions.values()) >= 3
    assert scheduler.kv.pool.num_free_blocks == 24


def test_a_request_preempted_again_and_again_still_finishes_before_later_arrivals() -> None:
    """A request behind five that grow and finish at different times: each freed
    block lets it back in, each block they grow into may push it out again, and
    each time it returns to the front of the queue: the newcomer that arrives
    every step never gets ahead of it."""
    scheduler = make_scheduler(num_blocks=10, max_num_batched_tokens=16, max_num_seqs=8)
    ahead = [make_request("long", [1, 2, 3, 4], max_tokens=16)]  # 1 -> 5 blocks
    ahead += [make_request(f"s{i}", [5 + i] * 4, max_tokens=4 * (i + 1)) for i in range(4)]
    victim = make_request("v", [9] * 4, max_tokens=8)
    for r in [*ahead, victim]:
        scheduler.add_request(r)
    bound = sum(blocks(max_len(r)) - blocks(r.num_tokens) for r in ahead)  # 4 + 10
    num_newcomers = 0
    while not victim.status.finished:
        scheduler.add_request(make_request(f"n{num_newcomers}", [20] * 4, max_tokens=8))
        num_newcomers += 1
        step(scheduler)
        newcomers_running = [r for r in scheduler.running if r.request_id.startswith("n")]
        victim_waits = victim.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        assert not (newcomers_running and victim_waits), "a newcomer runs while the victim waits"
    assert victim.status is RequestStatus.FINISHED_LENGTH and victim.num_output_tokens == 8
    assert victim.num_preemptions == 4 and bound == 14
