"""The OpenAI-compatible server through real HTTP: the official `openai` client
and httpx against uvicorn on a loopback port, on the default model (float32).

One engine serves two apps built by the factory: `main` (no limits) and
`strict` (API key, served model name, max_queued_requests=2, chat templates
taken from requests). Greedy outputs
are checked against offline generation on the same engine, run before the
server starts."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest

from tests.server_harness import ServerThread, metric_value
from tokenmill import LLM, SamplingParams
from tokenmill.config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.server import build_app

TIMEOUT_S = 60.0
API_KEY = "test-key"
MAX_QUEUED = 2
CONCURRENT_PROMPTS = [
    f"Write one sentence about the number {i} and the color {color}."
    for i, color in enumerate(["red", "blue", "green", "gold"] * 8)
]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
HELLO = "Hello, my name is"


@dataclass
class Served:
    llm: LLM
    engine: AsyncEngine
    main: ServerThread
    strict: ServerThread
    expected: dict[str, Any]

    def client(self, **kwargs: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.main.url + "/v1", api_key="unused",
                             timeout=TIMEOUT_S, max_retries=0, **kwargs)

    def async_client(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.main.url + "/v1", api_key="unused",
                                  timeout=TIMEOUT_S, max_retries=0)


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    llm = LLM(dtype="float32", kv_cache_memory_bytes=256 << 20)
    greedy = SamplingParams(temperature=0, max_tokens=24)
    # The oracle: offline greedy generation on this engine, before the loop owns it.
    expected = {
        "concurrent": [o.outputs[0].text for o in llm.generate(CONCURRENT_PROMPTS, greedy, use_tqdm=False)],
        "hello": llm.generate(HELLO, greedy, use_tqdm=False)[0],
        "chat": llm.chat(CHAT, SamplingParams(temperature=0, max_tokens=32), use_tqdm=False)[0],
    }
    engine = AsyncEngine(llm.engine)
    main = ServerThread(build_app(engine, ServerConfig())).start()
    strict = ServerThread(build_app(engine, ServerConfig(
        api_key=API_KEY, served_model_name="strict-model", max_queued_requests=MAX_QUEUED,
        trust_request_chat_template=True,
    ))).start()
    try:
        yield Served(llm, engine, main, strict, expected)
    finally:
        main.stop()
        strict.stop()
        engine.shutdown()


def long_prompt(seed: int, num_tokens: int = 1500) -> list[int]:
    """A prompt no other test shares (so the prefix cache cannot shorten its prefill)."""
    return [1000 + (seed * 7919 + i * 31) % 20000 for i in range(num_tokens)]


def wait_until_idle(engine: AsyncEngine, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        stats = engine.stats()
        if stats.num_running == 0 and engine.num_waiting_requests() == 0 and stats.kv_cache_usage == 0:
            return
        time.sleep(0.05)
    raise AssertionError(f"the engine did not go idle: {engine.stats()}")


def post_json(url: str, body: Any, **kwargs: Any) -> httpx.Response:
    """POST `body` as JSON with non-ASCII escaped, so it can carry what UTF-8
    cannot (lone surrogates, as any JSON client may send them)."""
    return httpx.post(url, content=json.dumps(body), timeout=TIMEOUT_S,
                      headers={"content-type": "application/json"}, **kwargs)


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert "Traceback" not in response.text
    if status == 503:  # (a full queue, a dead engine: the client may come back)
        assert response.headers.get("retry-after", "").isdigit(), response.headers
    if param is not None:
        assert error["param"] == param, error
    return dict(error)


# ---- happy paths -------------------------------------------------------------------


def test_models_health_and_tokenize(served: Served) -> None:
    models = served.client().models.list()
    (card,) = models.data
    assert card.id == "SmolLM2-135M-Instruct"
    assert httpx.get(served.main.url + "/health", timeout=10).status_code == 200
    with httpx.Client(base_url=served.main.url, timeout=10) as http:
        tokens = http.post("/tokenize", json={"prompt": HELLO}).json()
        assert tokens["count"] == len(tokens["tokens"]) > 0
        assert tokens["max_model_len"] == served.engine.facts.max_model_len
        text = http.post("/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"]
        assert text == HELLO
        chat_tokens = http.post("/tokenize", json={"messages": CHAT}).json()
        assert chat_tokens["tokens"] == served.expected["chat"].prompt_token_ids
        # Special tokens come back too (as vLLM's /detokenize): the round trip is whole.
        chat_text = http.post("/detokenize", json={"tokens": chat_tokens["tokens"]}).json()["prompt"]
        assert "<|im_start|>" in chat_text
        assert http.post("/tokenize", json={"prompt": chat_text, "add_special_tokens": False}).json()[
            "tokens"] == chat_tokens["tokens"]
        assert_error(http.post("/tokenize", json={"messages": []}), 400, "messages")
        assert_error(post_json(served.main.url + "/tokenize", {"prompt": "a\ud800b"}), 400, "prompt")


def test_completion_matches_offline_with_usage(served: Served) -> None:
    hello = served.expected["hello"]
    out = served.client().completions.create(
        model="SmolLM2-135M-Instruct", prompt=HELLO, max_tokens=24, temperature=0
    )
    assert out.choices[0].text == hello.outputs[0].text
    assert out.choices[0].finish_reason == "length"
    assert out.usage is not None
    assert out.usage.prompt_tokens == len(hello.prompt_token_ids)
    assert out.usage.completion_tokens == 24
    assert out.usage.total_tokens == out.usage.prompt_tokens + 24


def test_chat_streaming_and_not_match_offline(served: Served) -> None:
    chat = served.expected["chat"]
    client = served.client()
    out = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=32, temperature=0  # type: ignore[arg-type]
    )
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == chat.outputs[0].text
    assert out.choices[0].finish_reason == chat.outputs[0].finish_reason
    assert out.usage.prompt_tokens == len(chat.prompt_token_ids)
    assert out.usage.completion_tokens == len(chat.outputs[0].token_ids)

    stream = client.chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=32, temperature=0,  # type: ignore[arg-type]
        stream=True, stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat.outputs[0].text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [chat.outputs[0].finish_reason]
    assert not chunks[-1].choices and chunks[-1].usage is not None  # usage on a final chunk
    assert chunks[-1].usage.completion_tokens == len(chat.outputs[0].token_ids)
    assert all(c.usage is None for c in chunks[:-1])
    # A stop string: the final chunk says which, as the non-streamed reply does.
    body = {"messages": CHAT, "max_tokens": 32, "temperature": 0, "stop": [" Paris"]}
    whole = httpx.post(served.main.url + "/v1/chat/completions", json=body, timeout=TIMEOUT_S).json()
    assert whole["choices"][0]["stop_reason"] == " Paris"
    with httpx.stream("POST", served.main.url + "/v1/chat/completions", json={**body, "stream": True},
                      timeout=TIMEOUT_S) as response:
        events = [json.loads(line[6:]) for line in response.iter_lines()
                  if line.startswith("data: {")]
    last = [e for e in events if e["choices"] and e["choices"][0]["finish_reason"]][-1]
    assert (last["choices"][0]["finish_reason"], last["choices"][0]["stop_reason"]) == ("stop", " Paris")


def test_32_concurrent_streams_match_offline_greedy(served: Served) -> None:
    async def one(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, list[str | None], int]:
        stream = await client.completions.create(
            model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=24, temperature=0,
            stream=True, stream_options={"include_usage": True},
        )
        text, finishes, usage = "", [], -1
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
                finishes.append(chunk.choices[0].finish_reason)
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        return text, finishes, usage

    async def all_of_them() -> list[tuple[str, list[str | None], int]]:
        client = served.async_client()
        try:
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, p) for p in CONCURRENT_PROMPTS)), 150
            )
        finally:
            await client.close()

    results = asyncio.run(all_of_them())
    assert len(results) == 32
    for (text, finishes, usage), expected in zip(results, served.expected["concurrent"], strict=True):
        assert text == expected
        assert finishes[-1] in ("length", "stop") and all(f is None for f in finishes[:-1])
        assert usage > 0


def test_completion_logprobs(served: Served) -> None:
    out = served.client().completions.create(
        model="SmolLM2-135M-Instruct", prompt=HELLO, max_tokens=6, temperature=0, logprobs=3
    )
    lp = out.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and lp.top_logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    assert "".join(lp.tokens) == out.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob is not None and logprob <= 0
        assert 1 <= len(top) <= 4
        assert max(top.values()) == pytest.approx(logprob)  # greedy: the chosen one is the top
        assert top[token] == pytest.approx(logprob)
    hello = served.expected["hello"]
    assert out.choices[0].text == served.llm.get_tokenizer().decode(hello.outputs[0].token_ids[:6])


def test_chat_logprobs_not_streamed(served: Served) -> None:
    out = served.client().chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=5, temperature=0,  # type: ignore[arg-type]
        logprobs=True, top_logprobs=2,
    )
    assert out.choices[0].logprobs is not None
    entries = out.choices[0].logprobs.content or []
    assert len(entries) == 5
    assert "".join(e.token for e in entries) == out.choices[0].message.content
    for entry in entries:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)


def test_chat_logprobs_streamed(served: Served) -> None:
    stream = served.client().chat.completions.create(
        model="SmolLM2-135M-Instruct", messages=CHAT, max_tokens=8, temperature=0,  # type: ignore[arg-type]
        logprobs=True, top_logprobs=2, stream=True,
    )
    entries = [e for c in stream if c.choices and c.choices[0].logprobs
               for e in (c.choices[0].logprobs.content or [])]
    assert len(entries) == 8
    for entry in entries:
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)


def test_stop_string(served: Served) -> None:
    full = served.expected["hello"].outputs[0].text
    assert "," in full
    client = served.client()
    out = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=HELLO, max_tokens=24, temperature=0, stop=[","]
    )
    assert out.choices[0].text == full.split(",")[0]
    assert out.choices[0].finish_reason == "stop"
    stream = client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=HELLO, max_tokens=24, temperature=0, stop=",",
        stream=True,
    )
    chunks = [c for c in stream if c.choices]
    assert "".join(c.choices[0].text for c in chunks) == full.split(",")[0]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_n(served: Served) -> None:
    try:
        SamplingParams(n=2)
    except ValueError:
        supported = False
    else:
        supported = True
    body = {"prompt": HELLO, "max_tokens": 8, "n": 2, "temperature": 0.8, "seed": 1}
    response = httpx.post(served.main.url + "/v1/completions", json=body, timeout=TIMEOUT_S)
    if not supported:  # the engine refuses n > 1: a clear 400 naming n
        assert_error(response, 400, param="n")
        return
    assert response.status_code == 200, response.text
    choices = response.json()["choices"]
    assert sorted(c["index"] for c in choices) == [0, 1]
    assert response.json()["usage"]["completion_tokens"] == 16


def test_prompt_forms_and_echo(served: Served) -> None:
    client = served.client()
    hello = served.expected["hello"]
    ids = hello.prompt_token_ids
    greedy: dict[str, Any] = {"model": "SmolLM2-135M-Instruct", "max_tokens": 5, "temperature": 0}
    five = served.llm.get_tokenizer().decode(hello.outputs[0].token_ids[:5])
    two = client.completions.create(prompt=[HELLO, HELLO], **greedy)
    assert [c.index for c in two.choices] == [0, 1]
    assert [c.text for c in two.choices] == [five, five]
    assert client.completions.create(prompt=ids, **greedy).choices[0].text == five
    lists = client.completions.create(prompt=[ids, ids], **greedy)
    assert [c.text for c in lists.choices] == [five, five]
    echoed = client.completions.create(prompt=HELLO, echo=True, **greedy)
    assert echoed.choices[0].text == HELLO + five


# ---- errors ----------------------------------------------------------------------------

BAD_COMPLETIONS = [
    ({"prompt": "hi", "temperature": -1}, "temperature"),
    ({"prompt": "hi", "top_p": 0}, "top_p"),
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ({"prompt": "hi", "max_tokens": 10**6}, "max_tokens"),  # over the context length
    ({"prompt": [10**9]}, "prompt"),  # a token id outside the vocabulary
    ({"prompt": "hi", "stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"prompt": "hi", "response_format": {"type": "json_schema"}}, "response_format"),  # no schema
    ({"prompt": "hi", "response_format": {"type": "xml"}}, "response_format"),
    ({"prompt": "hi", "structured_outputs": {"json": {"type": "foo"}}}, "structured_outputs"),
    ({"prompt": "hi", "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"prompt": "hi", "guided_regex": "a(b"}, "structured_outputs"),  # does not compile
    ({"prompt": "hi", "guided_choice": ["a"], "response_format": {"type": "json_object"}},
     "response_format"),
    ({"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
    ({"prompt": []}, "prompt"),
    ({"prompt": ""}, "prompt"),
    ({"prompt": "hi", "n": 129, "temperature": 1.0}, "n"),  # OpenAI's limit: 128
    ({"prompt": "hi", "suffix": "tail"}, "suffix"),
    ({"prompt": "hi", "echo": True, "logprobs": 21}, "logprobs"),
    ({"prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),
    ({"prompt": "hi", "seed": 2**64}, "seed"),  # past the signed 64-bit range
    ({"prompt": "hi", "seed": -(2**63) - 1}, "seed"),
    ({"prompt": "a lone surrogate \ud800"}, "prompt"),
    ({"prompt": ["fine", "\udc00"]}, "prompt"),
    ({}, "prompt"),
]


@pytest.mark.parametrize(("body", "param"), BAD_COMPLETIONS, ids=[str(b) for b, _ in BAD_COMPLETIONS])
def test_bad_completion_requests_are_400(served: Served, body: dict[str, Any], param: str | None) -> None:
    assert_error(post_json(served.main.url + "/v1/completions", body), 400, param)


def test_bad_chat_requests_are_400(served: Served) -> None:
    url = served.main.url + "/v1/chat/completions"
    assert_error(httpx.post(url, json={"messages": []}, timeout=TIMEOUT_S), 400, "messages")
    assert_error(httpx.post(url, json={"messages": CHAT, "max_tokens": 10**6}, timeout=TIMEOUT_S), 400)
    assert_error(httpx.post(url, json={"messages": CHAT, "top_logprobs": 2}, timeout=TIMEOUT_S), 400)
    assert_error(httpx.post(url, json={"messages": CHAT, "logprobs": True, "top_logprobs": 21},
                            timeout=TIMEOUT_S), 400, "top_logprobs")
    response = httpx.post(url, content=b"{not json", timeout=TIMEOUT_S,
                          headers={"content-type": "application/json"})
    assert "not valid JSON" in assert_error(response, 400)["message"]
    assert response.json()["error"]["param"] is None
    assert_error(httpx.post(url, json={"messages": CHAT, "max_completion_tokens": 0}, timeout=TIMEOUT_S),
                 400, "max_tokens")
    lone = [{"role": "user", "content": "hi \udfff"}]
    assert_error(post_json(url, {"messages": lone}), 400, "messages")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    # tool_choice "auto" (the default with tools) needs --enable-auto-tool-choice (tests/test_tool_calling.py)
    assert_error(httpx.post(url, json={"messages": CHAT, "tools": [tool]}, timeout=TIMEOUT_S), 400, "tool_choice")
    # A template is code the server would run: refused unless the server trusts them.
    templated = {"messages": CHAT, "max_tokens": 2, "chat_template": "{{ messages[0]['content'] }}"}
    assert_error(httpx.post(url, json=templated, timeout=TIMEOUT_S), 400, "chat_template")
    trusting = httpx.post(served.strict.url + "/v1/chat/completions", timeout=TIMEOUT_S,
                          json={**templated, "model": "strict-model"},
                          headers={"Authorization": f"Bearer {API_KEY}"})
    assert trusting.status_code == 200, trusting.text
    assert trusting.json()["usage"]["prompt_tokens"] == len(served.llm.get_tokenizer().encode(
        CHAT[0]["content"], add_special_tokens=False))
    with pytest.raises(openai.BadRequestError):  # the client sees it as OpenAI's error
        served.client().chat.completions.create(
            model="SmolLM2-135M-Instruct", messages=CHAT, temperature=-2  # type: ignore[arg-type]
        )


def test_allowed_token_ids_and_bad_words_reach_the_engine(served: Served) -> None:
    tokenizer = served.llm.get_tokenizer()
    only = tokenizer.encode(" Paris", add_special_tokens=False)[:1]
    body = {"prompt": HELLO, "max_tokens": 3, "temperature": 0, "allowed_token_ids": only}
    out = httpx.post(served.main.url + "/v1/completions", json=body, timeout=TIMEOUT_S).json()
    assert out["choices"][0]["text"] == tokenizer.decode(only * 3)
    first = served.expected["hello"].outputs[0].text.split()[0]
    body = {"prompt": HELLO, "max_tokens": 4, "temperature": 0, "bad_words": [first]}
    out = httpx.post(served.main.url + "/v1/completions", json=body, timeout=TIMEOUT_S).json()
    assert not out["choices"][0]["text"].split() or out["choices"][0]["text"].split()[0] != first


def test_a_refused_prompt_leaves_none_of_its_batch_running(served: Served) -> None:
    # The third prompt is refused after the first two were queued: those are aborted,
    # not left to run their 1000 tokens for nobody.
    wait_until_idle(served.engine)
    body = {"prompt": [[1, 2, 3], [4, 5], [10**9]], "max_tokens": 1000, "ignore_eos": True}
    assert_error(httpx.post(served.main.url + "/v1/completions", json=body, timeout=TIMEOUT_S), 400)
    wait_until_idle(served.engine, timeout_s=5)


def test_unknown_route_is_404(served: Served) -> None:
    assert_error(httpx.get(served.main.url + "/v1/nothing-here", timeout=10), 404)
    wrong_method = httpx.get(served.main.url + "/v1/completions", timeout=10)
    assert_error(wrong_method, 405)
    assert wrong_method.headers["allow"] == "POST"
    assert_error(httpx.post(served.main.url + "/nope", json={}, timeout=10), 404)


def test_api_key(served: Served) -> None:
    url = served.strict.url
    body = {"model": "strict-model", "prompt": "hi", "max_tokens": 2}
    assert_error(httpx.post(url + "/v1/completions", json=body, timeout=10), 401)
    wrong = {"Authorization": "Bearer nope"}
    assert_error(httpx.post(url + "/v1/completions", json=body, headers=wrong, timeout=10), 401)
    assert_error(httpx.get(url + "/v1/models", headers=wrong, timeout=10), 401)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=url + "/v1", api_key="nope", max_retries=0, timeout=10).models.list()
    client = openai.OpenAI(base_url=url + "/v1", api_key=API_KEY, max_retries=0, timeout=TIMEOUT_S)
    assert [m.id for m in client.models.list().data] == ["strict-model"]
    assert client.completions.create(model="strict-model", prompt="hi", max_tokens=2).choices
    assert httpx.get(url + "/health", timeout=10).status_code == 200  # no key for health


def test_engine_fault_is_500_and_the_engine_keeps_serving(served: Served) -> None:
    runner = served.llm.engine.runner
    real_execute = runner.execute
    calls = {"n": 0}

    def fail_once(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected fault: secret internal detail")
        return real_execute(*args, **kwargs)

    runner.execute = fail_once  # type: ignore[method-assign]
    try:
        response = httpx.post(served.main.url + "/v1/completions", timeout=TIMEOUT_S,
                              json={"prompt": HELLO, "max_tokens": 4})
        error = assert_error(response, 500)
        assert "secret" not in response.text
        assert error["type"] == "internal_server_error"
        calls["n"] = 0  # the next request's first step fails too, while streaming
        with httpx.stream("POST", served.main.url + "/v1/completions", timeout=TIMEOUT_S,
                          json={"prompt": HELLO, "max_tokens": 4, "stream": True}) as stream:
            lines = [line for line in stream.iter_lines() if line.startswith("data: ")]
        assert json.loads(lines[0].removeprefix("data: "))["error"]["type"] == "internal_server_error"
        assert lines[-1] == "data: [DONE]"
    finally:
        runner.execute = real_execute  # type: ignore[method-assign]
    wait_until_idle(served.engine)
    out = served.client().completions.create(
        model="SmolLM2-135M-Instruct", prompt=HELLO, max_tokens=24, temperature=0
    )
    assert out.choices[0].text == served.expected["hello"].outputs[0].text
    assert httpx.get(served.main.url + "/health", timeout=10).status_code == 200


def test_async_engine_refusal_surfaces_to_the_caller(served: Served) -> None:
    async def refused() -> None:
        with pytest.raises(ValueError, match="vocabulary"):
            await served.engine.add_request(
                "refused-1", {"prompt_token_ids": [10**9]}, SamplingParams(max_tokens=2)
            )

    asyncio.run(asyncio.wait_for(refused(), 30))


# ---- load, cancellation, admission -------------------------------------------------------


def test_health_and_metrics_answer_during_a_long_prefill(served: Served) -> None:
    wait_until_idle(served.engine)
    ttft_count = "tokenmill:time_to_first_token_seconds_count"
    first_tokens_before = metric_value(httpx.get(served.main.url + "/metrics", timeout=10).text,
                                       ttft_count)
    body = {"prompt": long_prompt(1), "max_tokens": 2, "stream": True}
    latencies: list[float] = []
    probes: list[tuple[float | None, float | None]] = []
    with httpx.Client(base_url=served.main.url, timeout=TIMEOUT_S) as http, http.stream(
        "POST", "/v1/completions", json=body
    ) as stream:
        assert stream.status_code == 200  # accepted: its prefill step is under way
        with httpx.Client(base_url=served.main.url, timeout=5) as probe:
            for _ in range(5):
                start = time.monotonic()
                assert probe.get("/health").status_code == 200
                latencies.append(time.monotonic() - start)
                metrics = probe.get("/metrics").text
                probes.append((metric_value(metrics, "tokenmill:num_requests_running"),
                               metric_value(metrics, ttft_count)))
                time.sleep(0.05)
        data = [line for line in stream.iter_lines() if line.startswith("data: ")]
    assert data[-1] == "data: [DONE]"
    # Every probe saw the request running and no first token yet: the prefill was on.
    assert probes == [(1.0, first_tokens_before)] * 5, probes
    assert max(latencies) < 1.0, latencies


def test_abort_on_disconnect_frees_blocks(served: Served) -> None:
    wait_until_idle(served.engine)
    before = httpx.get(served.main.url + "/metrics", timeout=10).text
    aborted_before = metric_value(before, "tokenmill:request_success_total", finished_reason="abort") or 0
    body = {"prompt": HELLO, "max_tokens": 1000, "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=served.main.url, timeout=TIMEOUT_S) as http, http.stream(
        "POST", "/v1/completions", json=body
    ) as stream:
        seen = 0
        for line in stream.iter_lines():
            seen += line.startswith("data: ")
            if seen >= 3:
                break
        assert served.engine.stats().kv_cache_usage > 0
    # The client is gone: the request is aborted at a step boundary, its blocks freed.
    closed_at = time.monotonic()
    wait_until_idle(served.engine, timeout_s=10)
    assert time.monotonic() - closed_at < 5
    # A non-streaming request whose client gives up is aborted too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(served.main.url + "/v1/completions", timeout=1.0,
                   json={"prompt": HELLO + " Bob", "max_tokens": 1000, "ignore_eos": True})
    wait_until_idle(served.engine, timeout_s=10)
    after = httpx.get(served.main.url + "/metrics", timeout=10).text
    assert metric_value(after, "tokenmill:request_success_total", finished_reason="abort") == aborted_before + 2
    assert metric_value(after, "tokenmill:kv_cache_usage_perc") == 0.0
    assert metric_value(after, "tokenmill:num_requests_running") == 0.0


def test_queue_limit_is_503(served: Served) -> None:
    wait_until_idle(served.engine)
    strict = served.strict.url
    headers = {"Authorization": f"Bearer {API_KEY}"}
    short = {"model": "strict-model", "prompt": "hi", "max_tokens": 2}

    async def scenario() -> tuple[list[int], int]:
        async with httpx.AsyncClient(timeout=TIMEOUT_S) as http:
            # A long prefill keeps the engine busy; requests pile up behind its step.
            async with http.stream("POST", served.main.url + "/v1/completions",
                                   json={"prompt": long_prompt(2), "max_tokens": 1, "stream": True}) as busy:
                assert busy.status_code == 200
                queued = [asyncio.create_task(http.post(strict + "/v1/completions", json=short,
                                                        headers=headers)) for _ in range(MAX_QUEUED)]
                deadline = time.monotonic() + 5
                while served.engine.num_waiting_requests() < MAX_QUEUED:
                    assert time.monotonic() < deadline, "the requests did not queue"
                    await asyncio.sleep(0.01)
                overflow = await http.post(strict + "/v1/completions", json=short, headers=headers)
                assert_error(overflow, 503)
                waiting_metric = metric_value((await http.get(strict + "/metrics")).text,
                                              "tokenmill:num_requests_waiting")
                assert waiting_metric == MAX_QUEUED
                statuses = [r.status_code for r in await asyncio.gather(*queued)]
                async for _ in busy.aiter_lines():
                    pass
            return statuses, overflow.status_code

    statuses, overflow_status = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert statuses == [200] * MAX_QUEUED
    assert overflow_status == 503
    # Each of n samples waits as a request of its own: n over the limit is refused.
    wait_until_idle(served.engine)
    many = {**short, "n": MAX_QUEUED + 1, "temperature": 1.0}
    assert_error(httpx.post(strict + "/v1/completions", json=many, headers=headers, timeout=TIMEOUT_S), 503)
    wait_until_idle(served.engine, timeout_s=5)


def test_metrics_appear_and_move(served: Served) -> None:
    wait_until_idle(served.engine)
    url = served.main.url + "/metrics"
    before = httpx.get(url, timeout=10).text
    names = [
        "tokenmill:num_requests_running", "tokenmill:num_requests_waiting",
        "tokenmill:kv_cache_usage_perc", "tokenmill:prefix_cache_queries_total",
        "tokenmill:prefix_cache_hits_total", "tokenmill:prompt_tokens_total",
        "tokenmill:generation_tokens_total", "tokenmill:num_preemptions_total",
        "tokenmill:time_to_first_token_seconds_count", "tokenmill:inter_token_latency_seconds_count",
        "tokenmill:e2e_request_latency_seconds_count", "tokenmill:request_queue_time_seconds_count",
    ]
    for name in names:
        assert metric_value(before, name) is not None, name
    prompt = "Tell me a short story about a robot who learns to paint."
    for _ in range(2):  # the second time, the prompt's full blocks hit the prefix cache
        served.client().completions.create(
            model="SmolLM2-135M-Instruct", prompt=prompt * 3, max_tokens=5, temperature=0
        )
    after = httpx.get(url, timeout=10).text

    def moved(name: str) -> float:
        return (metric_value(after, name) or 0) - (metric_value(before, name) or 0)

    assert moved("tokenmill:generation_tokens_total") == 10
    assert moved("tokenmill:prompt_tokens_total") > 0
    assert moved("tokenmill:time_to_first_token_seconds_count") == 2
    assert moved("tokenmill:inter_token_latency_seconds_count") == 8
    assert moved("tokenmill:e2e_request_latency_seconds_count") == 2
    assert moved("tokenmill:request_queue_time_seconds_count") == 2
    assert moved("tokenmill:prefix_cache_queries_total") > 0
    assert moved("tokenmill:prefix_cache_hits_total") > 0
    length = "tokenmill:request_success_total"
    assert (metric_value(after, length, finished_reason="length") or 0) - (
        metric_value(before, length, finished_reason="length") or 0) == 2


def test_async_engine_builds_its_engine_on_its_own_thread() -> None:
    # `tokenmill serve` passes a builder, so the model is loaded and run by one
    # thread (one OpenMP pool); a builder that fails raises in the constructor.
    built_on: list[str] = []

    def build() -> LLMEngine:
        built_on.append(threading.current_thread().name)
        return LLM(dtype="float32", kv_cache_memory_bytes=64 << 20).engine

    engine = AsyncEngine(build)
    try:
        assert built_on == ["tokenmill-engine"] and engine.is_running

        async def one() -> str:
            params = SamplingParams(temperature=0, max_tokens=4)
            text = ""
            async for out in await engine.add_request("built-here", HELLO, params):
                text += out.outputs[0].text
            return text

        assert asyncio.run(one())
    finally:
        engine.shutdown()

    def broken() -> LLMEngine:
        raise ValueError("no such model")

    with pytest.raises(ValueError, match="no such model"):
        AsyncEngine(broken)


STREAM_TEXTS = ["", " hello", 'a "quote" \\ back/slash', "tab\tnew\nline\r", "\x00\x01\x1f\x7f",
                "é中文 🙂 \u2028\u2029", "\ufffd", "<|im_end|>", "x" * 300]


@pytest.mark.parametrize("text", STREAM_TEXTS)
def test_stream_chunks_are_the_models_bytes(text: str) -> None:
    """The template's chunks (serving.StreamChunks) are byte for byte what
    sse() of the pydantic models writes (the server's SSE before the template)."""
    from tokenmill.server.protocol import (
        ChatCompletionChunk,
        ChatStreamChoice,
        CompletionChoice,
        CompletionResponse,
        DeltaMessage,
    )
    from tokenmill.server.serving import StreamChunks, sse

    for request_id, model in [("cmpl-0123abc", "default"), ('chat-"x"', "my/model é")]:
        chunks = StreamChunks(request_id, model)
        for index, reason, stop in [(0, None, None), (3, "stop", None), (1, "stop", 42),
                                    (0, "length", "END"), (0, "abort", None)]:
            for _ in range(2):  # `created` is read per chunk: a second may tick between
                want = sse(CompletionResponse(id=request_id, model=model, choices=[CompletionChoice(
                    index=index, text=text, logprobs=None, finish_reason=reason, stop_reason=stop)]))
                got = chunks.completion(index, text, reason, stop)
                if got == want:
                    break
            assert got == want
            content = text or None
            for _ in range(2):
                want = sse(ChatCompletionChunk(id=request_id, model=model, choices=[ChatStreamChoice(
                    index=index, delta=DeltaMessage(content=content), logprobs=None,
                    finish_reason=reason, stop_reason=stop)]))
                got = chunks.chat(index, content, reason, stop)
                if got == want:
                    break
            assert got == want
