"""The live view's feed: snapshots of the engine's state for `serve --dashboard`.

    engine thread (AsyncEngine._step)            event loop (one per subscriber)
    ---------------------------------            -------------------------------
    schedule()
    if live.watched:  <- the only cost unwatched
        live.publish(snapshot(...))  ---------> deque(maxlen) + wake-up -> SSE
    execute()

A snapshot is taken between schedule() and execute(), so it shows the batch
that is about to run, at most `max_rate_hz` times a second and only while
someone is subscribed: unwatched, a step pays one attribute read. Each
subscriber has a bounded deque; when it is full the oldest snapshot is dropped
(and counted), so a slow reader never blocks or grows the engine. Preemptions
and latency samples between two snapshots are accumulated (cheap list
appends while watched) and ride on the next one, so none is missed.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import json
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from tokenmill.core.contracts import SchedulerOutput
from tokenmill.core.scheduler import Scheduler

# Block states in a snapshot's `kv.blocks` string, one character per block.
BLOCK_FREE = "0"  # no references, no content worth keeping
BLOCK_CACHED = "1"  # no references, but its content is a prefix-cache entry (revivable)
BLOCK_USED = "2"  # held by one request
BLOCK_SHARED = "3"  # held by several requests (a shared prefix)
# At most this many waiting requests are listed (the count is always exact).
MAX_WAITING_LISTED = 64
# Latency samples carried by one snapshot at most (the rest are counted only).
MAX_SAMPLES = 4096


class Subscriber:
    """One reader's queue of encoded snapshots (JSON text), newest last."""

    def __init__(self, loop: asyncio.AbstractEventLoop, max_queued: int) -> None:
        self.loop = loop
        self.queue: collections.deque[str] = collections.deque(maxlen=max_queued)
        self.event = asyncio.Event()
        self.num_dropped = 0

    def push(self, data: str) -> None:  # engine thread
        if len(self.queue) == self.queue.maxlen:
            self.num_dropped += 1  # the deque drops the oldest
        self.queue.append(data)
        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody reads
            self.loop.call_soon_threadsafe(self.event.set)

    async def get(self, timeout_s: float) -> str | None:
        """The oldest queued snapshot; None if none came within timeout_s."""
        while not self.queue:
            self.event.clear()
            if self.queue:
                break
            try:
                await asyncio.wait_for(self.event.wait(), timeout_s)
            except TimeoutError:
                return None
        return self.queue.popleft()


@dataclass
class _Pending:
    """What happened since the last snapshot (engine thread only; only while watched)."""

    preemptions: list[dict[str, Any]] = field(default_factory=list)
    ttft_s: list[float] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)
    num_steps: int = 0
    num_finished: int = 0
    step_time_s: float = 0.0


class LiveView:
    def __init__(self, max_rate_hz: float = 10.0, max_queued: int = 8) -> None:
        self.min_interval_s = 1.0 / max_rate_hz if max_rate_hz > 0 else 0.0
        self.max_queued = max_queued
        # Read by the engine thread every step; written under the lock.
        self.watched = False
        self._subscribers: list[Subscriber] = []
        self._lock = threading.Lock()
        self._pending = _Pending()
        self._last_time = 0.0
        self._seq = itertools.count(1)
        self.num_snapshots = 0
        self.last: str | None = None  # the last snapshot published, for new subscribers

    # ---- subscribers (event loop) -----------------------------------------------------

    def subscribe(self) -> Subscriber:
        subscriber = Subscriber(asyncio.get_running_loop(), self.max_queued)
        if self.last is not None:
            subscriber.queue.append(self.last)
        with self._lock:
            self._subscribers = [*self._subscribers, subscriber]
            self.watched = True
        return subscriber

    def unsubscribe(self, subscriber: Subscriber) -> None:
        with self._lock:
            self._subscribers = [s for s in self._subscribers if s is not subscriber]
            self.watched = bool(self._subscribers)
            if not self.watched:
                self._pending = _Pending()

    @property
    def num_subscribers(self) -> int:
        return len(self._subscribers)

    # ---- the engine thread, only while watched ----------------------------------------------

    def due(self, now: float) -> bool:
        return now - self._last_time >= self.min_interval_s

    def note_step(
        self, scheduler_output: SchedulerOutput, step_time_s: float, num_finished: int,
        ttft_s: Sequence[float], itl_s: Sequence[float],
    ) -> None:
        """What a step did, kept for the next snapshot."""
        pending = self._pending
        pending.num_steps += 1
        pending.step_time_s += step_time_s
        pending.num_finished += num_finished
        if len(pending.ttft_s) < MAX_SAMPLES:
            pending.ttft_s.extend(ttft_s)
        if len(pending.itl_s) < MAX_SAMPLES:
            pending.itl_s.extend(itl_s)

    def note_preemptions(self, request_ids: Sequence[str], now: float) -> None:
        self._pending.preemptions.extend({"id": r, "t": now} for r in request_ids)

    def publish(self, snapshot: dict[str, Any], now: float) -> None:
        """Send a snapshot (taken by `take_snapshot`) with what was pending to every subscriber."""
        pending, self._pending = self._pending, _Pending()
        snapshot["seq"] = next(self._seq)
        snapshot["preemptions"] = pending.preemptions
        snapshot["ttft_s"] = pending.ttft_s
        snapshot["itl_s"] = pending.itl_s
        snapshot["num_steps"] = pending.num_steps
        snapshot["num_finished"] = pending.num_finished
        snapshot["mean_step_ms"] = (
            1000 * pending.step_time_s / pending.num_steps if pending.num_steps else None)
        data = json.dumps(snapshot, separators=(",", ":"))
        self.last = data
        self._last_time = now
        self.num_snapshots += 1
        for subscriber in self._subscribers:  # (a copy-on-write list: no lock needed)
            subscriber.push(data)


def take_snapshot(
    scheduler: Scheduler, scheduler_output: SchedulerOutput | None, now: float, cache_dtype: str = ""
) -> dict[str, Any]:
    """The engine's state as plain data: the batch about to run (None: an idle
    iteration), the waiting queue's head, the KV block pool (and what it stores,
    `cache_dtype`: EngineFacts.cache's). Engine thread only."""
    batch = []
    if scheduler_output is not None:
        for scheduled in scheduler_output.scheduled:
            request = scheduler.requests.get(scheduled.request_id)
            num_prompt = request.num_prompt_tokens if request is not None else 0
            batch.append({
                "id": scheduled.request_id,
                "tokens": scheduled.num_tokens,
                # A chunk of the prompt, or of a preempted request's recompute, is a prefill.
                "kind": "decode" if scheduled.num_computed_tokens >= num_prompt
                and scheduled.num_tokens == 1 else "prefill",
                "computed": scheduled.num_computed_tokens,
                "total": request.num_tokens if request is not None else 0,
                "prompt": num_prompt,
                "output": request.num_output_tokens if request is not None else 0,
                "max_tokens": scheduled.sampling_params.max_tokens,
            })
    waiting = [
        {"id": r.request_id, "prompt": r.num_prompt_tokens,
         "waited_s": round(now - r.arrival_time, 3), "preempted": r.num_preemptions > 0}
        for r in itertools.islice(scheduler.queue, MAX_WAITING_LISTED)
    ]
    pool = scheduler.kv.pool
    blocks = "".join([
        (BLOCK_SHARED if b.ref_cnt > 1 else BLOCK_USED) if b.ref_cnt
        else (BLOCK_FREE if b.block_hash is None else BLOCK_CACHED)
        for b in pool.blocks
    ])
    return {
        "t": now,
        "time": time.time(),
        "batch": batch,
        "num_batched_tokens": scheduler_output.num_scheduled_tokens if scheduler_output else 0,
        "num_running": len(scheduler.running),
        "num_waiting": len(scheduler.queue),
        "waiting": waiting,
        "kv": {
            "num_blocks": pool.num_blocks,
            "block_size": scheduler.block_size,
            "cache_dtype": cache_dtype,
            "blocks": blocks,
        },
        "num_preemptions_total": scheduler.num_preemptions,
        "max_num_seqs": scheduler.config.max_num_seqs,
        "max_num_batched_tokens": scheduler.config.max_num_batched_tokens,
    }
