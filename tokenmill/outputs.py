"""Results handed to users, shaped as vLLM's RequestOutput / CompletionOutput."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Logprob:
    """One token's logprob under the raw model distribution, as vLLM's Logprob."""

    logprob: float
    rank: int | None = None  # 1 = the most likely token
    decoded_token: str | None = None  # the token's own text (None without a tokenizer)


# Per position: {token_id: Logprob} for the chosen token and the top alternatives.
SampleLogprobs = list[dict[int, Logprob]]
# The same for each prompt token; the first is None (nothing predicts it).
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    # One entry per generated token: {token_id: Logprob} for the chosen token (and
    # the top alternatives when asked for); None when logprobs were not requested.
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that matched

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    """Wall-clock times (time.monotonic()) of one request's life."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    error: str | None = field(default=None)  # set when the request was rejected
    prompt_logprobs: PromptLogprobs | None = None  # when asked for (SamplingParams.prompt_logprobs)


@dataclass
class GenerateStats:
    """What one `LLM.generate` call cost, step by step."""

    num_steps: int = 0
    num_computed_tokens: int = 0  # tokens run through the model, recomputes and padding included
    num_scheduled_reqs: int = 0  # summed over steps
    num_preemptions: int = 0
    wall_time_s: float = 0.0
    # Seconds in each part of the steps, summed: schedule, prepare_inputs,
    # forward, head, sample, update, detokenize.
    phase_s: dict[str, float] = field(default_factory=dict)
    # KV blocks after each step's scheduling, summed over steps: holding tokens,
    # and held (those plus the ones reserved for running requests' later tokens).
    kv_blocks_used: int = 0
    kv_blocks_held: int = 0
    num_kv_blocks: int = 0  # the pool's size

    @property
    def mean_batch_size(self) -> float:
        """Requests per forward pass, on average."""
        return self.num_scheduled_reqs / self.num_steps if self.num_steps else 0.0

    @property
    def mean_kv_used(self) -> float:
        """The pool's fraction holding tokens, on average over steps."""
        steps = self.num_steps * self.num_kv_blocks
        return self.kv_blocks_used / steps if steps else 0.0

    @property
    def mean_kv_held(self) -> float:
        """The pool's fraction held by running requests (used or reserved), on average."""
        steps = self.num_steps * self.num_kv_blocks
        return self.kv_blocks_held / steps if steps else 0.0


@dataclass
class PoolingOutput:
    """A pooling request's result, as vLLM's PoolingOutput (`data`: a list of
    floats here, not a tensor: outputs.py holds no torch)."""

    data: list[float]


@dataclass
class EmbeddingOutput:
    """An embedding, as vLLM's EmbeddingOutput."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class PoolingRequestOutput:
    """One pooling request's result, as vLLM's PoolingRequestOutput: one output,
    when the prompt has run (nothing streams). An aborted request's
    `outputs.data` is empty."""

    request_id: str
    outputs: PoolingOutput
    prompt_token_ids: list[int]
    finished: bool
    num_cached_tokens: int = 0
    prompt: str | None = None
    metrics: RequestMetrics | None = None


@dataclass
class EmbeddingRequestOutput:
    """`LLM.embed`'s result per prompt, as vLLM's EmbeddingRequestOutput."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool

    @classmethod
    def from_base(cls, out: PoolingRequestOutput) -> EmbeddingRequestOutput:
        return cls(out.request_id, EmbeddingOutput(list(out.outputs.data)), out.prompt_token_ids,
                   out.finished)


@dataclass
class ScoringOutput:
    """A pair's similarity, as vLLM's ScoringOutput."""

    score: float


@dataclass
class ScoringRequestOutput:
    """`LLM.score`'s result per pair, as vLLM's ScoringRequestOutput."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool


# What an engine step hands out: a generation request's output or a pooling one's.
EngineOutput = RequestOutput | PoolingRequestOutput
