"""A request as the scheduler sees it: token counts, status, block hashes."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tokenmill.sampling_params import LoRARequest, PoolingParams, SamplingParams


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    """`num_tokens` = prompt + generated; `num_computed_tokens` = those whose
    K/V are in the cache. The scheduler's only job is to make the second catch
    up with the first."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    bad_words_token_ids: list[list[int]] = field(default_factory=list)  # the engine tokenizes them
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = 0.0
    priority: int = 0  # lower runs first (vLLM's convention)
    # A pooling request: prefill only, then finished with its pooled hidden state
    # (its sampling_params hold max_tokens=1, as vLLM's, and are not used to sample).
    pooling_params: PoolingParams | None = None
    # Its pooler reads rows before the last (MEAN, CLS), or its model is an
    # encoder (every row attends to every other): it takes no prefix hits.
    pool_every_row: bool = False
    # An encoder's request: its whole prompt runs in one step, never chunked
    # (bidirectional attention needs every token of it at once).
    whole_prompt: bool = False
    # An encoder's token types (segment ids: a text pair's 0s then 1s), one per
    # prompt token; None: all 0.
    token_type_ids: list[int] | None = None
    lora_request: LoRARequest | None = None  # its LoRA adapter (None: the base model)

    all_token_ids: list[int] = field(init=False)
    output_token_ids: list[int] = field(default_factory=list, init=False)
    num_computed_tokens: int = field(default=0, init=False)
    status: RequestStatus = field(default=RequestStatus.WAITING, init=False)
    stop_reason: int | str | None = field(default=None, init=False)
    num_preemptions: int = field(default=0, init=False)
    num_cached_tokens: int = field(default=-1, init=False)  # prefix hits at first schedule
    # Chained hashes of this request's full blocks of tokens (prefix caching).
    block_hashes: list[int] = field(default_factory=list, init=False)
    # The disk tier (kv_offload_dir): True after a load was chosen for it, so its
    # next admission attempt is a plain one (KVCacheManager.load_from_disk); the
    # tokens the RAM cache lacked at its last lookup, and those loaded for it
    # (counted, then zeroed, when it is admitted).
    skip_disk_lookup: bool = field(default=False, init=False)
    disk_query_tokens: int = field(default=0, init=False)
    disk_hit_tokens: int = field(default=0, init=False)
    # The tokens whose full blocks were offered to the disk tier (KVCacheManager.stores):
    # blocks that accepted drafts filled come after it, offered at the next step.
    disk_offered_tokens: int = field(default=0, init=False)
    # structured_outputs: False while the engine compiles the request's grammar
    # (off the step loop); the scheduler admits it only once this is True.
    grammar_ready: bool = field(default=True, init=False)

    def __post_init__(self) -> None:
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def lora_int_id(self) -> int:
        """Its adapter's id, 0 for the base model."""
        return 0 if self.lora_request is None else self.lora_request.lora_int_id

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_token(self, token_id: int) -> None:
        self.all_token_ids.append(token_id)
        self.output_token_ids.append(token_id)

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finished status the newest token puts this request in, if any.
        `max_model_len` is the scheduler's (capped by the KV cache), so the one
        limit every request shares is kept in one place."""
        params = self.sampling_params
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in self.eos_token_ids:
                self.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if last in params.stop_token_ids:
                self.stop_reason = last
                return RequestStatus.FINISHED_STOPPED
        max_tokens = params.max_tokens
        if self.num_tokens >= max_model_len or (
            max_tokens is not None and self.num_output_tokens >= max_tokens
        ):
            return RequestStatus.FINISHED_LENGTH
        return None
