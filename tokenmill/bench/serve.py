"""`tokenmill bench serve`: latency under load against any OpenAI-compatible server.

serve-B (docs/WORKLOADS.md): the throughput-A requests with CAP 128, sent as
streaming `/v1/completions` with prompt token ids, `max_tokens` = the drawn
length, `ignore_eos`, temperature 0, with Poisson arrivals (default_rng(2) for
the gaps) at each rate. Metrics are defined as `vllm bench serve` defines them:

- TTFT: send -> first streamed token;
- TPOT: (e2e - TTFT) / (output tokens - 1), per request with > 1 output token;
- ITL: the gaps between successive streamed chunks, over all requests;
- E2E: send -> last chunk;
- goodput: requests per second that met every given SLO.

Every rate sends the same prompts (the first --num-requests of throughput-A),
so run the server with prefix caching off (`--no-enable-prefix-caching`, in
tokenmill and vLLM alike): with it on, each rate after the first finds every
prompt cached and its TTFT is no prefill at all (`bench all` does so).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.bench import extras
from tokenmill.bench.workloads import throughput_a

PERCENTILES = (50, 90, 99)


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int
    output_tokens: int = 0
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    error: str = ""


@dataclass
class StreamResult(RequestResult):
    text: str = ""
    finish_reason: str | None = None


@dataclass
class RateReport:
    rate: float  # requests per second asked for (inf: all at once)
    num_requests: int
    num_ok: int
    duration_s: float
    request_throughput: float  # completed requests / s
    output_throughput: float  # generated tokens / s
    total_token_throughput: float
    goodput: float | None  # requests / s meeting every SLO given
    # {"mean": ..., "p50": ..., "p90": ..., "p99": ...} in milliseconds
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2e_ms: dict[str, float]
    errors: list[str]


def summarize(values_s: list[float]) -> dict[str, float]:
    if not values_s:
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in PERCENTILES}}
    arr = np.asarray(values_s) * 1000.0
    return {"mean": float(arr.mean()), **{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}}


def tpot_s(r: RequestResult) -> float | None:
    if r.output_tokens <= 1:
        return None
    return (r.e2e_s - r.ttft_s) / (r.output_tokens - 1)


def build_report(
    rate: float,
    results: list[RequestResult],
    duration_s: float,
    slo_ttft_ms: float | None = None,
    slo_tpot_ms: float | None = None,
) -> RateReport:
    ok = [r for r in results if r.ok]
    tpots = [t for t in (tpot_s(r) for r in ok) if t is not None]
    goodput = None
    if slo_ttft_ms is not None or slo_tpot_ms is not None:
        good = 0
        for r in ok:
            t = tpot_s(r)
            if slo_ttft_ms is not None and r.ttft_s * 1000 > slo_ttft_ms:
                continue
            if slo_tpot_ms is not None and t is not None and t * 1000 > slo_tpot_ms:
                continue
            good += 1
        goodput = good / duration_s
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    return RateReport(
        rate=rate,
        num_requests=len(results),
        num_ok=len(ok),
        duration_s=duration_s,
        request_throughput=len(ok) / duration_s,
        output_throughput=out_tokens / duration_s,
        total_token_throughput=(out_tokens + in_tokens) / duration_s,
        goodput=goodput,
        ttft_ms=summarize([r.ttft_s for r in ok]),
        tpot_ms=summarize(tpots),
        itl_ms=summarize([x for r in ok for x in r.itl_s]),
        e2e_ms=summarize([r.e2e_s for r in ok]),
        errors=sorted({r.error for r in results if not r.ok})[:5],
    )


async def send_one(
    client: Any, url: str, model: str, prompt: list[int], max_tokens: int,
    headers: dict[str, str], timeout_s: float,
) -> RequestResult:
    """One streaming completion of serve-B (greedy, EOS ignored), timed by stream_one."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True}
    return await stream_one(client, url, body, headers, timeout_s)


def client_session(timeout_s: float) -> Any:
    """The benchmark's HTTP client: one aiohttp session a run, for every server
    alike. aiohttp, not httpx: on a 2-core machine the client's CPU a token is
    taken from the server's step, and httpx spends ~10x more of it a chunk
    (docs/perf-notes.md, "The benchmark's client")."""
    import aiohttp

    return aiohttp.ClientSession(
        # No cap: every stream its own connection. A new connection a request, closed after
        # it: a server may close a kept-alive connection while the client reuses it
        # (llama-server after its keep-alive limit), and the request would fail unsent.
        connector=aiohttp.TCPConnector(limit=0, force_close=True),
        timeout=read_timeout(timeout_s),
    )


def read_timeout(timeout_s: float) -> Any:
    """As httpx's timeout: each connect and each read may take `timeout_s`, a
    whole stream as long as it keeps sending."""
    import aiohttp

    return aiohttp.ClientTimeout(total=None, connect=timeout_s, sock_read=timeout_s)


async def stream_one(client: Any, url: str, body: dict[str, Any], headers: dict[str, str],
                     timeout_s: float) -> StreamResult:
    """One streamed request to /v1/completions (choices[0].text) or
    /v1/chat/completions (choices[0].delta.content), on `client` (an aiohttp
    ClientSession: client_session()); times each chunk with text."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    prompt = body.get("prompt")
    result = StreamResult(ok=False, prompt_tokens=len(prompt) if isinstance(prompt, list) else 0)
    start = last = time.perf_counter()
    chunks = 0
    usage: dict[str, Any] | None = None
    parts: list[str] = []
    try:
        async with client.post(url, json=body, headers=headers, timeout=read_timeout(timeout_s)) as resp:
            if resp.status != 200:
                text = (await resp.read()).decode(errors="replace")
                result.error = f"HTTP {resp.status}: {text[:200]}"
                return result
            pending = b""
            done = False
            # Lines split by hand from whatever the socket gave (one SSE event a
            # line that starts with "data:"; others, and blank lines, skipped).
            async for data in resp.content.iter_any():
                lines = (pending + data).split(b"\n")
                pending = lines.pop()
                for raw in lines:
                    if not raw.startswith(b"data:"):
                        continue
                    line = raw[5:].strip()
                    if line == b"[DONE]":
                        done = True
                        break
                    payload = json.loads(line)
                    if payload.get("usage"):
                        usage = payload["usage"]
                    for choice in payload.get("choices") or []:
                        if choice.get("finish_reason"):
                            result.finish_reason = choice["finish_reason"]
                        piece = choice.get("text")
                        if piece is None:
                            piece = (choice.get("delta") or {}).get("content")
                        if not piece:
                            continue
                        now = time.perf_counter()
                        if chunks == 0:
                            result.ttft_s = now - start
                        else:
                            result.itl_s.append(now - last)
                        last = now
                        chunks += 1
                        parts.append(piece)
                if done:
                    break
    except Exception as e:  # a failed request is reported, never fatal to the run
        result.error = f"{type(e).__name__}: {e}"[:200]
        return result
    result.e2e_s = last - start
    result.text = "".join(parts)
    if usage:
        result.output_tokens = int(usage.get("completion_tokens") or chunks)
        result.prompt_tokens = int(usage.get("prompt_tokens") or result.prompt_tokens)
    else:
        result.output_tokens = chunks  # one token a chunk without speculation
    result.ok = chunks > 0
    if not result.ok:
        result.error = "no tokens streamed"
    return result


async def run_rate(
    base_url: str, model: str, prompts: list[list[int]], output_lens: list[int], rate: float,
    seed: int = 2, api_key: str | None = None, timeout_s: float = 600.0,
) -> tuple[list[RequestResult], float]:
    """Send every request at its Poisson arrival time; wait for all."""
    rng = np.random.default_rng(seed)
    gaps = rng.exponential(1.0 / rate, size=len(prompts)) if np.isfinite(rate) else np.zeros(len(prompts))
    gaps[0] = 0.0
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with client_session(timeout_s) as client:
        start = time.perf_counter()
        tasks = []
        for prompt, n, gap in zip(prompts, output_lens, gaps, strict=True):
            await asyncio.sleep(float(gap))
            tasks.append(asyncio.create_task(
                send_one(client, url, model, prompt, n, headers, timeout_s)))
        results = list(await asyncio.gather(*tasks))
        return results, time.perf_counter() - start


def format_table(reports: list[RateReport]) -> str:
    lines = ["| rate req/s | ok | req/s | out tok/s | TTFT mean/p50/p90/p99 ms | "
             "TPOT mean/p50/p90/p99 ms | ITL mean/p50/p90/p99 ms | E2E mean/p50/p90/p99 ms | goodput |",
             "|" + "---|" * 9]

    def q(d: dict[str, float]) -> str:
        return "/".join(f"{d[k]:.0f}" for k in ("mean", "p50", "p90", "p99"))

    for r in reports:
        goodput = f"{r.goodput:.2f}" if r.goodput is not None else "-"
        lines.append(
            f"| {r.rate:g} | {r.num_ok}/{r.num_requests} | {r.request_throughput:.2f} | "
            f"{r.output_throughput:.1f} | {q(r.ttft_ms)} | {q(r.tpot_ms)} | {q(r.itl_ms)} | "
            f"{q(r.e2e_ms)} | {goodput} |"
        )
    return "\n".join(lines)


def plot(reports: list[RateReport], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r.rate for r in reports]
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    for ax, key, label in zip(axes, ("ttft_ms", "tpot_ms", "e2e_ms"),
                              ("time to first token", "time per output token", "end-to-end latency"),
                              strict=True):
        for p in ("p50", "p90", "p99"):
            ax.plot(rates, [getattr(r, key)[p] for r in reports], marker="o", label=p)
        ax.set_xlabel("request rate (req/s, Poisson)")
        ax.set_ylabel(f"{label} (ms)")
        ax.set_title(label)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def add_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--rates", default="0.5,1,2,4")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--workload", default="serve-B", choices=["serve-B"])
    p.add_argument("--slo-ttft-ms", type=float, default=None)
    p.add_argument("--slo-tpot-ms", type=float, default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--label", default="tokenmill", help="name of the server, for the report")
    p.add_argument("--output-dir", default="bench-results")


def _first_model(base_url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30)
    resp.raise_for_status()
    return str(resp.json()["data"][0]["id"])


def warm_up(base_url: str, model: str, prompt: list[int], api_key: str | None = None) -> None:
    """One short request first (as `vllm bench serve` sends a test prompt): the
    server's first-call costs stay out of the first rate's numbers."""
    warmup, _ = asyncio.run(run_rate(base_url, model, [prompt], [4], float("inf"),
                                     api_key=api_key))
    if not warmup[0].ok:
        raise RuntimeError(f"the warm-up request failed: {warmup[0].error}")


def main_serve(args: argparse.Namespace) -> int:
    extras.require("aiohttp", "httpx", "matplotlib")
    workload = throughput_a(128)
    n = args.num_requests
    prompts, lens = workload.prompts[:n], workload.output_lens[:n]
    model = args.model or _first_model(args.base_url, args.api_key)
    warm_up(args.base_url, model, prompts[0], args.api_key)
    reports = []
    for rate_text in args.rates.split(","):
        rate = float(rate_text)
        print(f"== {args.label}: {n} requests at {rate:g} req/s", file=sys.stderr, flush=True)
        results, duration = asyncio.run(
            run_rate(args.base_url, model, prompts, lens, rate, api_key=args.api_key))
        reports.append(build_report(rate, results, duration, args.slo_ttft_ms, args.slo_tpot_ms))
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"serve-{args.label}"
    (out / f"{stem}.json").write_text(json.dumps([asdict(r) for r in reports], indent=2))
    plot(reports, out / f"{stem}.png", f"serve-B against {args.label} ({model})")
    print(format_table(reports))
    print(f"\nwrote {out / stem}.json and .png")
    return 0 if all(r.num_ok == r.num_requests for r in reports) else 1


def stop(process: subprocess.Popen[bytes], timeout_s: float = 30.0) -> None:
    """Terminate a process still running; kill it if it has not exited in `timeout_s`."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def spawn_server(cmd: list[str], env: dict[str, str], log_path: Path | None) -> subprocess.Popen[bytes]:
    """Start a server process, its output to `log_path` (or nowhere)."""
    log = open(log_path, "w") if log_path else subprocess.DEVNULL  # noqa: SIM115
    try:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    finally:
        if log_path:
            log.close()  # type: ignore[union-attr]


def wait_healthy(server: subprocess.Popen[bytes], base_url: str, timeout_s: float, what: str,
                 where: str) -> None:
    """Return once GET /health is a 200; RuntimeError if `server` exits or
    `timeout_s` passes first (`where` says where its log is)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        if server.poll() is not None:
            raise RuntimeError(f"{what} exited with {server.returncode}{where}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} was not healthy in {timeout_s:.0f} s{where}")
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def running_server(cmd: list[str], base_url: str, label: str, *,
                   env: dict[str, str] | None = None, log_path: Path | None = None,
                   startup_timeout_s: float = 180.0, stop_timeout_s: float = 30.0
                   ) -> Iterator[subprocess.Popen[bytes]]:
    """A server (`cmd`) from the moment its /health answers until the block ends,
    then stopped (terminated, killed after `stop_timeout_s`)."""
    server = spawn_server(cmd, {**os.environ, **(env or {})}, log_path)
    where = f"; see {log_path}" if log_path else ""
    try:
        wait_healthy(server, base_url, startup_timeout_s, f"{label}'s server", where)
        yield server
    finally:
        stop(server, stop_timeout_s)


def run_against_server(
    cmd: list[str], base_url: str, label: str, args: argparse.Namespace, out: Path, *,
    model: str | None = None, env: dict[str, str] | None = None, log_path: Path | None = None,
    startup_timeout_s: float = 180.0, stop_timeout_s: float = 30.0,
) -> list[RateReport]:
    """Start a server (`cmd`), wait until its /health answers, run serve-B at
    args.rates against it (out/serve-LABEL.json), stop it."""
    extras.require("aiohttp", "httpx", "matplotlib")

    out.mkdir(parents=True, exist_ok=True)
    with running_server(cmd, base_url, label, env=env, log_path=log_path,
                        startup_timeout_s=startup_timeout_s, stop_timeout_s=stop_timeout_s):
        main_serve(argparse.Namespace(
            base_url=base_url, model=model, rates=args.rates, num_requests=args.num_requests,
            workload="serve-B", slo_ttft_ms=None, slo_tpot_ms=None, api_key=None,
            label=label, output_dir=str(out)))
        return [RateReport(**d) for d in json.loads((out / f"serve-{label}.json").read_text())]
