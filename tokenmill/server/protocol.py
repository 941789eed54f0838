"""OpenAI request and response bodies (pydantic), with vLLM's extra sampling fields.

Requests ignore fields they do not know (as OpenAI's and vLLM's servers do),
so newer clients keep working (each such field logged once, at debug level); every known field is type-checked and a bad one
becomes a 400 naming it. Fields that would change the output and that this
server does not implement (tools outside chat) are known
so that a request using them gets a 400 instead of an answer that ignores them.

Numbers and booleans are strict, as OpenAI's API (vLLM's models coerce): "5",
true or 5.0 for an integer, "1" or true for a float, "yes" or 1 for a boolean
are 400s naming the field; a float field takes an integer (JSON has one number
type, and OpenAI takes temperature: 1).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from typing import Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    StrictBool,
    StrictFloat,
    StrictInt,
    field_validator,
    model_serializer,
    model_validator,
)

logger = logging.getLogger("tokenmill")


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class LenientRequest(BaseModel):
    """A request body that ignores fields it does not know (as OpenAI's and
    vLLM's servers do), logging each such field once per request type at debug
    level, so an option that was silently dropped can be found."""

    model_config = ConfigDict(extra="ignore")

    # (request type, field) pairs already logged; bounded, so clients that send
    # ever-new names cannot grow it.
    _logged: ClassVar[set[tuple[str, str]]] = set()
    _logged_lock: ClassVar[threading.Lock] = threading.Lock()
    MAX_LOGGED: ClassVar[int] = 1000

    @model_validator(mode="before")
    @classmethod
    def _log_unknown_fields(cls, data: Any) -> Any:
        if isinstance(data, dict) and logger.isEnabledFor(logging.DEBUG):
            known = set(cls.model_fields)
            for name in data:
                key = (cls.__name__, str(name))
                if name in known or key in LenientRequest._logged:
                    continue
                with LenientRequest._logged_lock:
                    if len(LenientRequest._logged) >= LenientRequest.MAX_LOGGED:
                        return data
                    LenientRequest._logged.add(key)
                logger.debug("%s: ignoring the unknown field %r (logged once)", cls.__name__,
                             str(name).encode("utf-8", "backslashreplace").decode()[:100])
        return data


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class SamplingFields(LenientRequest):
    """The sampling options both endpoints take (OpenAI's, then vLLM's extras)."""

    model: str | None = None
    n: StrictInt = Field(default=1, ge=1, le=128)  # OpenAI's range: each sample is a request of its own
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    logit_bias: dict[str, StrictFloat] | None = None
    user: str | None = None
    # vLLM's extras
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    ignore_eos: StrictBool | None = None
    min_tokens: StrictInt | None = None
    stop_token_ids: list[StrictInt] | None = None
    include_stop_str_in_output: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    spaces_between_special_tokens: StrictBool | None = None
    allowed_token_ids: list[StrictInt] | None = None
    bad_words: list[str] | None = None
    priority: StrictInt = 0
    # Known, so that asking for them is refused rather than silently ignored
    # (sampling.build_sampling_params): they would change what comes back.
    prompt_logprobs: StrictInt | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None
    # vLLM's structured outputs (server/structured.py): its extra body field, and
    # the older guided_* names.
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = 16
    echo: StrictBool = False
    logprobs: StrictInt | None = None
    suffix: str | None = None
    best_of: StrictInt | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _no_booleans(cls, prompt: Any) -> Any:
        # (else the union's error names a member type: "prompt.str")
        items = prompt if isinstance(prompt, list) else [prompt]
        if any(isinstance(x, bool) or (isinstance(x, list) and any(isinstance(y, bool) for y in x))
               for x in items):
            raise ValueError("a prompt is a string, a list of strings, token ids (integers) "
                             "or a list of lists of token ids; booleans are not token ids")
        return prompt


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: StrictInt | None = None
    max_completion_tokens: StrictInt | None = None
    logprobs: StrictBool = False
    top_logprobs: StrictInt | None = None
    add_generation_prompt: StrictBool = True
    chat_template: str | None = None
    parallel_tool_calls: StrictBool | None = True
    # vLLM's: extra variables for the chat template (Qwen3's {"enable_thinking": false});
    # reasoning_effort reaches it as the variable of that name.
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None


class TokenizeRequest(LenientRequest):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: StrictBool = True
    add_generation_prompt: StrictBool = True
    chat_template_kwargs: dict[str, Any] | None = None  # (as chat's: vLLM's)


class DetokenizeRequest(LenientRequest):
    model: str | None = None
    tokens: list[StrictInt]


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


# ---- completions -------------------------------------------------------------------


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class PromptLogprobEntry(BaseModel):
    """One token's entry in vLLM's `prompt_logprobs` field (its Logprob)."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # vLLM's extra: per prompt token (the first null), {token id: entry}.
    prompt_logprobs: list[dict[int, PromptLogprobEntry] | None] | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# ---- chat -----------------------------------------------------------------------------


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class OmitNone(BaseModel):
    """Serialized without its None fields: a stream's deltas carry only what
    they set (clients merge them key by key, and a null would overwrite)."""

    @model_serializer(mode="wrap")
    def _omit_none(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        return {k: v for k, v in handler(self).items() if v is not None}


class DeltaFunctionCall(OmitNone):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(OmitNone):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = None  # vLLM's: the thinking (--reasoning-parser)
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: list[dict[int, PromptLogprobEntry] | None] | None = None  # vLLM's extra


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=now_s)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


# ---- the rest -------------------------------------------------------------------------


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "tokenmill"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model (vLLM's)
    max_model_len: int | None = None


class LoadLoRAAdapterRequest(BaseModel):
    """POST /v1/load_lora_adapter (vLLM's, with TOKENMILL_ALLOW_RUNTIME_LORA_UPDATING=1)."""

    lora_name: str
    lora_path: str


class UnloadLoRAAdapterRequest(BaseModel):
    """POST /v1/unload_lora_adapter."""

    lora_name: str
    lora_int_id: int | None = None  # (vLLM's field; the name decides)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo
