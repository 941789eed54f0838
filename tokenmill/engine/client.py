"""The one interface a front end (server/, serve_ray/) uses to talk to an engine,
as vLLM's EngineClient: what the model and its cache are (`EngineFacts`, plain
data fixed when the engine is built), its tokenizer, and the request and
lifecycle calls. AsyncEngine provides it; a front end never reaches through it
into the scheduler, the runner or the LLMEngine (tests/test_architecture.py
checks that by name: see docs/ARCHITECTURE.md §2)."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, TypeAlias

from tokenmill.config import PoolerConfig
from tokenmill.outputs import PoolingRequestOutput, RequestOutput
from tokenmill.sampling_params import LoRARequest, PoolingParams, SamplingParams
from tokenmill.tokenizer import Tokenizer

if TYPE_CHECKING:
    from tokenmill.core.scheduler import SchedulerStats
    from tokenmill.engine.iteration_stats import IterationStats
    from tokenmill.engine.live_view import LiveView

# A prompt: text, or {"prompt_token_ids": [...]} (optionally with "prompt": text).
PromptType: TypeAlias = str | dict[str, Any]


@dataclass(frozen=True)
class CacheFacts:
    """The KV cache as built (vLLM's cache_config_info labels)."""

    block_size: int
    num_blocks: int  # found at load from the memory budget
    enable_prefix_caching: bool
    kv_cache_memory_bytes: int | None  # as asked for (None: the default budget)
    cache_dtype: str  # what the KV cache stores: "bfloat16", "float32", "q8_0", "fp8_e4m3", "fp8_e5m2"


@dataclass(frozen=True)
class EngineFacts:
    """What a front end may know about the engine's model and cache."""

    model_name: str  # the model's source, as given (a repo id, a directory, a GGUF file)
    model_path: str  # where it was loaded from
    max_model_len: int  # the context length, capped by the KV cache
    vocab_size: int
    dtype: str  # the weights' dtype: "bfloat16", "float32"
    # The generation config's defaults for what a request leaves unset
    # (engine/generation_config.py; vLLM's get_diff_sampling_param). Read-only.
    default_sampling_params: Mapping[str, Any]
    cache: CacheFacts
    # Tensor parallelism's other ranks started through Ray: (rank, pid, node IP).
    tensor_parallel_ranks: tuple[tuple[int, int, str], ...] = ()
    # Which requests it serves (config.RUNNERS: "auto" both kinds, "generate",
    # "pooling"), and the width of its pooled vectors (embeddings).
    runner: str = "auto"
    hidden_size: int = 0
    pooler: PoolerConfig = field(default_factory=PoolerConfig)  # how pooling requests pool


class EngineClient(Protocol):
    """What server/ and serve_ray/ may call on an engine (AsyncEngine is one)."""

    @property
    def facts(self) -> EngineFacts: ...

    @property
    def tokenizer(self) -> Tokenizer | None:
        """None when the engine runs without one (skip_tokenizer_init)."""
        ...

    @property
    def live_view(self) -> LiveView: ...

    @property
    def is_running(self) -> bool: ...

    def check_health(self) -> None:
        """Raise RuntimeError saying why when the engine cannot serve (its loop
        is down, or its tensor-parallel group stopped)."""
        ...

    def stats(self) -> SchedulerStats: ...

    def num_waiting_requests(self) -> int: ...

    def add_stat_logger(self, stat_logger: Callable[[IterationStats], None]) -> None: ...

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, object]],
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str: ...

    def chat_template_source(
        self, chat_template: str | None = None, tools: list[dict[str, Any]] | None = None
    ) -> str | None: ...

    async def add_request(
        self, request_id: str, prompt: PromptType, params: SamplingParams, priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]: ...

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """Load a LoRA adapter (ValueError saying why one cannot be served)."""
        ...

    async def remove_lora(self, lora_int_id: int) -> bool:
        """Unload a LoRA adapter; False if it was not loaded."""
        ...

    async def add_pooling_request(
        self, request_id: str, prompt: PromptType, params: PoolingParams, priority: int = 0
    ) -> AsyncGenerator[PoolingRequestOutput, None]:
        """A pooling request (an embedding): its stream yields one output, when
        its prompt has run. As add_request otherwise (vLLM's `encode`)."""
        ...

    def abort(self, request_id: str) -> None: ...

    def fail_requests(self, error: BaseException) -> None: ...

    def shutdown(self, timeout_s: float = 30.0) -> None: ...
