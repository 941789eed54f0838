"""What one iteration of the engine loop did, for metrics (the server's
Prometheus logger reads it). Times are seconds of time.monotonic()."""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.core.scheduler import SchedulerStats


@dataclass
class FinishedRequestStats:
    finish_reason: str  # "stop", "length", "abort" or "error"
    e2e_latency_s: float
    num_prompt_tokens: int
    num_generation_tokens: int
    # vLLM's per-request phases (0 where the request never got that far):
    # prefill = first scheduled -> first token, decode = first -> last token,
    # inference = first scheduled -> last token.
    num_cached_tokens: int = 0
    prefill_time_s: float = 0.0
    decode_time_s: float = 0.0
    inference_time_s: float = 0.0
    mean_time_per_output_token_s: float = 0.0  # decode time / (generation tokens - 1)
    n: int = 1  # the request's SamplingParams.n and .max_tokens
    max_tokens: int | None = None


@dataclass
class IterationStats:
    scheduler_stats: SchedulerStats  # state after the iteration (cumulative counters inside)
    num_prompt_tokens: int = 0  # prompts whose first token came out this iteration
    num_generation_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # of num_prompt_tokens, those found in the prefix cache
    num_scheduled_tokens: int | None = None  # tokens the step ran (None: no step this iteration)
    time_to_first_tokens_s: list[float] = field(default_factory=list)
    inter_token_latencies_s: list[float] = field(default_factory=list)
    queue_times_s: list[float] = field(default_factory=list)  # arrival -> first scheduled
    finished: list[FinishedRequestStats] = field(default_factory=list)
