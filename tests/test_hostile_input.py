"""`tokenmill serve` as a process, under hostile input through real HTTP: bodies
over the limit (413), headers over it (431) and a broken request line (400), all
in OpenAI's JSON shape; 10 MB prompts refused before tokenizing, in under a
second, with the server's memory back where it was after a storm of them; types
that vLLM's models would coerce refused as 400s naming the field; /tokenize and
/detokenize bounded and behind the API key."""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from fastapi import FastAPI

from tests.server_harness import HOST, Server, ServerThread, start_server
from tests.test_server_limits import reset_peak_rss, status_bytes, stop_server
from tokenmill.server.app import APIKeyCheck

API_KEY = "hostile-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
BODY_LIMIT = 32 << 20  # above the 10 MB prompts, so they reach the length check
BIG = 10_000_000  # characters of a hostile prompt
REFUSE_DEADLINE_S = 1.0
RSS_GROWTH_LIMIT = 100 << 20
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    served = start_server(tmp_path_factory.mktemp("hostile"), "--api-key", API_KEY,
                          "--max-request-body-bytes", str(BODY_LIMIT))
    try:
        # Warm up: the first request pays one-time costs (the tokenizer's bound).
        warm = httpx.post(served.url + "/v1/completions", headers=AUTH, timeout=60,
                          json={"prompt": "Hi", "max_tokens": 1})
        assert warm.status_code == 200, warm.text
        yield served
    finally:
        stop_server(served)


def post(server: Server, path: str, body: Any, timeout: float = 60) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=AUTH, timeout=timeout)


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    error: dict[str, Any] = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if param is not None:
        assert error["param"] == param, error
    return error


def assert_serving(server: Server) -> None:
    response = post(server, "/v1/completions", {"prompt": "The capital of France is",
                                                "max_tokens": 3, "temperature": 0})
    assert response.status_code == 200, response.text


# ---- sizes ---------------------------------------------------------------------------


def test_a_body_over_the_limit_is_a_413_before_it_is_read(server: Server) -> None:
    big = b'{"prompt": "' + b"a" * (BODY_LIMIT + 1) + b'"}'
    start = time.monotonic()
    response = httpx.post(server.url + "/v1/completions", content=big, timeout=60,
                          headers={**AUTH, "Content-Type": "application/json"})
    error = assert_error(response, 413)
    assert error["code"] == "request_too_large" and "--max-request-body-bytes" in error["message"]
    assert time.monotonic() - start < 10

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it streams in
        yield b'{"prompt": "'
        for _ in range(BODY_LIMIT // (1 << 20) + 2):
            yield b"a" * (1 << 20)
        yield b'"}'

    chunked = httpx.post(server.url + "/v1/completions", content=chunks(), timeout=60,
                         headers={**AUTH, "Content-Type": "application/json"})
    assert_error(chunked, 413)
    assert_serving(server)


def test_headers_over_the_limit_are_a_431_in_json(server: Server) -> None:
    for size in (100_000, 2_000_000):  # read whole, and past h11's buffer
        response = httpx.get(server.url + "/health", headers={"X-Big": "a" * size}, timeout=30)
        error = assert_error(response, 431)
        assert error["code"] == "request_header_fields_too_large", error
    assert httpx.get(server.url + "/health", headers={"X-Small": "a" * 1000}).status_code == 200


def test_a_broken_request_line_is_a_400_in_json(server: Server) -> None:
    port = int(server.url.rsplit(":", 1)[1])
    with socket.create_connection((HOST, port), timeout=10) as sock:
        sock.sendall(b"NOT AN HTTP REQUEST\r\n\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), reply
    error = json.loads(body)["error"]
    assert error["code"] == "invalid_http_request" and error["type"] == "invalid_request_error"


# ---- prompts far over the context ----------------------------------------------------


def rss_while(server: Server, send: Any) -> tuple[Any, float, int, int]:
    """(send()'s result, seconds, RSS before, peak RSS) of the server process."""
    pid = server.process.pid
    before = status_bytes(pid, "VmRSS")
    exact = reset_peak_rss(pid)
    start = time.monotonic()
    result = send()
    elapsed = time.monotonic() - start
    peak = status_bytes(pid, "VmHWM") if exact else status_bytes(pid, "VmRSS")
    return result, elapsed, before, peak


@pytest.mark.parametrize(("path", "field"), [
    ("/v1/completions", "prompt"), ("/v1/chat/completions", "messages"), ("/tokenize", "prompt"),
])
def test_a_10mb_prompt_is_refused_fast_and_small(server: Server, path: str, field: str) -> None:
    text = "All work and no play makes Jack a dull boy. " * (BIG // 44)
    body = ({"messages": [{"role": "user", "content": text}], "max_tokens": 5}
            if field == "messages" else {"prompt": text, "max_tokens": 5})
    if path == "/tokenize":
        del body["max_tokens"]
    payload = json.dumps(body).encode()
    response, elapsed, before, peak = rss_while(server, lambda: httpx.post(
        server.url + path, content=payload, timeout=60,
        headers={**AUTH, "Content-Type": "application/json"}))
    error = assert_error(response, 400, field)
    assert "maximum context length" in error["message"], error
    assert elapsed < REFUSE_DEADLINE_S, elapsed
    assert peak - before < RSS_GROWTH_LIMIT, (before >> 20, peak >> 20)
    print(f"{path}: 400 in {elapsed * 1000:.0f} ms; RSS {before >> 20} -> peak {peak >> 20} MiB")


def test_ten_10mb_prompts_at_once_leave_the_server_serving_and_memory_back(server: Server) -> None:
    payload = json.dumps({"prompt": "x" * BIG, "max_tokens": 5}).encode()
    pid = server.process.pid
    before = status_bytes(pid, "VmRSS")
    statuses: list[int] = []

    def send() -> None:
        response = httpx.post(server.url + "/v1/completions", content=payload, timeout=120,
                              headers={**AUTH, "Content-Type": "application/json"})
        statuses.append(response.status_code)

    threads = [threading.Thread(target=send) for _ in range(10)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert statuses == [400] * 10, statuses
    assert_serving(server)
    deadline = time.monotonic() + 10  # the give-back runs after the last big request
    while (after := status_bytes(pid, "VmRSS")) > before * 1.1 and time.monotonic() < deadline:
        time.sleep(0.2)
    print(f"10 x 10 MB at once: RSS {before >> 20} -> {after >> 20} MiB")
    assert after <= before * 1.1, (before >> 20, after >> 20)


def test_detokenize_is_bounded_by_the_context(server: Server) -> None:
    models = httpx.get(server.url + "/v1/models", headers=AUTH, timeout=10).json()
    max_len = models["data"][0]["max_model_len"]
    assert_error(post(server, "/detokenize", {"tokens": [1] * (max_len + 1)}), 400, "tokens")
    assert post(server, "/detokenize", {"tokens": [1] * 4}).status_code == 200


# ---- strict types ----------------------------------------------------------------------


COMPLETION = {"prompt": "Hello", "max_tokens": 2}
CHAT_BODY = {"messages": CHAT, "max_tokens": 2}


@pytest.mark.parametrize(("path", "base", "field", "value"), [
    ("/v1/completions", COMPLETION, "max_tokens", "5"),
    ("/v1/completions", COMPLETION, "max_tokens", True),
    ("/v1/completions", COMPLETION, "max_tokens", 5.0),
    ("/v1/completions", COMPLETION, "n", "2"),
    ("/v1/completions", COMPLETION, "stream", "yes"),
    ("/v1/completions", COMPLETION, "stream", 1),
    ("/v1/completions", COMPLETION, "logprobs", "1"),
    ("/v1/completions", COMPLETION, "prompt", [True, False]),
    ("/v1/completions", COMPLETION, "prompt", [[True]]),
    ("/v1/completions", COMPLETION, "temperature", "0.5"),
    ("/v1/completions", COMPLETION, "temperature", True),
    ("/v1/completions", COMPLETION, "seed", "1"),
    ("/v1/completions", COMPLETION, "echo", "true"),
    ("/v1/chat/completions", CHAT_BODY, "max_tokens", "5"),
    ("/v1/chat/completions", CHAT_BODY, "max_completion_tokens", True),
    ("/v1/chat/completions", CHAT_BODY, "n", "2"),
    ("/v1/chat/completions", CHAT_BODY, "stream", "yes"),
    ("/v1/chat/completions", CHAT_BODY, "logprobs", "1"),
    ("/v1/chat/completions", CHAT_BODY, "logprobs", 1),
    ("/v1/chat/completions", CHAT_BODY, "top_logprobs", "2"),
    ("/v1/chat/completions", CHAT_BODY, "top_p", "1"),
    ("/tokenize", {"prompt": "Hi"}, "add_special_tokens", "no"),
    ("/detokenize", {"tokens": [1]}, "tokens", [True]),
])
def test_a_coerced_type_is_a_400_naming_its_field(
    server: Server, path: str, base: dict[str, Any], field: str, value: Any
) -> None:
    error = assert_error(post(server, path, {**base, field: value}), 400)
    assert error["param"] is not None and error["param"].split(".")[0] == field, error
    assert field in error["message"], error


def test_numbers_as_json_sends_them_still_pass(server: Server) -> None:
    # A float field takes an integer (JSON has one number type; OpenAI takes it too).
    body = {"prompt": "Hello", "max_tokens": 2, "temperature": 1, "top_p": 1, "seed": 3,
            "presence_penalty": 0, "logit_bias": {"50": 1}, "stream": False, "n": 2}
    assert post(server, "/v1/completions", body).status_code == 200
    client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
    completion = client.completions.create(model=client.models.list().data[0].id, prompt="Hi",
                                           max_tokens=2, temperature=0.0, logprobs=1, seed=1)
    assert completion.choices[0].text is not None
    chat = client.chat.completions.create(
        model=completion.model, messages=CHAT, max_completion_tokens=2, temperature=0.7,
        top_p=0.9, n=2, logprobs=True, top_logprobs=2, stream=False, seed=4,
    )
    assert len(chat.choices) == 2
    stream = client.chat.completions.create(model=completion.model, messages=CHAT,
                                            max_tokens=2, stream=True,
                                            stream_options={"include_usage": True})
    assert [c for c in stream if c.usage is not None]


# ---- /tokenize and /detokenize behind the key -------------------------------------------


def test_tokenize_needs_the_api_key(server: Server) -> None:
    for path, body in (("/tokenize", {"prompt": "Hi"}), ("/detokenize", {"tokens": [1]})):
        refused = httpx.post(server.url + path, json=body, timeout=10)
        assert assert_error(refused, 401)["code"] == "invalid_api_key"
        assert post(server, path, body).status_code == 200


def test_allow_unauthenticated_tokenize_opens_only_those_routes() -> None:
    app = FastAPI()

    @app.post("/tokenize")
    @app.post("/detokenize")
    @app.post("/v1/completions")
    async def ok() -> dict[str, bool]:
        return {"ok": True}

    for open_tokenize in (False, True):
        thread = ServerThread(APIKeyCheck(app, API_KEY, open_tokenize=open_tokenize)).start()
        try:
            for path in ("/tokenize", "/detokenize"):
                status = httpx.post(thread.url + path, timeout=10).status_code
                assert status == (200 if open_tokenize else 401), (path, open_tokenize)
            assert httpx.post(thread.url + "/v1/completions", timeout=10).status_code == 401
        finally:
            thread.stop()


def test_the_flags_reach_the_server_config(tmp_path: Path) -> None:
    from tokenmill.cli import build_parser
    from tokenmill.config import DEFAULT_MAX_REQUEST_BODY_BYTES

    args = build_parser().parse_args(["serve", "--allow-unauthenticated-tokenize",
                                      "--max-request-body-bytes", "1024"])
    assert args.allow_unauthenticated_tokenize and args.max_request_body_bytes == 1024
    default = build_parser().parse_args(["serve"])
    assert not default.allow_unauthenticated_tokenize
    assert default.max_request_body_bytes == DEFAULT_MAX_REQUEST_BODY_BYTES == 8 << 20


# ---- the length bound's proof -------------------------------------------------------------


def test_max_token_bytes_bounds_the_token_count_from_below() -> None:
    import random

    from tokenmill.model.source import default_model_path
    from tokenmill.tokenizer import Tokenizer

    tok = Tokenizer.load(default_model_path())
    longest = tok.max_token_bytes
    assert longest is not None and longest >= len("<|im_start|>")
    rng = random.Random(0)
    pieces = ["#" * 200, " " * 90, "\n\n\n", "héllo wörld", "😀", "<|im_start|>", "<|im_end|>",
              "word", "\t" * 9, "東京", "1234567890" * 5, "x"]
    for _ in range(300):
        text = "".join(rng.choice(pieces) for _ in range(rng.randint(1, 40)))
        assert len(tok.encode(text)) * longest >= len(text.encode()), text
    # Bytes the vocabulary lacks (some control characters) are dropped: the count
    # can fall below the bound only through them, which the server counts anyway.
    assert len(tok.encode("\x04" * 100, add_special_tokens=False)) < 100 / longest


def test_no_bound_where_none_is_proven() -> None:
    from tokenizers import AddedToken, models, normalizers, pre_tokenizers
    from tokenizers import Tokenizer as Backend
    from transformers import PreTrainedTokenizerFast

    from tokenmill.tokenizer import Tokenizer

    def build(normalizer: bool, strip: bool) -> Tokenizer:
        backend = Backend(models.BPE(vocab={"a": 0, "b": 1, "ab": 2}, merges=[("a", "b")]))
        backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        if normalizer:
            backend.normalizer = normalizers.NFKC()
        backend.add_special_tokens([AddedToken("<mask>", lstrip=strip, rstrip=strip)])
        return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=backend))

    assert build(normalizer=False, strip=False).max_token_bytes == len("<mask>")
    assert build(normalizer=True, strip=False).max_token_bytes is None
    assert build(normalizer=False, strip=True).max_token_bytes is None
