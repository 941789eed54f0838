"""OpenAI request fields -> SamplingParams.

A field reaches SamplingParams only if the client set it. Fields that
SamplingParams does not have (yet) are refused with a 400 naming them, unless
the value asks for nothing (e.g. presence_penalty=0); SamplingParams' own
validation errors become 400s too."""

from __future__ import annotations

import dataclasses
from typing import Any

from tokenmill.sampling_params import ParamError, SamplingParams
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import ChatCompletionRequest, SamplingFields
from tokenmill.server.structured import structured_outputs_from_request

PARAM_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))

# OpenAI / vLLM name -> the value that asks for nothing.
NEUTRAL: dict[str, Any] = {
    "n": 1,
    "temperature": 1.0,
    "top_p": 1.0,
    "seed": None,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logit_bias": {},
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "ignore_eos": False,
    "min_tokens": 0,
    "stop_token_ids": [],
    "include_stop_str_in_output": False,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "allowed_token_ids": None,
    "bad_words": None,
    "prompt_logprobs": None,
}


def refuse_unsupported(request: SamplingFields) -> None:
    """400 for fields that would change the output and are not implemented here."""
    if not isinstance(request, ChatCompletionRequest):  # (chat's tools: server/tools.py)
        if request.tools:
            raise APIError(400, "tools (function calling) are for /v1/chat/completions", param="tools")
        if request.tool_choice not in (None, "none", "auto"):
            raise APIError(400, "tool_choice is for /v1/chat/completions", param="tool_choice")


def build_sampling_params(
    request: SamplingFields, max_tokens: int, logprobs: int | None
) -> SamplingParams:
    refuse_unsupported(request)
    kwargs: dict[str, Any] = {"max_tokens": max_tokens}
    if logprobs is not None:
        kwargs["logprobs"] = logprobs
    structured_outputs = structured_outputs_from_request(request)
    if structured_outputs is not None:
        kwargs["structured_outputs"] = structured_outputs
    values: dict[str, Any] = {name: getattr(request, name) for name in NEUTRAL}
    if request.stop is not None:
        values["stop"] = [request.stop] if isinstance(request.stop, str) else list(request.stop)
    for name, value in values.items():
        if value is None:
            continue
        if name not in PARAM_FIELDS:
            if value == NEUTRAL.get(name):
                continue
            raise APIError(400, f"{name} is not supported by this engine yet", param=name)
        kwargs[name] = value
    try:
        return SamplingParams(**kwargs)
    except ValueError as e:
        raise APIError(400, str(e), param=e.param if isinstance(e, ParamError) else None) from e
