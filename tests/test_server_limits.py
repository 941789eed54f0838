"""`tokenmill serve` as a process, pushed past its limits: request chat templates
that try to take the machine (a 10 GB string, a 10^10-step loop, a huge output),
the API key checked before the body, HEAD /health, and a graceful shutdown whose
grace period runs out while streams are open."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.server_harness import Server, start_server

REPO_ROOT = Path(__file__).resolve().parent.parent
API_KEY = "limits-key"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
RENDER_DEADLINE_S = 15.0  # the 5 s time limit, plus a worker start on a busy machine
RSS_GROWTH_LIMIT = 200 << 20


def stop_server(server: Server) -> None:
    if server.process.poll() is None:
        server.process.kill()
        server.process.wait(timeout=30)


def status_bytes(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith(field + ":"))


def reset_peak_rss(pid: int) -> bool:
    """Restart the kernel's count of the peak RSS (VmHWM) of `pid`."""
    try:
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    served = start_server(tmp_path_factory.mktemp("limits"), "--trust-request-chat-template",
                          "--api-key", API_KEY)
    try:
        yield served
    finally:
        stop_server(served)


def chat_with_template(server: Server, template: str) -> httpx.Response:
    body = {"messages": CHAT, "max_tokens": 2, "temperature": 0, "chat_template": template}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=AUTH, timeout=60)


def test_a_request_template_renders(server: Server) -> None:
    # (Also starts the template worker, so the cases below time only the render.)
    response = chat_with_template(server, "{{ bos_token }}{{ messages[0]['content'] }} Answer:")
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] > 5
    failing = chat_with_template(server, "{{ raise_exception('no such role') }}")
    assert failing.status_code == 400 and "no such role" in failing.json()["error"]["message"]


@pytest.mark.parametrize(("template", "limit"), [
    ("{{ 'x' * 10**10 }}", "memory limit"),
    ("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}", "time limit"),
    ("{{ 'x' * 5 * 10**6 }}", "characters, over the limit"),
], ids=["10GB-string", "1e10-loop", "5M-chars"])
def test_a_hostile_template_is_a_400_and_the_server_keeps_answering(
    server: Server, template: str, limit: str
) -> None:
    pid = server.process.pid
    rss_before = status_bytes(pid, "VmRSS")
    exact_peak = reset_peak_rss(pid)  # else: sampled below
    peak = [rss_before]
    health: list[tuple[int, float]] = []
    done = threading.Event()

    def watch() -> None:
        with httpx.Client(timeout=5) as probe:
            while not done.is_set():
                start = time.monotonic()
                status = probe.get(server.url + "/health").status_code
                health.append((status, time.monotonic() - start))
                probed.set()
                peak[0] = max(peak[0], status_bytes(pid, "VmRSS"))
                time.sleep(0.2)

    probed = threading.Event()  # (a render refused in milliseconds could beat the first probe)
    watcher = threading.Thread(target=watch)
    watcher.start()
    assert probed.wait(30), "/health did not answer before the render"
    try:
        start = time.monotonic()
        response = chat_with_template(server, template)
        elapsed = time.monotonic() - start
    finally:
        done.set()
        watcher.join(30)
    if exact_peak:
        peak[0] = max(peak[0], status_bytes(pid, "VmHWM"))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "chat_template" and limit in error["message"], error
    assert elapsed < RENDER_DEADLINE_S, elapsed
    assert health and all(status == 200 and took < 3 for status, took in health), health
    assert peak[0] - rss_before < RSS_GROWTH_LIMIT, (rss_before, peak[0])
    print(f"{limit}: 400 after {elapsed:.2f} s; server RSS {rss_before >> 20} -> "
          f"peak {peak[0] >> 20} MiB; /health answered {len(health)} times")
    # The server still renders and serves after the worker was stopped.
    assert chat_with_template(server, "{{ messages[0]['content'] }}").status_code == 200


def test_the_api_key_is_checked_before_the_body(server: Server) -> None:
    url = server.url + "/v1/chat/completions"
    malformed = httpx.post(url, content=b"{not json", timeout=10,
                           headers={"Content-Type": "application/json"})
    assert malformed.status_code == 401, malformed.text
    assert malformed.json()["error"]["code"] == "invalid_api_key"
    invalid = httpx.post(url, json={"messages": "nope"}, timeout=10,
                         headers={"Authorization": "Bearer wrong"})
    assert invalid.status_code == 401, invalid.text
    assert httpx.post(url, content=b"{not json", timeout=10,
                      headers={**AUTH, "Content-Type": "application/json"}).status_code == 400
    assert httpx.get(server.url + "/v1/no-such-route", timeout=10).status_code == 401
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # no key for health


def test_head_health(server: Server) -> None:
    response = httpx.head(server.url + "/health", timeout=10)
    assert response.status_code == 200
    assert response.content == b""


def test_shutdown_past_its_grace_period_ends_streams_with_an_error_and_done(tmp_path: Path) -> None:
    server = start_server(tmp_path, "--graceful-shutdown-timeout", "1")
    try:
        bodies = [
            ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 1400,
                                 "ignore_eos": True, "stream": True, "temperature": 0}),
            ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 1400, "ignore_eos": True,
                                      "stream": True, "temperature": 0}),
        ]
        events: list[list[str]] = [[] for _ in bodies]
        first = [threading.Event() for _ in bodies]

        def read(i: int) -> None:
            path, body = bodies[i]
            with httpx.stream("POST", server.url + path, json=body, timeout=120) as response:
                assert response.status_code == 200
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        events[i].append(line.removeprefix("data: "))
                        first[i].set()

        readers = [threading.Thread(target=read, args=(i,)) for i in range(len(bodies))]
        for reader in readers:
            reader.start()
        for event in first:
            assert event.wait(60), server.log()
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(timeout=60) == 0, server.log()
        for reader in readers:
            reader.join(30)
        for stream in events:
            assert stream[-1] == "[DONE]", stream[-3:]
            error = json.loads(stream[-2])["error"]
            assert error["code"] == "server_shutting_down" and error["message"], error
            assert len(stream) < 1400  # cut short, not run to the end
        log = server.log()
        assert "Traceback" not in log and "CancelledError" not in log, log
        assert "shut down after SIGTERM" in log
    finally:
        stop_server(server)
