"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API,
as the Anthropic SDKs and Claude Code call it.

A request is turned into a chat completion request (system, content blocks,
tools and tool_choice, stop_sequences, sampling fields, `thinking` as the
template's enable_thinking) and runs as chat runs: the chat template
(chat.chat_prompt), tool planning (tools.py), the engine client and the output
accumulator; each choice is read by answer.AnswerStream (thinking, text, tool
calls). What is Anthropic's is only the shape: content blocks, stop reasons,
the stream's events (message_start, content_block_start / delta / stop,
message_delta, message_stop) and errors ({"type": "error", "error": {...}},
errors.py, chosen by the path).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request, Response
from pydantic import Field, StrictBool, StrictFloat, StrictInt, ValidationError

from tokenmill.server.accumulator import OutputAccumulator, json_answer, sse_stream
from tokenmill.server.answer import AnswerStream, whole_answer
from tokenmill.server.chat import chat_prompt
from tokenmill.server.errors import (
    INTERNAL_ERROR_MESSAGE,
    APIError,
    anthropic_error_dict,
    describe_validation_error,
)
from tokenmill.server.protocol import ChatCompletionRequest, ChatResponseMessage, LenientRequest
from tokenmill.server.sampling import build_sampling_params
from tokenmill.server.serving import Prompt, Serving, SSEResponse
from tokenmill.server.tools import ToolPlan, constrain, plan_tools


class CountTokensRequest(LenientRequest):
    """The fields that make a Messages prompt (count_tokens takes only these)."""

    model: str | None = None
    messages: list[Any] = Field(min_length=1)
    system: str | list[Any] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's extra, as on chat


class MessagesRequest(CountTokensRequest):
    max_tokens: StrictInt = Field(ge=1)
    stop_sequences: list[str] | None = None
    stream: StrictBool = False
    temperature: StrictFloat | None = None
    top_p: StrictFloat | None = None
    top_k: StrictInt | None = None
    metadata: dict[str, Any] | None = None


def anthropic_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- the request, as chat's ---------------------------------------------------------------


def _bad(message: str, param: str = "messages") -> APIError:
    return APIError(400, message, param=param)


def _text_of(blocks: Any, where: str) -> str:
    """A string, or a list of text blocks, as one string."""
    if isinstance(blocks, str):
        return blocks
    if not isinstance(blocks, list):
        raise _bad(f"{where} must be a string or a list of text blocks")
    texts = []
    for j, block in enumerate(blocks):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(
                block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise _bad(f"{where}[{j}] is a {kind!r} block; only text blocks are supported here")
        texts.append(block["text"])
    return "".join(texts)


def _blocks(message: dict[str, Any], i: int) -> list[dict[str, Any]]:
    content = message.get("content")
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _bad(f"messages[{i}].content must be a string or a list of content blocks")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise _bad(f"messages[{i}].content[{j}] must be a content block with a 'type'")
    return content


def _assistant_message(blocks: list[dict[str, Any]], i: int) -> dict[str, Any]:
    texts, thinking, calls = [], [], []
    for j, block in enumerate(blocks):
        kind, where = block["type"], f"messages[{i}].content[{j}]"
        if kind == "text":
            texts.append(_text_of([block], where))
        elif kind in ("thinking", "redacted_thinking"):
            if isinstance(block.get("thinking"), str):
                thinking.append(block["thinking"])
        elif kind == "tool_use":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise _bad(f"{where}: a tool_use block needs a string 'id' and 'name'")
            if not isinstance(block.get("input", {}), dict):
                raise _bad(f"{where}: a tool_use block's 'input' must be an object")
            calls.append({"id": block["id"], "type": "function", "function": {
                "name": block["name"], "arguments": json.dumps(block.get("input", {}))}})
        else:
            raise _bad(f"{where} is a {kind!r} block; an assistant message takes text, "
                       "thinking and tool_use blocks")
    message: dict[str, Any] = {"role": "assistant", "content": "".join(texts)}
    if thinking:  # (templates that show past thinking read reasoning_content)
        message["reasoning_content"] = "".join(thinking)
    if calls:
        message["tool_calls"] = calls
    return message


def _user_messages(blocks: list[dict[str, Any]], i: int, open_calls: set[str]) -> list[dict[str, Any]]:
    """A user message's tool results (each a tool message, answering a tool_use
    of the assistant message before it) and its text."""
    results, texts = [], []
    for j, block in enumerate(blocks):
        kind, where = block["type"], f"messages[{i}].content[{j}]"
        if kind == "text":
            texts.append(_text_of([block], where))
        elif kind == "tool_result":
            call_id = block.get("tool_use_id")
            if not isinstance(call_id, str):
                raise _bad(f"{where}: a tool_result block needs a string 'tool_use_id'")
            if call_id not in open_calls:
                raise _bad(f"{where}: tool_result's tool_use_id {call_id!r} answers no tool_use "
                           "block of the assistant message just before it; each tool_result must "
                           "follow the assistant message that has its tool_use")
            open_calls.discard(call_id)
            content = block.get("content", "")
            text = _text_of(content, f"{where}.content") if content is not None else ""
            if block.get("is_error") is True:
                text = f"Error: {text}"
            results.append({"role": "tool", "tool_call_id": call_id, "content": text})
        else:
            raise _bad(f"{where} is a {kind!r} block; this server takes text, tool_use, "
                       "tool_result and thinking blocks")
    return results + ([{"role": "user", "content": "".join(texts)}] if texts else [])


def chat_messages(request: CountTokensRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    if request.system is not None:
        system = _text_of(request.system, "system")
        if system:
            messages.append({"role": "system", "content": system})
    open_calls: set[str] = set()  # the previous assistant message's tool_use ids
    for i, message in enumerate(request.messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise _bad(f"messages[{i}] must be {{'role': 'user' or 'assistant', 'content': ...}}")
        blocks = _blocks(message, i)
        if message["role"] == "assistant":
            converted = _assistant_message(blocks, i)
            messages.append(converted)
            open_calls = {c["id"] for c in converted.get("tool_calls", [])}
        else:
            messages += _user_messages(blocks, i, open_calls)
            open_calls = set()
    if request.messages[-1].get("role") == "assistant":
        raise _bad("the last message is the assistant's: continuing it (prefill) is not "
                   "supported; end with a user message")
    return messages


def chat_tools(tools: list[Any] | None) -> list[dict[str, Any]] | None:
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if (not isinstance(tool, dict) or not isinstance(tool.get("name"), str)
                or not isinstance(tool.get("input_schema"), dict)):
            raise _bad(f"tools[{i}] must be {{'name': ..., 'description': ..., 'input_schema': "
                       "{...}}; server tools are not supported", param="tools")
        function = {"name": tool["name"], "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            function["description"] = tool["description"]
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: dict[str, Any] | None) -> tuple[Any, bool | None]:
    """Anthropic's tool_choice as chat's tool_choice and parallel_tool_calls."""
    if choice is None:
        return None, None
    parallel = None if not choice.get("disable_parallel_tool_use") else False
    kind = choice.get("type")
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", parallel
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise _bad("tool_choice must be {'type': 'auto'}, {'type': 'any'}, {'type': 'none'} or "
               "{'type': 'tool', 'name': ...}", param="tool_choice")


def template_kwargs(request: CountTokensRequest) -> dict[str, Any] | None:
    """`thinking` as the template's enable_thinking (Qwen3's switch), under what
    chat_template_kwargs says."""
    kwargs = dict(request.chat_template_kwargs or {})
    if request.thinking is not None:
        kind = request.thinking.get("type")
        if kind not in ("enabled", "disabled"):
            raise _bad("thinking must be {'type': 'enabled', 'budget_tokens': N} or "
                       "{'type': 'disabled'}", param="thinking")
        kwargs.setdefault("enable_thinking", kind == "enabled")
    return kwargs or None


def chat_request(request: CountTokensRequest) -> ChatCompletionRequest:
    tool_choice, parallel = chat_tool_choice(request.tool_choice)
    body: dict[str, Any] = {
        "messages": chat_messages(request), "tools": chat_tools(request.tools),
        "tool_choice": tool_choice, "parallel_tool_calls": parallel,
        "chat_template_kwargs": template_kwargs(request),
    }
    if isinstance(request, MessagesRequest):
        user = (request.metadata or {}).get("user_id")
        body |= {"max_tokens": request.max_tokens, "stop": request.stop_sequences,
                 "temperature": request.temperature, "top_p": request.top_p,
                 "top_k": request.top_k, "user": user if isinstance(user, str) else None}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        message, param = describe_validation_error(e.errors())
        raise APIError(400, message, param) from e


async def _prompt(serving: Serving, request: CountTokensRequest) -> tuple[
        ChatCompletionRequest, ToolPlan | None, Prompt]:
    serving.check_model(request.model)
    chat = chat_request(request)
    serving.apply_generation_defaults(chat)
    plan = plan_tools(chat, serving.config)
    return chat, plan, await chat_prompt(serving, chat, plan)


async def count_tokens(serving: Serving, request: CountTokensRequest) -> dict[str, int]:
    _, _, prompt = await _prompt(serving, request)
    return {"input_tokens": len(prompt.token_ids)}


# ---- the answer --------------------------------------------------------------------------


def stop_reason(finish_reason: str | None, matched: int | str | None,
                called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) in Anthropic's words."""
    if finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def _tool_input(arguments: str) -> dict[str, Any]:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:  # (cut short by max_tokens)
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(message: ChatResponseMessage) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if message.reasoning_content:
        blocks.append({"type": "thinking", "thinking": message.reasoning_content, "signature": ""})
    if message.content or not (blocks or message.tool_calls):
        blocks.append({"type": "text", "text": message.content or ""})
    for call in message.tool_calls:
        blocks.append({"type": "tool_use", "id": anthropic_id("toolu"), "name": call.function.name,
                       "input": _tool_input(call.function.arguments)})
    return blocks


def message_json(message_id: str, model: str, blocks: list[dict[str, Any]], reason: str | None,
                 sequence: str | None, num_input: int, num_output: int) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model,
            "content": blocks, "stop_reason": reason, "stop_sequence": sequence,
            "usage": {"input_tokens": num_input, "output_tokens": num_output}}


async def create_message(serving: Serving, request: MessagesRequest, raw: Request) -> Response:
    chat, plan, prompt = await _prompt(serving, request)
    params = build_sampling_params(chat, serving.max_tokens_for(prompt, chat.max_tokens, "messages"),
                                   None)
    constrain(plan, params)
    serving.hold_constraint_after_thinking(params, prompt)
    message_id = anthropic_id("msg")
    streams = await serving.start(message_id, [prompt], [params], chat.priority)
    outputs = OutputAccumulator(streams)
    if request.stream:
        return SSEResponse(
            sse_stream(_stream(serving, message_id, outputs, plan, prompt), outputs,
                       error_event=_error_event, done=""),
            fault_end=_error_event(APIError(500, INTERNAL_ERROR_MESSAGE)))
    return await json_answer(raw, _collect(serving, message_id, outputs, plan, prompt))


async def _collect(serving: Serving, message_id: str, outputs: OutputAccumulator,
                   plan: ToolPlan | None, prompt: Prompt) -> str:
    text, finish, matched = "", None, None
    async for _, _, c in outputs.deltas():
        text += c.text
        if c.finish_reason is not None:
            finish, matched = c.finish_reason, c.stop_reason
    message = whole_answer(plan, serving.reasoning_parser(prompt), text)
    reason, sequence = stop_reason(finish, matched, bool(message.tool_calls))
    usage = outputs.usage()
    return json.dumps(message_json(message_id, serving.model_name, content_blocks(message), reason,
                                   sequence, usage.prompt_tokens, usage.completion_tokens))


def event(kind: str, data: dict[str, Any]) -> str:
    """One of Anthropic's server-sent events: its type is the event's name."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n"


def _error_event(e: APIError) -> str:
    return event("error", {"error": anthropic_error_dict(e.status_code, e.message)["error"]})


async def _stream(serving: Serving, message_id: str, outputs: OutputAccumulator,
                  plan: ToolPlan | None, prompt: Prompt) -> AsyncGenerator[str, None]:
    """Anthropic's event sequence: one content block at a time (thinking, text,
    tool_use), each started, filled with deltas and stopped before the next."""
    yield event("message_start", {"message": message_json(
        message_id, serving.model_name, [], None, None, len(prompt.token_ids), 0)})
    answer = AnswerStream(plan, serving.reasoning_parser(prompt))
    index, kind = -1, None  # the open block
    finish, matched = None, None

    def start(new_kind: str, block: dict[str, Any]) -> list[str]:
        nonlocal index, kind
        events: list[str] = [event("content_block_stop", {"index": index})] if kind is not None else []
        index, kind = index + 1, new_kind
        return [*events, event("content_block_start", {"index": index, "content_block": block})]

    async for _, _, c in outputs.deltas():
        if c.finish_reason is not None:
            finish, matched = c.finish_reason, c.stop_reason
        part = answer.feed(c.text, final=c.finish_reason is not None)
        events = []
        if part.reasoning:
            if kind != "thinking":
                events += start("thinking", {"type": "thinking", "thinking": "", "signature": ""})
            events.append(event("content_block_delta", {"index": index, "delta": {
                "type": "thinking_delta", "thinking": part.reasoning}}))
        if part.content:
            if kind != "text":
                events += start("text", {"type": "text", "text": ""})
            events.append(event("content_block_delta", {"index": index, "delta": {
                "type": "text_delta", "text": part.content}}))
        for call in part.tool_calls or []:
            function = call.function
            if call.id is not None and function is not None and function.name is not None:
                events += start("tool_use", {"type": "tool_use", "id": anthropic_id("toolu"),
                                             "name": function.name, "input": {}})
            if function is not None and function.arguments and kind == "tool_use":
                events.append(event("content_block_delta", {"index": index, "delta": {
                    "type": "input_json_delta", "partial_json": function.arguments}}))
        for e in events:
            yield e
    if kind is None:  # (an empty answer: one empty text block, as Anthropic's)
        for e in start("text", {"type": "text", "text": ""}):
            yield e
    yield event("content_block_stop", {"index": index})
    reason, sequence = stop_reason(finish, matched, answer.called)
    yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                  "usage": {"output_tokens": outputs.num_completion_tokens}})
    yield event("message_stop", {})
