"""One replica: a tokenmill AsyncEngine and the very app `tokenmill serve` runs
(server.build_app), called in-process with the request the ingress forwarded.

What crosses the wire per request: in, the HTTP method, path, query, headers and
body (plus the routing text, which only the router reads); out, a stream whose first
item is (status, headers, first body chunk) and whose next items are body chunks:
one per SSE event for a stream, the whole JSON otherwise. Ray cancelling the
stream (the client went away) reaches the app as an http.disconnect and then as a
cancel, so the server's own code aborts the request in the engine."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from collections.abc import AsyncGenerator
from typing import Any

from ray import serve
from starlette.types import Message

from tokenmill.config import ServerConfig
from tokenmill.engine.arg_utils import EngineArgs
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.llm_engine import LLMEngine
from tokenmill.engine.process_settings import apply_process_settings
from tokenmill.serve_ray.router import REPLICA_HEADER
from tokenmill.server.app import build_app

logger = logging.getLogger("tokenmill")

Header = tuple[bytes, bytes]
Start = tuple[int, list[Header], bytes]  # the stream's first item


class EngineReplica:
    def __init__(self, engine_args: EngineArgs, server_config: ServerConfig, num_threads: int) -> None:
        def build() -> LLMEngine:
            # On the engine thread, the only one that runs the model (AsyncEngine says why).
            import torch

            torch.set_num_threads(num_threads)
            return LLMEngine.from_engine_args(engine_args)

        self.engine = AsyncEngine(build)
        self.app = build_app(self.engine, server_config)
        apply_process_settings()
        self.replica_id = serve.get_replica_context().replica_id.to_full_id_str()
        logger.info("replica %s: %s on %d threads", self.replica_id, engine_args.model, num_threads)

    async def http(
        self, method: str, path: str, query: bytes, headers: list[Header], body: bytes,
        routing_text: str = "",  # read by the router only
        target_replica: str | None = None,  # (likewise: a request for this replica)
    ) -> AsyncGenerator[Start | bytes, None]:
        scope: dict[str, Any] = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": "1.1", "method": method, "scheme": "http", "path": path,
            "raw_path": path.encode(), "query_string": query, "root_path": "",
            "headers": headers, "client": None, "server": None, "state": {},
        }
        messages: asyncio.Queue[Message | None] = asyncio.Queue()
        gone = asyncio.Event()
        body_given = False

        async def receive() -> Message:
            nonlocal body_given
            if not body_given:
                body_given = True
                return {"type": "http.request", "body": body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            messages.put_nowait(message)

        task = asyncio.create_task(self.app(scope, receive, send))
        task.add_done_callback(lambda _: messages.put_nowait(None))
        start: Message | None = None
        try:
            while (message := await messages.get()) is not None:
                if message["type"] == "http.response.start":
                    start = message
                    continue
                if message["type"] != "http.response.body":
                    continue
                chunk = message.get("body", b"")
                if start is not None:  # the first chunk goes out with the status
                    headers = [*start.get("headers", []), (REPLICA_HEADER, self.replica_id.encode())]
                    yield (start["status"], headers, chunk)
                    start = None
                elif chunk:
                    yield chunk
                if not message.get("more_body", False):
                    break
            await task  # (raises what the app raised: Ray reports it to the ingress)
        finally:
            gone.set()
            if not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task

    async def stats(self, target_replica: str | None = None) -> AsyncGenerator[dict[str, Any], None]:
        """This replica's engine counters, as a stream of one item: the ingress calls
        it through the same streaming handle (so the same router) as `http`; the
        router sends a call naming `target_replica` to that replica only."""
        stats = self.engine.stats()
        yield {
            "replica_id": self.replica_id, "pid": os.getpid(),
            "num_running": stats.num_running, "num_waiting": self.engine.num_waiting_requests(),
            "kv_cache_usage": stats.kv_cache_usage,
            "prefix_cache_queries": stats.prefix_cache_queries,
            "prefix_cache_hits": stats.prefix_cache_hits,
            "num_preemptions": stats.num_preemptions,
            # The disk tier's counters (queries, hits, the transfers), None without --kv-offload-dir.
            "kv_offload": None if stats.kv_offload is None else dataclasses.asdict(stats.kv_offload),
            "tensor_parallel_ranks": self.tensor_parallel_ranks(),
        }

    def tensor_parallel_ranks(self) -> list[dict[str, Any]]:
        """Ranks 1..T-1 (Ray actors): rank, pid, node IP. [] without TP."""
        return [{"rank": r, "pid": pid, "node": node}
                for r, pid, node in self.engine.facts.tensor_parallel_ranks]

    def check_health(self) -> None:
        """Ray Serve's health check: a replica whose engine loop died, or whose
        tensor-parallel group stopped (a rank gone), is replaced (its rank actors
        with it)."""
        self.engine.check_health()

    def __del__(self) -> None:
        # Ray Serve calls this on a graceful replica shutdown.
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.shutdown(timeout_s=5.0)
