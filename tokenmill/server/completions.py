"""POST /v1/completions."""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field

from fastapi import Request, Response
from fastapi.responses import StreamingResponse

from tokenmill.outputs import RequestOutput
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    random_id,
)
from tokenmill.server.sampling import build_sampling_params
from tokenmill.server.serving import (
    ClientDisconnected,
    LogprobEntries,
    Prompt,
    Serving,
    engine_error_to_api,
    logprob_value,
    merge,
    sse,
    sse_error,
    unless_disconnected,
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
    token_ids: list[int] = field(default_factory=list)
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    offset: int = 0


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
    serving.check_model(request.model)
    if request.suffix is not None:
        raise APIError(400, "suffix is not supported (no fill-in-the-middle); remove it", param="suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise APIError(400, "best_of other than n is not supported; remove it", param="best_of")
    if request.echo and request.logprobs is not None:
        raise APIError(
            400, "echo with logprobs needs prompt logprobs, which are not supported; drop one",
            param="echo",
        )
    if request.stream_options is not None and not request.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
    prompts = await parse_prompts(serving, request.prompt)
    params = [
        build_sampling_params(request, serving.max_tokens_for(p, request.max_tokens, "prompt"), request.logprobs)
        for p in prompts
    ]
    request_id = random_id("cmpl")
    streams = await serving.start(request_id, prompts, params, request.priority)
    echoes = [
        (p.text if p.text is not None else serving.engine.decode(p.token_ids)) if request.echo else ""
        for p in prompts
    ]
    n = params[0].n
    outputs = merge(streams)
    if request.stream:
        body = _stream(serving, request, request_id, outputs, echoes, n)
        return StreamingResponse(body, media_type="text/event-stream")
    try:
        choices, usage = await unless_disconnected(raw, _collect(serving, outputs, echoes, n))
    except ClientDisconnected:
        return Response(status_code=499)
    return Response(
        CompletionResponse(
            id=request_id, model=serving.model_name, usage=usage,
            choices=[
                CompletionChoice(
                    index=i, text=c.text, logprobs=c.logprobs,
                    finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                )
                for i, c in sorted(choices.items())
            ],
        ).model_dump_json(),
        media_type="application/json",
    )


async def _collect(
    serving: Serving,
    outputs: AsyncGenerator[tuple[int, RequestOutput], None],
    echoes: list[str],
    n: int,
) -> tuple[dict[int, _Choice], UsageInfo]:
    choices = {i * n + j: _Choice(text=echoes[i]) for i in range(len(echoes)) for j in range(n)}
    num_prompt_tokens = [0] * len(echoes)
    try:
        async for i, out in outputs:
            num_prompt_tokens[i] = len(out.prompt_token_ids)
            for c in out.outputs:
                choice = choices[i * n + c.index]
                choice.text += c.text
                if c.logprobs is not None:
                    new = add_logprobs(serving, choice, c.token_ids, c.logprobs)
                    if choice.logprobs is None:
                        choice.logprobs = new
                    else:
                        for name in ("tokens", "token_logprobs", "top_logprobs", "text_offset"):
                            getattr(choice.logprobs, name).extend(getattr(new, name))
                choice.token_ids.extend(c.token_ids)
                if c.finish_reason is not None:
                    choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
    except RuntimeError as e:
        raise engine_error_to_api(e) from e
    finally:
        await outputs.aclose()
    num_prompt = sum(num_prompt_tokens)
    num_completion = sum(len(c.token_ids) for c in choices.values())
    usage = UsageInfo(
        prompt_tokens=num_prompt, completion_tokens=num_completion,
        total_tokens=num_prompt + num_completion,
    )
    return choices, usage


async def _stream(
    serving: Serving,
    request: CompletionRequest,
    request_id: str,
    outputs: AsyncGenerator[tuple[int, RequestOutput], None],
    echoes: list[str],
    n: int,
) -> AsyncIterator[str]:
    model = serving.model_name
    choices: dict[int, _Choice] = {}
    num_prompt_tokens = [0] * len(echoes)

    def chunk(index: int, text: str, logprobs: CompletionLogprobs | None = None,
              finish_reason: str | None = None, stop_reason: int | str | None = None) -> str:
        return sse(CompletionResponse(
            id=request_id, model=model,
            choices=[CompletionChoice(index=index, text=text, logprobs=logprobs,
                                      finish_reason=finish_reason, stop_reason=stop_reason)],
        ))

    try:
        async for i, out in outputs:
            num_prompt_tokens[i] = len(out.prompt_token_ids)
            for c in out.outputs:
                index = i * n + c.index
                choice = choices.get(index)
                text = c.text
                if choice is None:
                    choice = choices[index] = _Choice()
                    text = echoes[i] + text
                lp = add_logprobs(serving, choice, c.token_ids, c.logprobs) if c.logprobs is not None else None
                choice.token_ids.extend(c.token_ids)
                if text or c.finish_reason is not None or c.token_ids:
                    yield chunk(index, text, lp, c.finish_reason, c.stop_reason)
        if request.stream_options is not None and request.stream_options.include_usage:
            num_prompt = sum(num_prompt_tokens)
            num_completion = sum(len(c.token_ids) for c in choices.values())
            usage = UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_completion,
                              total_tokens=num_prompt + num_completion)
            yield sse(CompletionResponse(id=request_id, model=model, choices=[], usage=usage))
    except RuntimeError as e:
        yield sse_error(engine_error_to_api(e))
    finally:
        await outputs.aclose()
    yield sse("[DONE]")
