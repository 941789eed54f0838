"""The serving benchmark's client, against a fake OpenAI server on loopback.

The fake exists only to test the client's arithmetic and parsing: it streams
`max_tokens` chunks with known delays (a first-token delay, then a fixed gap),
so the measured TTFT / ITL / TPOT must come out at those delays.
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tokenmill.bench.serve import (
    RequestResult,
    StreamResult,
    build_report,
    client_session,
    format_table,
    run_rate,
    stream_one,
    summarize,
)

FIRST_DELAY_S = 0.15
GAP_S = 0.03


class FakeOpenAI(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.0"  # close-delimited body: simple streaming

    def log_message(self, *args: object) -> None:  # keep test output quiet
        pass

    def do_GET(self) -> None:
        body = json.dumps({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if request["max_tokens"] == 13:  # the test's way to ask for a failure
            self.send_response(500)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "boom", "type": "internal_error"}}')
            return
        assert request["stream"] is True and request["ignore_eos"] is True
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        if request["max_tokens"] == 17:  # silent past the client's read timeout
            time.sleep(3.0)
            return
        # Prompt [9, 9, 9]: every event sent in 5-byte pieces, each its own segment,
        # so the client sees lines split across reads.
        piece = 5 if request["prompt"] == [9, 9, 9] else 0
        if piece:
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        time.sleep(FIRST_DELAY_S)
        for i in range(request["max_tokens"]):
            if i:
                time.sleep(GAP_S)
            chunk = {"choices": [{"index": 0, "text": f"t{i}", "finish_reason": None}]}
            event = f"data: {json.dumps(chunk)}\n\n".encode()
            for at in range(0, len(event), piece or len(event)):
                self.wfile.write(event[at:at + (piece or len(event))])
                self.wfile.flush()
        usage = {"choices": [], "usage": {"prompt_tokens": len(request["prompt"]),
                                          "completion_tokens": request["max_tokens"]}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())


@pytest.fixture(scope="module")
def fake_server() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), FakeOpenAI)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_percentiles_on_known_values() -> None:
    stats = summarize([0.001 * i for i in range(1, 101)])  # 1..100 ms
    assert stats["mean"] == pytest.approx(50.5)
    assert stats["p50"] == pytest.approx(50.5)
    assert stats["p90"] == pytest.approx(90.1)
    assert stats["p99"] == pytest.approx(99.01)


def test_report_arithmetic_and_goodput() -> None:
    results = [
        RequestResult(ok=True, prompt_tokens=10, output_tokens=5, ttft_s=0.1, e2e_s=0.5,
                      itl_s=[0.1] * 4),
        RequestResult(ok=True, prompt_tokens=10, output_tokens=3, ttft_s=0.3, e2e_s=0.7,
                      itl_s=[0.2, 0.2]),
        RequestResult(ok=False, prompt_tokens=10, error="HTTP 500"),
    ]
    report = build_report(1.0, results, duration_s=2.0, slo_ttft_ms=200, slo_tpot_ms=150)
    assert report.num_ok == 2 and report.errors == ["HTTP 500"]
    assert report.request_throughput == pytest.approx(1.0)
    assert report.output_throughput == pytest.approx(4.0)
    assert report.total_token_throughput == pytest.approx(14.0)
    # TPOT = (e2e - ttft) / (n - 1): 0.1 s and 0.2 s.
    assert report.tpot_ms["mean"] == pytest.approx(150.0)
    assert report.ttft_ms["p50"] == pytest.approx(200.0)
    assert report.itl_ms["mean"] == pytest.approx(1000 * (0.4 + 0.4) / 6)
    # Only the first request meets TTFT <= 200 ms and TPOT <= 150 ms.
    assert report.goodput == pytest.approx(0.5)
    assert "| 1 | 2/3 |" in format_table([report])


def test_client_measures_a_fake_servers_known_timings(fake_server: str) -> None:
    prompts = [[1, 2, 3]] * 6
    lens = [4, 8, 1, 13, 6, 5]  # 13: the fake answers 500
    results, duration = asyncio.run(
        run_rate(fake_server, "fake-model", prompts, lens, rate=20.0, timeout_s=30))
    ok = [r for r in results if r.ok]
    assert len(ok) == 5
    assert results[3].error.startswith("HTTP 500")
    assert [r.output_tokens for r in ok] == [4, 8, 1, 6, 5]
    for r in ok:
        assert FIRST_DELAY_S <= r.ttft_s < FIRST_DELAY_S + 0.25
        assert len(r.itl_s) == r.output_tokens - 1
        assert all(GAP_S * 0.8 <= gap < GAP_S + 0.2 for gap in r.itl_s)
    report = build_report(20.0, results, duration)
    assert GAP_S * 1000 * 0.8 <= report.tpot_ms["p50"] < (GAP_S + 0.2) * 1000
    assert report.num_requests == 6



def test_client_joins_lines_split_across_reads(fake_server: str) -> None:
    results, _ = asyncio.run(
        run_rate(fake_server, "fake-model", [[9, 9, 9]], [6], rate=float("inf"), timeout_s=30))
    r = results[0]
    assert r.ok, r.error
    assert r.text == "t0t1t2t3t4t5" and r.output_tokens == 6 and r.prompt_tokens == 3
    assert len(r.itl_s) == 5 and r.ttft_s >= FIRST_DELAY_S


def test_a_read_timeout_is_reported_not_fatal(fake_server: str) -> None:
    results, _ = asyncio.run(
        run_rate(fake_server, "fake-model", [[1, 2], [1, 2]], [17, 2], rate=float("inf"),
                 timeout_s=1.0))
    assert not results[0].ok and "Timeout" in results[0].error
    assert results[1].ok and results[1].output_tokens == 2


class OneRequestAConnection(BaseHTTPRequestHandler):
    """HTTP/1.1, keep-alive offered, but the connection closed 50 ms after one chunked
    response (as llama-server does at its keep-alive limit)."""
    protocol_version = "HTTP/1.1"

    def log_message(self, *args: object) -> None:
        pass

    def handle(self) -> None:
        self.close_connection = True
        self.handle_one_request()
        time.sleep(0.05)

    def do_POST(self) -> None:
        request = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        events = [f"data: {json.dumps({'choices': [{'index': 0, 'text': f't{i}'}]})}\n\n"
                  for i in range(request["max_tokens"])] + ["data: [DONE]\n\n"]
        for event in events:
            data = event.encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
        self.wfile.write(b"0\r\n\r\n")


def test_back_to_back_requests_survive_a_server_closing_kept_alive_connections() -> None:
    # A reused kept-alive connection failed every second request ("Server disconnected",
    # against llama-server: "Can not write request body"): each request opens its own.
    server = ThreadingHTTPServer(("127.0.0.1", 0), OneRequestAConnection)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/v1/completions"

    async def closed_loop() -> list[StreamResult]:
        async with client_session(10.0) as client:
            return [await stream_one(client, url, {"model": "m", "prompt": [1, 2], "max_tokens": 3}, {}, 10.0)
                    for _ in range(6)]

    try:
        results = asyncio.run(closed_loop())
    finally:
        server.shutdown()
        server.server_close()
    assert [r.error for r in results] == [""] * 6 and all(r.text == "t0t1t2" for r in results)
