"""`tokenmill bench soak`: a bounded soak of `tokenmill serve` under mixed traffic.

It starts the server as a subprocess on a free loopback port (only 127.0.0.1),
optionally starts `--busy-cores` spinning processes beside it (a machine busy
with another job), and runs `--concurrency` clients for `--minutes`: completions
and chat, streaming and not, random `max_tokens` up to 300 (`--max-tokens`) and random sampling
options (temperature, top_p, top_k, seed, n up to 4, logprobs, stop); 30% of
the streams are dropped mid-way (the client closes the connection). Then it
checks what a user would call a failure:

- no 5xx (and no 4xx: every request it sends is valid);
- no stream without progress for `--stall-s` (the gap before its first chunk
  and between chunks); a non-streamed request shows no progress until it ends,
  so its whole time is reported beside (a slow one is not a hang; one that
  never ends runs into the read timeout, `--drain-s`, an error);
- no cut stream: every stream not dropped ends with a final chunk for each
  choice and `[DONE]`;
- the KV cache back to 0 and no request left running once the traffic stops
  (from /metrics);
- the server's RSS at start, middle and end (from /proc);
- with `--check-greedy N`: N greedy prompts are sent one at a time while the
  server is idle, then all N together, round after round, during the traffic;
  every answer must be the idle text (batch invariance: the same tokens
  whatever else runs, preemption and chunking included), and every prompt
  must have been checked under the traffic.

One summary line, the JSON with `--output`; the exit status is 1 when a check
failed. Everything is bounded: requests stop being sent at `--minutes`, and
those still running get `--drain-s` more.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.bench import extras
from tokenmill.bench.serve import free_port, spawn_server, stop, wait_healthy

HOST = "127.0.0.1"
MAX_TOKENS = 300
DROP_FRACTION = 0.3
MAX_PROBLEMS_KEPT = 50  # problem requests written to the JSON, first ones first
WORDS = (
    "the", "river", "stone", "light", "quiet", "engine", "paper", "seven", "window", "garden",
    "music", "cold", "market", "number", "story", "bright", "field", "winter", "road",
    "silver", "morning", "question", "answer", "city", "old", "small", "green", "cloud",
    "letter", "mountain", "simple", "reason", "between", "water", "thousand", "orange",
)
STOPS = ([" the"], ["\n"], [".", "!"], ["and", "or", "but"])
# --check-greedy's prompts (the first N; more than these are refused).
GREEDY_PROMPTS = (
    "Once upon a time, in a village by the sea,", "The three most important rules of cooking are",
    "Here is a short story about a robot who learns to paint:", "The history of the bicycle begins",
    "A letter to my younger self:", "The best way to learn a new language is",
    "In the year 2100, cities will", "Write a poem about the winter morning light.",
    "The main causes of the French Revolution were", "How do bees make honey? First,",
    "My favourite place in the world is", "The recipe for a simple bread needs",
    "Explain to a child why the sky is blue.", "The old lighthouse keeper opened the door and",
    "Ten tips for a good night's sleep:", "The difference between weather and climate is",
)
MAX_MISMATCHES_KEPT = 20


@dataclass
class RequestRecord:
    index: int
    route: str  # "completions" or "chat"
    stream: bool
    n: int
    max_tokens: int
    drop_after_chunks: int | None  # a stream the client drops after this many chunks
    started_s: float = 0.0  # since the traffic started
    duration_s: float = 0.0
    status: int | None = None  # HTTP status (None: no response)
    max_gap_s: float = 0.0  # longest time without a byte of progress
    num_chunks: int = 0
    dropped: bool = False
    cut: bool = False  # a stream that ended without its final chunks and [DONE]
    error: str = ""


@dataclass
class SoakReport:
    config: dict[str, Any]
    num_requests: int = 0
    num_5xx: int = 0
    num_4xx: int = 0
    num_transport_errors: int = 0
    num_stalled: int = 0  # streams without a chunk for stall_s or more
    longest_gap_s: float = 0.0  # of the streams
    # Non-streamed requests show no progress until they end: their whole time is
    # reported (a slow one is not a hang); one that never ends is a timeout error.
    num_slow_non_stream: int = 0  # those that took stall_s or more
    longest_non_stream_s: float = 0.0
    # Requests whose longest time without progress reached each threshold, streamed
    # (gaps between chunks) and not (the whole request), e.g. {"stream": {"10": 0}}.
    gap_counts: dict[str, dict[str, int]] = field(default_factory=dict)
    num_cut_streams: int = 0
    num_streams: int = 0
    num_dropped_streams: int = 0
    num_unfinished: int = 0  # still running when the drain time ran out
    num_preemptions: float | None = None
    kv_back_to_zero: bool = False
    kv_usage_end: float | None = None
    rss_mib: dict[str, float] = field(default_factory=dict)  # start, mid, end
    duration_s: float = 0.0
    timeline: list[dict[str, float]] = field(default_factory=list)
    problems: list[dict[str, Any]] = field(default_factory=list)
    # --check-greedy: answers compared with the idle text, those that differed (the first ones kept).
    num_greedy_checked: int = 0
    num_greedy_mismatches: int = 0
    num_greedy_rounds: int = 0  # rounds begun under the traffic, each all N prompts
    greedy_mismatches: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return (self.num_5xx == 0 and self.num_4xx == 0 and self.num_transport_errors == 0
                and self.num_stalled == 0 and self.num_cut_streams == 0
                and self.num_unfinished == 0 and self.kv_back_to_zero
                and self.num_greedy_mismatches == 0
                and (not self.config.get("check_greedy") or self.num_greedy_rounds > 0))

    def summary(self) -> str:
        rss = "/".join(f"{self.rss_mib.get(k, float('nan')):.0f}" for k in ("start", "mid", "end"))
        stall_s = self.config["stall_s"]
        return (
            f"soak: {self.num_requests} requests in {self.duration_s / 60:.1f} min, "
            f"5xx {self.num_5xx}, 4xx {self.num_4xx}, errors {self.num_transport_errors}, "
            f"hangs (a stream without a chunk >= {stall_s:g} s) {self.num_stalled} "
            f"(longest gap {self.longest_gap_s:.1f} s), non-streamed >= {stall_s:g} s "
            f"{self.num_slow_non_stream} (longest {self.longest_non_stream_s:.1f} s), "
            f"cut streams {self.num_cut_streams} "
            f"of {self.num_streams - self.num_dropped_streams} (dropped {self.num_dropped_streams}), "
            f"unfinished {self.num_unfinished}, preemptions {self.num_preemptions or 0:.0f}, "
            f"KV back to 0: {'yes' if self.kv_back_to_zero else 'NO'}, "
            + (f"greedy answers unlike the idle text {self.num_greedy_mismatches} of {self.num_greedy_checked} "
               f"({self.num_greedy_rounds} rounds of {self.config['check_greedy']} prompts), "
               if self.config.get("check_greedy") else "")
            + f"RSS start/mid/end {rss} MiB -> {'ok' if self.ok else 'FAILED'}"
        )


# ---- the server and the busy processes ----------------------------------------------


def server_command(args: argparse.Namespace, port: int) -> list[str]:
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--host", HOST, "--port", str(port)]
    if args.model:
        cmd += ["--model", args.model]
    if args.kv_cache_memory_bytes is not None:
        cmd += ["--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)]
    return cmd + shlex.split(args.serve_args or "")


def start_busy(num: int) -> list[subprocess.Popen[bytes]]:
    """`num` processes that spin on a core each: another job on the machine."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(num)]




def rss_mib(pid: int) -> float:
    """The process's resident set (VmRSS) in MiB; nan where /proc has none."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return float("nan")
    match = re.search(r"^VmRSS:\s+(\d+) kB", text, re.MULTILINE)
    return int(match.group(1)) / 1024 if match else float("nan")


def metric_value(text: str, name: str) -> float | None:
    """The first sample of one Prometheus series in /metrics text (None when absent)."""
    match = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})?\s+(\S+)$", text, re.MULTILINE)
    return float(match.group(1)) if match else None


# ---- the traffic --------------------------------------------------------------------


def make_request(rng: random.Random, index: int, max_model_len: int, max_tokens_cap: int = MAX_TOKENS
                 ) -> tuple[RequestRecord, str, dict[str, Any]]:
    """One random, valid request: (its record, the route, the JSON body)."""
    route = rng.choice(("completions", "chat"))
    stream = rng.random() < 0.5
    n = rng.choice((1, 1, 1, 2, 3, 4))
    # Prompts stay short (< 100 tokens), so any max_tokens up to the cap fits the context.
    max_tokens = rng.randint(1, max(1, min(max_tokens_cap, max_model_len - 128)))
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 40)))
    body: dict[str, Any] = {"model": "", "max_tokens": max_tokens, "n": n, "stream": stream}
    # n > 1 needs sampling: greedy samples would all be the same (a 400).
    body["temperature"] = rng.choice((0.0, 0.7, 1.0, 1.5)) if n == 1 else rng.choice((0.7, 1.0))
    if rng.random() < 0.5:
        body["top_p"] = rng.choice((0.5, 0.9, 1.0))
    if rng.random() < 0.5:
        body["top_k"] = rng.choice((-1, 1, 5, 50))
    if rng.random() < 0.5:
        body["seed"] = rng.randint(0, 2**31 - 1)
    if rng.random() < 0.3:
        body["stop"] = rng.choice(STOPS)
    if stream and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if route == "completions":
        body["prompt"] = text
        if rng.random() < 0.3:
            body["logprobs"] = rng.randint(0, 5)
    else:
        messages = [{"role": "user", "content": text}]
        if rng.random() < 0.3:
            messages.insert(0, {"role": "system", "content": "Answer briefly."})
        body["messages"] = messages
        if rng.random() < 0.3:
            body["logprobs"] = True
            body["top_logprobs"] = rng.randint(0, 5)
    drop = rng.randint(1, 20) if stream and rng.random() < DROP_FRACTION else None
    record = RequestRecord(index=index, route=route, stream=stream, n=n,
                           max_tokens=max_tokens, drop_after_chunks=drop)
    return record, "/v1/completions" if route == "completions" else "/v1/chat/completions", body


async def send(client: Any, path: str, body: dict[str, Any], record: RequestRecord,
               t0: float) -> None:
    """Send one request and fill in its record: status, gaps, chunks, cut or dropped."""
    start = time.monotonic()
    record.started_s = start - t0
    last = start

    def progress() -> None:
        nonlocal last
        now = time.monotonic()
        record.max_gap_s = max(record.max_gap_s, now - last)
        last = now

    try:
        if not record.stream:
            response = await client.post(path, json=body)
            progress()
            record.status = response.status_code
            if response.status_code >= 400:
                record.error = response.text[:300]
            return
        async with client.stream("POST", path, json=body) as response:
            record.status = response.status_code
            if response.status_code >= 400:
                progress()
                record.error = (await response.aread()).decode(errors="replace")[:300]
                return
            finished: set[int] = set()
            done = False
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                progress()
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    continue
                record.num_chunks += 1
                chunk = json.loads(data)
                if "error" in chunk:
                    record.error = str(chunk["error"])[:300]
                for choice in chunk.get("choices", []):
                    if choice.get("finish_reason") is not None:
                        finished.add(int(choice["index"]))
                if record.drop_after_chunks is not None and \
                        record.num_chunks >= record.drop_after_chunks and not done:
                    record.dropped = True
                    return  # leaving the block closes the connection mid-stream
            record.cut = not (done and finished == set(range(record.n)))
            if record.cut and not record.error:
                record.error = f"stream ended: [DONE] {done}, final chunks {sorted(finished)}"
    except Exception as e:  # a transport error is a finding, not the end of the soak
        record.error = f"{type(e).__name__}: {e}"[:300]
        # A stream the server answered and then broke off is a cut stream.
        record.cut = record.stream and record.status == 200 and not record.dropped
    finally:
        now = time.monotonic()
        if not record.dropped:  # a dropped stream's wait after the drop is not the server's
            record.max_gap_s = max(record.max_gap_s, now - last)
        record.duration_s = now - start


async def greedy_text(client: Any, model: str, prompt: str, max_tokens: int) -> str:
    """One greedy completion's text (an error raises: the check needs every answer)."""
    response = await client.post("/v1/completions", json={
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0})
    response.raise_for_status()
    return str(response.json()["choices"][0]["text"])


async def check_greedy(client: Any, model: str, prompts: list[str], idle: list[str], max_tokens: int,
                       report: SoakReport, stop_at: float) -> None:
    """All the greedy prompts at once, round after round until stop_at (a round
    begun finishes), each answer compared with its idle text."""
    while time.monotonic() < stop_at:
        report.num_greedy_rounds += 1
        answers = await asyncio.gather(*(greedy_text(client, model, p, max_tokens) for p in prompts))
        for k, got in enumerate(answers):
            report.num_greedy_checked += 1
            if got != idle[k]:
                report.num_greedy_mismatches += 1
                if len(report.greedy_mismatches) < MAX_MISMATCHES_KEPT:
                    at = next((j for j, (a, b) in enumerate(zip(got, idle[k], strict=False)) if a != b),
                              min(len(got), len(idle[k])))  # (the first character that differs)
                    report.greedy_mismatches.append({"prompt": k, "differs_at_char": at, "idle": idle[k],
                                                     "got": got})


async def monitor(client: Any, pid: int, t0: float, report: SoakReport, stop_at: float,
                  period_s: float = 5.0) -> None:
    """Every period_s: the server's RSS and its scheduler gauges; the RSS at mid-time."""
    mid = t0 + (stop_at - t0) / 2
    while time.monotonic() < stop_at:
        await asyncio.sleep(min(period_s, max(0.0, stop_at - time.monotonic())))
        now = time.monotonic()
        sample: dict[str, float] = {"t_s": round(now - t0, 1), "rss_mib": round(rss_mib(pid), 1)}
        try:
            text = (await client.get("/metrics")).text
            for key, name in (("kv_usage", "tokenmill:kv_cache_usage_perc"),
                              ("running", "tokenmill:num_requests_running"),
                              ("waiting", "tokenmill:num_requests_waiting")):
                value = metric_value(text, name)
                if value is not None:
                    sample[key] = value
        except Exception:  # the metrics are for the record; the checks come at the end
            pass
        report.timeline.append(sample)
        if "mid" not in report.rss_mib and now >= mid:
            report.rss_mib["mid"] = sample["rss_mib"]


async def run_traffic(args: argparse.Namespace, base_url: str, pid: int) -> SoakReport:
    import httpx

    report = SoakReport(config={k: v for k, v in vars(args).items() if k != "func"})
    rng = random.Random(args.seed)
    timeout = httpx.Timeout(connect=10.0, read=args.drain_s, write=30.0, pool=args.drain_s)
    limits = httpx.Limits(max_connections=args.concurrency + args.check_greedy + 4)
    async with httpx.AsyncClient(base_url=base_url, timeout=timeout, limits=limits) as client:
        models = (await client.get("/v1/models")).json()["data"][0]
        max_model_len = int(models.get("max_model_len") or 2048)
        report.rss_mib["start"] = rss_mib(pid)
        prompts = list(GREEDY_PROMPTS[:args.check_greedy])
        idle = [await greedy_text(client, models["id"], p, args.greedy_max_tokens) for p in prompts]
        records: list[RequestRecord] = []
        t0 = time.monotonic()
        stop_at = t0 + args.minutes * 60

        async def worker() -> None:
            while time.monotonic() < stop_at and len(records) < args.max_requests:
                record, path, body = make_request(rng, len(records), max_model_len,
                                                  args.max_tokens)
                body["model"] = models["id"]
                records.append(record)
                await send(client, path, body, record, t0)

        workers = [asyncio.create_task(worker()) for _ in range(args.concurrency)]
        watcher = asyncio.create_task(monitor(client, pid, t0, report, stop_at))
        if prompts:
            workers.append(asyncio.create_task(check_greedy(
                client, models["id"], prompts, idle, args.greedy_max_tokens, report, stop_at)))
        _, pending = await asyncio.wait(workers, timeout=args.minutes * 60 + args.drain_s)
        for task in pending:  # bounded: what still runs past the drain time is unfinished
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        report.num_unfinished = len(pending)
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
        report.duration_s = time.monotonic() - t0

        # Aborts of dropped streams apply at the next step boundary: give them a moment.
        deadline = time.monotonic() + 30
        while True:
            text = (await client.get("/metrics")).text
            usage = metric_value(text, "tokenmill:kv_cache_usage_perc")
            running = metric_value(text, "tokenmill:num_requests_running")
            waiting = metric_value(text, "tokenmill:num_requests_waiting")
            report.kv_back_to_zero = usage == 0 and running == 0 and waiting == 0
            if report.kv_back_to_zero or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        report.kv_usage_end = usage
        report.num_preemptions = metric_value(text, "tokenmill:num_preemptions_total")
        report.rss_mib["end"] = rss_mib(pid)
        report.rss_mib.setdefault("mid", float("nan"))

    tally(report, records, args.stall_s)
    return report


GAP_THRESHOLDS_S = (5, 10, 20, 30, 60)


def tally(report: SoakReport, records: list[RequestRecord], stall_s: float) -> None:
    report.num_requests = len(records)
    for kind, stream in (("stream", True), ("non-stream", False)):
        report.gap_counts[kind] = {
            str(t): sum(r.stream is stream and r.max_gap_s >= t for r in records)
            for t in GAP_THRESHOLDS_S
        }
    for r in records:
        problem = []
        if r.status is not None and r.status >= 500:
            report.num_5xx += 1
            problem.append("5xx")
        elif r.status is not None and r.status >= 400:
            report.num_4xx += 1
            problem.append("4xx")
        elif r.error and not r.cut and r.status is None:
            report.num_transport_errors += 1
            problem.append("error")
        if r.stream:
            report.num_streams += 1
            report.num_dropped_streams += r.dropped
            if r.cut:
                report.num_cut_streams += 1
                problem.append("cut")
        if not r.stream:
            report.longest_non_stream_s = max(report.longest_non_stream_s, r.max_gap_s)
            report.num_slow_non_stream += r.max_gap_s >= stall_s
        else:
            report.longest_gap_s = max(report.longest_gap_s, r.max_gap_s)
            if r.max_gap_s >= stall_s:
                report.num_stalled += 1
                problem.append("stalled")
        if problem and len(report.problems) < MAX_PROBLEMS_KEPT:
            report.problems.append({"problem": problem, **asdict(r)})


def run_soak(args: argparse.Namespace) -> SoakReport:
    extras.require("httpx")

    port = free_port()
    base_url = f"http://{HOST}:{port}"
    log_path = Path(args.server_log) if args.server_log else None
    env = {**os.environ, **dict(kv.split("=", 1) for kv in args.server_env)}
    server = spawn_server(server_command(args, port), env, log_path)
    busy: list[subprocess.Popen[bytes]] = []
    where = f"; see {log_path}" if log_path else " (--server-log FILE keeps its output)"
    try:
        wait_healthy(server, base_url, args.startup_timeout_s, "the server", where)
        busy = start_busy(args.busy_cores)
        report = asyncio.run(run_traffic(args, base_url, server.pid))
        if server.poll() is not None:
            raise RuntimeError(f"the server died during the soak{where}")
        return report
    finally:
        for process in busy:
            stop(process)
        stop(server)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--minutes", type=float, default=5.0, help="how long to send requests")
    p.add_argument("--concurrency", type=int, default=16, help="clients sending at once")
    p.add_argument("--model", default=None, help="the model to serve (default: the default model)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                   help="the server's KV pool (small: constant preemption)")
    p.add_argument("--busy-cores", type=int, default=0,
                   help="start this many spinning processes beside the server (another job)")
    p.add_argument("--stall-s", type=float, default=10.0,
                   help="a request without progress this long counts as a hang")
    p.add_argument("--drain-s", type=float, default=300.0,
                   help="time the requests still running at the end get to finish")
    p.add_argument("--max-tokens", type=int, default=MAX_TOKENS,
                   help="each request's max_tokens is drawn from 1 to this")
    p.add_argument("--max-requests", type=int, default=1_000_000, help="stop after this many")
    p.add_argument("--seed", type=int, default=0, help="the traffic's random seed")
    p.add_argument("--check-greedy", type=int, default=0, metavar="N",
                   help=f"N greedy prompts (at most {len(GREEDY_PROMPTS)}) answered idle first, then again "
                        "during the traffic: any answer unlike the idle text fails the soak")
    p.add_argument("--greedy-max-tokens", type=int, default=200, help="max_tokens of --check-greedy's prompts")
    p.add_argument("--serve-args", default="",
                   help="more `tokenmill serve` options, as one string (e.g. '--dtype float32')")
    p.add_argument("--server-env", action="append", default=[], metavar="NAME=VALUE",
                   help="an environment variable for the server (repeatable)")
    p.add_argument("--server-log", default=None, help="write the server's output here")
    p.add_argument("--startup-timeout-s", type=float, default=300.0)
    p.add_argument("--output", default=None, help="write the report as JSON here")


def main_soak(args: argparse.Namespace) -> int:
    if args.minutes <= 0 or args.concurrency < 1 or args.busy_cores < 0:
        raise ValueError("--minutes must be > 0, --concurrency >= 1 and --busy-cores >= 0")
    if not 0 <= args.check_greedy <= len(GREEDY_PROMPTS) or args.greedy_max_tokens < 1:
        raise ValueError(f"--check-greedy takes 0 to {len(GREEDY_PROMPTS)} prompts, "
                         "and --greedy-max-tokens at least 1")
    report = run_soak(args)
    print(report.summary())
    if args.output:
        path = Path(args.output)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**asdict(report), "ok": report.ok}, indent=1) + "\n")
    return 0 if report.ok else 1
