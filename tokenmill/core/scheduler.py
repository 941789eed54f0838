"""The scheduler: one token-budget rule, re-applied at every step.

Each step may compute at most `max_num_batched_tokens` tokens for at most
`max_num_seqs` running requests. The budget goes to running requests first (a
decoding request needs 1 token, a request in the middle of its prefill needs
the rest of its prompt, chunked to what is left), then to waiting requests in
the order of the policy's queue (request_queue.py), each chunked to what is
left. Chunked prefill, prefix-cache hits, mixed prefill+decode steps and
recompute preemption all fall out of this one piece of arithmetic. An
encoder's request (Request.whole_prompt) is the one exception to chunking: it
is admitted only when all of its prompt fits what is left of the budget.

When the KV pool runs short, the running request the queue's order puts last
is preempted: its blocks are freed and it goes back to the waiting queue, to be
recomputed later (its full blocks usually come back as prefix-cache hits).

Speculative decoding goes through the same rule: a decoding request with k
draft tokens (handed over by the engine between steps: `set_drafts`)
asks for 1 + k tokens, its KV slots cover them, and the runner verifies them
in the same forward as everything else. After the step the rejected drafts are
rolled back (num_computed_tokens lowered, their blocks freed). Drafts are
dropped before anything is preempted for them: speculation is an option, a
running request's next token is not.

Static batching, the classic baseline, is a subclass (static_scheduler.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tokenmill.config import CacheConfig, SchedulerConfig
from tokenmill.core.contracts import (
    EngineCoreOutput,
    KVTransferStats,
    ModelRunnerOutput,
    SampledToken,
    ScheduledRequest,
    SchedulerOutput,
    TokenLogprobs,
)
from tokenmill.core.kv_cache_manager import KVCacheManager
from tokenmill.core.kv_disk import BlockFiles
from tokenmill.core.kv_layout import KVLayout
from tokenmill.core.kv_reservation import make_kv_cache_manager
from tokenmill.core.request import Request, RequestStatus
from tokenmill.core.request_queue import RequestQueue, make_request_queue


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
    # Blocks promised to running requests, not handed out yet (kv_allocation="reserved").
    num_reserved_blocks: int = 0
    spec_decoding: SpecDecodingStats | None = None  # cumulative; None without speculation
    kv_offload: KVOffloadStats | None = None  # cumulative; None without a disk tier


@dataclass
class KVOffloadStats:
    """The disk tier's counters (cumulative). Queries and hits are tokens, as
    vLLM's external_prefix_cache_* (a KV connector's): counted when a request is
    admitted, queries being what the RAM cache lacked of its prompt's full
    blocks, hits what of that came from disk. Misses: queries - hits."""

    queries: int = 0
    hits: int = 0
    transfers: KVTransferStats = field(default_factory=KVTransferStats)


@dataclass
class SpecDecodingStats:
    """Speculative decoding's counters (cumulative), as vLLM's spec_decode_* metrics."""

    num_spec_tokens: int  # drafts per step at most (num_speculative_tokens)
    num_drafts: int = 0  # verifications: (request, step) pairs that had drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.num_accepted_tokens_per_pos:
            self.num_accepted_tokens_per_pos = [0] * self.num_spec_tokens

    def observe(self, num_draft_tokens: int, num_accepted_tokens: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        for pos in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[pos] += 1


class Scheduler:
    def __init__(
        self,
        scheduler_config: SchedulerConfig,
        cache_config: CacheConfig,
        num_blocks: int,
        max_model_len: int,
        num_spec_tokens: int = 0,
        disk: BlockFiles | None = None,
        max_loras: int = 0,
        layout: KVLayout | None = None,
    ) -> None:
        """`disk`: the prefix cache's second tier (cache_config.kv_offload_dir,
        under the engine's fingerprint), or None. `layout`: the cache's layer
        groups (core/kv_layout.py; None: one group)."""
        self.config = scheduler_config
        # LoRA adapters: at most this many distinct ones among the running requests
        # (so in any step); 0 without enable_lora, where no request has one.
        self.max_loras = max_loras
        self.block_size = cache_config.block_size
        # A request must always fit alone in the pool, or preemption could loop.
        fits = (num_blocks * self.block_size if layout is None else
                layout.max_tokens_alone(num_blocks, self.block_size, scheduler_config.max_num_batched_tokens))
        self.max_model_len = min(max_model_len, fits)
        # Paged or reserved (cache_config.kv_allocation), one block table or one a
        # layer group: a policy of the KV manager alone.
        self.kv: KVCacheManager = make_kv_cache_manager(cache_config, num_blocks, self.max_model_len,
                                                        disk, layout)
        self.requests: dict[str, Request] = {}
        self.queue: RequestQueue = make_request_queue(scheduler_config.policy)
        self.running: list[Request] = []  # in admission order
        self.finished_req_ids: list[str] = []  # since the last schedule()
        self.num_preemptions = 0
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        # Speculative decoding (num_spec_tokens > 0): the drafts for the next step
        # (set_drafts), and what was drafted and accepted.
        self.drafts: dict[str, list[int]] = {}
        self.spec_stats = SpecDecodingStats(num_spec_tokens) if num_spec_tokens else None
        # The disk tier: its counters, and the request whose loads are in flight.
        self.offload_stats = KVOffloadStats() if self.kv.disk is not None else None
        self._loading: Request | None = None

    @property
    def waiting(self) -> list[Request]:
        """The waiting requests, next to be admitted first."""
        return list(self.queue)

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
        self.kv.check_request(request)
        self.requests[request.request_id] = request
        self.queue.add(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> None:
        """Finish requests from outside the step (abort, a matched stop string)."""
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is not None:
                self._finish(request, status)

    def _finish(self, request: Request, status: RequestStatus) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.queue.remove(request)
        request.status = status
        self.kv.free(request)
        del self.requests[request.request_id]
        self.finished_req_ids.append(request.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def set_drafts(self, request_id: str, draft_token_ids: list[int]) -> None:
        """Speculative decoding: drafts for a running request's next token, to be
        verified in the next schedule() as far as budget and blocks allow (used
        then or never: the engine proposes anew before every step). The
        runner's draft model fills in DRAFT_PLACEHOLDER ones."""
        assert self.requests[request_id].status is RequestStatus.RUNNING, request_id
        self.drafts[request_id] = draft_token_ids

    # ---- one step --------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        num_new_by_req: dict[str, int] = {}
        drafts_by_req: dict[str, list[int]] = {}  # speculative decoding
        preempted: list[str] = []

        # 1. Running requests, in admission order.
        for request in self._running_to_schedule():
            if budget <= 0:
                break
            if request.status is not RequestStatus.RUNNING:  # preempted for an earlier one
                continue
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            drafts = self._drafts(request, budget)
            if drafts and self.kv.allocate_slots(request, 1 + len(drafts)) is not None:
                num_new_by_req[request.request_id] = 1 + len(drafts)
                drafts_by_req[request.request_id] = drafts
                budget -= 1 + len(drafts)
                continue
            while self.kv.allocate_slots(request, num_new) is None:
                victim = self._pick_victim()
                budget += num_new_by_req.pop(victim.request_id, 0)
                drafts_by_req.pop(victim.request_id, None)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is request:
                    break
            else:
                num_new_by_req[request.request_id] = num_new
                budget -= num_new

        # 2. Waiting requests, in queue order, unless we just had to preempt.
        # (Admitting may preempt too, in a subclass: what is new is what was not running.)
        running_before = {r.request_id for r in self.running}
        if not preempted:
            budget = self._admit_waiting(budget, num_new_by_req, preempted)

        # 3. Describe the step and advance the computed counts.
        scheduled = []
        kv_stores = []
        admitted = {r.request_id for r in self.running} - running_before
        for request in self.running:
            if request.request_id not in num_new_by_req:
                continue
            num_new = num_new_by_req[request.request_id]
            drafts = drafts_by_req.get(request.request_id, [])
            start = request.num_computed_tokens
            num_real = num_new - len(drafts)
            ends = start + num_real == request.num_tokens  # (its last known token runs)
            scheduled.append(
                ScheduledRequest(
                    request_id=request.request_id,
                    token_ids=request.all_token_ids[start : start + num_real] + drafts,
                    num_computed_tokens=start,
                    block_ids=self.kv.block_ids(request.request_id),
                    group_block_ids=self.kv.group_block_ids(request.request_id),
                    sampling_params=request.sampling_params,
                    bad_words_token_ids=request.bad_words_token_ids,
                    num_draft_tokens=len(drafts),
                    do_sample=ends and request.pooling_params is None,
                    pooling_params=request.pooling_params,
                    do_pool=ends and request.pooling_params is not None,
                    lora_int_id=request.lora_int_id,
                    prompt_token_ids=(
                        request.prompt_token_ids if request.request_id in admitted else None
                    ),
                    token_type_ids=request.token_type_ids,
                )
            )
            kv_stores += self.kv.stores(request, start, num_real)
            request.num_computed_tokens += num_new
        out = SchedulerOutput(
            scheduled=scheduled,
            num_scheduled_tokens=self.config.max_num_batched_tokens - budget,
            preempted_req_ids=preempted,
            finished_req_ids=self.finished_req_ids,
            kv_stores=kv_stores,
            kv_loads=self.kv.take_loads(),
        )
        self.kv.release_held()  # (admission has taken the blocks loaded last step)
        self.finished_req_ids = []
        self.drafts.clear()  # used now or never
        return out

    def _drafts(self, request: Request, budget: int) -> list[int]:
        """The drafts a decoding request verifies this step: its proposed ones, as
        many as the budget leaves room for beside its own token, and none that
        could only run past max_tokens or the context (a run ends there anyway)."""
        drafts = self.drafts.get(request.request_id)
        if (not drafts or request.num_tokens - request.num_computed_tokens != 1
                or request.pooling_params is not None):
            return []
        room = min(budget, self.max_model_len - request.num_tokens) - 1
        max_tokens = request.sampling_params.max_tokens
        if max_tokens is not None:
            room = min(room, max_tokens - request.num_output_tokens - 1)
        return drafts[: max(room, 0)]

    def _running_to_schedule(self) -> list[Request]:
        """The running requests to give budget to, in admission order (a copy:
        preemption changes `running` while they are gone through)."""
        return list(self.running)

    def _admit_waiting(self, budget: int, num_new_by_req: dict[str, int],
                       preempted: list[str]) -> int:
        """Admit from the queue's head while budget, seats and blocks last. A
        newcomer waits for blocks to be freed and never preempts: preempting for
        it would only trade one waiting request for another. (A subclass that
        does preempt adds each victim's id to `preempted`.)"""
        while budget > 0 and len(self.running) < self.config.max_num_seqs and self.queue:
            request = self._next_ready()
            if request is None:
                break
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            if self.kv.load_from_disk(request, hits, budget):
                # Admitted next step, its loaded blocks then prefix-cache hits: a
                # failed load has then cost a step, never a wrong token.
                self._loading = request
                break
            num_new = min(request.num_tokens - num_hit_tokens, budget)
            if request.whole_prompt and num_new < request.num_tokens - num_hit_tokens:
                break  # (an encoder's prompt waits for a step with room for all of it)
            if self.kv.allocate_slots(request, num_new, hits) is None:
                break
            if request is self.queue.peek():
                self.queue.pop()
            else:  # (passed over a head whose grammar is compiling)
                self.queue.remove(request)
            self._admit(request, num_hit_tokens, num_new, num_new_by_req)
            budget -= num_new
        return budget

    def _next_ready(self) -> Request | None:
        """The queue's first request that can run: one whose grammar is still
        compiling is passed over, so it holds up nobody behind it. So is one
        whose LoRA adapter would be one past `max_loras` running adapters; and
        once one is, every adapter request behind it is too (base requests still
        run): the running adapters then drain, and it gets the first free slot."""
        head = self.queue.peek()
        if head.grammar_ready and not head.lora_int_id:
            return head
        active = {r.lora_int_id for r in self.running} - {0}
        blocked = False
        for request in self.queue:
            lora = request.lora_int_id
            if lora and (blocked or (lora not in active and len(active) >= self.max_loras)):
                blocked = True
            elif request.grammar_ready:
                return request
        return None

    def _admit(
        self, request: Request, num_hit_tokens: int, num_new: int, num_new_by_req: dict[str, int]
    ) -> None:
        """Move a request whose blocks are allocated (and that has left the queue) to running."""
        self.prefix_cache_queries += request.num_tokens
        self.prefix_cache_hits += num_hit_tokens
        if self.offload_stats is not None:
            self.offload_stats.queries += request.disk_query_tokens
            self.offload_stats.hits += request.disk_hit_tokens
        request.disk_query_tokens = request.disk_hit_tokens = 0
        request.skip_disk_lookup = False
        if request.num_cached_tokens < 0:
            request.num_cached_tokens = num_hit_tokens
        request.num_computed_tokens = num_hit_tokens
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        num_new_by_req[request.request_id] = num_new

    def _pick_victim(self) -> Request:
        return self.queue.preemption_victim(self.running)

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.queue.add_front(request)

    # ---- after the forward pass ---------------------------------------------------

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, check stop conditions, free finished requests."""
        if scheduler_output.kv_loads:
            num_loaded = self.kv.finish_loads(runner_output.kv_loaded_block_ids)
            if self._loading is not None:
                self._loading.disk_hit_tokens = num_loaded * self.block_size
            self._loading = None
        if runner_output.kv_transfers is not None and self.offload_stats is not None:
            self.offload_stats.transfers.add(runner_output.kv_transfers)
        outputs: list[EngineCoreOutput] = []
        num_drafts_by_req = {
            r.request_id: r.num_draft_tokens for r in scheduler_output.scheduled if r.num_draft_tokens
        }
        for request_id, vector in runner_output.pooled.items():
            request = self.requests.get(request_id)
            if request is not None and request.status is RequestStatus.RUNNING:
                outputs.append(self._pooled(request, vector))
        for k, request_id in enumerate(runner_output.req_ids):
            request = self.requests.get(request_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            run = runner_output.runs[k]
            num_drafts = num_drafts_by_req.get(request_id, 0)
            if num_drafts:
                self._roll_back(request, num_drafts, len(run) - 1)
            out = self._append_sampled(request, run, runner_output.prompt_logprobs)
            if out is not None:
                outputs.append(out)
        return outputs

    def _pooled(self, request: Request, vector: list[float]) -> EngineCoreOutput:
        """A pooling request's prompt has run: it is done, and its blocks go back
        to the pool now (full ones stay cached for later prefix hits)."""
        self._finish(request, RequestStatus.FINISHED_STOPPED)
        return EngineCoreOutput(
            request_id=request.request_id, new_token_ids=[], new_logprobs=[], new_top_logprobs=[],
            finish_reason=RequestStatus.FINISHED_STOPPED.finish_reason,
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_preemptions=request.num_preemptions, pooled=vector,
        )

    def _roll_back(self, request: Request, num_drafts: int, num_accepted: int) -> None:
        """Drafts past the accepted ones were computed for nothing: their slots
        are not the request's any more (the next step writes its new token where
        the first rejected draft was)."""
        request.num_computed_tokens -= num_drafts - num_accepted
        self.kv.rollback(request)
        if self.spec_stats is not None:
            self.spec_stats.observe(num_drafts, num_accepted)

    def _append_sampled(
        self, request: Request, run: list[SampledToken],
        prompt_logprobs: dict[str, list[TokenLogprobs]],
    ) -> EngineCoreOutput | None:
        """Append the request's run of new tokens (accepted drafts, then its
        sampled token); its output, if it has one to give out now. A stop (EOS,
        a stop token, max_tokens) inside the run cuts the run there."""
        out = EngineCoreOutput(
            request_id=request.request_id,
            new_token_ids=[],
            new_logprobs=[],
            new_top_logprobs=[],
            new_token_ranks=[],
            prompt_logprobs=prompt_logprobs.get(request.request_id),
            num_cached_tokens=max(request.num_cached_tokens, 0),
            num_preemptions=request.num_preemptions,
        )
        status = None
        for token_id, logprob, rank, top in run:
            out.new_token_ids.append(token_id)
            out.new_logprobs.append(logprob)
            out.new_top_logprobs.append(top)
            out.new_token_ranks.append(rank)
            request.append_token(token_id)
            status = request.check_stop(self.max_model_len)
            if status is not None:
                break
        if len(run) > 1:  # accepted drafts: their full blocks join the prefix cache
            self.kv.cache_accepted(request)
        return out if status is None else self._stop(request, status, out)

    def _stop(
        self, request: Request, status: RequestStatus, out: EngineCoreOutput
    ) -> EngineCoreOutput | None:
        """A sampled token ended the request: finish it; `out` carries the reason."""
        self._finish(request, status)
        out.finish_reason = status.finish_reason
        out.stop_reason = request.stop_reason
        return out

    # ---- introspection -------------------------------------------------------------

    def stats(self) -> SchedulerStats:
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.queue),
            kv_cache_usage=self.kv.usage(),
            num_blocks=self.kv.num_blocks,
            num_free_blocks=self.kv.pool.num_free_blocks,
            prefix_cache_queries=self.prefix_cache_queries,
            prefix_cache_hits=self.prefix_cache_hits,
            num_preemptions=self.num_preemptions,
            num_reserved_blocks=self.kv.num_reserved_blocks,
            spec_decoding=dataclasses.replace(
                self.spec_stats,
                num_accepted_tokens_per_pos=list(self.spec_stats.num_accepted_tokens_per_pos),
            ) if self.spec_stats is not None else None,
            kv_offload=None if self.offload_stats is None else dataclasses.replace(
                self.offload_stats, transfers=dataclasses.replace(self.offload_stats.transfers)),
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
        assert len(self.running) + len(self.queue) == len(self.requests)
