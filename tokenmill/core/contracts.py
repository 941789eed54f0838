"""Plain data passed between the scheduler, the model runner and the engine.

Scheduler -> runner: SchedulerOutput. Runner -> scheduler: ModelRunnerOutput.
Scheduler -> engine: EngineCoreOutput per request that produced something.
No tensors here: lists of Python ints and floats only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TypeAlias

from tokenmill.sampling_params import PoolingParams, SamplingParams

# A draft token the runner's drafter (a draft model) fills in before the forward.
DRAFT_PLACEHOLDER = -1


@dataclass
class TokenLogprobs:
    """One position's logprobs under the raw model distribution."""

    token_id: int  # the token at this position (sampled, or the prompt's)
    logprob: float
    rank: int  # 1 = the most likely token
    top: dict[int, float]  # the top-k alternatives {token_id: logprob}, most likely first


@dataclass
class ScheduledRequest:
    request_id: str
    token_ids: list[int]  # the tokens to compute this step
    num_computed_tokens: int  # position of token_ids[0]; tokens before it are cached
    block_ids: list[int]  # the request's whole block table after this step's allocation
    sampling_params: SamplingParams
    # True when this step reaches the request's last known token, so a new token
    # is sampled from its logits; False for a chunk in the middle of a prefill.
    do_sample: bool
    # Set when the request is (re)admitted from the waiting queue, so the runner
    # can build its per-request state (penalties see the whole prompt, prefix
    # hits included); None on later steps.
    prompt_token_ids: list[int] | None = None
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # sampling_params.bad_words
    # Speculative decoding: the last num_draft_tokens of token_ids are drafts to
    # verify (do_sample is then True: every one of their rows is sampled).
    num_draft_tokens: int = 0
    # A pooling request (prefill only, do_sample always False): its options, and
    # do_pool True in the step that computes its last prompt token, whose output
    # is its pooled hidden state.
    pooling_params: PoolingParams | None = None
    do_pool: bool = False
    # An encoder's request (Request.whole_prompt: admitted and run whole in one
    # step): its token types, one per token of token_ids; None: all 0.
    token_type_ids: list[int] | None = None
    lora_int_id: int = 0  # its LoRA adapter's id (0: the base model)
    # The block tables of the KV layer groups after the first (core/kv_layout.py),
    # as long as block_ids; empty where the cache is one group.
    group_block_ids: list[list[int]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class KVBlockTransfer:
    """A full block moving between the KV cache and the disk tier
    (kv_offload_dir): which block of the cache, and whose content it is (its
    chain hash, its parent's, its tokens: the file is named by the hash and
    checked against all three when read)."""

    block_id: int
    block_hash: int
    parent_hash: int
    token_ids: tuple[int, ...]


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_scheduled_tokens: int
    preempted_req_ids: list[str] = field(default_factory=list)
    # Requests finished since the last step: the runner drops their state.
    finished_req_ids: list[str] = field(default_factory=list)
    # The disk tier (kv_offload_dir): files read into fresh blocks before the
    # forward (no request computes on them this step: the scheduler registers
    # those that loaded once it has the runner's output); blocks this step's
    # forward fills, written to files after it.
    kv_loads: list[KVBlockTransfer] = field(default_factory=list)
    kv_stores: list[KVBlockTransfer] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


# One new token of a request: (token_id, logprob, rank, top_logprobs), under the
# raw model distribution. logprob is NaN and rank 0 where the request did not ask
# for logprobs (not computed: it costs a vocab pass); top_logprobs, the top-k
# alternatives {token_id: logprob} best first, is None unless asked for. A plain
# tuple: one is made per token on the decode path.
SampledToken: TypeAlias = tuple[int, float, int, dict[int, float] | None]


@dataclass
class ModelRunnerOutput:
    # One entry per scheduled request with do_sample, in SchedulerOutput order.
    req_ids: list[str]
    # Per request, its run of new tokens: the drafts it accepted (speculative
    # decoding, each with the target's logprobs), then the token sampled after
    # them, last. Without drafts a run is one token.
    runs: list[list[SampledToken]]
    # The prompt logprobs of each request that asked for them and whose prefill
    # ends this step: one entry per prompt token after the first.
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    # Each pooling request whose prompt ended this step: its pooled vector.
    pooled: dict[str, list[float]] = field(default_factory=dict)
    # The disk tier: the blocks of SchedulerOutput.kv_loads that loaded (a file
    # missing, truncated, corrupt or another's is a miss, left out), and what
    # this step's transfers did.
    kv_loaded_block_ids: list[int] = field(default_factory=list)
    kv_transfers: KVTransferStats | None = None


@dataclass
class KVTransferStats:
    """The disk tier's transfers (one step's, or summed): blocks, bytes, seconds."""

    num_loaded_blocks: int = 0
    num_failed_loads: int = 0  # files that were there but were not the block's, or went
    num_stored_blocks: int = 0  # written (a block whose file was there is not rewritten)
    bytes_loaded: int = 0
    bytes_stored: int = 0
    load_s: float = 0.0
    store_s: float = 0.0
    num_files_removed: int = 0  # by the byte bound

    def add(self, other: KVTransferStats) -> None:
        for name in vars(other):
            setattr(self, name, getattr(self, name) + getattr(other, name))


@dataclass
class EngineCoreOutput:
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[float]
    new_top_logprobs: list[dict[int, float] | None]
    new_token_ranks: list[int] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    pooled: list[float] | None = None  # a pooling request's result (it is then finished)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
