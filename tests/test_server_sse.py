"""serving.SSEResponse, the streaming endpoints' response, on a real uvicorn
with generators standing in for the engine's streams (the endpoints' own
streaming, disconnects and engine faults are tested in test_server.py)."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import AsyncGenerator, Iterator

import httpx
import pytest
from fastapi import FastAPI, Response

from tests.server_harness import ServerThread
from tokenmill.server.serving import SSEResponse, sse

closed = threading.Event()  # set by the endless stream's finally


async def failing() -> AsyncGenerator[str, None]:
    yield sse('{"n": 0}')
    yield sse('{"n": 1}')
    raise KeyError("a bug after the status line went out")


async def endless() -> AsyncGenerator[str, None]:
    try:
        n = 0
        while True:
            yield sse(json.dumps({"n": n}))
            n += 1
            await asyncio.sleep(0.01)
    finally:
        closed.set()


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    app = FastAPI()

    @app.get("/failing")
    async def get_failing() -> Response:
        return SSEResponse(failing())

    @app.get("/endless")
    async def get_endless() -> Response:
        return SSEResponse(endless())

    server = ServerThread(app).start()
    yield server.url
    server.stop()


def test_an_error_mid_stream_ends_with_an_error_event_and_done(url: str) -> None:
    response = httpx.get(url + "/failing", timeout=10)
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/event-stream; charset=utf-8"
    events = [line.removeprefix("data: ") for line in response.text.split("\n\n") if line]
    assert [json.loads(e)["n"] for e in events[:2]] == [0, 1]
    error = json.loads(events[2])["error"]
    assert error["type"] == "internal_server_error" and "KeyError" not in events[2]
    assert events[3:] == ["[DONE]"]


def test_a_client_that_goes_away_closes_the_stream(url: str) -> None:
    closed.clear()
    with httpx.stream("GET", url + "/endless", timeout=10) as response:
        for n, _line in enumerate(response.iter_lines()):
            assert not closed.is_set()  # (the stream runs while its client reads)
            if n >= 6:
                break
    start = time.monotonic()
    assert closed.wait(5), "the stream kept running after its client left"
    assert time.monotonic() - start < 5
