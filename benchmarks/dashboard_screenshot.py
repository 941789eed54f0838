"""docs/dashboard.png: `tokenmill serve --dashboard` on the default model (float32,
64 MiB of KV: ~90 blocks, so the pool fills and requests are preempted) under
chat load from 16 clients (12 seats), /dashboard in headless Chromium, a screenshot after
--seconds: PYTHONPATH=. .venv/bin/python benchmarks/dashboard_screenshot.py [--out docs/dashboard.png]"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from tests.browser import Chromium  # noqa: E402
from tests.server_harness import start_server  # noqa: E402

QUESTIONS = [
    "Explain how a paged KV cache works.", "Write a haiku about autumn rain.",
    "What is continuous batching?", "List five uses of a hash map.",
    "Summarise the plot of Hamlet in three sentences.", "Why is the sky blue?",
    "Give me a recipe for pancakes.", "How do vaccines train the immune system?",
]


def client(url: str, c: int, stop: threading.Event) -> None:
    with httpx.Client(timeout=300) as http:
        i = 0
        while not stop.is_set():
            question = QUESTIONS[(c + i) % len(QUESTIONS)]
            http.post(url + "/v1/chat/completions", json={
                "messages": [{"role": "user", "content": question}],
                "max_tokens": 64 + 40 * ((c + i) % 5), "temperature": 0.7, "ignore_eos": True})
            i += 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO_ROOT / "docs" / "dashboard.png"))
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=25.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = start_server(Path(tmp), "--dashboard", "--max-num-seqs", "12")
        stop = threading.Event()
        threads = [threading.Thread(target=client, args=(server.url, c, stop), daemon=True)
                   for c in range(args.clients)]
        try:
            for thread in threads:
                thread.start()
            with Chromium() as browser:
                page = browser.page()
                page.navigate(server.url + "/dashboard", width=1400, height=980)
                deadline = time.monotonic() + args.seconds
                while time.monotonic() < deadline:
                    page.pump(0.5)
                page.screenshot(Path(args.out))
                assert not page.errors, page.errors
            print(f"wrote {args.out}")
        finally:
            stop.set()
            server.process.terminate()
            server.process.wait(60)


if __name__ == "__main__":
    main()
