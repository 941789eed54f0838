"""POST /v1/responses and GET /v1/responses/{id}: OpenAI's Responses API for
text in and text out, streaming and not.

A request becomes chat messages (`instructions` as the system message, then the
stored conversation of `previous_response_id`, then `input`), runs through the
model's chat template as a chat completion does, and comes back as one
assistant message. Responses with `store` (the default, as OpenAI's) are kept in
memory, the most recently used `max_stored_responses` of them (least recently
used dropped first), so a long-running server's memory stays bounded."""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from pydantic import (
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    ValidationError,
)

from tokenmill.outputs import CompletionOutput
from tokenmill.server.accumulator import OutputAccumulator, json_answer
from tokenmill.server.answer import AnswerDelta, AnswerStream
from tokenmill.server.chat import chat_prompt
from tokenmill.server.errors import APIError, describe_validation_error
from tokenmill.server.protocol import ChatCompletionRequest, LenientRequest, random_id
from tokenmill.server.sampling import build_sampling_params
from tokenmill.server.serving import Prompt, Serving

# Content part types that carry text, in input items and in stored outputs.
TEXT_PART_TYPES = ("input_text", "output_text", "text")


class ResponsesRequest(LenientRequest):
    """The fields of OpenAI's Responses API that apply to text generation; numbers
    and booleans strict, as the other requests (server/protocol.py)."""

    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: StrictInt | None = Field(default=None, ge=1)
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    store: StrictBool = True
    previous_response_id: str | None = None
    stream: StrictBool = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    # Known so that asking for them is refused rather than silently ignored.
    tools: list[Any] | None = None
    tool_choice: Any = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    background: StrictBool | None = None
    # vLLM's extras (its ResponsesRequest takes these sampling fields too)
    top_k: StrictInt | None = None
    min_p: StrictFloat | None = None
    repetition_penalty: StrictFloat | None = None
    presence_penalty: StrictFloat | None = None
    frequency_penalty: StrictFloat | None = None
    logit_bias: dict[str, StrictFloat] | None = None
    seed: StrictInt | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: StrictBool | None = None
    min_tokens: StrictInt | None = None
    skip_special_tokens: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None
    priority: StrictInt = 0
    chat_template_kwargs: dict[str, Any] | None = None


# Fields passed on as they are to the chat request that runs the response.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                   "presence_penalty", "frequency_penalty", "logit_bias", "seed", "stop",
                   "stop_token_ids", "ignore_eos", "min_tokens", "skip_special_tokens",
                   "include_stop_str_in_output", "user", "model", "chat_template_kwargs")


class ResponseStore:
    """Stored responses: id -> (the response's JSON, the conversation it ends:
    its messages without instructions, its output last). At most `capacity`,
    least recently used dropped first. Used from the event loop and its threads."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]]) -> None:
        if self.capacity <= 0:
            return
        with self._lock:
            self._items[response["id"]] = (response, conversation)
            self._items.move_to_end(response["id"])
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> tuple[dict[str, Any], list[dict[str, Any]]] | None:
        with self._lock:
            item = self._items.get(response_id)
            if item is not None:
                self._items.move_to_end(response_id)
            return item

    def __len__(self) -> int:
        return len(self._items)


def not_found(response_id: str, param: str | None) -> APIError:
    return APIError(404, f"Response with id '{response_id}' not found; it was never stored "
                    "(store=false), or the server has dropped it (--max-stored-responses)",
                    param=param, code="response_not_found")


def item_text(content: Any, index: int) -> str:
    """The text of an input item's content: a string or a list of text parts."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise APIError(400, f"input[{index}].content must be a string or a list of content parts",
                       param="input")
    texts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PART_TYPES or not isinstance(part.get("text"), str):
            raise APIError(400, f"input[{index}] has a content part of type {kind!r}; this server "
                           f"takes text parts only ({', '.join(TEXT_PART_TYPES)})", param="input")
        texts.append(part["text"])
    return "".join(texts)


def input_messages(request_input: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    if isinstance(request_input, str):
        return [{"role": "user", "content": request_input}]
    messages = []
    for i, item in enumerate(request_input):
        kind = item.get("type", "message")
        if kind != "message" or "role" not in item:
            raise APIError(400, f"input[{i}] is of type {kind!r}; this server takes messages "
                           "({'role': ..., 'content': ...}) only", param="input")
        if item["role"] not in ("user", "assistant", "system", "developer"):
            raise APIError(400, f"input[{i}].role {item['role']!r} is not one of user, assistant, "
                           "system, developer", param="input")
        # The chat templates know "system"; OpenAI's "developer" is its new name.
        role = "system" if item["role"] == "developer" else item["role"]
        messages.append({"role": role, "content": item_text(item.get("content"), i)})
    if not messages:
        raise APIError(400, "input is an empty list; give a string or at least one message",
                       param="input")
    return messages


def refuse_unsupported(request: ResponsesRequest) -> None:
    if request.tools:
        raise APIError(400, "tools are not supported by this server's /v1/responses yet",
                       param="tools")
    if request.tool_choice not in (None, "none", "auto"):
        raise APIError(400, "tool_choice is not supported (no tools)", param="tool_choice")
    fmt = (request.text or {}).get("format") or {"type": "text"}
    if fmt.get("type", "text") != "text":
        raise APIError(400, "text.format other than {'type': 'text'} (structured output) is not "
                       "supported by this server's /v1/responses yet", param="text")
    if request.background:
        raise APIError(400, "background responses are not supported", param="background")


def usage_json(num_input: int, num_cached: int, num_output: int,
               num_reasoning: int = 0) -> dict[str, Any]:
    return {
        "input_tokens": num_input,
        "input_tokens_details": {"cached_tokens": num_cached},
        "output_tokens": num_output,
        "output_tokens_details": {"reasoning_tokens": num_reasoning},
        "total_tokens": num_input + num_output,
    }


def message_json(message_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def reasoning_json(item_id: str, text: str, status: str) -> dict[str, Any]:
    """A reasoning item (the thinking split out by --reasoning-parser), as vLLM's."""
    return {"id": item_id, "type": "reasoning", "summary": [], "status": status,
            "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None}


class ResponseBuilder:
    """One response's JSON as it grows: the object the stream's events carry and
    the non-streaming answer."""

    def __init__(self, serving: Serving, request: ResponsesRequest, max_tokens: int,
                 prompt: Prompt) -> None:
        self.id = random_id("resp")
        self.message_id = random_id("msg")
        self.reasoning_id = random_id("rs")
        self.created_at = int(time.time())
        self.serving = serving
        self.request = request
        self.max_tokens = max_tokens
        self.answer = AnswerStream(None, serving.reasoning_parser(prompt))
        self.text = ""
        self.reasoning = ""
        self.finish_reason: str | None = None
        self.outputs: OutputAccumulator | None = None  # (set once the request runs)

    def add(self, c: CompletionOutput) -> AnswerDelta:
        """Takes the output's delta; returns its new thinking and text."""
        if c.finish_reason is not None:
            self.finish_reason = c.finish_reason
        part = self.answer.feed(c.text, final=c.finish_reason is not None,
                                num_tokens=len(c.token_ids))
        self.reasoning += part.reasoning or ""
        self.text += part.content or ""
        return part

    @property
    def message_index(self) -> int:
        """The message's place in `output` (after the reasoning item, if any)."""
        return 1 if self.reasoning else 0

    def json(self, status: Literal["in_progress", "completed", "incomplete", "failed"],
             error: dict[str, Any] | None = None) -> dict[str, Any]:
        request = self.request
        done = status in ("completed", "incomplete")
        output = []
        if done:
            if self.reasoning:
                output.append(reasoning_json(self.reasoning_id, self.reasoning, "completed"))
            output.append(message_json(self.message_id, self.text, status))
        return {
            "id": self.id, "object": "response", "created_at": self.created_at,
            "model": self.serving.model_name, "status": status,
            "error": error,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": request.instructions, "metadata": request.metadata,
            "max_output_tokens": request.max_output_tokens,
            "output": output, "parallel_tool_calls": True,
            "previous_response_id": request.previous_response_id,
            "store": request.store, "temperature": request.temperature, "top_p": request.top_p,
            "text": {"format": {"type": "text"}}, "tool_choice": "auto", "tools": [],
            "truncation": "disabled", "user": request.user,
            "usage": self.usage() if done else None,
        }

    def usage(self) -> dict[str, Any]:
        outputs = self.outputs
        assert outputs is not None
        usage = outputs.usage()
        return usage_json(usage.prompt_tokens, outputs.num_cached_tokens.get(0, 0),
                          usage.completion_tokens, self.answer.num_reasoning_tokens)

    def final_status(self) -> Literal["completed", "incomplete"]:
        # Cut by the token limit: OpenAI's "incomplete" with reason max_output_tokens.
        return "incomplete" if self.finish_reason == "length" else "completed"


async def create_response(serving: Serving, store: ResponseStore, request: ResponsesRequest,
                          raw: Request) -> Response:
    serving.check_model(request.model)
    refuse_unsupported(request)
    history: list[dict[str, Any]] = []
    if request.previous_response_id is not None:
        stored = store.get(request.previous_response_id)
        if stored is None:
            raise not_found(request.previous_response_id, "previous_response_id")
        history = stored[1]
    conversation = history + input_messages(request.input)
    # Instructions hold for this response only (OpenAI's rule): they are not
    # carried into the stored conversation.
    system = [{"role": "system", "content": request.instructions}] if request.instructions else []
    try:
        chat = ChatCompletionRequest.model_validate({
            "messages": system + conversation,
            # OpenAI's reasoning.effort: the template's reasoning_effort, as chat's field
            "reasoning_effort": (request.reasoning or {}).get("effort"),
            **{name: v for name in SAMPLING_FIELDS if (v := getattr(request, name)) is not None},
        })
    except ValidationError as e:
        message, param = describe_validation_error(e.errors())
        raise APIError(400, message, param) from e
    prompt = await chat_prompt(serving, chat)
    try:
        max_tokens = serving.max_tokens_for(prompt, request.max_output_tokens, "input")
    except APIError as e:  # named as this endpoint names it
        if e.param != "max_tokens":
            raise
        raise APIError(400, e.message.replace("max_tokens", "max_output_tokens"),
                       param="max_output_tokens") from e
    params = build_sampling_params(chat, max_tokens, None)
    serving.hold_constraint_after_thinking(params, prompt)
    builder = ResponseBuilder(serving, request, max_tokens, prompt)
    streams = await serving.start(builder.id, [prompt], [params], request.priority)
    outputs = builder.outputs = OutputAccumulator(streams)

    def finish() -> dict[str, Any]:
        body = builder.json(builder.final_status())
        if request.store:
            store.put(body, [*conversation, {"role": "assistant", "content": builder.text}])
        return body

    if request.stream:
        return StreamingResponse(_stream(builder, outputs, finish), media_type="text/event-stream")

    async def collect() -> str:
        async for _, _, c in outputs.deltas():
            builder.add(c)
        return json.dumps(finish())

    return await json_answer(raw, collect())


def event(kind: str, seq: int, **fields: Any) -> str:
    """One server-sent event, named by its type as OpenAI's stream names them."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq, **fields})}\n\n"


async def _stream(
    builder: ResponseBuilder,
    outputs: OutputAccumulator,
    finish: Any,
) -> AsyncIterator[str]:
    """The Responses API's event sequence for one text message."""
    seq = 0

    def ev(kind: str, **fields: Any) -> str:
        nonlocal seq
        seq += 1
        return event(kind, seq - 1, **fields)

    thought = {"item_id": builder.reasoning_id, "output_index": 0, "content_index": 0}
    reasoning_open = message_open = False

    def open_message() -> Iterator[str]:
        """The message item begins (after the thinking, if there was any)."""
        nonlocal reasoning_open, message_open
        if reasoning_open:  # the thinking is over
            reasoning_open = False
            yield ev("response.reasoning_text.done", **thought, text=builder.reasoning)
            yield ev("response.output_item.done", output_index=0,
                     item=reasoning_json(builder.reasoning_id, builder.reasoning, "completed"))
        message_open = True
        yield ev("response.output_item.added", output_index=builder.message_index,
                 item=message_json(builder.message_id, "", "in_progress") | {"content": []})
        yield ev("response.content_part.added", **part(),
                 part={"type": "output_text", "text": "", "annotations": [], "logprobs": []})

    def part() -> dict[str, Any]:
        return {"item_id": builder.message_id, "output_index": builder.message_index,
                "content_index": 0}

    yield ev("response.created", response=builder.json("in_progress"))
    yield ev("response.in_progress", response=builder.json("in_progress"))
    try:
        async for _, _, c in outputs.deltas():
            delta = builder.add(c)
            if delta.reasoning and not message_open:
                if not reasoning_open:
                    reasoning_open = True
                    yield ev("response.output_item.added", output_index=0,
                             item=reasoning_json(builder.reasoning_id, "", "in_progress")
                             | {"content": []})
                yield ev("response.reasoning_text.delta", **thought, delta=delta.reasoning)
            if delta.content:
                if not message_open:
                    for opened in open_message():
                        yield opened
                yield ev("response.output_text.delta", **part(), delta=delta.content, logprobs=[])
    except APIError as err:  # (the engine's fault)
        yield ev("response.failed", response=builder.json(
            "failed", error={"code": str(err.code or "server_error"), "message": err.message}))
        return
    finally:
        await outputs.aclose()  # (the client left: abort)
    if not message_open:
        for opened in open_message():
            yield opened
    body = finish()
    status = body["status"]
    yield ev("response.output_text.done", **part(), text=builder.text, logprobs=[])
    yield ev("response.content_part.done", **part(),
             part={"type": "output_text", "text": builder.text, "annotations": [], "logprobs": []})
    yield ev("response.output_item.done", output_index=builder.message_index,
             item=message_json(builder.message_id, builder.text, status))
    yield ev("response.completed" if status == "completed" else "response.incomplete",
             response=body)
