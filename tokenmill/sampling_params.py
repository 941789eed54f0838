"""User-facing request options, named and shaped as vLLM's SamplingParams.

Every field keeps vLLM's name, default and meaning; a bad value raises
ParamError (a ValueError) naming the field and its allowed range, so the
server can answer 400 with that field. Checks that need the model (token ids
inside the vocabulary) are done by the engine when the request is added.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from enum import Enum

# Temperatures below this are greedy (as in vLLM); nonzero ones are clamped up to
# MIN_TEMPERATURE so that logits / temperature cannot overflow.
GREEDY_EPS = 1e-5
MIN_TEMPERATURE = 1e-2
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 100.0
# A seed is a signed 64-bit integer, as in vLLM (torch's generators take it; the
# extra samples of n > 1 use seed + index, which still fits their unsigned range).
MIN_SEED, MAX_SEED = -(2**63), 2**63 - 1


class ParamError(ValueError):
    """A request option is wrong; `param` names it (as OpenAI's error body does),
    so nobody has to parse the message for it."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def is_integer(value: object) -> bool:
    """An int (numpy's too), not a bool and not a float such as 2.0."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


class RequestOutputKind(Enum):
    CUMULATIVE = 0  # every output holds everything generated so far
    DELTA = 1  # every output holds only what is new since the last one
    FINAL_ONLY = 2  # one output, when the request finishes


@dataclass
class StructuredOutputsParams:
    """Constrain a request's output, as vLLM's StructuredOutputsParams: exactly one kind.

    json: a JSON schema (dict or its JSON text); json_object: any JSON object;
    regex: a regular expression; choice: one of these strings; grammar: an EBNF/GBNF
    grammar. The engine compiles each distinct constraint once and masks the logits
    of the request's rows so that only tokens the constraint allows can be sampled.
    disable_any_whitespace: JSON output without free whitespace between tokens
    (json.dumps' separators), as vLLM's flag of that name.
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    # A reasoning model's end of thinking (Qwen3's `</think>` token): the constraint
    # holds the answer after the first such token, and the thinking before it is
    # free (vLLM's rule under --reasoning-parser). None: from the first token.
    reasoning_end_token_id: int | None = None

    def __post_init__(self) -> None:
        kinds = [name for name in ("json", "regex", "choice", "grammar", "json_object")
                 if getattr(self, name) not in (None, False)]
        if len(kinds) != 1:
            raise ParamError(
                "structured_outputs must set exactly one of json, regex, choice, grammar, "
                f"json_object; got {kinds or 'none'}",
                "structured_outputs",
            )
        if self.choice is not None and (
            not isinstance(self.choice, list) or not self.choice
            or any(not isinstance(c, str) for c in self.choice)
        ):
            raise ParamError(f"choice must be a non-empty list of strings, got {self.choice!r}",
                             "structured_outputs")
        if self.reasoning_end_token_id is not None and (
                isinstance(self.reasoning_end_token_id, bool)
                or not isinstance(self.reasoning_end_token_id, int)):
            raise ParamError("reasoning_end_token_id must be a token id (an integer), got "
                             f"{self.reasoning_end_token_id!r}", "structured_outputs")

    @property
    def kind(self) -> str:
        return next(name for name in ("json", "regex", "choice", "grammar", "json_object")
                    if getattr(self, name) not in (None, False))


@dataclass
class SamplingParams:
    n: int = 1  # independent samples of the same prompt (they share its KV blocks)
    presence_penalty: float = 0.0  # [-2, 2]: minus this for every token already generated
    frequency_penalty: float = 0.0  # [-2, 2]: minus this times the token's count so far
    repetition_penalty: float = 1.0  # > 0: divides (or multiplies) logits of prompt+output tokens
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16  # None: up to the model's context length
    min_tokens: int = 0  # EOS and stop_token_ids are masked until this many are generated
    logprobs: int | None = None  # top-k alternatives per generated token (the chosen one always)
    prompt_logprobs: int | None = None  # the same for each prompt token after the first
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit, [-100, 100]
    allowed_token_ids: list[int] | None = None  # only these may be sampled
    bad_words: list[str] | None = None  # words (token sequences) that are never completed
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    structured_outputs: StructuredOutputsParams | None = None  # constrained decoding

    def __post_init__(self) -> None:
        self._check_types()
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if isinstance(self.bad_words, str):
            self.bad_words = [self.bad_words]
        self.stop = list(self.stop or [])
        self.stop_token_ids = [int(t) for t in self.stop_token_ids or []]
        if self.top_k == -1:
            self.top_k = 0
        if self.logit_bias is not None:
            # JSON sends token ids as strings: accept them, as vLLM does.
            try:
                self.logit_bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except (AttributeError, TypeError, ValueError) as e:
                raise ParamError(
                    f"logit_bias must map token ids (int) to floats, got {self.logit_bias!r}",
                    "logit_bias",
                ) from e
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = [int(t) for t in self.allowed_token_ids]
        if self.bad_words is not None:
            self.bad_words = list(self.bad_words)
        self._verify()
        if GREEDY_EPS <= self.temperature < MIN_TEMPERATURE:
            self.temperature = MIN_TEMPERATURE
        if self.greedy:
            # Filtering cannot change an argmax (vLLM resets these too).
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    def _check_types(self) -> None:
        """Numbers of the right kind, before any arithmetic on them: an int where a
        count is asked for (not a bool, not 2.5), an int or float for the rest."""
        for name in ("n", "top_k", "min_tokens", "max_tokens", "logprobs", "prompt_logprobs", "seed"):
            value = getattr(self, name)
            if value is None and name not in ("n", "top_k", "min_tokens"):
                continue
            if not is_integer(value):
                raise ParamError(f"{name} must be an integer, got {value!r}", name)
            setattr(self, name, int(value))
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "temperature",
                     "top_p", "min_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Real):
                raise ParamError(f"{name} must be a number, got {value!r}", name)
            setattr(self, name, float(value))

    def _verify(self) -> None:
        def check(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise ParamError(f"{name} must be {allowed}, got {getattr(self, name)!r}", name)

        check(self.n >= 1, "n", ">= 1")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "in [-2, 2]")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "in [-2, 2]")
        check(self.repetition_penalty > 0.0, "repetition_penalty", "> 0 (1 disables it)")
        check(math.isfinite(self.temperature) and self.temperature >= 0.0, "temperature",
              "finite and >= 0 (0 is greedy)")
        check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]")
        check(self.top_k >= 0, "top_k", "0 or -1 (disabled) or >= 1")
        check(0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]")
        check(
            self.max_tokens is None or self.max_tokens >= 1, "max_tokens", ">= 1 (or None)"
        )
        check(self.min_tokens >= 0, "min_tokens", ">= 0")
        check(self.seed is None or MIN_SEED <= self.seed <= MAX_SEED, "seed",
              f"None or an integer in [{MIN_SEED}, {MAX_SEED}]")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParamError(
                f"min_tokens must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}",
                "min_tokens",
            )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            check(value is None or 0 <= value <= MAX_LOGPROBS, name, f"None or in [0, {MAX_LOGPROBS}]")
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ParamError(f"stop must be a list of non-empty strings, got {self.stop!r}", "stop")
        if self.stop and not self.detokenize:
            raise ParamError("stop strings need detokenize=True; use stop_token_ids instead", "stop")
        if any(t < 0 for t in self.stop_token_ids):
            raise ParamError(
                f"stop_token_ids must be >= 0, got {self.stop_token_ids!r}", "stop_token_ids"
            )
        if self.logit_bias is not None:
            bad = {k: v for k, v in self.logit_bias.items()
                   if k < 0 or not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS}
            if bad:
                raise ParamError(
                    f"logit_bias must map token ids >= 0 to values in [-{MAX_LOGIT_BIAS:g}, "
                    f"{MAX_LOGIT_BIAS:g}], got {bad!r}",
                    "logit_bias",
                )
        if self.allowed_token_ids is not None and (
            not self.allowed_token_ids or any(t < 0 for t in self.allowed_token_ids)
        ):
            raise ParamError(
                f"allowed_token_ids must be None or a non-empty list of token ids >= 0, "
                f"got {self.allowed_token_ids!r}",
                "allowed_token_ids",
            )
        if self.bad_words is not None and any(
            not isinstance(w, str) or not w.strip() for w in self.bad_words
        ):
            raise ParamError(f"bad_words must be non-empty strings, got {self.bad_words!r}", "bad_words")
        for name in ("stop", "bad_words"):
            for text in getattr(self, name) or []:
                try:
                    text.encode("utf-8")
                except UnicodeEncodeError as e:  # a lone surrogate, as JSON's "\ud800"
                    raise ParamError(
                        f"{name} must be valid Unicode text, got {text!r} ({e.reason})", name
                    ) from e
        if self.n > 1 and self.greedy:
            raise ParamError(
                f"n must be 1 when temperature is 0 (greedy samples are identical), got {self.n}",
                "n",
            )

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_EPS

    @property
    def output_text_buffer_length(self) -> int:
        """Characters held back from a stream so a stop string never leaks."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )


@dataclass
class PoolingParams:
    """Options of a pooling request (an embedding), named as vLLM's PoolingParams.

    A pooling request runs its prompt through the model (prefill only, chunked
    as any prefill) and returns the pooled last hidden state instead of tokens.
    dimensions: Matryoshka truncation, the first this many values, renormalised
    where the vector is normalised; only for models trained for it (the engine
    checks). normalize: L2-normalise the vector; None: the model's default (its
    sentence-transformers Normalize module, or True for a decoder without one).
    use_activation (vLLM's): a cross-encoder's activation on its logits (sigmoid
    for one label: model/pooler_config.py); False: the raw logits; for an
    embedding, where normalize is unset, whether to normalise. None: the model's."""

    dimensions: int | None = None
    normalize: bool | None = None
    use_activation: bool | None = None

    def __post_init__(self) -> None:
        if self.dimensions is not None:
            if not is_integer(self.dimensions) or self.dimensions < 1:
                raise ParamError(f"dimensions must be an integer >= 1, got {self.dimensions!r}",
                                 "dimensions")
            self.dimensions = int(self.dimensions)
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ParamError(f"normalize must be true, false or null, got {self.normalize!r}",
                             "normalize")
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise ParamError(f"use_activation must be true, false or null, got "
                             f"{self.use_activation!r}", "use_activation")


@dataclass(frozen=True)
class LoRARequest:
    """A request's LoRA adapter, as vLLM's LoRARequest: `lora_name` (what the
    server lists and a request's `model` names), `lora_int_id` (>= 1, unique per
    adapter: it keys the loaded weights and the prefix cache's blocks),
    `lora_path` (a PEFT directory: adapter_config.json + adapter_model.safetensors)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not is_integer(self.lora_int_id) or self.lora_int_id < 1:
            raise ParamError(f"lora_int_id must be an integer >= 1 (0 is the base model), "
                             f"got {self.lora_int_id!r}", "lora_request")
        if not self.lora_name:
            raise ParamError("lora_name must not be empty", "lora_request")
