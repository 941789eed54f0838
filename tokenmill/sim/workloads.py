"""The simulator's inputs: docs/WORKLOADS.md's workloads, or a JSON of arrivals and lengths.

The bench workloads come from bench/workloads.py (the same draws), with the
arrival times their bench command uses: throughput-A all at time 0, serve-B
at Poisson arrivals (`default_rng(2)` gaps, the first one 0; bench/serve.py).

A JSON file (or JSON Lines, one request a line) lists requests, each
    {"arrival_s": 0.25, "prompt_tokens": 128, "output_tokens": 57}
with `prompt_token_ids` (a list) in place of `prompt_tokens` where the
contents matter (prefix caching), and optionally `"ignore_eos": false` with
`max_tokens`. `arrival_time` is taken for `arrival_s`, so a server's request
log in that shape (a recorded trace) replays as it came; times are shifted
so the first arrival is 0. A top-level object may hold the list as "requests".
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from tokenmill.bench.workloads import chat_prefix, throughput_a
from tokenmill.sim.simulator import SimRequest


def throughput_a_requests(cap: int) -> list[SimRequest]:
    w = throughput_a(cap)
    return [SimRequest(0.0, p, n) for p, n in zip(w.prompts, w.output_lens, strict=True)]


def serve_b_arrivals(rate: float, num_requests: int, seed: int = 2) -> list[float]:
    """bench/serve.py's send times: cumulative Poisson gaps, the first gap 0."""
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=num_requests)
    gaps[0] = 0.0
    return [float(t) for t in np.cumsum(gaps)]


def serve_b_requests(rate: float, num_requests: int = 64) -> list[SimRequest]:
    """serve-B: throughput-A's CAP-128 requests, the first `num_requests` of them,
    cycled past 128 (the planner may ask for more than the workload has)."""
    w = throughput_a(128)
    arrivals = serve_b_arrivals(rate, num_requests)
    n = len(w.prompts)
    return [SimRequest(t, w.prompts[i % n], w.output_lens[i % n]) for i, t in enumerate(arrivals)]


def chat_prefix_requests() -> list[SimRequest]:
    w = chat_prefix()
    return [SimRequest(0.0, p, n) for p, n in zip(w.prompts, w.output_lens, strict=True)]


def load_requests(path: str | Path, seed: int = 0) -> list[SimRequest]:
    """Requests from a JSON / JSON Lines file (the module's docstring has the shape).
    Prompts given as a length get random token ids from `default_rng(seed)`."""
    text = Path(path).read_text()
    try:
        data: Any = json.loads(text)
    except json.JSONDecodeError:
        data = [json.loads(line) for line in text.splitlines() if line.strip()]
    if isinstance(data, dict):
        data = data.get("requests")
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path}: expected a non-empty list of requests (or {{\"requests\": [...]}})")
    rng = np.random.default_rng(seed)
    out = []
    for i, item in enumerate(data):
        where = f"{path}: request {i}"
        if not isinstance(item, dict):
            raise ValueError(f"{where}: expected an object")
        arrival = item.get("arrival_s", item.get("arrival_time")) or 0.0
        if "prompt_token_ids" in item:
            prompt = [int(t) for t in item["prompt_token_ids"]]
        elif "prompt_tokens" in item:
            prompt = rng.integers(100, 49000, size=int(item["prompt_tokens"])).tolist()
        else:
            raise ValueError(f"{where}: give prompt_tokens (a count) or prompt_token_ids")
        if "output_tokens" not in item:
            raise ValueError(f"{where}: give output_tokens")
        if not prompt:
            raise ValueError(f"{where}: prompt_tokens must be >= 1")
        out.append(SimRequest(float(arrival), prompt, int(item["output_tokens"]),
                              ignore_eos=bool(item.get("ignore_eos", True)),
                              max_tokens=item.get("max_tokens")))
    start = min(r.arrival_s for r in out)
    return [SimRequest(r.arrival_s - start, r.prompt_token_ids, r.output_len, r.ignore_eos,
                       r.max_tokens) for r in out]
