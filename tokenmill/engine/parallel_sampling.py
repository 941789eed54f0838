"""`n > 1` by fan-out, as vLLM v1 does it.

A request with n samples becomes n child requests with the same prompt,
ids "{index}_{request_id}" (only made here, never parsed: the output
processor keeps the map from child to parent). Children admitted together share the prompt's
full KV blocks through the prefix cache (a block is registered when it is
allocated, so the second child already hits the first one's blocks), and each
continues on its own blocks. Their outputs are folded back here into one
RequestOutput per step under the parent's id, each CompletionOutput carrying
its `index`.

    parent "7", n=3 ──> "0_7"  "1_7"  "2_7"  (scheduler, runner: plain requests)
                         │      │      │
    RequestOutput("7", outputs=[index 0, index 1, index 2])
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from tokenmill.outputs import CompletionOutput, PromptLogprobs, RequestMetrics, RequestOutput
from tokenmill.sampling_params import MAX_SEED, MIN_SEED, RequestOutputKind, SamplingParams


def child_request_id(request_id: str, index: int) -> str:
    return f"{index}_{request_id}"


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """One sample's options: n=1, and for a seeded request the seed + index
    (wrapped around inside the seeds' signed 64-bit range), so the children
    draw distinct streams that are still reproducible. Only the first child
    computes prompt logprobs (the others may then use the prefix cache)."""
    seed = params.seed
    if seed is not None:
        seed = (seed + index - MIN_SEED) % (MAX_SEED - MIN_SEED + 1) + MIN_SEED
    return dataclasses.replace(
        params,
        n=1,
        seed=seed,
        prompt_logprobs=params.prompt_logprobs if index == 0 else None,
    )


def fan_out(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """The (id, options) of each of a request's n samples."""
    return [(child_request_id(request_id, i), child_params(params, i)) for i in range(params.n)]


@dataclass
class ParentRequest:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    child_ids: list[str]
    unfinished: set[str] = field(init=False)
    latest: dict[int, CompletionOutput] = field(default_factory=dict)  # by index
    new_indices: set[int] = field(default_factory=set)  # produced this step
    prompt_logprobs: PromptLogprobs | None = None
    num_cached_tokens: int = 0

    def __post_init__(self) -> None:
        self.unfinished = set(self.child_ids)

    @property
    def finished(self) -> bool:
        return not self.unfinished

    def add_child_output(
        self, child_id: str, output: RequestOutput, finished_time: float | None
    ) -> None:
        completion = output.outputs[0]
        self.latest[completion.index] = completion
        self.new_indices.add(completion.index)
        if output.prompt_logprobs is not None:
            self.prompt_logprobs = output.prompt_logprobs
        self.num_cached_tokens = max(self.num_cached_tokens, output.num_cached_tokens)
        child_metrics = output.metrics
        if child_metrics is not None:
            m = self.metrics
            if child_metrics.first_token_time is not None and (
                m.first_token_time is None or child_metrics.first_token_time < m.first_token_time
            ):
                m.first_token_time = child_metrics.first_token_time
            m.last_token_time = child_metrics.last_token_time or m.last_token_time
        if output.finished:
            self.unfinished.discard(child_id)
            if self.finished:
                self.metrics.finished_time = finished_time

    def make_output(self) -> RequestOutput | None:
        """The step's output: FINAL_ONLY waits for all n; DELTA carries the samples
        that moved this step; CUMULATIVE carries every sample so far."""
        kind = self.params.output_kind
        new, self.new_indices = self.new_indices, set()
        if kind is RequestOutputKind.FINAL_ONLY:
            indices = sorted(self.latest) if self.finished else []
        elif kind is RequestOutputKind.DELTA:
            indices = sorted(new)
        else:
            indices = sorted(self.latest)
        if not indices:
            return None
        prompt_logprobs = self.prompt_logprobs
        if kind is RequestOutputKind.DELTA:
            self.prompt_logprobs = None  # sent once
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[self.latest[i] for i in indices],
            finished=self.finished,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
        )
