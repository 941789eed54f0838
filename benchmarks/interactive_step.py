"""Interactive speed (issue 34), engine alone and through the server.

    PYTHONPATH=. .venv/bin/python benchmarks/interactive_step.py engine [--batches 1,4] [--busy 0]
    PYTHONPATH=. .venv/bin/python benchmarks/interactive_step.py server [--streams 1,4] [--busy 0]

engine: B requests of throughput-A's 128-token prompts, 256 output tokens,
EOS ignored, greedy, stepped by `LLMEngine.step()`; prints the median decode
step (B requests each decoding) and the median of each part of it
(worker/step_timer.py), plus what no part covers.

server: `tokenmill serve` on a free port; S streams at once, closed loop
(each stream sends its next request when the last ends, `--rounds` each),
streaming /v1/completions; per-stream decode speed = (tokens - 1) / (e2e -
TTFT). Then one 2,048-token prompt with one output token (TTFT, 3 times).
`--cpu`: also the CPU time each of the server's threads and this client
spent per generated token (/proc/PID/task/*/schedstat; the main thread runs
the event loop, the busiest other one is the engine thread, which is also
OpenMP's thread 0).
`--server-prefix CMD`: run the server under CMD (e.g. a py-spy record ...).
The client is the benchmarks' own (bench.serve.client_session: aiohttp);
`--cpu`'s client column is its CPU a token.

`--busy N` starts N processes that spin on a core each (bounded by the run).
The perf notes' small_decode runs were made with a `--small` switch, gone
with csrc/small_decode.cpp.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.bench.serve import client_session, free_port, send_one, spawn_server, wait_healthy
from tokenmill.bench.workloads import throughput_a


def start_busy(num: int) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen([sys.executable, "-c",
                              "import time\nt=time.time()+600\nwhile time.time()<t: pass"])
            for _ in range(num)]


def engine(args: argparse.Namespace) -> None:
    from tokenmill import LLM, SamplingParams

    llm = LLM(None, dtype="bfloat16", quantization=args.quantization)
    eng = llm.engine
    prompts = throughput_a(128).prompts
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=0.0)
    for batch in [int(b) for b in args.batches.split(",")]:
        for i in range(batch):
            eng.add_request(str(time.monotonic_ns()) + f"-{i}", {"prompt_token_ids": prompts[i]}, params)
        steps: list[tuple[float, dict[str, float]]] = []
        while eng.has_unfinished_requests():
            t = time.perf_counter()
            result = eng.step()
            dt = time.perf_counter() - t
            if (result.stats.num_scheduled_tokens == batch
                    and result.stats.num_scheduled_reqs == batch):
                steps.append((dt, {str(k): v for k, v in result.stats.phase_s.items()}))
        steps = steps[5:]
        med = statistics.median(s for s, _ in steps)
        parts = {k: statistics.median(p.get(k, 0.0) for _, p in steps) for k in steps[0][1]}
        other = statistics.median(s - sum(p.values()) for s, p in steps)
        line = " ".join(f"{k} {v * 1e3:.2f}" for k, v in parts.items())
        print(f"engine B={batch}: decode step median {med * 1e3:.2f} ms "
              f"({batch / med:.1f} tok/s, {1 / med:.1f} per stream), p90 "
              f"{np.percentile([s for s, _ in steps], 90) * 1e3:.2f}; parts ms: {line}; "
              f"uncovered {other * 1e3:.2f}", flush=True)


async def streams(url: str, num: int, rounds: int, max_tokens: int) -> list[tuple[float, float]]:
    prompts = throughput_a(128).prompts
    out: list[tuple[float, float]] = []

    async def stream(i: int, client: Any) -> None:
        for r in range(rounds):
            res = await send_one(client, url, "default", prompts[(i * rounds + r) % 128],
                                 max_tokens, {}, 600.0)
            assert res.ok, res.error
            out.append((res.ttft_s, (res.output_tokens - 1) / (res.e2e_s - res.ttft_s)))

    async with client_session(600.0) as client:
        await asyncio.gather(*(stream(i, client) for i in range(num)))
    return out


def thread_cpu_ns(pid: int) -> dict[int, int]:
    """Each thread's time on a CPU so far (ns), by thread id."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError):  # (a thread that just ended)
            out[int(task.name)] = int((task / "schedstat").read_text().split()[0])
    return out


def cpu_report(pid: int, before: dict[int, int], after: dict[int, int], client_s: float,
               tokens: int, wall_s: float) -> str:
    """CPU us per generated token: the event loop (main thread), each other
    busy thread, and the client; and the wall time per token."""
    spent = {t: after[t] - before.get(t, 0) for t in after}
    main = spent.pop(pid, 0)
    others = sorted((v for v in spent.values() if v > 1e6), reverse=True)
    per = 1e-3 / tokens  # ns -> us per token
    return (f"cpu us/token: loop {main * per:.0f}, threads "
            f"{' '.join(f'{v * per:.0f}' for v in others)}, client {client_s * 1e9 * per:.0f}; "
            f"wall us/token {wall_s * 1e9 * per:.0f} (tokens {tokens})")


async def long_prompt(url: str, times: int) -> list[float]:
    rng = np.random.default_rng(7)
    out = []
    async with client_session(600.0) as client:
        for _ in range(times):
            prompt = rng.integers(100, 49000, size=2048).tolist()
            res = await send_one(client, url, "default", prompt, 1, {}, 600.0)
            assert res.ok, res.error
            out.append(res.ttft_s)
    return out


def server(args: argparse.Namespace) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    cmd = [*args.server_prefix.split(), sys.executable, "-m", "tokenmill.cli", "serve", "--port", str(port),
           "--dtype", "bfloat16", "--no-enable-prefix-caching", "--served-model-name", "default",
           "--quantization", args.quantization, *args.serve_args.split()]
    log = Path(os.environ.get("LOG", "/tmp/interactive_server.log"))
    proc = spawn_server(cmd, dict(os.environ), log)
    try:
        wait_healthy(proc, base, 300, "server", f"; see {log}")
        url = base + "/v1/completions"
        asyncio.run(streams(url, 1, 1, 16))  # warm-up
        for num in [int(s) for s in args.streams.split(",")]:
            before, c0, w0 = thread_cpu_ns(proc.pid), time.process_time(), time.perf_counter()
            res = asyncio.run(streams(url, num, args.rounds, args.max_tokens))
            if args.cpu:
                print(cpu_report(proc.pid, before, thread_cpu_ns(proc.pid),
                                 time.process_time() - c0, num * args.rounds * args.max_tokens,
                                 time.perf_counter() - w0), flush=True)
            ttft = statistics.median(t for t, _ in res)
            speed = statistics.median(s for _, s in res)
            print(f"server {num} stream(s): per-stream {speed:.1f} tok/s (all {speed * num:.0f}), "
                  f"TTFT median {ttft * 1e3:.0f} ms, max {max(t for t, _ in res) * 1e3:.0f}",
                  flush=True)
        if args.long:
            ttfts = asyncio.run(long_prompt(url, args.long))
            print(f"server 2048-token prompt: TTFT {' '.join(f'{t * 1e3:.0f}' for t in ttfts)} ms",
                  flush=True)
    finally:
        # (py-spy writes its profile on SIGINT)
        proc.send_signal(signal.SIGINT if args.server_prefix else signal.SIGTERM)
        proc.wait(timeout=60)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["engine", "server"])
    p.add_argument("--batches", default="1,4")
    p.add_argument("--streams", default="1,4")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--long", type=int, default=0, help="times to send the 2,048-token prompt")
    p.add_argument("--busy", type=int, default=0)
    p.add_argument("--serve-args", default="")
    p.add_argument("--server-prefix", default="", help="server: run it under this command")
    p.add_argument("--cpu", action="store_true", help="server: CPU time per token, by thread")
    p.add_argument("--quantization", default="none", choices=("none", "q8_0", "gguf"),
                   help="the weights kept as Q8_0 blocks, or the file's own (gguf) "
                        "(engine; server: passed to serve)")
    args = p.parse_args()
    if args.mode == "engine":  # as `tokenmill serve` does, before torch loads
        from tokenmill.engine.openmp_wait import apply_openmp_wait_policy

        print(apply_openmp_wait_policy(os.environ.get("POLICY")), flush=True)
    busy = start_busy(args.busy)
    try:
        engine(args) if args.mode == "engine" else server(args)
    finally:
        for b in busy:
            b.kill()
            b.wait()


if __name__ == "__main__":
    main()
