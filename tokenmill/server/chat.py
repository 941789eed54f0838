"""POST /v1/chat/completions: the model's chat template, then one request per
choice set, streamed as chat.completion.chunk objects."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from fastapi import Request, Response

from tokenmill.sampling_params import MAX_LOGPROBS
from tokenmill.server.accumulator import OutputAccumulator, json_answer, sse_stream
from tokenmill.server.answer import AnswerStream, whole_answer
from tokenmill.server.errors import APIError
from tokenmill.server.logprobs import prompt_logprobs_field
from tokenmill.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    TokenLogprob,
    TopLogprob,
    random_id,
)
from tokenmill.server.sampling import build_sampling_params
from tokenmill.server.serving import (
    MIN_LOGPROB,
    LogprobEntries,
    Prompt,
    Serving,
    SSEResponse,
    StreamChunks,
    logprob_value,
    sse,
)
from tokenmill.server.templates import ChatTemplateLimitError
from tokenmill.server.tools import (
    ToolPlan,
    constrain,
    finish_reason,
    plan_tools,
    template_tools,
)


def plain_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as the chat template takes them (the tokenizer joins text content
    parts, and refuses other parts, when it applies the template)."""
    return [m.model_dump(exclude_none=True) for m in messages]


def template_kwargs(request: ChatCompletionRequest) -> dict[str, Any]:
    """The template's extra variables: chat_template_kwargs, and reasoning_effort
    (as vLLM passes it) unless chat_template_kwargs sets it."""
    kwargs = dict(request.chat_template_kwargs or {})
    if request.reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", request.reasoning_effort)
    return kwargs


async def chat_prompt(serving: Serving, request: ChatCompletionRequest,
                      plan: ToolPlan | None = None) -> Prompt:
    if request.chat_template is not None and not serving.config.trust_request_chat_template:
        # A template is code the server runs: one line of Jinja can take minutes
        # and gigabytes. As vLLM, only a server started to trust them takes one.
        raise APIError(
            400, "this request brings its own chat_template, and the server does not run "
            "templates from requests; drop it (the model's template is used) or start the "
            "server with --trust-request-chat-template", param="chat_template",
        )
    messages = plain_messages(request.messages)
    template = request.chat_template or serving.config.chat_template  # (None: the model's)
    kwargs = template_kwargs(request)
    try:
        source = template if template is not None else serving.engine.chat_template_source(
            None, plan.tools if plan is not None else None)
        tools = template_tools(plan, messages, source)
        if request.chat_template is None:  # the server's: trusted with the model
            text = await asyncio.to_thread(
                serving.engine.apply_chat_template, messages, request.add_generation_prompt,
                template, tools, kwargs,
            )
        else:  # under limits, in the template worker
            text = await serving.render_request_chat_template(
                request.chat_template, messages, request.add_generation_prompt, tools, kwargs
            )
    except ChatTemplateLimitError as e:
        raise APIError(400, str(e), param="chat_template") from e
    except APIError:
        raise
    except ValueError as e:
        param = "chat_template_kwargs" if str(e).startswith("chat_template_kwargs") else "messages"
        raise APIError(400, str(e), param=param) from e
    except Exception as e:  # a template that fails on these messages (jinja errors)
        raise APIError(400, f"the chat template failed on these messages: {e}", param="messages") from e
    # The template writes the special tokens itself.
    return Prompt(text, await serving.encode(text, "messages", add_special_tokens=False))


def chat_logprobs(serving: Serving, token_ids: list[int], entries: LogprobEntries,
                  top_k: int) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        ranked = sorted(((t, logprob_value(v)) for t, v in entry.items()), key=lambda kv: -kv[1])
        token = serving.token_text(token_id)
        chosen = entry.get(token_id)
        content.append(TokenLogprob(
            token=token, logprob=MIN_LOGPROB if chosen is None else logprob_value(chosen),
            bytes=list(token.encode()),
            top_logprobs=[
                TopLogprob(token=(t := serving.token_text(tid)), logprob=v, bytes=list(t.encode()))
                for tid, v in ranked[:top_k]
            ],
        ))
    return ChatLogprobs(content=content)


async def create_chat_completion(
    serving: Serving, request: ChatCompletionRequest, raw: Request
) -> Response:
    lora_request = serving.lora_for(request.model)
    if request.stream_options is not None and not request.stream:
        raise APIError(400, "stream_options is only allowed with stream=true", param="stream_options")
    if request.stream and request.prompt_logprobs is not None:
        raise APIError(400, "prompt_logprobs is not available with stream=true (as in vLLM); drop one",
                       param="prompt_logprobs")
    if request.top_logprobs is not None and not request.logprobs:
        raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    if request.top_logprobs is not None and not 0 <= request.top_logprobs <= MAX_LOGPROBS:
        raise APIError(400, f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {request.top_logprobs}",
                       param="top_logprobs")
    top_k = (request.top_logprobs or 0) if request.logprobs else None
    plan = plan_tools(request, serving.config)
    prompt = await chat_prompt(serving, request, plan)
    max_tokens = request.max_completion_tokens
    if max_tokens is None:  # (not `or`: a 0 is an error to report, not "unset")
        max_tokens = request.max_tokens
    params = build_sampling_params(request, serving.max_tokens_for(prompt, max_tokens, "messages"), top_k)
    constrain(plan, params)  # (tool_choice "required" or named: the calls' JSON schema)
    serving.hold_constraint_after_thinking(params, prompt)
    request_id = random_id("chatcmpl")
    streams = await serving.start(request_id, [prompt], [params], request.priority, lora_request)
    outputs = OutputAccumulator(streams)
    if request.stream:
        return SSEResponse(sse_stream(_stream(serving, request, request_id, outputs, top_k, plan,
                                              prompt), outputs))
    return await json_answer(raw, _collect(serving, request_id, serving.answer_model(request.model), outputs, params.n, top_k,
                                           request.prompt_logprobs, plan, prompt))


async def _collect(
    serving: Serving,
    request_id: str,
    model: str,
    outputs: OutputAccumulator,
    n: int,
    top_k: int | None,
    prompt_k: int | None = None,
    plan: ToolPlan | None = None,
    prompt: Prompt | None = None,
) -> str:
    choices = {
        j: ChatChoice(index=j, message=ChatResponseMessage(content=""),
                      logprobs=ChatLogprobs(content=[]) if top_k is not None else None)
        for j in range(n)
    }
    async for _, _, c in outputs.deltas():
        choice = choices[c.index]
        choice.message.content = (choice.message.content or "") + c.text
        if top_k is not None and c.logprobs is not None and choice.logprobs is not None:
            new = chat_logprobs(serving, c.token_ids, c.logprobs, top_k)
            if choice.logprobs.content is None:
                choice.logprobs.content = []
            choice.logprobs.content.extend(new.content or [])
        if c.finish_reason is not None:
            choice.finish_reason, choice.stop_reason = c.finish_reason, c.stop_reason
    prompt_logprobs = None
    if prompt_k is not None and 0 in outputs.prompt_logprobs:  # vLLM's extra field
        prompt_logprobs = prompt_logprobs_field(
            serving, outputs.prompt_token_ids[0], outputs.prompt_logprobs[0], prompt_k)
    if plan is not None or serving.config.reasoning_parser is not None:
        for choice in choices.values():  # the thinking and the tool calls in the text
            reasoning = serving.reasoning_parser(prompt) if prompt is not None else None
            choice.message = whole_answer(plan, reasoning, choice.message.content or "")
            if plan is not None:
                choice.finish_reason = finish_reason(plan, bool(choice.message.tool_calls),
                                                     choice.finish_reason)
    return ChatCompletionResponse(
        id=request_id, model=model, choices=list(choices.values()),
        usage=outputs.usage(), prompt_logprobs=prompt_logprobs,
    ).model_dump_json()


async def _stream(
    serving: Serving,
    request: ChatCompletionRequest,
    request_id: str,
    outputs: OutputAccumulator,
    top_k: int | None,
    plan: ToolPlan | None = None,
    prompt: Prompt | None = None,
) -> AsyncGenerator[str, None]:
    model = serving.answer_model(request.model)
    started: set[int] = set()
    answers: dict[int, AnswerStream] = {}
    split = plan is not None or serving.config.reasoning_parser is not None

    chunks = StreamChunks(request_id, model)

    def chunk(choice: ChatStreamChoice) -> str:
        return sse(ChatCompletionChunk(id=request_id, model=model, choices=[choice]))

    async for _, _, c in outputs.deltas():
        if c.index not in started:  # OpenAI's first chunk: the role
            started.add(c.index)
            yield chunk(ChatStreamChoice(
                index=c.index, delta=DeltaMessage(role="assistant", content="")))
        logprobs = None
        if top_k is not None and c.logprobs is not None:
            logprobs = chat_logprobs(serving, c.token_ids, c.logprobs, top_k)
        content, reasoning, tool_calls, reason = c.text or None, None, None, c.finish_reason
        if split:  # thinking, content and tool-call deltas (text held while it may be a tag)
            answer = answers.get(c.index)
            if answer is None:
                answer = answers[c.index] = AnswerStream(
                    plan, serving.reasoning_parser(prompt) if prompt is not None else None)
            part = answer.feed(c.text, final=reason is not None)
            content, reasoning, tool_calls = part.content, part.reasoning, part.tool_calls
            if plan is not None:
                reason = finish_reason(plan, answer.called, reason)
        if tool_calls is None and logprobs is None and reasoning is None and (
                content or reason is not None):
            yield chunks.chat(c.index, content, reason, c.stop_reason)
        elif content or reasoning or tool_calls or logprobs is not None or reason is not None:
            yield chunk(ChatStreamChoice(
                index=c.index, delta=DeltaMessage(content=content, reasoning_content=reasoning,
                                                  tool_calls=tool_calls),
                logprobs=logprobs, finish_reason=reason, stop_reason=c.stop_reason,
            ))
    if request.stream_options is not None and request.stream_options.include_usage:
        yield sse(ChatCompletionChunk(id=request_id, model=model, choices=[],
                                      usage=outputs.usage()))
