"""What both generation endpoints share: admission (model name, queue limit,
context length), rendering chat templates sent in requests, running requests
on the AsyncEngine, SSE framing, aborting on client disconnect, and ending what
still runs when a graceful shutdown runs out of time."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import json
import logging
from collections.abc import AsyncGenerator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import pydantic_core
from fastapi import Request, Response
from pydantic import BaseModel
from starlette.types import Receive, Scope, Send

from tokenmill.config import ServerConfig
from tokenmill.engine.async_engine import EngineDeadError, EngineError
from tokenmill.engine.client import EngineClient
from tokenmill.outputs import PoolingRequestOutput, RequestOutput
from tokenmill.sampling_params import LoRARequest, ParamError, PoolingParams, SamplingParams
from tokenmill.server.errors import INTERNAL_ERROR_MESSAGE, APIError
from tokenmill.server.protocol import now_s
from tokenmill.server.reasoning import THINK_END, ReasoningParser, prompt_closes_reasoning
from tokenmill.server.templates import TemplateRenderer

T = TypeVar("T")
S = TypeVar("S")  # a request's stream

logger = logging.getLogger("tokenmill")


@dataclass
class Prompt:
    text: str | None  # None when given as token ids
    token_ids: list[int]
    token_type_ids: list[int] | None = None  # an encoder's text pair (vLLM's TokensPrompt field)


def engine_prompt(prompt: Prompt) -> dict[str, Any]:
    """The engine's form of a prompt: its token ids, and its text where it has one."""
    out: dict[str, Any] = {"prompt_token_ids": prompt.token_ids}
    if prompt.text is not None:
        out["prompt"] = prompt.text
    if prompt.token_type_ids is not None:
        out["token_type_ids"] = prompt.token_type_ids
    return out


class ClientDisconnected(Exception):
    pass


class ServerShuttingDown(RuntimeError):
    """The server's graceful shutdown ran out of time: the request was aborted.
    (A RuntimeError, as the engine's faults: the endpoints report both the same way.)"""


# JSON has no -inf: OpenAI's (and vLLM's) floor for a logprob in an answer. A
# masked token (structured outputs, allowed_token_ids) has -inf in the engine.
MIN_LOGPROB = -9999.0


def logprob_value(entry: object) -> float:
    """A logprob entry's value, floored at MIN_LOGPROB: a `Logprob` (its
    .logprob) or a plain float."""
    return max(float(getattr(entry, "logprob", entry)), MIN_LOGPROB)  # type: ignore[arg-type]


LogprobEntries = Sequence[Mapping[int, Any]]  # per token: {token_id: Logprob or float}


class Serving:
    def __init__(self, engine: EngineClient, config: ServerConfig, model_name: str) -> None:
        self.engine = engine
        self.config = config
        self.model_name = model_name
        # LoRA adapters served by name (--lora-modules, then runtime loads): each
        # request naming one in `model` runs on it; ids from 1, in that order.
        self.loras: dict[str, LoRARequest] = {
            name: LoRARequest(name, i + 1, path, model_name) for i, (name, path) in enumerate(config.lora_modules)}
        self._next_lora_id = len(self.loras) + 1
        self._token_text: dict[int, str] = {}
        self._reasoning_end_token_id: int | None = None  # (-1: not one token)
        # Only a server that runs request templates starts their worker process.
        self.template_renderer = TemplateRenderer() if config.trust_request_chat_template else None

    def apply_generation_defaults(self, request: BaseModel) -> None:
        """The model's generation-config defaults (engine/generation_config.py) for
        the sampling fields this request left unset, as vLLM applies them. Their
        max_tokens caps the request's (vLLM takes the smaller of the two)."""
        defaults = self.engine.facts.default_sampling_params
        fields = type(request).model_fields
        for name, value in defaults.items():
            if name != "max_tokens" and name in fields and getattr(request, name) is None:
                setattr(request, name, value)
        cap = defaults.get("max_tokens")
        if cap is None:
            return
        names = [n for n in ("max_completion_tokens", "max_output_tokens", "max_tokens") if n in fields]
        for name in names:
            if (value := getattr(request, name)) is not None:
                setattr(request, name, min(value, cap))
                return
        if names:
            setattr(request, names[-1], cap)

    def hold_constraint_after_thinking(self, params: SamplingParams, prompt: Prompt) -> None:
        """With --reasoning-parser, a constraint (structured outputs, tool calls)
        holds the answer after the thinking, as vLLM's: the grammar waits for the
        `</think>` token, unless the prompt already closed the thinking (Qwen3
        with enable_thinking=false). A tokenizer that writes `</think>` in several
        tokens cannot say when it ends: the grammar holds from the first token."""
        if self.config.reasoning_parser is None or params.structured_outputs is None:
            return
        if prompt_closes_reasoning(prompt.text):
            return
        if self._reasoning_end_token_id is None:
            ids = self.engine.encode(THINK_END, False) if self.engine.tokenizer is not None else []
            self._reasoning_end_token_id = ids[0] if len(ids) == 1 else -1
            if len(ids) != 1:
                logger.warning("--reasoning-parser: this tokenizer writes %s in %d tokens; "
                               "structured outputs hold from the first token", THINK_END, len(ids))
        if self._reasoning_end_token_id >= 0:
            params.structured_outputs = dataclasses.replace(
                params.structured_outputs, reasoning_end_token_id=self._reasoning_end_token_id)

    def reasoning_parser(self, prompt: Prompt) -> ReasoningParser | None:
        """A fresh parser for one choice's thinking (--reasoning-parser), or None."""
        name = self.config.reasoning_parser
        return None if name is None else ReasoningParser(name, prompt.text)

    def close(self) -> None:
        if self.template_renderer is not None:
            self.template_renderer.close()

    # ---- admission ------------------------------------------------------------------

    def check_model(self, model: str | None, adapters: bool = False) -> None:
        """The base model's name (or, with `adapters`, a LoRA adapter's), else a
        404 of type NotFoundError, as vLLM's (clients tell it from a bad request).
        An endpoint that runs no adapter refuses an adapter's name with a 400."""
        if model is None or model == self.model_name or (adapters and model in self.loras):
            return
        if model in self.loras:
            raise APIError(400, f"`{model}` is a LoRA adapter; this endpoint runs the base model "
                           f"`{self.model_name}` only (adapters: /v1/completions and "
                           "/v1/chat/completions)", param="model")
        served = ", ".join(f"`{name}`" for name in (self.model_name, *self.loras))
        raise APIError(404, f"The model `{model}` does not exist; this server serves {served}.",
                       param="model", code=404, error_type="NotFoundError")

    def lora_for(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter a request's `model` names (None: the base model);
        a 404 for a name this server does not serve."""
        self.check_model(model, adapters=True)
        return None if model is None else self.loras.get(model)

    def answer_model(self, model: str | None) -> str:
        """The `model` an answer names: the adapter's where the request ran on one."""
        return model if model is not None and model in self.loras else self.model_name

    async def load_lora(self, name: str, path: str) -> LoRARequest:
        """Load an adapter at run time and serve it as `name` (a 400 saying why
        not, for a name in use or an adapter that cannot be served)."""
        if name == self.model_name or name in self.loras:
            raise APIError(400, f"The lora adapter `{name}` has already been loaded (or names the "
                           "base model); unload it first or pick another name", param="lora_name")
        lora = LoRARequest(name, self._next_lora_id, path, self.model_name)
        self._next_lora_id += 1
        try:
            await self.engine.add_lora(lora)
        except ValueError as e:
            raise APIError(400, f"LoRA adapter `{name}` could not be loaded: {e}",
                           param="lora_path") from e
        self.loras[name] = lora
        return lora

    async def unload_lora(self, name: str) -> None:
        """Stop serving adapter `name` (its running requests finish on it; new
        ones get a 404); a 404 if it is not served."""
        lora = self.loras.pop(name, None)
        if lora is None:
            raise APIError(404, f"The lora adapter `{name}` is not loaded", param="lora_name",
                           code=404, error_type="NotFoundError")
        await self.engine.remove_lora(lora.lora_int_id)

    def check_queue(self, num_new: int) -> None:
        limit = self.config.max_queued_requests
        if limit is not None and self.engine.num_waiting_requests() + num_new > limit:
            raise APIError(
                503, f"the server's queue is full ({limit} requests waiting); retry later",
                code="queue_full",
            )

    def max_tokens_for(self, prompt: Prompt, max_tokens: int | None, prompt_param: str) -> int:
        """max_tokens, checked against the context length (None: all that is left).
        `prompt_param` names the prompt's field in errors ("prompt" or "messages")."""
        max_len = self.engine.facts.max_model_len
        num_prompt = len(prompt.token_ids)
        if max_tokens is None:
            if num_prompt >= max_len:
                raise APIError(
                    400, f"This model's maximum context length is {max_len} tokens. However, "
                    f"your prompt has {num_prompt} tokens; shorten it.", param=prompt_param,
                )
            return max_len - num_prompt
        if num_prompt + max_tokens > max_len:
            raise APIError(
                400, f"This model's maximum context length is {max_len} tokens. However, you "
                f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, "
                f"{max_tokens} in the completion). Reduce the prompt or max_tokens.",
                param="max_tokens",
            )
        return max_tokens

    def check_text_length(self, text: str, param: str) -> None:
        """A 400 for text longer than the context can hold, found without
        tokenizing it: with a tokenizer whose tokens cover at most L bytes each
        (Tokenizer.max_token_bytes), text of more than max_model_len * L bytes
        has more than max_model_len tokens. Tokenizing 10 MB would otherwise cost
        ~10 s and ~1 GiB; text that passes is at most max_model_len * L bytes."""
        tokenizer = self.engine.tokenizer
        longest = tokenizer.max_token_bytes if tokenizer is not None else None
        if longest is None:
            return
        max_len = self.engine.facts.max_model_len
        limit = max_len * longest
        # Characters <= UTF-8 bytes: a text too long in characters needs no encoding.
        if len(text) <= limit and len(size := text.encode("utf-8", "surrogatepass")) <= limit:
            return
        num_bytes = len(size) if len(text) <= limit else len(text)
        raise APIError(
            400, f"This model's maximum context length is {max_len} tokens, and one of its "
            f"tokens covers at most {longest} bytes of text. However, your prompt has "
            f"{'' if len(text) <= limit else 'at least '}{num_bytes} bytes "
            f"(more than {max_len} x {longest}); shorten it.", param=param,
        )

    async def encode(self, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`, on a worker thread: the tokenizer lets go of the GIL,
        so a long prompt (up to a second for the longest text check_text_length
        lets through) does not hold up other requests."""

        def checked_encode() -> list[int]:
            self.check_text_length(text, param)
            return self.engine.encode(text, add_special_tokens)

        try:
            return await asyncio.to_thread(checked_encode)
        except ValueError as e:
            raise APIError(400, str(e), param=param) from e

    async def render_request_chat_template(
        self, template: str, messages: list[dict[str, Any]], add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """A chat template from a request, rendered under limits in the template
        worker (templates.py) and waited for on a worker thread."""
        assert self.template_renderer is not None, "the server does not run request templates"
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise ValueError("this engine runs without a tokenizer; send token ids")
        plain, variables = tokenizer.chat_template_inputs(messages, chat_template_kwargs)
        if tools is not None:
            variables["tools"] = tools
        return await asyncio.to_thread(
            self.template_renderer.render, template, plain, add_generation_prompt, variables
        )

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.engine.decode([token_id], False)
        return text

    # ---- running ------------------------------------------------------------------------

    async def start(
        self,
        request_id: str,
        prompts: Sequence[Prompt],
        params: Sequence[SamplingParams],
        priority: int,
        lora_request: LoRARequest | None = None,
    ) -> list[AsyncGenerator[RequestOutput, None]]:
        """Queue every prompt (on `lora_request`'s adapter, where given); if one
        is refused, abort the ones already queued."""
        self.check_queue(sum(p.n for p in params))  # each sample waits as a request
        return await self._start_all(request_id, [
            functools.partial(self.engine.add_request, f"{request_id}-{i}", engine_prompt(prompt), p,
                              priority, lora_request)
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))])

    async def start_pooling(
        self, request_id: str, prompts: Sequence[Prompt], params: PoolingParams, priority: int
    ) -> list[AsyncGenerator[PoolingRequestOutput, None]]:
        """Queue every prompt as a pooling request (start's rules)."""
        self.check_queue(len(prompts))
        return await self._start_all(request_id, [
            functools.partial(self.engine.add_pooling_request, f"{request_id}-{i}",
                              engine_prompt(prompt), params, priority)
            for i, prompt in enumerate(prompts)])

    async def _start_all(self, request_id: str, adds: list[Callable[[], Awaitable[S]]]) -> list[S]:
        """Run each add (request `{request_id}-{i}`); if one is refused, abort the
        ones already queued and raise the refusal as an APIError."""
        streams: list[S] = []
        try:
            for add in adds:
                streams.append(await add())
        except BaseException as e:
            # A stream never iterated does not abort when closed (its generator
            # has not started): abort the queued requests by id.
            for i in range(len(streams)):
                self.engine.abort(f"{request_id}-{i}")
            if isinstance(e, ValueError):
                param = e.param if isinstance(e, ParamError) else None
                raise APIError(400, str(e), param=param) from e
            if isinstance(e, EngineDeadError):
                raise APIError(503, str(e), code="engine_unavailable") from e
            if isinstance(e, EngineError):
                raise APIError(500, INTERNAL_ERROR_MESSAGE) from e
            raise
        return streams

    # ---- shutdown -----------------------------------------------------------------------

    def end_requests(self) -> None:
        """Graceful shutdown is out of time: every request still running ends at the
        engine's next step boundary, a stream with an error event and [DONE], others
        with a 503."""
        self.engine.fail_requests(ServerShuttingDown(
            "the server is shutting down; its grace period for running requests "
            "ran out, so this one was stopped; retry on another server or later"
        ))


async def merge(
    streams: list[AsyncGenerator[RequestOutput, None]],
) -> AsyncGenerator[tuple[int, RequestOutput], None]:
    """Interleave several requests' outputs as they come, tagged with the prompt index.
    Closing the merge (or cancelling its consumer) aborts what still runs."""
    if len(streams) == 1:
        try:
            async for out in streams[0]:
                yield 0, out
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(i: int, stream: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async for out in stream:
                queue.put_nowait((i, out))
        except Exception as e:
            queue.put_nowait((i, e))
        queue.put_nowait((i, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


def engine_error_to_api(e: BaseException) -> APIError:
    if isinstance(e, ServerShuttingDown):
        return APIError(503, str(e), code="server_shutting_down")
    if isinstance(e, EngineDeadError):
        return APIError(503, str(e), code="engine_unavailable")
    return APIError(500, INTERNAL_ERROR_MESSAGE)


def sse(data: BaseModel | str) -> str:
    payload = data if isinstance(data, str) else data.model_dump_json()
    return f"data: {payload}\n\n"


def _json(value: str | int | None) -> str:
    return "null" if value is None else pydantic_core.to_json(value).decode()


class StreamChunks:
    """One stream's plain text chunks (no logprobs, no tool calls), written
    from a template: the same bytes as sse() of CompletionResponse /
    ChatCompletionChunk with one such choice (pydantic's own JSON encoder
    writes each value; tests hold the two to the same bytes), at ~1 us a
    chunk where building and dumping the models costs ~12 us."""

    def __init__(self, request_id: str, model: str) -> None:
        self.head = f'data: {{"id":{_json(request_id)},"object":"'
        self.model = f'"model":{_json(model)},"choices":[{{"index":'

    def completion(self, index: int, text: str, finish_reason: str | None,
                   stop_reason: int | str | None) -> str:
        return (f'{self.head}text_completion","created":{now_s()},{self.model}{index},'
                f'"text":{_json(text)},"logprobs":null,"finish_reason":{_json(finish_reason)},'
                f'"stop_reason":{_json(stop_reason)},"prompt_logprobs":null}}],"usage":null}}\n\n')

    def chat(self, index: int, content: str | None, finish_reason: str | None,
             stop_reason: int | str | None) -> str:
        return (f'{self.head}chat.completion.chunk","created":{now_s()},{self.model}{index},'
                f'"delta":{{"role":null,"content":{_json(content)},"reasoning_content":null,'
                f'"tool_calls":null}},'
                f'"logprobs":null,"finish_reason":{_json(finish_reason)},'
                f'"stop_reason":{_json(stop_reason)}}}],"usage":null}}\n\n')


def sse_error(e: APIError) -> str:
    return sse(json.dumps(e.body().model_dump()))


class SSEResponse(Response):
    """An ASGI response for a stream of prebuilt SSE chunks: each chunk goes to
    `send` as it comes, and nothing else runs per chunk. (starlette's
    StreamingResponse runs its loop in an anyio task group; on 2 cores every
    microsecond of the event loop a token is one of the step's:
    docs/perf-notes.md.) A client that goes away cancels the stream, whose
    generators' `finally` abort its requests; an error after the status line
    went out ends the stream with an error event and [DONE]."""

    media_type = "text/event-stream"

    def __init__(self, chunks: AsyncGenerator[str, None], fault_end: str | None = None) -> None:
        self.chunks = chunks
        # (how a stream ends after an internal fault: OpenAI's error event and [DONE])
        self.fault_end = fault_end if fault_end is not None else (
            sse_error(APIError(500, INTERNAL_ERROR_MESSAGE)) + sse("[DONE]"))
        self.status_code = 200
        self.background = None
        self.init_headers()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        pump = asyncio.ensure_future(self._pump(send))
        watcher = asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({pump, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not pump.done():
                pump.cancel()
                with contextlib.suppress(BaseException):
                    await pump

    async def _pump(self, send: Send) -> None:
        chunks = self.chunks
        try:
            async for chunk in chunks:
                await send({"type": "http.response.body", "body": chunk.encode(), "more_body": True})
        except Exception:
            logger.exception("a stream failed after its first byte")
            await send({"type": "http.response.body", "body": self.fault_end.encode(),
                        "more_body": True})
        finally:
            await chunks.aclose()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def wait_for_disconnect(request: Request) -> None:
    await _wait_for_disconnect(request.receive)


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`; if the client goes away first, cancel it (which aborts its
    requests) and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()
