"""Static batching: the classic baseline that continuous batching is measured against.

A batch of up to `max_num_seqs` waiting requests is admitted only once the
previous batch has completely finished, and it runs until its longest member
ends. A member that is done early becomes padding: it keeps its slot and keeps
being computed (its tokens discarded) until the batch ends, as a fixed-shape
batch would compute it. When blocks run short a padding member is the first to
give its blocks up, and then waits (not computed again) for its batch to end:
it never holds blocks that a member still generating needs.
"""

from __future__ import annotations

import itertools

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.contracts import (
    EngineCoreOutput,
    ModelRunnerOutput,
    SampledToken,
    SchedulerOutput,
    TokenLogprobs,
)
from tokenmill.core.kv_disk import BlockFiles
from tokenmill.core.kv_layout import KVLayout
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.scheduler import Scheduler


class StaticBatchScheduler(Scheduler):
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
    ) -> None:
        super().__init__(scheduler_config, cache_config, num_blocks, max_model_len)
        # The current batch's members in admission order (a dict, not a set: the batch's
        # end reports them in this order whatever the process's string hashing).
        self.batch: dict[str, None] = {}
        # The padding members, with the status each will finish with.
        self.padding: dict[str, RequestStatus] = {}
        # A member's stop token, held back to go out with its finish reason at the
        # batch's end (a stop token's text is dropped only beside "stop").
        self._held_outputs: dict[str, EngineCoreOutput] = {}

    # ---- finishing: a done member turns into padding until its batch ends ----------

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """An abort finishes at once; a running member stopped from outside (a
        matched stop string) becomes padding."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            running = request.status is RequestStatus.RUNNING
            if running and status is not RequestStatus.FINISHED_ABORTED:
                self.padding[request_id] = status
            else:
                self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        super()._finish(request, status)
        self.batch.pop(request.request_id, None)
        self.padding.pop(request.request_id, None)
        self._held_outputs.pop(request.request_id, None)

    def _stop(
        self, request: Request, status: RequestStatus, out: EngineCoreOutput
    ) -> EngineCoreOutput | None:
        self.padding[request.request_id] = status
        if status is RequestStatus.FINISHED_STOPPED:
            self._held_outputs[request.request_id] = out
            return None
        return out

    def _append_sampled(
        self, request: Request, run: list[SampledToken],
        prompt_logprobs: dict[str, list[TokenLogprobs]],
    ) -> EngineCoreOutput | None:
        if request.request_id not in self.padding:
            return super()._append_sampled(request, run, prompt_logprobs)
        # Padding: the token is computed next step and never given out.
        if request.num_tokens < self.max_model_len:
            request.all_token_ids.append(run[-1][0])
        return None

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs = super().update_from_output(scheduler_output, runner_output)
        return outputs + self._end_batch_if_done()

    def _end_batch_if_done(self) -> list[EngineCoreOutput]:
        members = [self.requests[i] for i in self.batch]
        if not members or not all(r.request_id in self.padding for r in members):
            return []
        outputs = []
        for request in members:
            status = self.padding[request.request_id]
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
        self.batch.clear()
        return outputs

    # ---- admission: the next batch only once the last one has ended -----------------

    def _running_to_schedule(self) -> list[Request]:
        # A padding member that reached max_model_len has nothing left to compute.
        return [r for r in self.running if r.num_computed_tokens < r.num_tokens]

    def _admit_waiting(self, budget: int, num_new_by_req: dict[str, int],
                       preempted: list[str]) -> int:
        if not self.batch:
            first = itertools.islice(self.queue, self.config.max_num_seqs)
            self.batch = dict.fromkeys(r.request_id for r in first)
        while budget > 0 and len(self.running) < self.config.max_num_seqs:
            # The batch's first member still generating; padding that gave its
            # blocks up waits for the batch to end without running.
            request = next(
                (r for r in self.queue
                 if r.request_id in self.batch and r.request_id not in self.padding
                 and r.grammar_ready),
                None,
            )
            if request is None:
                break
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            while self.kv.allocate_slots(request, num_new, hits) is None:
                victim = self._last_padding_member()
                if victim is None:
                    return budget
                budget += num_new_by_req.pop(victim.request_id, 0)
                self._preempt(victim)
                preempted.append(victim.request_id)
            self.queue.remove(request)
            self._admit(request, num_hit_tokens, num_new, num_new_by_req)
            budget -= num_new
        return budget

    def _pick_victim(self) -> Request:
        return self._last_padding_member() or super()._pick_victim()

    def _last_padding_member(self) -> Request | None:
        """The latest admitted running member that is padding: its blocks go first."""
        return next((r for r in reversed(self.running) if r.request_id in self.padding), None)


def make_scheduler(
    scheduler_config: SchedulerConfig,
    cache_config: CacheConfig,
    num_blocks: int,
    max_model_len: int,
    num_spec_tokens: int = 0,
    disk: BlockFiles | None = None,
    max_loras: int = 0,
    layout: KVLayout | None = None,
) -> Scheduler:
    """The scheduler for `scheduler_config.policy`: static batching is its own class
    (without speculative decoding: it is the baseline); FCFS and priority differ
    only in the Scheduler's request queue."""
    if scheduler_config.policy == "static":
        if num_spec_tokens:
            raise ValueError("speculative_config cannot be used with scheduling_policy='static' "
                             "(the static-batching baseline); use 'fcfs' or 'priority'")
        if disk is not None:
            raise ValueError("kv_offload_dir cannot be used with scheduling_policy='static' "
                             "(the static-batching baseline); use 'fcfs' or 'priority'")
        if max_loras:
            raise ValueError("LoRA adapters cannot be used with scheduling_policy='static' "
                             "(the static-batching baseline); use 'fcfs' or 'priority'")
        return StaticBatchScheduler(scheduler_config, cache_config, num_blocks, max_model_len)
    return Scheduler(scheduler_config, cache_config, num_blocks, max_model_len, num_spec_tokens,
                     disk, max_loras, layout)
