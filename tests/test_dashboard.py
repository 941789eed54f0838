"""The dashboard's feed (`serve --dashboard`, engine/live_view.py, server/dashboard.py):
no subscriber -> no snapshot work; the snapshots' shape against what the
scheduler did (every preemption and first token reported, none missed); a
subscriber that never reads is bounded and never blocks the engine, in process
and over a real socket. Tiny random Llama, no tokenizer (token-id prompts)."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.hf_models import build_hf_model, save_hf_model
from tests.server_harness import ServerThread
from tokenmill import LLM, SamplingParams
from tokenmill.config import ServerConfig
from tokenmill.engine import async_engine as async_engine_module
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.live_view import LiveView, Subscriber
from tokenmill.server import build_app

NUM_KV_BLOCKS = 12  # 192 tokens: four requests of 60 cannot all fit, so some are preempted


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_hf_model(build_hf_model("llama"), Path(tmp_path_factory.mktemp("llama")))


@pytest.fixture
def engine(model_path: str) -> Iterator[AsyncEngine]:
    llm = LLM(model_path, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=NUM_KV_BLOCKS,
              max_num_seqs=4, max_num_batched_tokens=32)
    engine = AsyncEngine(llm.engine)
    try:
        yield engine
    finally:
        engine.shutdown()


def prompt(i: int, length: int = 20) -> dict[str, list[int]]:
    return {"prompt_token_ids": [(7 * i + k) % 200 + 3 for k in range(length)]}


async def run_requests(engine: AsyncEngine, num: int, max_tokens: int = 40) -> int:
    """Run `num` requests at once to the end; the number of tokens they produced."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)

    async def one(i: int) -> int:
        stream = await engine.add_request(f"r{i}-{time.monotonic_ns()}", prompt(i), params)
        return sum([len(out.outputs[0].token_ids) async for out in stream])

    return sum(await asyncio.gather(*(one(i) for i in range(num))))


def count_snapshots(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    real = async_engine_module.take_snapshot

    def counting(*args: Any, **kwargs: Any) -> dict[str, Any]:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(async_engine_module, "take_snapshot", counting)
    return calls


def test_no_subscriber_no_snapshot_work(engine: AsyncEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = count_snapshots(monkeypatch)
    noted: list[int] = []
    monkeypatch.setattr(LiveView, "note_step", lambda *a, **k: noted.append(1))
    monkeypatch.setattr(LiveView, "note_preemptions", lambda *a, **k: noted.append(1))
    live = engine.live_view

    async def scenario() -> None:
        assert await run_requests(engine, 4) == 160
        assert calls[0] == 0 and not noted and live.num_snapshots == 0
        assert engine.engine.scheduler.num_preemptions > 0  # (the steps had things to report)

        subscriber = live.subscribe()
        await run_requests(engine, 4)
        assert calls[0] > 0 and noted and live.num_snapshots > 0
        assert subscriber.queue

        live.unsubscribe(subscriber)
        assert not live.watched
        before, num_noted = calls[0], len(noted)
        await run_requests(engine, 4)
        assert calls[0] == before and len(noted) == num_noted

    asyncio.run(scenario())


def test_snapshots_report_every_step_event(engine: AsyncEngine) -> None:
    engine.live_view = live = LiveView(max_rate_hz=0, max_queued=100_000)  # every step
    scheduler = engine.engine.scheduler
    preemptions_before = scheduler.num_preemptions

    async def scenario() -> list[dict[str, Any]]:
        subscriber = live.subscribe()
        assert await run_requests(engine, 6) == 240
        await asyncio.sleep(0.6)  # an idle iteration: an empty batch is published
        live.unsubscribe(subscriber)
        return [json.loads(data) for data in subscriber.queue]

    snapshots = asyncio.run(scenario())
    assert [s["seq"] for s in snapshots] == list(range(1, len(snapshots) + 1))
    kinds = set()
    for snap in snapshots:
        assert snap["kv"]["num_blocks"] == NUM_KV_BLOCKS and snap["kv"]["block_size"] == 16
        blocks = snap["kv"]["blocks"]
        assert len(blocks) == NUM_KV_BLOCKS and set(blocks) <= set("0123")
        assert sum(r["tokens"] for r in snap["batch"]) == snap["num_batched_tokens"] <= 32
        assert len(snap["batch"]) <= snap["num_running"] <= 4
        # Every running request holds blocks while its step runs.
        assert (blocks.count("2") + blocks.count("3") > 0) == bool(snap["batch"])
        assert len(snap["waiting"]) == snap["num_waiting"]
        for r in snap["batch"]:
            kinds.add(r["kind"])
            assert r["kind"] in ("prefill", "decode")
            assert r["computed"] + r["tokens"] <= r["total"]
            assert r["max_tokens"] == 40 and 0 <= r["output"] < 40
            if r["kind"] == "decode":
                assert r["tokens"] == 1 and r["computed"] >= r["prompt"]
    assert kinds == {"prefill", "decode"}
    assert snapshots[-1]["batch"] == [] and snapshots[-1]["num_running"] == 0
    # Nothing between two snapshots is lost: every preemption, first token and step.
    preempted = [p["id"] for s in snapshots for p in s["preemptions"]]
    assert len(preempted) == scheduler.num_preemptions - preemptions_before > 0
    assert snapshots[-1]["num_preemptions_total"] == scheduler.num_preemptions
    assert sum(len(s["ttft_s"]) for s in snapshots) == 6
    assert sum(len(s["itl_s"]) for s in snapshots) == 6 * 39
    assert sum(s["num_finished"] for s in snapshots) == 6
    assert all(t > 0 for s in snapshots for t in s["ttft_s"] + s["itl_s"])


def test_a_subscriber_that_never_reads_is_bounded(engine: AsyncEngine) -> None:
    engine.live_view = live = LiveView(max_rate_hz=0, max_queued=4)

    async def scenario() -> Subscriber:
        subscriber = live.subscribe()  # never read
        await asyncio.wait_for(run_requests(engine, 6), timeout=60)
        return subscriber

    subscriber = asyncio.run(scenario())
    assert len(subscriber.queue) == 4
    assert subscriber.num_dropped == live.num_snapshots - 4 > 0
    # The newest snapshots are kept, the oldest dropped.
    assert [json.loads(d)["seq"] for d in subscriber.queue] == list(
        range(live.num_snapshots - 3, live.num_snapshots + 1))


@pytest.fixture
def served(engine: AsyncEngine) -> Iterator[tuple[AsyncEngine, ServerThread]]:
    server = ServerThread(build_app(engine, ServerConfig(dashboard=True))).start()
    try:
        yield engine, server
    finally:
        server.stop()


def completion(url: str, i: int, max_tokens: int = 40) -> None:
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": prompt(i)["prompt_token_ids"], "max_tokens": max_tokens,
        "ignore_eos": True, "temperature": 0})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"][0]["text"]) == 0  # (no tokenizer: token ids only)


def wait_unwatched(live: LiveView) -> None:
    deadline = time.monotonic() + 10
    while live.watched:  # the server notices the closed connection at its next write
        assert time.monotonic() < deadline, "the closed stream stayed subscribed"
        time.sleep(0.05)


def test_sse_feed(served: tuple[AsyncEngine, ServerThread], model_path: str) -> None:
    engine, server = served
    page = httpx.get(server.url + "/dashboard", timeout=30)
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "/events" in page.text and "<svg id=\"batch\"" in page.text
    events: list[tuple[str, dict[str, Any]]] = []
    # Requests keep coming until a snapshot shows one: a short request can run whole
    # between two snapshots (at most 10 a second), and keepalives never end the read.
    stop = threading.Event()

    def load() -> None:
        while not stop.is_set():
            completion(server.url, 0)

    loader = threading.Thread(target=load, daemon=True)
    deadline = time.monotonic() + 60
    with httpx.stream("GET", server.url + "/dashboard/events", timeout=30) as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        assert engine.live_view.watched
        lines = stream.iter_lines()
        name = None
        try:
            for line in lines:
                assert time.monotonic() < deadline, "no snapshot showed a running request"
                if line.startswith("event: "):
                    name = line.removeprefix("event: ")
                elif line.startswith("data: "):
                    assert name is not None
                    events.append((name, json.loads(line.removeprefix("data: "))))
                    if name == "snapshot" and events[-1][1]["batch"]:
                        break
                    if len(events) == 2:
                        loader.start()  # something to show after the idle snapshot
        finally:
            stop.set()
    if loader.is_alive():
        loader.join(timeout=60)
    assert events[0] == ("hello", {"model": Path(model_path).name, "max_model_len": 192,
                                   "max_rate_hz": 10.0})
    assert {name for name, _ in events[1:]} == {"snapshot"}
    assert events[-1][1]["batch"][0]["id"].startswith("cmpl-")
    wait_unwatched(engine.live_view)


def test_no_dashboard_without_the_flag(engine: AsyncEngine) -> None:
    server = ServerThread(build_app(engine, ServerConfig())).start()
    try:
        for path in ("/dashboard", "/dashboard/events"):
            assert httpx.get(server.url + path, timeout=30).status_code == 404
    finally:
        server.stop()


def test_a_stalled_connection_never_blocks_the_engine(model_path: str) -> None:
    """A client that opens the feed and never reads: its socket buffers fill (up to
    4 MiB of the kernel's, then uvicorn's 64 KiB), the server's writes to it wait,
    its queue drops the oldest; everyone else is served. A big KV pool makes each
    snapshot ~8 KB, so the buffers fill in a few hundred steps."""
    llm = LLM(model_path, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=8000,
              max_num_seqs=4)
    engine = AsyncEngine(llm.engine)
    server = ServerThread(build_app(engine, ServerConfig(dashboard=True))).start()
    try:
        stall_the_feed(engine, server)
    finally:
        server.stop()
        engine.shutdown()


def stall_the_feed(engine: AsyncEngine, server: ServerThread) -> None:
    engine.live_view = live = LiveView(max_rate_hz=0, max_queued=4)
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        sock.sendall(b"GET /dashboard/events HTTP/1.1\r\nHost: x\r\n\r\n")
        deadline = time.monotonic() + 10
        while not live.watched:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        subscriber = live._subscribers[0]
        start = time.monotonic()
        while True:  # load until the feed is stuck: its queue stays full while idle snapshots come
            assert time.monotonic() - start < 60, "the stalled stream never filled its queue"
            for i in range(4):
                completion(server.url, i)
            time.sleep(1.0)  # two idle snapshots: a stream still writing would take them
            if len(subscriber.queue) == 4:
                break
        assert subscriber.num_dropped > 0
        # Stuck, and the engine serves everyone else as before.
        started = time.monotonic()
        for i in range(4):
            completion(server.url, i)
        assert time.monotonic() - started < 30
        assert len(subscriber.queue) == 4
    wait_unwatched(live)
