"""Step time with the dashboard closed vs open (`serve --dashboard`): the same
fixed load, run alternately with no subscriber, with an SSE reader, and with
/dashboard open in headless Chromium, on the default model:
PYTHONPATH=. .venv/bin/python benchmarks/dashboard_overhead.py [--repeats 3] [--requests 32] [--concurrency 8]

The server (engine thread + uvicorn) runs in this process, as `tokenmill serve`
runs it; the load comes from a child process (httpx threads), the SSE reader
from another, so neither takes this process's GIL. Step time = the engine
loop's period between two iterations that ran a step (a stat logger's clock),
so a snapshot's cost is inside it. Prompts are token ids and decoding ignores
EOS: every run computes the same tokens.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from tests.browser import Chromium  # noqa: E402
from tests.server_harness import ServerThread  # noqa: E402
from tokenmill import LLM  # noqa: E402
from tokenmill.config import ServerConfig  # noqa: E402
from tokenmill.engine.async_engine import AsyncEngine  # noqa: E402
from tokenmill.engine.iteration_stats import IterationStats  # noqa: E402
from tokenmill.server import build_app  # noqa: E402

LOAD = """
import sys, threading, httpx
url, num, conc, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
def client(c):
    with httpx.Client(timeout=600) as http:
        for i in range(c, num, conc):
            r = http.post(url + "/v1/completions", json={
                "prompt": [(i * 13 + k) % 40000 + 100 for k in range(64 + (i * 17) % 64)],
                "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0})
            assert r.status_code == 200, r.text
threads = [threading.Thread(target=client, args=(c,)) for c in range(conc)]
for t in threads: t.start()
for t in threads: t.join()
"""

READER = """
import sys, httpx
with httpx.stream("GET", sys.argv[1] + "/dashboard/events", timeout=None) as r:
    for line in r.iter_lines():
        pass
"""


class StepClock:
    def __init__(self) -> None:
        self.last: float | None = None
        self.periods_s: list[float] = []
        self.recording = False

    def __call__(self, stats: IterationStats) -> None:
        now = time.perf_counter()
        if stats.num_scheduled_tokens is None:  # an idle iteration: no step
            self.last = None
            return
        if self.recording and self.last is not None:
            self.periods_s.append(now - self.last)
        self.last = now


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--modes", default="closed,sse,browser")
    parser.add_argument("--out", default=None, help="write the numbers as JSON here")
    args = parser.parse_args()

    llm = LLM(kv_cache_memory_bytes=256 << 20, max_num_seqs=args.concurrency)
    engine = AsyncEngine(llm.engine)
    clock = StepClock()
    engine.add_stat_logger(clock)
    server = ServerThread(build_app(engine, ServerConfig(dashboard=True))).start()
    load_cmd = [sys.executable, "-c", LOAD, server.url, str(args.requests),
                str(args.concurrency), str(args.max_tokens)]
    subprocess.run([*load_cmd[:4], "8", "8", "4"], check=True, cwd=REPO_ROOT)  # warm-up
    results: dict[str, list[dict[str, float]]] = {}
    browser: Chromium | None = None
    try:
        for repeat in range(args.repeats):
            for mode in args.modes.split(","):
                watcher: subprocess.Popen[bytes] | None = None
                if mode == "sse":
                    watcher = subprocess.Popen([sys.executable, "-c", READER, server.url])
                elif mode == "browser":  # (a fresh browser each time: closing it ends the feed)
                    browser = Chromium().__enter__()
                    page = browser.page()
                    page.navigate(server.url + "/dashboard")
                if mode != "closed":
                    deadline = time.monotonic() + 20
                    while not engine.live_view.watched:
                        assert time.monotonic() < deadline, f"{mode}: nobody subscribed"
                        time.sleep(0.05)
                snapshots_before = engine.live_view.num_snapshots
                clock.periods_s, clock.recording = [], True
                start = time.perf_counter()
                subprocess.run(load_cmd, check=True, cwd=REPO_ROOT)
                wall_s = time.perf_counter() - start
                clock.recording = False
                periods = sorted(clock.periods_s)
                row = {"repeat": repeat, "steps": len(periods), "wall_s": wall_s,
                       "mean_ms": 1000 * statistics.fmean(periods),
                       "median_ms": 1000 * statistics.median(periods),
                       "p90_ms": 1000 * periods[int(0.9 * len(periods))],
                       "snapshots": engine.live_view.num_snapshots - snapshots_before}
                results.setdefault(mode, []).append(row)
                print(f"{mode:8s} {json.dumps({k: round(v, 2) for k, v in row.items()})}", flush=True)
                if watcher is not None:
                    watcher.terminate()
                    watcher.wait()
                if browser is not None:
                    browser.__exit__(None, None, None)
                    browser = None
                deadline = time.monotonic() + 20
                while engine.live_view.watched:  # (noticed at the next write: an idle snapshot)
                    assert time.monotonic() < deadline, f"{mode}: still subscribed"
                    time.sleep(0.05)
    finally:
        if browser is not None:
            browser.__exit__(None, None, None)
        server.stop()
        engine.shutdown()
    print("\nmode      median step ms (per repeat)          mean step ms (per repeat)    snapshots")
    for mode, rows in results.items():
        medians = " ".join(f"{r['median_ms']:.2f}" for r in rows)
        means = " ".join(f"{r['mean_ms']:.2f}" for r in rows)
        print(f"{mode:8s}  {medians:36s} {means:28s} {sum(r['snapshots'] for r in rows)}")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
