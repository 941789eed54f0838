"""serve-B's TTFT as a queue: what prefill-step time a TTFT p99 target needs.

serve-B's arrivals (WORKLOADS.md: Poisson, default_rng(2), 64 requests) are fed
to a model of the engine: one step at a time, a started step runs to its end,
every prompt waiting when a step starts is prefilled in it, costing T seconds
each (one 128-token prompt with the decodes riding along). A request's TTFT is
the end of its prefill step minus its arrival. Compare the p99 it prints for
the T measured (scripts/serve_replay.py prints the prefill steps' p50) with
the replay's and the server's p99.

    .venv/bin/python scripts/ttft_queue.py [RATE]

Measured 2026-11-30 at 2 req/s: the model gives p99 258 ms for T = 100 ms, the
replay gave 254-300 ms (prefill steps p50 97-104 ms), the server 248-265 ms.
p99 <= 200 ms needs T <= ~85 ms (with ~10 ms of server on top, less).
"""

from __future__ import annotations

import sys

import numpy as np


def ttfts(arrivals: np.ndarray, step_s: float) -> np.ndarray:
    t, i, out = 0.0, 0, np.zeros(len(arrivals))
    while i < len(arrivals):
        t = max(t, arrivals[i])
        batch = [j for j in range(i, len(arrivals)) if arrivals[j] <= t]
        t += step_s * len(batch)
        for j in batch:
            out[j] = t - arrivals[j]
        i += len(batch)
    return out


def main() -> None:
    rate = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    gaps = np.random.default_rng(2).exponential(1.0 / rate, size=64)
    gaps[0] = 0.0
    arrivals = np.cumsum(gaps)
    for ms in range(70, 115, 5):
        x = ttfts(arrivals, ms / 1e3) * 1e3
        print(f"rate {rate}: prefill step {ms} ms -> TTFT p50 {np.percentile(x, 50):.0f} "
              f"p99 {np.percentile(x, 99):.0f} max {x.max():.0f} ms")


if __name__ == "__main__":
    main()
