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


@dataclass
class IterationStats:
    scheduler_stats: SchedulerStats  # state after the iteration (cumulative counters inside)
    num_prompt_tokens: int = 0  # prompts whose first token came out this iteration
    num_generation_tokens: int = 0
    time_to_first_tokens_s: list[float] = field(default_factory=list)
    inter_token_latencies_s: list[float] = field(default_factory=list)
    queue_times_s: list[float] = field(default_factory=list)  # arrival -> first scheduled
    finished: list[FinishedRequestStats] = field(default_factory=list)
