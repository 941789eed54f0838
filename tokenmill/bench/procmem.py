"""A server's memory from /proc: the RSS of its process tree (vLLM runs its engine in a
child process), sampled on a thread for the peak, and the machine's MemAvailable.
Linux only, as the sizes benchmark is."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

PROC = Path("/proc")


def mem_available_bytes() -> int:
    for line in (PROC / "meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise OSError("/proc/meminfo has no MemAvailable")


def _children(pid: int) -> list[int]:
    out: list[int] = []
    for task in (PROC / str(pid) / "task").glob("*"):
        with contextlib.suppress(OSError):
            out += [int(c) for c in (task / "children").read_text().split()]
    return out


def tree_pids(pid: int) -> list[int]:
    """pid and its descendants (those alive now)."""
    seen, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.append(p)
        todo += _children(p)
    return seen


def rss_bytes(pid: int) -> int:
    """VmRSS of one process (0 once it is gone)."""
    try:
        for line in (PROC / str(pid) / "status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def tree_rss_bytes(pid: int) -> int:
    return sum(rss_bytes(p) for p in tree_pids(pid))


class RssSampler:
    """Samples the tree RSS of `pid` every `interval_s` until stopped; keeps the peak.
    Where MemAvailable falls under `guard_bytes`, it calls `on_low_memory` once (the
    benchmark stops the server: a shared machine must not swap or kill others)."""

    def __init__(self, pid: int, interval_s: float = 0.2, guard_bytes: int = 0,
                 on_low_memory: Callable[[], None] | None = None) -> None:
        self.pid, self.interval_s, self.guard_bytes = pid, interval_s, guard_bytes
        self.on_low_memory = on_low_memory
        self.peak_bytes = 0
        self.low_memory = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name=f"rss-{pid}")

    def start(self) -> RssSampler:
        self._thread.start()
        return self

    def sample(self) -> int:
        rss = tree_rss_bytes(self.pid)
        self.peak_bytes = max(self.peak_bytes, rss)
        return rss

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            if (self.guard_bytes and not self.low_memory and os.path.exists(PROC / "meminfo")
                    and mem_available_bytes() < self.guard_bytes):
                self.low_memory = True
                if self.on_low_memory is not None:
                    self.on_low_memory()
            time.sleep(self.interval_s)

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()
