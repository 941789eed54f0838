"""Closed-loop streaming clients and the per-phase report, shared by `bench interactive`
and `bench editing`; plus the servers they start and the bounded busy process.

A phase runs S streams at once; each stream sends its requests one after the
other (closed loop: the next leaves when the previous one's last chunk came).
Metrics, as `vllm bench serve` defines them (tokenmill/bench/serve.py):
- TTFT: send -> first chunk with text; ITL: the gaps between chunks;
- TPOT: (e2e - TTFT) / (output tokens - 1) per request; per-stream tok/s is
  1000 / mean TPOT: the speed a reader sees once tokens flow (with speculation a
  chunk may carry several tokens, so it is tokens, not chunks, that count);
- total tok/s: the phase's generated tokens / the phase's wall time.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenmill.bench.serve import (
    StreamResult,
    client_session,
    free_port,
    spawn_server,
    stream_one,
    summarize,
    wait_healthy,
)


@dataclass
class PhaseReport:
    name: str
    streams: int
    num_requests: int
    num_ok: int
    wall_s: float
    output_tokens: int
    per_stream_tok_s: float  # 1000 / mean TPOT
    total_tok_s: float  # all generated tokens / wall
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    errors: list[str] = field(default_factory=list)


def phase_report(name: str, streams: int, results: Sequence[StreamResult], wall_s: float) -> PhaseReport:
    ok = [r for r in results if r.ok]
    tpots = [(r.e2e_s - r.ttft_s) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    tpot = summarize(tpots)
    out = sum(r.output_tokens for r in ok)
    return PhaseReport(
        name=name, streams=streams, num_requests=len(results), num_ok=len(ok), wall_s=wall_s,
        output_tokens=out,
        per_stream_tok_s=1000.0 / tpot["mean"] if tpots else float("nan"),
        total_tok_s=out / wall_s if wall_s > 0 else float("nan"),
        ttft_ms=summarize([r.ttft_s for r in ok]), tpot_ms=tpot,
        itl_ms=summarize([x for r in ok for x in r.itl_s]),
        errors=sorted({r.error for r in results if not r.ok})[:5],
    )


async def closed_loop(base_url: str, path: str, bodies_per_stream: Sequence[Sequence[dict[str, Any]]],
                      api_key: str | None = None, timeout_s: float = 600.0
                      ) -> tuple[list[list[StreamResult]], float]:
    """Every stream at once, each sending its bodies one after another; returns
    the results per stream (in order) and the wall time of the whole phase."""
    url = base_url.rstrip("/") + path
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def one_stream(client: Any, bodies: Sequence[dict[str, Any]]) -> list[StreamResult]:
        return [await stream_one(client, url, b, headers, timeout_s) for b in bodies]

    async with client_session(timeout_s) as client:
        start = time.perf_counter()
        per_stream = await asyncio.gather(*(one_stream(client, b) for b in bodies_per_stream))
        return list(per_stream), time.perf_counter() - start


def run_phase(name: str, base_url: str, path: str, bodies_per_stream: Sequence[Sequence[dict[str, Any]]],
              timeout_s: float = 600.0) -> tuple[PhaseReport, list[list[StreamResult]]]:
    print(f"   {name}: {len(bodies_per_stream)} stream(s)", file=sys.stderr, flush=True)
    per_stream, wall = asyncio.run(closed_loop(base_url, path, bodies_per_stream, timeout_s=timeout_s))
    flat = [r for rs in per_stream for r in rs]
    return phase_report(name, len(bodies_per_stream), flat, wall), per_stream


def split_streams(items: Sequence[Any], streams: int) -> list[list[Any]]:
    """Round robin: stream s gets items s, s + streams, ..."""
    return [list(items[s::streams]) for s in range(streams)]


# ---- the bounded busy process (the contention row) ------------------------------------------

# Spins one core until its deadline: bounded by itself, so even a benchmark killed
# with SIGKILL leaves nothing spinning for longer than that.
BUSY_SCRIPT = "import sys, time\nend = time.monotonic() + float(sys.argv[1])\nwhile time.monotonic() < end:\n    pass\n"
PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: the kernel SIGKILLs it when the benchmark dies."""
    # Not Linux: no prctl, and the deadline alone bounds it.
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)


class BusyCore:
    """A context manager: one process keeping one core busy for at most `max_s`
    seconds, killed on exit (and by the kernel if this process dies first)."""

    def __init__(self, max_s: float) -> None:
        if max_s <= 0:
            raise ValueError(f"the busy process's bound must be > 0 s, got {max_s}")
        self.max_s = max_s
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> BusyCore:
        self.process = subprocess.Popen(
            [sys.executable, "-c", BUSY_SCRIPT, str(self.max_s)],
            preexec_fn=_die_with_parent if sys.platform == "linux" else None)
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def stop(self) -> None:
        p = self.process
        if p is None:
            return
        if p.poll() is None:
            p.kill()
        p.wait()

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid


# ---- servers ------------------------------------------------------------------------------


@dataclass
class ServerSpec:
    label: str  # the row's name
    cmd: list[str]
    port: int
    model: str  # the model name requests send
    env: dict[str, str] = field(default_factory=dict)
    settings: str = ""  # how it was run, for the table
    startup_timeout_s: float = 300.0

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class RunningServer:
    """Start `spec`'s server (its output to `log`), wait for /health, stop it on exit.
    `on_spawn` sees the process as soon as it exists (bench sizes samples its memory from then)."""

    def __init__(self, spec: ServerSpec, log: Path,
                 on_spawn: Callable[[subprocess.Popen[bytes]], None] | None = None) -> None:
        self.spec, self.log, self.on_spawn = spec, log, on_spawn
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> RunningServer:
        print(f"== {self.spec.label}: {' '.join(self.spec.cmd)}", file=sys.stderr, flush=True)
        self.process = spawn_server(self.spec.cmd, {**os.environ, **self.spec.env}, self.log)
        try:
            if self.on_spawn is not None:
                self.on_spawn(self.process)
            wait_healthy(self.process, self.spec.base_url, self.spec.startup_timeout_s,
                         f"{self.spec.label}'s server", f"; see {self.log}")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        p = self.process
        if p is None:
            return
        if p.poll() is None:
            p.terminate()
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def tokenmill_spec(label: str, model: str | None, dtype: str, extra: Sequence[str] = ()) -> ServerSpec:
    port = free_port()
    cmd = [sys.executable, "-m", "tokenmill.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
           "--dtype", dtype, "--served-model-name", "tokenmill"]
    if model:
        cmd += ["--model", model]
    cmd += list(extra)
    return ServerSpec(label, cmd, port, "tokenmill", settings=" ".join(["defaults", *extra]).strip(),
                      startup_timeout_s=600.0)


def serve_has_flag(flag: str) -> bool:
    """Whether this tokenmill's `serve` takes `flag` (an option another branch may
    not have landed yet): asked of `tokenmill serve --help` (bench/ does not import the CLI)."""
    proc = subprocess.run([sys.executable, "-m", "tokenmill.cli", "serve", "--help"],
                          capture_output=True, text=True, check=False)
    return proc.returncode == 0 and re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", proc.stdout) is not None
