"""POST /v1/completions."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncGenerator
from dataclasses import dataclass

from fastapi import Request, Response

from tokenmill.outputs import PromptLogprobs
from tokenmill.sampling_params import SamplingParams
from tokenmill.server.accumulator import OutputAccumulator, json_answer, sse_stream
from tokenmill.server.errors import APIError
from tokenmill.server.logprobs import echo_logprobs, join, prompt_logprobs_field
from tokenmill.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptLogprobEntry,
    random_id,
)
from tokenmill.server.sampling import build_sampling_params
from tokenmill.server.serving import (
    LogprobEntries,
    Prompt,
    Serving,
    SSEResponse,
    StreamChunks,
    logprob_value,
    sse,
)


async def parse_prompts(
    serving: Serving, prompt: str | list[str] | list[int] | list[list[int]]
) -> list[Prompt]:
    if not prompt:
        raise APIError(400, "prompt is empty; give a string, token ids or a list of them", param="prompt")
    prompts: list[Prompt] = []
    if isinstance(prompt, str):
        prompts.append(Prompt(prompt, await serving.encode(prompt, "prompt")))
    elif isinstance(prompt[0], int):
        prompts.append(Prompt(None, [int(t) for t in prompt]))
    else:
        for item in prompt:  # strings or lists of token ids (the request model allows no mix)
            if isinstance(item, str):
                prompts.append(Prompt(item, await serving.encode(item, "prompt")))
            else:
                prompts.append(Prompt(None, list(item)))
    if any(not p.token_ids for p in prompts):
        raise APIError(400, "a prompt is empty; give at least one token", param="prompt")
    return prompts


@dataclass
class _Choice:
    """One choice being assembled (non-streaming) or streamed (its text offset)."""

    text: str = ""
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    offset: int = 0
    prompt_logprobs: list[dict[int, PromptLogprobEntry] | None] | None = None


@dataclass
class _Echo:
    """What a request shows of its prompts: the echoed text, and the prompt logprobs
    asked for (the legacy shape's `echo` + `logprobs`, vLLM's `prompt_logprobs`)."""

    request: CompletionRequest
    prompts: list[Prompt]
    texts: list[str]

    @property
    def only(self) -> bool:
        """echo with max_tokens=0: the prompt alone (one token runs and is dropped, as vLLM)."""
        return self.request.echo and self.request.max_tokens == 0

    def first(self, serving: Serving, i: int, choice: _Choice,
              prompt_logprobs: PromptLogprobs | None) -> tuple[str, CompletionLogprobs | None]:
        """A choice's first output: the prompt's text, and its part of the legacy
        logprobs (the completion's offsets then continue after it)."""
        request = self.request
        if request.prompt_logprobs is not None or (request.echo and request.logprobs is not None):
            # The first output of every choice carries them: the sample that computes
            # them (index 0) is scheduled ahead of the others (FCFS), never after.
            if prompt_logprobs is None:
                raise RuntimeError("a sample's first output came before its prompt's logprobs")
            ids = self.prompts[i].token_ids
            if request.prompt_logprobs is not None:
                choice.prompt_logprobs = prompt_logprobs_field(
                    serving, ids, prompt_logprobs, request.prompt_logprobs)
            if request.echo and request.logprobs is not None:
                part, choice.offset = echo_logprobs(serving, ids, prompt_logprobs, request.logprobs)
                return self.texts[i], part
        return self.texts[i], None


def completion_params(serving: Serving, request: CompletionRequest, prompt: Prompt) -> SamplingParams:
    max_tokens = 1 if request.echo and request.max_tokens == 0 else request.max_tokens
    params = build_sampling_params(request, serving.max_tokens_for(prompt, max_tokens, "prompt"),
                                   request.logprobs)
    if request.echo and request.logprobs is not None:  # the legacy shape needs the prompt's
        k = max(request.logprobs, request.prompt_logprobs or 0)
        params = dataclasses.replace(params, prompt_logprobs=k)
    return params


def add_logprobs(
    serving: Serving, choice: _Choice, token_ids: list[int], entries: LogprobEntries
) -> CompletionLogprobs:
    """Logprobs of the new tokens, in OpenAI's completions shape."""
    lp = CompletionLogprobs()
    for token_id, entry in zip(token_ids, entries, strict=False):
        token = serving.token_text(token_id)
        lp.tokens.append(token)
        chosen = entry.get(token_id)
        lp.token_logprobs.append(None if chosen is None else logprob_value(chosen))
        ranked = sorted(((t, logprob_value(v)) for t, v in entry.items()), key=lambda kv: -kv[1])
        lp.top_logprobs.append({serving.token_text(t): v for t, v in ranked})
        lp.text_offset.append(choice.offset)
        choice.offset += len(token)
    return lp


async def create_completion(serving: Serving, request: CompletionRequest, raw: Request) -> Response:
    lora_request = serving.lora_for(request.model)
    if request.suffix is not None:
        raise APIError(400, "suffix is not supported (no fill-in-the-middle); remove it", param="suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise APIError(400, "best_of other than n is not supported; remove it", param="best_of")
    if request.stream and request.prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs is not available with stream=true (as in vLLM); "
                       "drop one (echo with logprobs streams the prompt's)", param="prompt_logprobs")
    if request.stream_options is not None and not request.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
    prompts = await parse_prompts(serving, request.prompt)
    params = [completion_params(serving, request, p) for p in prompts]
    request_id = random_id("cmpl")
    streams = await serving.start(request_id, prompts, params, request.priority, lora_request)
    echoes = _Echo(request, prompts, [
        (p.text if p.text is not None else serving.engine.decode(p.token_ids)) if request.echo else ""
        for p in prompts
    ])
    n = params[0].n
    outputs = OutputAccumulator(streams)
    if request.stream:
        return SSEResponse(sse_stream(_stream(serving, request, request_id, outputs, echoes, n),
                                       outputs))
    return await json_answer(raw, _collect(serving, request_id, outputs, echoes, n,
                                            serving.answer_model(request.model)))


async def _collect(
    serving: Serving, request_id: str, outputs: OutputAccumulator, echoes: _Echo, n: int, model: str,
) -> str:
    choices: dict[int, _Choice] = {}
    async for i, _, c in outputs.deltas():
        choice = choices.get(i * n + c.index)
        if choice is None:
            choice = choices[i * n + c.index] = _Choice()
            choice.text, choice.logprobs = echoes.first(serving, i, choice,
                                                        outputs.prompt_logprobs.get(i))
        if c.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
        if echoes.only:
            continue
        choice.text += c.text
        if c.logprobs is not None:
            new = add_logprobs(serving, choice, c.token_ids, c.logprobs)
            if choice.logprobs is None:
                choice.logprobs = new
            else:
                for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                    getattr(choice.logprobs, name).extend(getattr(new, name))
    return CompletionResponse(
        id=request_id, model=model, usage=outputs.usage(not echoes.only),
        choices=[
            CompletionChoice(
                index=i, text=c.text, logprobs=c.logprobs,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                prompt_logprobs=c.prompt_logprobs,
            )
            for i, c in sorted(choices.items())
        ],
    ).model_dump_json()


async def _stream(
    serving: Serving,
    request: CompletionRequest,
    request_id: str,
    outputs: OutputAccumulator,
    echoes: _Echo,
    n: int,
) -> AsyncGenerator[str, None]:
    model = serving.answer_model(request.model)
    choices: dict[int, _Choice] = {}
    chunks = StreamChunks(request_id, model)

    def chunk(index: int, text: str, logprobs: CompletionLogprobs | None = None,
              finish_reason: str | None = None, stop_reason: int | str | None = None) -> str:
        if logprobs is None:
            return chunks.completion(index, text, finish_reason, stop_reason)
        return sse(CompletionResponse(
            id=request_id, model=model,
            choices=[CompletionChoice(index=index, text=text, logprobs=logprobs,
                                      finish_reason=finish_reason, stop_reason=stop_reason)],
        ))

    async for i, _, c in outputs.deltas():
        index = i * n + c.index
        choice = choices.get(index)
        echo, echo_lp = "", None
        if choice is None:
            choice = choices[index] = _Choice()
            echo, echo_lp = echoes.first(serving, i, choice, outputs.prompt_logprobs.get(i))
        text, lp = echo, echo_lp
        if not echoes.only:
            text += c.text
            if c.logprobs is not None:
                lp = join(echo_lp, add_logprobs(serving, choice, c.token_ids, c.logprobs))
        if text or c.finish_reason is not None or c.token_ids:
            yield chunk(index, text, lp, c.finish_reason, c.stop_reason)
    if request.stream_options is not None and request.stream_options.include_usage:
        yield sse(CompletionResponse(id=request_id, model=model, choices=[],
                                     usage=outputs.usage(not echoes.only)))
