"""What completions, chat and Responses share once their requests run: reading
the merged outputs choice by choice while counting usage, mapping an engine's
fault to an APIError, closing the streams (which aborts what still runs), and
ending an answer: a JSON body (or 499 if the client left first), or an SSE
stream's error event and [DONE]. Each endpoint keeps only its own shape."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any

from fastapi import Request, Response

from tokenmill.outputs import CompletionOutput, PromptLogprobs, RequestOutput
from tokenmill.server.errors import APIError
from tokenmill.server.protocol import UsageInfo
from tokenmill.server.serving import (
    ClientDisconnected,
    engine_error_to_api,
    merge,
    sse,
    sse_error,
    unless_disconnected,
)


class OutputAccumulator:
    """One API request's engine requests (one per prompt), read as deltas per
    choice (each sample of each prompt). Usage and the prompts' logprobs are gathered on
    the way, for the endpoint to read as it goes or at the end."""

    def __init__(self, streams: list[AsyncGenerator[RequestOutput, None]]) -> None:
        self.outputs = merge(streams)
        self.prompt_token_ids: dict[int, list[int]] = {}  # prompt index -> its token ids
        self.num_cached_tokens: dict[int, int] = {}  # prompt index -> its prefix-cache hits
        self.num_completion_tokens = 0
        self.prompt_logprobs: dict[int, PromptLogprobs] = {}  # prompt index -> its logprobs

    async def deltas(self) -> AsyncGenerator[tuple[int, RequestOutput, CompletionOutput], None]:
        """(prompt index, its output, one choice's delta) as each comes. An
        engine's fault is raised as an APIError; the engine's streams are
        closed when this ends, is closed, or fails."""
        try:
            async for i, out in self.outputs:
                self.prompt_token_ids[i] = out.prompt_token_ids
                self.num_cached_tokens[i] = out.num_cached_tokens
                if out.prompt_logprobs is not None:
                    self.prompt_logprobs[i] = out.prompt_logprobs
                for c in out.outputs:
                    self.num_completion_tokens += len(c.token_ids)
                    yield i, out, c
        except RuntimeError as e:
            raise engine_error_to_api(e) from e
        finally:
            await self.outputs.aclose()

    async def aclose(self) -> None:
        """Close the engine's streams, aborting what still runs (a client gone
        while a consumer of deltas() was suspended); idempotent."""
        await self.outputs.aclose()

    def usage(self, count_completion: bool = True) -> UsageInfo:
        """OpenAI's usage over every prompt (`count_completion=False`: the
        completion was run only to show the prompt, and counts no tokens)."""
        num_prompt = sum(len(ids) for ids in self.prompt_token_ids.values())
        num_completion = self.num_completion_tokens if count_completion else 0
        return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_completion,
                         total_tokens=num_prompt + num_completion)


async def sse_stream(
    chunks: AsyncGenerator[str, None], outputs: OutputAccumulator,
    error_event: Callable[[APIError], str] = sse_error, done: str = sse("[DONE]"),
) -> AsyncGenerator[str, None]:
    """An endpoint's SSE chunks made from `outputs`, ended as every stream of
    these endpoints ends: after an APIError (the engine's fault), an error
    event; then `done` (OpenAI's [DONE]; Anthropic's stream has none: "").
    Closed early (the client left), it closes `outputs`."""
    try:
        async for chunk in chunks:
            yield chunk
    except APIError as e:
        yield error_event(e)
    finally:
        await chunks.aclose()
        await outputs.aclose()
    if done:
        yield done


async def json_answer(raw: Request, body: Awaitable[Any]) -> Response:
    """The answer whose JSON text `body` computes, or a 499 when the client goes
    away first (which closes its streams and aborts its requests)."""
    try:
        return Response(await unless_disconnected(raw, body), media_type="application/json")
    except ClientDisconnected:
        return Response(status_code=499)
