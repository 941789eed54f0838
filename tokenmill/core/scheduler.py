"""The scheduler: one token-budget rule, re-applied at every step.

Each step may compute at most `max_num_batched_tokens` tokens for at most
`max_num_seqs` running requests. The budget goes to running requests first (a
decoding request needs 1 token, a request in the middle of its prefill needs
the rest of its prompt, chunked to what is left), then to waiting requests in
policy order (FCFS or priority), each chunked to what is left. Chunked
prefill, prefix-cache hits, mixed prefill+decode steps and recompute
preemption all fall out of this one piece of arithmetic.

When the KV pool runs short, the lowest-priority (FCFS: most recently
admitted) running request is preempted: its blocks are freed and it goes back
to the front of the waiting queue, to be recomputed later (its full blocks
usually come back as prefix-cache hits).

The `static` policy exists to reproduce the classic batching study: a batch of
up to `max_num_seqs` requests is admitted only once the previous batch has
completely finished, and a member that finishes early keeps its slot and keeps
being computed (its tokens discarded) until the whole batch ends. When blocks
run short, such a padding member is the first to give its blocks up (it then
waits, not computed again, for its batch to end): it never holds blocks that a
member still generating needs.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.contracts import (
    EngineCoreOutput,
    ModelRunnerOutput,
    ScheduledRequest,
    SchedulerOutput,
)
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.request import Request, RequestStatus


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of blocks in use
    num_blocks: int
    num_free_blocks: int
    prefix_cache_queries: int  # tokens looked up in the prefix cache (cumulative)
    prefix_cache_hits: int  # of those, tokens found (cumulative)
    num_preemptions: int  # cumulative


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
    ) -> None:
        self.config = scheduler_config
        self.block_size = cache_config.block_size
        self.kv = KVCacheManager(num_blocks, self.block_size, cache_config.enable_prefix_caching)
        # A request must always fit alone in the pool, or preemption could loop.
        self.max_model_len = min(max_model_len, num_blocks * self.block_size)
        self.requests: dict[str, Request] = {}
        self.waiting: list[Request] = []  # in policy order; waiting[0] is next
        self.running: list[Request] = []  # in admission order
        self.finished_req_ids: list[str] = []  # since the last schedule()
        self.static_batch: set[str] = set()  # static policy: the current batch's members
        # Static policy: a member's stop token, held back until its batch ends, to
        # go out with its finish reason.
        self._held_outputs: dict[str, EngineCoreOutput] = {}
        self._order = itertools.count()  # FCFS tie-break for the priority policy
        self._queue_key: dict[str, tuple[int, float, int]] = {}
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    # ---- requests in and out -------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queue a request, or raise ValueError (saying why) if it can never run."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        num_prompt = request.num_prompt_tokens
        if num_prompt == 0:
            raise ValueError("the prompt is empty; give at least one token")
        if num_prompt > self.max_model_len:
            raise ValueError(
                f"the prompt has {num_prompt} tokens, more than this engine's maximum "
                f"context length of {self.max_model_len} tokens (max_model_len, capped by "
                "the KV cache size); shorten the prompt or raise max_model_len / the KV cache"
            )
        request.max_model_len = self.max_model_len
        self.requests[request.request_id] = request
        self._queue_key[request.request_id] = (
            request.priority if self.config.policy == "priority" else 0,
            request.arrival_time,
            next(self._order),
        )
        self._enqueue(request)

    def _enqueue(self, request: Request, front: bool = False) -> None:
        if self.config.policy == "priority":
            keys = self._queue_key
            bisect.insort(self.waiting, request, key=lambda r: keys[r.request_id])
        elif front:
            self.waiting.insert(0, request)
        else:
            self.waiting.append(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Finish requests from outside the step (abort, a matched stop string).
        Under the static policy a stopped member keeps its slot until its batch ends."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            if (
                self.config.policy == "static"
                and status is not RequestStatus.FINISHED_ABORTED
                and request.status is RequestStatus.RUNNING
            ):
                request.padding_only = True
                request.padding_status = status
                continue
            self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        request.status = status
        self.kv.free(request)
        self.static_batch.discard(request.request_id)
        self._held_outputs.pop(request.request_id, None)
        del self.requests[request.request_id]
        del self._queue_key[request.request_id]
        self.finished_req_ids.append(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # ---- one step --------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_new_by_req: dict[str, int] = {}
        preempted: list[str] = []

        # 1. Running requests, in admission order.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            if num_new <= 0:  # a static-batch member that reached max_model_len
                i += 1
                continue
            while self.kv.allocate_slots(request, num_new) is None:
                victim = self._pick_victim()
                if self.running.index(victim) < i:
                    i -= 1
                budget += num_new_by_req.pop(victim.request_id, 0)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                num_new_by_req[request.request_id] = num_new
                budget -= num_new
                i += 1

        # 2. Waiting requests, in policy order, unless we just had to preempt.
        num_running_before = len(self.running)
        if not preempted:
            budget = self._admit_waiting(budget, num_new_by_req)

        # 3. Describe the step and advance the computed counts.
        scheduled = []
        admitted = {r.request_id for r in self.running[num_running_before:]}
        for request in self.running:
            if request.request_id not in num_new_by_req:
                continue
            num_new = num_new_by_req[request.request_id]
            start = request.num_computed_tokens
            scheduled.append(
                ScheduledRequest(
                    request_id=request.request_id,
                    token_ids=request.all_token_ids[start : start + num_new],
                    num_computed_tokens=start,
                    block_ids=self.kv.block_ids(request.request_id),
                    sampling_params=request.sampling_params,
                    bad_words_token_ids=request.bad_words_token_ids,
                    do_sample=start + num_new == request.num_tokens,
                    prompt_token_ids=(
                        request.prompt_token_ids if request.request_id in admitted else None
                    ),
                )
            )
            request.num_computed_tokens += num_new
        out = SchedulerOutput(
            scheduled=scheduled,
            num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            preempted_req_ids=preempted,
            finished_req_ids=self.finished_req_ids,
        )
        self.finished_req_ids = []
        return out

    def _admit_waiting(self, budget: int, num_new_by_req: dict[str, int]) -> int:
        static = self.config.policy == "static"
        if static and not self.static_batch:
            # A new static batch: the next max_num_seqs waiting requests.
            self.static_batch = {r.request_id for r in self.waiting[: self.config.max_num_seqs]}
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self._next_to_admit(static)
            if request is None:
                break
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            while self.kv.allocate_slots(request, num_new, hits) is None:
                # Wait for blocks to be freed; never preempt for a newcomer, only
                # a static batch's padding members for one of its own.
                victim = self._last_padding_member()
                if victim is None:
                    return budget
                budget += num_new_by_req.pop(victim.request_id, 0)
                self._preempt(victim)
            self.waiting.remove(request)
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += num_hit_tokens
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_hit_tokens
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            num_new_by_req[request.request_id] = num_new
            budget -= num_new
        return budget

    def _next_to_admit(self, static: bool) -> Request | None:
        """The next waiting request to admit: the queue's first, or under the static
        policy the current batch's first member still generating (padding members
        that gave up their blocks wait for the batch to end without running)."""
        if not static:
            return self.waiting[0] if self.waiting else None
        return next((r for r in self.waiting
                     if r.request_id in self.static_batch and not r.padding_only), None)

    def _last_padding_member(self) -> Request | None:
        """Static batching: the latest running member that is done (padding only),
        whose blocks go first when blocks run short."""
        return next((r for r in reversed(self.running) if r.padding_only), None)

    def _pick_victim(self) -> Request:
        padding = self._last_padding_member()
        if padding is not None:
            return padding
        if self.config.policy == "priority":
            keys = self._queue_key
            return max(self.running, key=lambda r: keys[r.request_id])
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self._enqueue(request, front=True)

    # ---- after the forward pass ---------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, check stop conditions, free finished requests."""
        outputs: list[EngineCoreOutput] = []
        for k, request_id in enumerate(runner_output.req_ids):
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            token_id = runner_output.sampled_token_ids[k]
            if request.padding_only:  # static batching: computed, then discarded
                if request.num_tokens < self.max_model_len:
                    request.append_token(token_id)
                continue
            request.append_token(token_id)
            top = runner_output.top_logprobs[k] if runner_output.top_logprobs else None
            ranks = runner_output.sampled_token_ranks
            out = EngineCoreOutput(
                request_id=request_id,
                new_token_ids=[token_id],
                new_logprobs=[runner_output.logprobs[k]],
                new_top_logprobs=[top],
                new_token_ranks=[ranks[k]] if ranks else [],
                prompt_logprobs=(
                    runner_output.prompt_logprobs[k] if runner_output.prompt_logprobs else None
                ),
                num_cached_tokens=max(request.num_cached_tokens, 0),
                num_preemptions=request.num_preemptions,
            )
            status = request.check_stop()
            if status is not None:
                if self.config.policy == "static":
                    request.padding_only = True
                    request.padding_status = status
                    if status is RequestStatus.FINISHED_STOPPED:
                        # A stop token: its text is left out only beside its finish
                        # reason, which comes when the batch ends.
                        self._held_outputs[request_id] = out
                        continue
                else:
                    self._finish(request, status)
                    out.finish_reason = status.finish_reason
                    out.stop_reason = request.stop_reason
            outputs.append(out)
        if self.config.policy == "static":
            outputs.extend(self._end_static_batch_if_done())
        return outputs

    def _end_static_batch_if_done(self) -> list[EngineCoreOutput]:
        members = [self.requests[i] for i in self.static_batch]
        if not members or not all(r.padding_only for r in members):
            return []
        outputs = []
        for request in members:
            status = request.padding_status or RequestStatus.FINISHED_LENGTH
            held = self._held_outputs.pop(request.request_id, None)
            self._finish(request, status)
            if held is not None:  # its stopping token, now with the reason
                held.finish_reason = status.finish_reason
                held.stop_reason = request.stop_reason
                outputs.append(held)
                continue
            outputs.append(
                EngineCoreOutput(
                    request_id=request.request_id,
                    new_token_ids=[],
                    new_logprobs=[],
                    new_top_logprobs=[],
                    finish_reason=status.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=max(request.num_cached_tokens, 0),
                    num_preemptions=request.num_preemptions,
                )
            )
        self.static_batch.clear()
        return outputs

    # ---- introspection -------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage(),
            num_blocks=self.kv.num_blocks,
            num_free_blocks=self.kv.pool.num_free_blocks,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
        )

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        held = set(self.kv.req_to_blocks)
        running = {r.request_id for r in self.running}
        assert held <= running, f"requests hold blocks without running: {held - running}"
        for request in self.running:
            assert request.status is RequestStatus.RUNNING
            assert request.num_computed_tokens <= request.num_tokens
        assert len(self.running) <= self.config.max_num_seqs
        assert len(self.running) + len(self.waiting) == len(self.requests)
