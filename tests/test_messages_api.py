"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) driven
by the official `anthropic` SDK against a live server on a tiny random Qwen3
(Qwen3's chat template, --reasoning-parser qwen3): create, stream, thinking
blocks, a tool-use round trip, count_tokens, bad input in Anthropic's error
shape; and every error path, OpenAI's and Anthropic's, fed text that UTF-8
cannot encode in each field it echoes."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import jsonschema
import openai
import pytest

from tests.qwen3_chat import Qwen3Served, serve_qwen3
from tests.server_harness import ServerThread
from tokenmill.config import ServerConfig
from tokenmill.server import build_app

TIMEOUT_S = 120.0
# (sampling fields go in the body: this SDK's create() has no temperature / top_p / top_k)
GREEDY = {"temperature": 0}
HELLO = [{"role": "user", "content": "Hello, who are you?"}]
WEATHER = {
    "name": "get_weather",
    "description": "The weather in a city",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                      "unit": {"enum": ["c", "f"]}},
                     "required": ["city", "unit"], "additionalProperties": False},
}


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Qwen3Served]:
    served = serve_qwen3(tmp_path_factory.mktemp("qwen3-messages"), think_tokens=True)
    try:
        yield served
    finally:
        served.stop()


def model_id(served: Qwen3Served) -> str:
    return str(httpx.get(served.server.url + "/v1/models").json()["data"][0]["id"])


def client(served: Qwen3Served, api_key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=served.server.url, api_key=api_key, timeout=TIMEOUT_S,
                               max_retries=0)


def test_create_is_chat_in_anthropic_shape(served: Qwen3Served) -> None:
    message = client(served).messages.create(model=model_id(served), max_tokens=8, messages=HELLO,
                                             extra_body=GREEDY)
    assert message.type == "message" and message.role == "assistant"
    assert message.id.startswith("msg_")
    assert [block.type for block in message.content] == ["text"]
    assert message.stop_reason in ("max_tokens", "end_turn")
    # The same engine request as chat's: the same greedy text and token counts.
    chat = openai.OpenAI(base_url=served.server.url + "/v1", api_key="x", max_retries=0).chat.completions.create(
        model=model_id(served), messages=HELLO, max_tokens=8, temperature=0)  # type: ignore[arg-type]
    assert message.content[0].text == chat.choices[0].message.content  # type: ignore[union-attr]
    assert chat.usage is not None
    assert message.usage.input_tokens == chat.usage.prompt_tokens
    assert message.usage.output_tokens == chat.usage.completion_tokens
    counted = client(served).messages.count_tokens(model=model_id(served), messages=HELLO)
    assert counted.input_tokens == message.usage.input_tokens


def test_stop_sequences_and_sampling_fields(served: Qwen3Served) -> None:
    base = client(served).messages.create(model=model_id(served), max_tokens=12, messages=HELLO,
                                          extra_body=GREEDY)
    text = base.content[0].text  # type: ignore[union-attr]
    stop = text[len(text) // 2:][:3]
    assert stop.strip(), text
    cut = client(served).messages.create(
        model=model_id(served), max_tokens=12, messages=HELLO, stop_sequences=[stop],
        metadata={"user_id": "u-1"}, system="You are terse.",
        extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 5})
    # (a system prompt changes the answer: only the shape is checked here)
    assert cut.stop_reason in ("stop_sequence", "max_tokens", "end_turn")
    cut = client(served).messages.create(model=model_id(served), max_tokens=12, messages=HELLO,
                                         extra_body=GREEDY, stop_sequences=[stop])
    assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
    assert cut.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]


def stream_events(served: Qwen3Served, **kwargs: Any) -> tuple[list[Any], anthropic.types.Message]:
    with client(served).messages.stream(**kwargs) as stream:
        events = list(stream)
        return events, stream.get_final_message()


def raw_event_names(served: Qwen3Served, body: dict[str, Any]) -> list[str]:
    names = []
    with httpx.stream("POST", served.server.url + "/v1/messages", json={**body, "stream": True},
                      timeout=TIMEOUT_S) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("event: "):
                names.append(line[len("event: "):])
    return names


@pytest.mark.parametrize("open_think", [False, True], ids=["text", "thinking"])
def test_stream_is_the_whole_answer(served: Qwen3Served, open_think: bool) -> None:
    """Streamed, the SDK's final message is the non-streamed one; with the
    template's <think> left open (open_think) the answer is a thinking block."""
    kwargs: dict[str, Any] = {"model": model_id(served), "max_tokens": 10, "messages": HELLO,
                              "extra_body": dict(GREEDY)}
    if open_think:
        kwargs["extra_body"]["chat_template_kwargs"] = {"open_think": True}
    whole = client(served).messages.create(**kwargs)
    _, final = stream_events(served, **kwargs)
    assert final.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})
    assert [b.type for b in whole.content] == (["thinking"] if open_think else ["text"])
    if open_think:
        assert whole.content[0].thinking  # type: ignore[union-attr]
    body = {k: v for k, v in kwargs.items() if k != "extra_body"} | kwargs.get("extra_body", {})
    names = raw_event_names(served, body)
    assert names == ["message_start", "content_block_start", *["content_block_delta"] * (len(names) - 5),
                     "content_block_stop", "message_delta", "message_stop"]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_round_trip(served: Qwen3Served, stream: bool) -> None:
    """A forced tool (thinking off, so the calls' schema holds from the first
    token): a valid tool_use, then its tool_result answered."""
    kwargs: dict[str, Any] = {
        "model": model_id(served), "max_tokens": 150, "messages": HELLO, "extra_body": GREEDY,
        "tools": [WEATHER], "tool_choice": {"type": "tool", "name": "get_weather"},
        "thinking": {"type": "disabled"}}
    if stream:
        events, message = stream_events(served, **kwargs)
        assert any(getattr(e, "type", "") == "input_json" for e in events)
    else:
        message = client(served).messages.create(**kwargs)
    assert message.stop_reason == "tool_use"
    calls = [b for b in message.content if b.type == "tool_use"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].id.startswith("toolu_")
    jsonschema.validate(calls[0].input, WEATHER["input_schema"])

    history = [*HELLO, {"role": "assistant", "content": [b.model_dump() for b in message.content]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": calls[0].id,
                                             "content": "12 degrees, dry"}]}]
    answer = client(served).messages.create(model=model_id(served), max_tokens=6,
                                            messages=history, tools=[WEATHER], extra_body=GREEDY,
                                            tool_choice={"type": "none"})
    assert answer.stop_reason in ("max_tokens", "end_turn")
    counted = client(served).messages.count_tokens(model=model_id(served), messages=history,
                                                   tools=[WEATHER], tool_choice={"type": "none"})
    assert counted.input_tokens == answer.usage.input_tokens


def assert_anthropic_error(response: httpx.Response, status: int, error_type: str, *words: str) -> None:
    assert response.status_code == status, response.text
    body = response.json()
    assert body["type"] == "error" and body["error"]["type"] == error_type, body
    for word in words:
        assert word in body["error"]["message"], body


def test_bad_input_is_4xx_in_anthropic_shape(served: Qwen3Served) -> None:
    url = served.server.url + "/v1/messages"

    def post(body: dict[str, Any], path: str = "") -> httpx.Response:
        return httpx.post(url + path, json={"max_tokens": 4, "messages": HELLO, **body}, timeout=TIMEOUT_S)

    stray = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}]
    assert_anthropic_error(post({"messages": stray}), 400, "invalid_request_error", "toolu_x", "tool_use")
    assert_anthropic_error(post({"messages": []}), 400, "invalid_request_error", "messages")
    assert_anthropic_error(post({"max_tokens": None}), 400, "invalid_request_error", "max_tokens")
    assert_anthropic_error(post({"max_tokens": 10**6}), 400, "invalid_request_error", "context length")
    assert_anthropic_error(post({"model": "claude-nope"}), 404, "not_found_error", "claude-nope")
    assert_anthropic_error(post({"messages": [{"role": "robot", "content": "hi"}]}), 400,
                           "invalid_request_error", "role")
    assert_anthropic_error(post({"messages": [{"role": "user", "content": [
        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}]}),
        400, "invalid_request_error", "image")
    assert_anthropic_error(post({"messages": [*HELLO, {"role": "assistant", "content": "Sure"}]}),
                           400, "invalid_request_error", "prefill")
    assert_anthropic_error(post({"tools": [{"name": "web_search", "type": "web_search_20250305"}]}),
                           400, "invalid_request_error", "tools[0]")
    assert_anthropic_error(post({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}),
                           400, "invalid_request_error", "nope")
    assert_anthropic_error(post({"thinking": {"type": "sometimes"}}), 400, "invalid_request_error",
                           "thinking")
    assert_anthropic_error(httpx.post(url + "/count_tokens", json={"messages": stray},
                                      timeout=TIMEOUT_S), 400, "invalid_request_error", "toolu_x")
    assert_anthropic_error(httpx.post(url, content=b"{not json", timeout=TIMEOUT_S,
                                      headers={"content-type": "application/json"}),
                           400, "invalid_request_error", "JSON")
    assert_anthropic_error(httpx.post(url, content=b"x" * (9 << 20), timeout=TIMEOUT_S), 413,
                           "request_too_large")
    # The SDK raises its own error classes from these.
    with pytest.raises(anthropic.BadRequestError):
        client(served).messages.create(model=model_id(served), max_tokens=4, messages=stray)  # type: ignore[arg-type]
    with pytest.raises(anthropic.NotFoundError):
        client(served).messages.create(model="claude-nope", max_tokens=4, messages=HELLO)  # type: ignore[arg-type]
    # ... and the server keeps serving.
    assert client(served).messages.create(model=model_id(served), max_tokens=2, messages=HELLO).content


def test_api_key_as_anthropic_sends_it(served: Qwen3Served) -> None:
    keyed = ServerThread(build_app(served.engine, ServerConfig(api_key="sk-test"))).start()
    try:
        sdk = anthropic.Anthropic(base_url=keyed.url, api_key="sk-test", max_retries=0, timeout=TIMEOUT_S)
        assert sdk.messages.count_tokens(model=model_id(served), messages=HELLO).input_tokens > 0  # type: ignore[arg-type]
        wrong = anthropic.Anthropic(base_url=keyed.url, api_key="sk-wrong", max_retries=0)
        with pytest.raises(anthropic.AuthenticationError) as raised:
            wrong.messages.create(model=model_id(served), max_tokens=2, messages=HELLO)  # type: ignore[arg-type]
        assert raised.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
        # x-api-key is Anthropic's header: OpenAI's routes still want Authorization.
        assert httpx.get(keyed.url + "/v1/models", headers={"x-api-key": "sk-test"}).status_code == 401
    finally:
        keyed.stop()


# ---- errors that echo the client's text ---------------------------------------------------------

BAD = "\ud800"  # a lone surrogate: valid in JSON text, not encodable in UTF-8


def echo_cases() -> list[tuple[str, str, dict[str, Any] | None]]:
    """(method, path, body) for every error path that repeats a field the client sent."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    message = {"messages": HELLO, "max_tokens": 2}
    stray = [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": BAD, "content": "1"}]}]
    return [
        ("POST", "/v1/chat/completions", {**chat, "model": BAD}),
        ("POST", "/v1/completions", {"prompt": "hi", "model": BAD}),
        ("POST", "/v1/responses", {"input": "hi", "model": BAD}),
        ("POST", "/v1/responses", {"input": "hi", "previous_response_id": BAD}),
        ("GET", "/v1/responses/%ED%A0%80", None),  # (a URL carries bytes: the surrogate's)
        ("POST", "/tokenize", {"prompt": "hi", "model": BAD}),
        ("POST", "/detokenize", {"tokens": [1], "model": BAD}),
        ("POST", "/v1/chat/completions", {**chat, "logit_bias": {BAD: "high"}}),
        ("POST", "/v1/chat/completions", {**chat, "structured_outputs": {BAD: 1}}),
        ("POST", "/v1/chat/completions", {**chat, "chat_template_kwargs": {BAD: 1}}),
        ("POST", "/v1/chat/completions", {**chat, "tools": [{"type": "function", "function": {
            "name": "f"}}], "tool_choice": {"type": "function", "function": {"name": BAD}}}),
        ("POST", "/v1/chat/completions", {**chat, "response_format": {"type": BAD}}),
        ("POST", "/v1/messages", {**message, "model": BAD}),
        ("POST", "/v1/messages", {**message, "messages": stray}),
        ("POST", "/v1/messages", {**message, "tools": [WEATHER], "tool_choice": {"type": "tool", "name": BAD}}),
        ("POST", "/v1/messages", {**message, "messages": [{"role": BAD, "content": "hi"}]}),
        ("POST", "/v1/messages", {**message, "messages": [{"role": "user", "content": [{"type": BAD}]}]}),
        ("POST", "/v1/messages/count_tokens", {"messages": HELLO, "model": BAD}),
        ("POST", "/v1/messages/count_tokens", {"messages": stray}),
        ("POST", "/v1/embeddings", {"input": "hi", "model": BAD}),
        ("POST", "/v1/embeddings", {"input": "hi", "encoding_format": BAD}),
        ("POST", "/score", {"text_1": "a", "text_2": "b", "model": BAD}),
        ("POST", "/v1/rerank", {"query": "a", "documents": ["b"], "model": BAD}),
        ("POST", "/v2/rerank", {"query": "a", "documents": ["b"], BAD: 1, "top_n": BAD}),
    ]


def test_errors_encode_what_they_echo(served: Qwen3Served) -> None:
    for method, path, body in echo_cases():
        content = None if body is None else json.dumps(body).encode()  # (ASCII: "\ud800" escaped)
        response = httpx.request(method, served.server.url + path, content=content, timeout=TIMEOUT_S,
                                 headers={"content-type": "application/json"})
        assert 400 <= response.status_code < 500, (path, body, response.status_code, response.text)
        error = response.json()
        if body is not None and body.get("model") == BAD:  # (echoed as sent)
            assert BAD in json.dumps(error, ensure_ascii=False), error
        if path.startswith("/v1/messages"):
            assert error["type"] == "error" and error["error"]["type"].endswith("_error"), error
        else:
            assert set(error["error"]) == {"message", "type", "param", "code"}, error
    assert httpx.post(served.server.url + "/v1/chat/completions", timeout=TIMEOUT_S, json={
        "messages": HELLO, "max_tokens": 1}).status_code == 200
