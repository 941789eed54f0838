"""The ingress: Ray Serve's HTTP proxy hands it every request; it reads the body,
takes the routing text out of it, and forwards the request to an engine replica
through a streaming DeploymentHandle (the prefix-aware router picks the replica).
The routes themselves are the replicas' (server.build_app), so `tokenmill
serve-ray` answers exactly as `tokenmill serve` does.

Faults: a replica that dies before its answer started (nothing sent to the client
yet) has the request retried on another replica, up to `max_attempts` times; one
that dies mid-stream ends the stream with an error event in OpenAI's shape and
[DONE]; with no replica left to try, a 503 in OpenAI's shape. Nothing waits on a
dead replica: Ray fails its calls as soon as the actor is gone.

Across replicas: GET /metrics asks every live replica for its /metrics and answers
their series together, each with a `replica` label; /v1/responses' stored responses
are each replica's own, so a request naming a response (previous_response_id, or
GET /v1/responses/{id}) goes to the replica that created it (ResponseOwners, learned
as answers pass here), or gets a 404 saying that replica is gone."""

# (No `from __future__ import annotations`: Ray Serve's class-based FastAPI routes
# read the handlers' annotations as objects.)
import asyncio
import json
import logging
import secrets
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, cast

from fastapi import FastAPI, Request, Response
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import DeploymentUnavailableError, ReplicaUnavailableError
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from starlette.responses import StreamingResponse

from tokenmill.serve_ray import live
from tokenmill.serve_ray.router import (
    HTTP_METHOD,
    REPLICA_HEADER,
    ROUTING_TEXT,
    TARGET_REPLICA,
    ResponseOwners,
)
from tokenmill.server.errors import APIError, error_json
from tokenmill.server.serving import sse, sse_error

logger = logging.getLogger("tokenmill")

# A replica gone (killed, crashed, its node lost): the request may go elsewhere.
REPLICA_GONE = (RayActorError, ReplicaUnavailableError, DeploymentUnavailableError)
DEFAULT_MAX_ATTEMPTS = 3
STATS_TIMEOUT_S = 10.0
REPLICAS_PATH = "/ray/replicas"
METRICS_PATH = "/metrics"
RESPONSES_PATH = "/v1/responses"
REPLICA_LABEL = "replica"

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


def named_response(method: str, path: str, body: bytes) -> tuple[str, str | None] | None:
    """The stored response a request reads, as (id, the field naming it): a POST
    /v1/responses' previous_response_id, or the id in /v1/responses/{id}."""
    if path.startswith(RESPONSES_PATH + "/") and method in ("GET", "DELETE"):
        return path[len(RESPONSES_PATH) + 1:], None
    if path != RESPONSES_PATH or method != "POST" or b"previous_response_id" not in body:
        return None
    try:
        data = json.loads(body)
    except ValueError:
        return None
    value = data.get("previous_response_id") if isinstance(data, dict) else None
    return (value, "previous_response_id") if isinstance(value, str) else None


def response_id_in(chunk: bytes, event_stream: bool) -> str | None:
    """A /v1/responses answer's id: the JSON's `id`, or, streamed, the
    response.created event's response.id (None if this chunk has neither)."""
    try:
        if not event_stream:
            data = json.loads(chunk)
            return data["id"] if isinstance(data, dict) and isinstance(data.get("id"), str) else None
        for line in chunk.split(b"\n"):
            if line.startswith(b"data: ") and b'"response.created"' in line:
                found = json.loads(line[6:]).get("response", {}).get("id")
                return found if isinstance(found, str) else None
    except (ValueError, AttributeError):
        pass
    return None


def merge_metrics(texts: list[tuple[str, str]]) -> bytes:
    """Several replicas' /metrics (Prometheus text) as one: each family once, its
    samples from every replica, each with a `replica` label naming its replica."""
    families: dict[str, Metric] = {}
    for replica, text in texts:
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation,
                                                        family.type, family.unit)
            merged.samples.extend(s._replace(labels={**s.labels, REPLICA_LABEL: replica})
                                  for s in family.samples)

    class Families:
        def collect(self) -> list[Metric]:
            return list(families.values())

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families())
    return generate_latest(registry)


def owner_gone_error(response_id: str, replica: str, param: str | None) -> APIError:
    return APIError(
        404, f"Response with id '{response_id}' was stored on replica {replica}, which has gone "
             "away; the responses it stored went with it", param=param, code="response_not_found")


def gone_error(e: BaseException) -> APIError:
    return APIError(
        503, f"the replica serving this request went away ({type(e).__name__}); retry",
        code="replica_unavailable",
    )


@serve.ingress(ingress_app)
class Ingress:
    def __init__(
        self, replicas: DeploymentHandle, max_request_body_bytes: int,
        api_key: str | None = None, max_attempts: int = DEFAULT_MAX_ATTEMPTS,
    ) -> None:
        self.deployment = replicas.deployment_name
        self.expected_auth = None if api_key is None else f"Bearer {api_key}".encode()
        # Every call goes through this one handle: one router, one view of the replicas
        # (a handle made by options() before its parent routed anything gets its own).
        self.stream = replicas.options(stream=True)
        self.max_request_body_bytes = max_request_body_bytes
        self.max_attempts = max_attempts
        self.owners = ResponseOwners()  # /v1/responses id -> the replica that stored it

    @ingress_app.get(REPLICAS_PATH)
    async def replicas(self, request: Request) -> Response:
        """Each live replica's engine counters (routing state made visible: which
        replica holds which prefixes shows in its prefix-cache hits). Behind the
        API key when there is one, as /metrics is not: it names processes."""
        if self.expected_auth is not None and not secrets.compare_digest(
                request.headers.get("authorization", "").encode(), self.expected_auth):
            return error_json(401, "missing or wrong API key; send 'Authorization: Bearer <key>'",
                              code="invalid_api_key")
        ids = live.REGISTRY.get(self.deployment)

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

    @ingress_app.get(METRICS_PATH)
    async def metrics(self, request: Request) -> Response:
        """Every live replica's /metrics, each series labelled with its replica."""
        args = ("GET", METRICS_PATH, request.scope.get("query_string", b""),
                list(request.scope["headers"]), b"")
        texts: list[tuple[str, str]] = []
        for replica in live.REGISTRY.get(self.deployment):  # (one at a time: see replicas())
            call = cast(DeploymentResponseGenerator, getattr(self.stream, HTTP_METHOD).remote(
                *args, **{ROUTING_TEXT: "", TARGET_REPLICA: replica}))
            try:
                status, headers, chunk = await asyncio.wait_for(call.__anext__(), STATS_TIMEOUT_S)
                rest: AsyncIterator[bytes] = call
                chunks = [chunk] + [c async for c in rest]
            except (TimeoutError, StopAsyncIteration, *REPLICA_GONE):
                continue
            finally:
                call.cancel()
            if status == 200 and dict(headers).get(REPLICA_HEADER, b"").decode() == replica:
                texts.append((replica, b"".join(chunks).decode()))
        return Response(merge_metrics(texts), media_type=CONTENT_TYPE_LATEST)

    @ingress_app.api_route("/{path:path}", methods=["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH"])
    async def forward(self, path: str, request: Request) -> Response:
        body = await self._read_body(request)
        if isinstance(body, Response):
            return body
        # The path the replica's app routes: under the app's route prefix (root_path).
        path = request.scope["path"]
        root = request.scope.get("root_path", "")
        if root and path.startswith(root):
            path = path[len(root):] or "/"
        args = (request.method, path, request.scope.get("query_string", b""),
                list(request.scope["headers"]), body)
        kwargs: dict[str, Any] = {ROUTING_TEXT: routing_text(body) if request.method == "POST" else ""}
        named = named_response(request.method, path, body)
        owner = self.owners.owner(named[0]) if named is not None else None
        if owner is not None:  # the replica that stored it, and only that one
            assert named is not None
            if owner not in live.REGISTRY.get(self.deployment):
                return self._error(owner_gone_error(named[0], owner, named[1]))
            kwargs[TARGET_REPLICA] = owner
        last: BaseException | None = None
        for attempt in range(self.max_attempts):
            call: DeploymentResponseGenerator = getattr(self.stream, HTTP_METHOD).remote(*args, **kwargs)
            try:
                first = await call.__anext__()
            except REPLICA_GONE as e:
                if owner is not None and named is not None:
                    return self._error(owner_gone_error(named[0], owner, named[1]))
                logger.warning("attempt %d of %s %s: %s; retrying elsewhere",
                               attempt + 1, request.method, path, e)
                last = e
                continue
            except BaseException:
                call.cancel()
                raise
            status, headers, chunk = first
            replica = next((v.decode() for k, v in headers if k == REPLICA_HEADER), None)
            if owner is not None and named is not None and replica != owner:
                # (The owner went away after the check above: the router sent it elsewhere.)
                call.cancel()
                return self._error(owner_gone_error(named[0], owner, named[1]))
            headers = [(k, v) for k, v in headers if k != REPLICA_HEADER]
            learn = (replica if status == 200 and request.method == "POST" and path == RESPONSES_PATH
                     else None)
            response = StreamingResponse(self._rest(call, chunk, headers, learn), status_code=status)
            response.raw_headers = headers
            return response
        assert last is not None
        return self._error(gone_error(last))

    @staticmethod
    def _error(error: APIError) -> Response:
        return error_json(error.status_code, error.message, param=error.param, code=error.code)

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
                                  code="request_too_large", path=request.url.path)
            chunks.append(chunk)
        return b"".join(chunks)

    async def _rest(
        self, call: DeploymentResponseGenerator, first: bytes, headers: list[tuple[bytes, bytes]],
        learn_for: str | None = None,
    ) -> AsyncGenerator[bytes, None]:
        """The answer's body; `learn_for`: the replica a /v1/responses answer came
        from, recorded as its id's owner when the id passes (the first events)."""
        event_stream = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                           for k, v in headers)
        done = False
        try:
            if first:
                if learn_for is not None and (found := response_id_in(first, event_stream)):
                    self.owners.learn(found, learn_for)
                    learn_for = None
                yield first
            rest: AsyncIterator[bytes] = call
            async for chunk in rest:
                if learn_for is not None and (found := response_id_in(chunk, event_stream)):
                    self.owners.learn(found, learn_for)
                    learn_for = None
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
