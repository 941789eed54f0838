"""A discrete-event simulation of one engine: the real scheduler, a modelled step.

The loop is the engine's own (engine/llm_engine.py, AsyncEngine): at each step
boundary the requests that have arrived are added, `Scheduler.schedule()`
(core's, the same object the engine builds through `make_scheduler`) chooses
the step, and `update_from_output()` takes its sampled tokens. What the model
runner would do is replaced by two things: the clock advances by the cost
model's price of the step's shape, and each sampling row gets a stand-in token
(EOS at the request's drawn output length when EOS counts, else a filler id),
so every stop, finish, preemption and KV allocation is the real code's. When
nothing is left to run the clock jumps to the next arrival, as the engine
thread sleeps until its inbox has a request.

Speculative decoding (`num_speculative_tokens` > 0) is the engine's too: before
each step every decoding request gets k draft tokens (as LLMEngine proposes
them, unless more than `spec_disable_by_batch_size` requests run), the
scheduler fits them into the step and rolls back the rejected ones; the
stand-in accepts each draft with probability `draft_acceptance_rate` until the
first rejection (a seeded generator, so a run repeats exactly).
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from tokenmill.config import DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE, CacheConfig, SchedulerConfig
from tokenmill.core.contracts import ModelRunnerOutput, SampledToken, SchedulerOutput
from tokenmill.core.request import Request
from tokenmill.core.scheduler import Scheduler
from tokenmill.core.static_scheduler import make_scheduler
from tokenmill.sampling_params import SamplingParams
from tokenmill.sim.cost_model import CostModel, StepShape

FILLER_TOKEN_ID = 1
EOS_TOKEN_ID = 0

SchedulerFactory = Callable[[SchedulerConfig, CacheConfig, int, int, int], Scheduler]


@dataclass(frozen=True)
class SimRequest:
    arrival_s: float
    prompt_token_ids: list[int]
    output_len: int  # tokens the request generates (its EOS comes last unless ignore_eos)
    ignore_eos: bool = True  # True: max_tokens = output_len, as the bench workloads send
    max_tokens: int | None = None  # with ignore_eos False: the request's cap (None: none)


@dataclass(frozen=True)
class EngineSettings:
    """The engine options the simulation honours, named as EngineArgs names them."""

    scheduling_policy: str = "fcfs"  # fcfs, priority or static
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    enable_prefix_caching: bool = False
    kv_allocation: str = "paged"  # or "reserved" (core/kv_reservation.py)
    kv_reserve_output_tokens: int | None = None  # reserved only (config.CacheConfig)
    num_kv_blocks: int | None = None  # None: from kv_cache_memory_bytes
    kv_cache_memory_bytes: int = 4 << 30  # the CPU engine's default cap (worker/cache_sizing.py)
    num_speculative_tokens: int = 0  # drafts per decoding request and step (0: no speculation)
    draft_acceptance_rate: float = 0.5  # each draft's chance to be accepted, given the last was
    spec_disable_by_batch_size: int = DEFAULT_SPEC_DISABLE_BY_BATCH_SIZE
    seed: int = 0  # the acceptance draws
    # Behind `tokenmill serve` (True) or offline (LLM.generate): serving adds the
    # cost model's serve_* terms to each step and to each request's arrival.
    serving: bool = False

    def configs(self) -> tuple[SchedulerConfig, CacheConfig]:
        return (SchedulerConfig(max_num_seqs=self.max_num_seqs,
                                max_num_batched_tokens=self.max_num_batched_tokens,
                                policy=self.scheduling_policy),
                CacheConfig(block_size=self.block_size,
                            enable_prefix_caching=self.enable_prefix_caching,
                            kv_allocation=self.kv_allocation,
                            kv_reserve_output_tokens=self.kv_reserve_output_tokens))

    def blocks(self, kv_bytes_per_token: int) -> int:
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        num = self.kv_cache_memory_bytes // (kv_bytes_per_token * self.block_size)
        if num < 1:
            raise ValueError(f"kv_cache_memory_bytes={self.kv_cache_memory_bytes} holds no KV block")
        return int(num)


@dataclass
class StepRecord:
    end_s: float  # simulated time at the step's end
    step_s: float
    num_tokens: int
    num_rows: int
    num_running: int  # after the step
    num_waiting: int
    kv_cache_usage: float
    num_preempted: int


@dataclass
class RequestTrace:
    request_id: str
    arrival_s: float
    prompt_tokens: int
    token_times_s: list[float] = field(default_factory=list)  # when each output token came out
    finish_s: float = math.nan
    finish_reason: str | None = None
    num_preemptions: int = 0


@dataclass
class SimResult:
    requests: list[RequestTrace]
    steps: list[StepRecord]
    num_preemptions: int
    num_computed_tokens: int  # static padding and recomputes included
    num_blocks: int

    @property
    def wall_s(self) -> float:
        """First arrival to last completion."""
        if not self.requests:
            return 0.0
        return max(r.finish_s for r in self.requests) - min(r.arrival_s for r in self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(len(r.token_times_s) for r in self.requests)

    @property
    def mean_batch_size(self) -> float:
        return sum(s.num_rows for s in self.steps) / max(len(self.steps), 1)


def simulate(requests: Sequence[SimRequest], settings: EngineSettings, cost: CostModel,
             scheduler_factory: SchedulerFactory = make_scheduler,
             check_integrity: bool = False) -> SimResult:
    """Run `requests` through a fresh scheduler on a simulated clock."""
    scheduler_config, cache_config = settings.configs()
    num_blocks = settings.blocks(cost.model.kv_bytes_per_token)
    if not 0.0 <= settings.draft_acceptance_rate <= 1.0:
        raise ValueError("draft_acceptance_rate must be in [0, 1], got "
                         f"{settings.draft_acceptance_rate}")
    sched = scheduler_factory(scheduler_config, cache_config, num_blocks, cost.model.max_model_len,
                              settings.num_speculative_tokens)
    rng = random.Random(settings.seed)
    delay_s = cost.serve_arrival_delay_s if settings.serving else 0.0
    order = sorted(range(len(requests)), key=lambda i: (requests[i].arrival_s, i))
    traces: dict[str, RequestTrace] = {}
    targets: dict[str, SimRequest] = {}
    steps: list[StepRecord] = []
    computed = 0
    now = requests[order[0]].arrival_s + delay_s if order else 0.0
    nxt = 0
    while nxt < len(order) or sched.has_unfinished_requests():
        while nxt < len(order) and requests[order[nxt]].arrival_s + delay_s <= now:
            k = order[nxt]
            _add(sched, f"r{k}", requests[k], traces, targets)
            nxt += 1
        if not sched.has_unfinished_requests():
            now = requests[order[nxt]].arrival_s + delay_s  # idle until the next arrival
            continue
        _propose_drafts(sched, settings)
        out = sched.schedule()
        if out.is_empty:
            if nxt < len(order):  # (only a grammar or the pool can hold everyone up)
                now = requests[order[nxt]].arrival_s + delay_s
                continue
            raise RuntimeError("the scheduler scheduled nothing with no arrival left to wait for")
        runner_output = _stand_in(sched, out, targets, rng, settings.draft_acceptance_rate)
        outputs = sched.update_from_output(out, runner_output)  # (its cost needs their number)
        shape = StepShape.of(out, sum(1 for o in outputs if o.new_token_ids))
        step_s = cost.step_s(shape) + (cost.serve_extra_s(shape) if settings.serving else 0.0)
        now += step_s
        computed += shape.num_tokens
        for output in outputs:
            trace = traces[output.request_id]
            trace.token_times_s.extend(now for _ in output.new_token_ids)
            if output.finished:
                trace.finish_s, trace.finish_reason = now, output.finish_reason
                trace.num_preemptions = output.num_preemptions
        if check_integrity:
            sched.check_integrity()
        stats = sched.stats()
        steps.append(StepRecord(end_s=now, step_s=step_s, num_tokens=shape.num_tokens,
                                num_rows=shape.num_rows, num_running=stats.num_running,
                                num_waiting=stats.num_waiting, kv_cache_usage=stats.kv_cache_usage,
                                num_preempted=len(out.preempted_req_ids)))
    return SimResult(requests=[traces[f"r{k}"] for k in range(len(requests))], steps=steps,
                     num_preemptions=sched.num_preemptions, num_computed_tokens=computed,
                     num_blocks=num_blocks)


def _add(sched: Scheduler, request_id: str, req: SimRequest, traces: dict[str, RequestTrace],
         targets: dict[str, SimRequest]) -> None:
    if req.output_len < 1:
        raise ValueError(f"request {request_id}: output_len must be >= 1, got {req.output_len}")
    max_tokens = req.output_len if req.ignore_eos else req.max_tokens
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=req.ignore_eos)
    sched.add_request(Request(request_id=request_id, prompt_token_ids=list(req.prompt_token_ids),
                              sampling_params=params, eos_token_ids=(EOS_TOKEN_ID,),
                              arrival_time=req.arrival_s))
    traces[request_id] = RequestTrace(request_id, req.arrival_s, len(req.prompt_token_ids))
    targets[request_id] = req


def _propose_drafts(sched: Scheduler, settings: EngineSettings) -> None:
    """LLMEngine._propose_drafts: k drafts for each request that decodes next."""
    k = settings.num_speculative_tokens
    if not k or len(sched.running) > settings.spec_disable_by_batch_size:
        return
    for request in sched.running:
        if request.num_tokens - request.num_computed_tokens == 1:
            sched.set_drafts(request.request_id, [FILLER_TOKEN_ID] * k)


def _stand_in(sched: Scheduler, out: SchedulerOutput, targets: dict[str, SimRequest],
              rng: random.Random, acceptance_rate: float) -> ModelRunnerOutput:
    """The runner's output for `out`: per sampling row its accepted drafts (each
    with probability `acceptance_rate`, up to the first rejection) and one
    sampled token; EOS as the request's `output_len`-th token (ignored where the
    request ignores EOS)."""
    req_ids: list[str] = []
    runs: list[list[SampledToken]] = []
    for s in out.scheduled:
        if not s.do_sample:
            continue
        request = sched.requests[s.request_id]
        num_accepted = 0
        while num_accepted < s.num_draft_tokens and rng.random() < acceptance_rate:
            num_accepted += 1
        req_ids.append(s.request_id)
        # The accepted drafts, then the sampled token (positions 1-based).
        runs.append([(_token(request.num_output_tokens + i, targets[s.request_id]), math.nan, 0, None)
                     for i in range(1, num_accepted + 2)])
    return ModelRunnerOutput(req_ids=req_ids, runs=runs)


def _token(position: int, target: SimRequest) -> int:
    """The stand-in for a request's `position`-th output token (1-based)."""
    return EOS_TOKEN_ID if position == target.output_len else FILLER_TOKEN_ID
