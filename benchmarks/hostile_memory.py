"""The server's memory under a storm of huge prompts, with glibc keeping freed
memory (engine/process_settings.keep_freed_memory) on and off, and the give-back
after big requests (give_back_freed_memory, server/limits.py) on and off.

For each of the four settings: `tokenmill serve` (the default model, float32) as
a subprocess, a warm-up, one 10 MB prompt (time to its 400, peak RSS growth), ten
10 MB prompts at once (peak RSS, RSS 3 s after), then decode speed (8 streams of
64 greedy tokens at once: tokens/s), the keep-freed setting's reason to exist.

    PYTHONPATH=. python benchmarks/hostile_memory.py [--configs on-on,off-on,...]

(The child mode, --child KEEP GIVE -- SERVE_ARGS, is how each server is started.)
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parent.parent
BIG = 10_000_000
BODY_LIMIT = 64 << 20


def child(keep: bool, give: bool, serve_args: list[str]) -> int:
    """`tokenmill serve` with the two settings switched as asked."""
    import tokenmill.server.limits as limits
    import tokenmill.server.run as run
    from tokenmill.cli import main
    from tokenmill.engine import process_settings

    if not keep:
        run.apply_process_settings = process_settings.freeze_gc_heap  # type: ignore[assignment]
    if not give:
        limits.give_back_freed_memory = lambda: False  # type: ignore[assignment]
    return main(["serve", *serve_args])


def rss(pid: int, field: str = "VmRSS") -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) >> 10 for line in f if line.startswith(field + ":"))


def reset_peak(pid: int) -> None:
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def post(url: str, payload: bytes) -> httpx.Response:
    return httpx.post(url + "/v1/completions", content=payload, timeout=300,
                      headers={"Content-Type": "application/json"})


def run_config(keep: bool, give: bool) -> dict[str, float]:
    from tests.server_harness import free_port  # (the suite's helper)

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log_path = Path(tempfile.mkdtemp()) / "serve.log"
    with log_path.open("w") as log:
        process = subprocess.Popen(
            [sys.executable, __file__, "--child", str(int(keep)), str(int(give)), "--",
             "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
             "--kv-cache-memory-bytes", str(64 << 20), "--max-request-body-bytes", str(BODY_LIMIT)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        )
    try:
        while True:
            if process.poll() is not None:
                raise SystemExit(log_path.read_text())
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        pid = process.pid
        warm = json.dumps({"prompt": "Hello", "max_tokens": 4}).encode()
        assert post(url, warm).status_code == 200
        time.sleep(1)
        out: dict[str, float] = {"rss_start": rss(pid)}
        big = json.dumps({"prompt": "All work and no play. " * (BIG // 22), "max_tokens": 5}).encode()
        reset_peak(pid)
        start = time.perf_counter()
        assert post(url, big).status_code == 400
        out["one_refused_ms"] = (time.perf_counter() - start) * 1000
        out["one_peak_growth"] = rss(pid, "VmHWM") - out["rss_start"]
        time.sleep(1)
        out["rss_before_storm"] = rss(pid)
        reset_peak(pid)
        statuses: list[int] = []
        threads = [threading.Thread(target=lambda: statuses.append(post(url, big).status_code))
                   for _ in range(10)]
        start = time.perf_counter()
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out["storm_s"] = time.perf_counter() - start
        assert statuses == [400] * 10, statuses
        out["storm_peak"] = rss(pid, "VmHWM")
        out["rss_after_storm"] = rss(pid)
        time.sleep(3)
        out["rss_after_storm_3s"] = rss(pid)
        # Decode speed: 8 greedy streams of 64 tokens at once.
        body = json.dumps({"prompt": "Once upon a time", "max_tokens": 64, "temperature": 0,
                           "ignore_eos": True}).encode()
        post(url, body)
        start = time.perf_counter()
        threads = [threading.Thread(target=post, args=(url, body)) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out["decode_tok_s"] = 8 * 64 / (time.perf_counter() - start)
        out["rss_end"] = rss(pid)
        return out
    finally:
        process.terminate()
        process.wait(60)


def main() -> int:
    if "--child" in sys.argv:
        i = sys.argv.index("--child")
        keep, give = sys.argv[i + 1] == "1", sys.argv[i + 2] == "1"
        return child(keep, give, sys.argv[sys.argv.index("--") + 1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--configs", default="on-on,on-off,off-on,off-off",
                        help="KEEP-GIVE pairs: keep freed memory, give back after big requests")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO_ROOT))
    print("| keep freed | give back | 1 x 10 MB: 400 in | peak growth | RSS before storm "
          "| 10 x 10 MB: peak | after | after 3 s | decode tok/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for config in args.configs.split(","):
        keep, give = (part == "on" for part in config.split("-"))
        r = run_config(keep, give)
        print(f"| {'on' if keep else 'off'} | {'on' if give else 'off'} "
              f"| {r['one_refused_ms']:.0f} ms | +{r['one_peak_growth']:.0f} MiB "
              f"| {r['rss_before_storm']:.0f} MiB | {r['storm_peak']:.0f} MiB "
              f"| {r['rss_after_storm']:.0f} MiB | {r['rss_after_storm_3s']:.0f} MiB "
              f"({100 * (r['rss_after_storm_3s'] / r['rss_before_storm'] - 1):+.1f}%) "
              f"| {r['decode_tok_s']:.0f} |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
