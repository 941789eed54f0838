"""The ingress: Ray Serve's HTTP proxy hands it every request; it reads the body,
takes the routing text out of it, and forwards the request to an engine replica
through a streaming DeploymentHandle (the prefix-aware router picks the replica).
The routes themselves are the replicas' (server.build_app), so `tokenmill
serve-ray` answers exactly as `tokenmill serve` does.

Faults: a replica that dies before its answer started (nothing sent to the client
yet) has the request retried on another replica, up to `max_attempts` times; one
that dies mid-stream ends the stream with an error event in OpenAI's shape and
[DONE]; with no replica left to try, a 503 in OpenAI's shape. Nothing waits on a
dead replica: Ray fails its calls as soon as the actor is gone."""

# (No `from __future__ import annotations`: Ray Serve's class-based FastAPI routes
# read the handlers' annotations as objects.)
import asyncio
import json
import logging
import secrets
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, cast

from fastapi import FastAPI, Request, Response
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.responses import StreamingResponse

from tokenmill.serve_ray.router import HTTP_METHOD, ROUTING_TEXT, TARGET_REPLICA, live_replicas
from tokenmill.server.errors import APIError, error_json
from tokenmill.server.serving import sse, sse_error

logger = logging.getLogger("tokenmill")

# A replica gone (killed, crashed, its node lost): the request may go elsewhere.
REPLICA_GONE = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)
DEFAULT_MAX_ATTEMPTS = 3
STATS_TIMEOUT_S = 10.0
REPLICAS_PATH = "/ray/replicas"

ingress_app = FastAPI(title="tokenmill on Ray Serve", docs_url=None, redoc_url=None, openapi_url=None)


def routing_text(body: bytes) -> str:
    """What prefix routing keys on: a request's messages (role and text of each, in
    order), else its prompt or input (text, or token ids written out), flattened to
    one string whose prefixes follow the prompt's. "" for anything else."""
    if not body:
        return ""
    try:
        data = json.loads(body)
    except ValueError:
        return ""
    if not isinstance(data, dict):
        return ""
    for name in ("messages", "prompt", "input"):
        if name in data:
            return _flatten(data[name])
    return ""


def _flatten(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return ""
    if isinstance(value, int):
        return f"{value},"
    if isinstance(value, list):
        return "".join(_flatten(v) for v in value)
    if isinstance(value, dict):
        if "content" in value:  # a message
            return f"<{value.get('role', '')}>{_flatten(value['content'])}\n"
        text = value.get("text")
        return text if isinstance(text, str) else ""
    return ""


def gone_error(e: BaseException) -> APIError:
    return APIError(
        503, f"the replica serving this request went away ({type(e).__name__}); retry",
        code="replica_unavailable",
    )


@serve.ingress(ingress_app)
class Ingress:
    def __init__(
        self, engine: DeploymentHandle, max_request_body_bytes: int,
        api_key: str | None = None, max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    ) -> None:
        self.deployment = engine.deployment_name
        self.expected_auth = None if api_key is None else f"Bearer {api_key}".encode()
        # Every call goes through this one handle: one router, one view of the replicas
        # (a handle made by options() before its parent routed anything gets its own).
        self.stream = engine.options(stream=True)
        self.max_request_body_bytes = max_request_body_bytes
        self.max_attempts = max_attempts

    @ingress_app.get(REPLICAS_PATH)
    async def replicas(self, request: Request) -> Response:
        """Each live replica's engine counters (routing state made visible: which
        replica holds which prefixes shows in its prefix-cache hits). Behind the
        API key when there is one, as /metrics is not: it names processes."""
        if self.expected_auth is not None and not secrets.compare_digest(
                request.headers.get("authorization", "").encode(), self.expected_auth):
            return error_json(401, "missing or wrong API key; send 'Authorization: Bearer <key>'",
                              code="invalid_api_key")
        ids = live_replicas(self.deployment)

        async def one(replica: str) -> dict[str, Any] | None:
            call = cast(DeploymentResponseGenerator,
                        self.stream.stats.remote(**{TARGET_REPLICA: replica}))
            try:
                stats: dict[str, Any] = await asyncio.wait_for(call.__anext__(), STATS_TIMEOUT_S)
                return stats if stats["replica_id"] == replica else None  # (it went away)
            except (TimeoutError, StopAsyncIteration, *REPLICA_GONE):
                return None
            finally:
                call.cancel()

        # One at a time: calls made within one request share Ray Serve's internal
        # request id, and the router fulfils pending calls by that id, so two at once
        # could each be handed the other's replica.
        found = [s for r in ids if (s := await one(r)) is not None]
        return Response(json.dumps({"replicas": found}), media_type="application/json")

    @ingress_app.api_route("/{path:path}", methods=["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH"])
    async def forward(self, path: str, request: Request) -> Response:
        body = await self._read_body(request)
        if isinstance(body, Response):
            return body
        args = (request.method, request.url.path, request.scope.get("query_string", b""),
                list(request.scope["headers"]), body)
        text = routing_text(body) if request.method == "POST" else ""
        last: BaseException | None = None
        for attempt in range(self.max_attempts):
            call: DeploymentResponseGenerator = getattr(self.stream, HTTP_METHOD).remote(
                *args, **{ROUTING_TEXT: text})
            try:
                first = await call.__anext__()
            except REPLICA_GONE as e:
                logger.warning("attempt %d of %s %s: %s; retrying elsewhere",
                               attempt + 1, request.method, request.url.path, e)
                last = e
                continue
            except BaseException:
                call.cancel()
                raise
            status, headers, chunk = first
            response = StreamingResponse(self._rest(call, chunk, headers), status_code=status)
            response.raw_headers = headers
            return response
        assert last is not None
        error = gone_error(last)
        return error_json(error.status_code, error.message, code=error.code)

    async def _read_body(self, request: Request) -> bytes | Response:
        """The body, or a 413 past the limit (the replica's app checks it too; the
        ingress must not buffer more than that)."""
        limit = self.max_request_body_bytes
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > limit:
                return error_json(413, f"the request body is over {limit} bytes",
                                  code="request_too_large")
            chunks.append(chunk)
        return b"".join(chunks)

    async def _rest(
        self, call: DeploymentResponseGenerator, first: bytes, headers: list[tuple[bytes, bytes]],
    ) -> AsyncGenerator[bytes, None]:
        event_stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                           for k, v in headers)
        done = False
        try:
            if first:
                yield first
            rest: AsyncIterator[bytes] = call
            async for chunk in rest:
                yield chunk
            done = True
        except REPLICA_GONE as e:
            logger.warning("a replica went away mid-answer: %s", e)
            done = True
            if event_stream:  # the stream ends cleanly, with the reason
                yield sse_error(gone_error(e)).encode()
                yield sse("[DONE]").encode()
            # (A non-streamed answer is sent whole in the first chunk: nothing is cut.)
        finally:
            if not done:  # the client went away: cancel the replica's side too
                call.cancel()
