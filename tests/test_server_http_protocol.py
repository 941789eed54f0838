"""The server's HTTP layer (server/limits.py): both protocols it may run on, the
httptools one `tokenmill serve` picks when httptools is installed and the h11
one otherwise, refuse a head over MAX_HEADER_BYTES with a JSON 431 and a broken
request line with a JSON 400, and stream a chunked response whole. (Through
`tokenmill serve` itself: tests/test_hostile_input.py.)"""

from __future__ import annotations

import json
import socket
import threading
import time
from collections.abc import AsyncGenerator, Iterator
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Response

from tests.server_harness import HOST, free_socket
from tokenmill.server import limits
from tokenmill.server.serving import SSEResponse, sse

PROTOCOLS = [limits.JSONErrorsH11Protocol]
if limits.HTTP_PROTOCOL is not limits.JSONErrorsH11Protocol:
    PROTOCOLS.append(limits.HTTP_PROTOCOL)


@pytest.fixture(scope="module", params=PROTOCOLS, ids=lambda p: p.__name__)
def url(request: pytest.FixtureRequest) -> Iterator[str]:
    app = FastAPI()

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.post("/stream")
    async def stream(body: dict[str, Any]) -> Response:
        async def chunks() -> AsyncGenerator[str, None]:
            for i in range(body["n"]):
                yield sse(json.dumps({"i": i, "pad": "x" * 5000}))
            yield sse("[DONE]")

        return SSEResponse(chunks())

    sock = free_socket()
    server = uvicorn.Server(uvicorn.Config(
        app, log_level="warning", lifespan="off", http=request.param,
        h11_max_incomplete_event_size=limits.MAX_HEADER_BYTES))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the server did not start"
        time.sleep(0.02)
    yield f"http://{HOST}:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(15)
    sock.close()


def test_headers_over_the_limit_are_a_431_in_json(url: str) -> None:
    # The protocol's own bound (no RequestLimits here: that one counts a head read whole).
    response = httpx.get(url + "/health", headers={"X-Big": "a" * 2_000_000}, timeout=30)
    assert response.status_code == 431, response.text
    assert response.json()["error"]["code"] == "request_header_fields_too_large"
    # Under the limit, in a head and a body that arrive together, over several requests.
    with httpx.Client(base_url=url, timeout=30) as http:
        for _ in range(3):
            assert http.get("/health", headers={"X-Small": "a" * 60_000}).status_code == 200
            response = http.post("/stream", json={"n": 40, "pad": "y" * 200_000})
            assert response.status_code == 200
            assert response.text.count("data: ") == 41 and response.text.endswith("data: [DONE]\n\n")


def test_a_broken_request_line_is_a_400_in_json(url: str) -> None:
    port = int(url.rsplit(":", 1)[1])
    with socket.create_connection((HOST, port), timeout=10) as sock:
        sock.sendall(b"NOT AN HTTP REQUEST\r\n\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400"), reply
    error = json.loads(body)["error"]
    assert error["code"] == "invalid_http_request" and error["type"] == "invalid_request_error"
