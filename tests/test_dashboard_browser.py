"""/dashboard in a real browser: Debian's headless Chromium, driven over the
DevTools protocol (tests/browser.py), loads the page from a server under load
(tiny random Llama). The batch and KV views must update (DOM assertions) and
the browser's console must hold no error (console.error, an uncaught
exception, a failed load)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.browser import Chromium, find_chromium
from tests.hf_models import build_hf_model, save_hf_model
from tests.server_harness import ServerThread
from tokenmill import LLM
from tokenmill.config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.server import build_app

CHROMIUM = find_chromium()
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="NO BROWSER: Chromium is not installed, so the dashboard's browser test cannot "
    "run; `apt-get install -y chromium` (make setup does it when run as root)",
)

# What the page shows, read from its DOM.
READ_VIEW = """JSON.stringify({
  status: document.getElementById("status").textContent,
  updates: Number(document.getElementById("num-updates").textContent),
  batchRows: document.querySelectorAll("#batch g.req").length,
  prefillRows: document.querySelectorAll("#batch g.req.prefill").length,
  decodeRows: document.querySelectorAll("#batch g.req.decode").length,
  batchSummary: document.getElementById("batch-summary").textContent,
  batchIds: Array.from(document.querySelectorAll("#batch g.req text:first-child"),
                       (t) => t.textContent).join(","),
  kvUpdates: Number(document.getElementById("kv-map").dataset.updates),
  kvInUse: Number(document.getElementById("kv-used").textContent)
           + Number(document.getElementById("kv-shared").textContent),
  kvFree: Number(document.getElementById("kv-free").textContent)
          + Number(document.getElementById("kv-cached").textContent),
  waitingChips: document.querySelectorAll("#waiting .chip").length,
  ttftSamples: Number(document.getElementById("ttft").dataset.count || 0),
  itlSamples: Number(document.getElementById("itl").dataset.count || 0),
  itlBars: document.querySelectorAll("#itl rect.bin").length,
})"""
NUM_KV_BLOCKS = 40


class Load:
    """Clients sending completions (token-id prompts of varied lengths) until stopped."""

    def __init__(self, url: str, num_clients: int = 8) -> None:
        self.url = url
        self.stop = threading.Event()
        self.errors: list[str] = []
        self.num_done = 0
        self.threads = [threading.Thread(target=self.client, args=(c,), daemon=True)
                        for c in range(num_clients)]

    def client(self, c: int) -> None:
        with httpx.Client(timeout=60) as http:
            i = 0
            while not self.stop.is_set():
                length = 8 + (37 * (c + 6 * i)) % 90
                r = http.post(self.url + "/v1/completions", json={
                    "prompt": [(c * 31 + i * 7 + k) % 250 + 3 for k in range(length)],
                    "max_tokens": 24 + (c * 5 + i) % 40, "ignore_eos": True, "temperature": 0})
                if r.status_code != 200:
                    self.errors.append(r.text)
                self.num_done += 1
                i += 1

    def __enter__(self) -> Load:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self.stop.set()
        for thread in self.threads:
            thread.join(60)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerThread]:
    path = save_hf_model(build_hf_model("llama"), Path(tmp_path_factory.mktemp("llama")))
    llm = LLM(path, dtype="float32", skip_tokenizer_init=True, num_kv_blocks=NUM_KV_BLOCKS,
              max_num_seqs=6, max_num_batched_tokens=64)
    engine = AsyncEngine(llm.engine)
    server = ServerThread(build_app(engine, ServerConfig(dashboard=True))).start()
    try:
        yield server
    finally:
        server.stop()
        engine.shutdown()


def test_dashboard_updates_under_load_without_console_errors(server: ServerThread) -> None:
    views: list[dict[str, Any]] = []
    with Chromium(CHROMIUM) as browser, Load(server.url) as load:
        page = browser.page()
        page.navigate(server.url + "/dashboard")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            page.pump(0.2)
            views.append(json.loads(page.evaluate(READ_VIEW)))
            seen = {k: max(v[k] for v in views) for k in views[-1]
                    if k not in ("status", "batchSummary", "batchIds")}
            if (seen["updates"] >= 30 and seen["prefillRows"] and seen["decodeRows"]
                    and seen["itlBars"] and seen["ttftSamples"] and seen["waitingChips"]
                    and len({v["batchIds"] for v in views}) >= 5):
                break
        errors = list(page.errors)
    assert not load.errors, load.errors[:3]
    assert load.num_done > 0
    assert not errors, "the browser console has errors:\n" + "\n".join(errors)
    last = views[-1]
    assert last["status"] == "live", last
    assert last["updates"] >= 30, last
    # The batch view changed: requests came and went, prefill and decode both seen.
    assert len({v["batchIds"] for v in views}) >= 5, views[-5:]
    assert all(v["batchIds"].count(",") + 1 == v["batchRows"] for v in views if v["batchRows"])
    assert max(v["prefillRows"] for v in views) > 0 and max(v["decodeRows"] for v in views) > 0
    # The KV view redrew with every update and showed blocks in use, of a pool of 40.
    assert last["kvUpdates"] == last["updates"]
    assert all(v["kvInUse"] + v["kvFree"] == NUM_KV_BLOCKS for v in views if v["updates"])
    assert len({v["kvInUse"] for v in views}) >= 3 and max(v["kvInUse"] for v in views) > 0
    assert max(v["waitingChips"] for v in views) > 0  # eight clients, six seats
    assert last["ttftSamples"] > 0 and last["itlSamples"] > 0 and last["itlBars"] > 0
