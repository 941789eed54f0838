"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}},
and under /v1/messages in Anthropic's: {"type": "error", "error": {"type", "message"}}.

400 for what the caller can fix, 401 for a bad key, 404 for an unknown route,
503 when the queue is full or the server is going away (with Retry-After), 500
only for real internal faults (logged here, never with a traceback in the body).

An error's text may echo what the client sent (a model's name, a field's key),
and that may hold anything JSON can carry, a lone surrogate ("\ud800") too, which
UTF-8 cannot encode: error bodies are written as ASCII JSON (every other
character escaped), so any text the client sent comes back as it was sent."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.server.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("tokenmill")

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    503: "service_unavailable_error",
    500: "internal_server_error",
}

# Anthropic's error types (its Messages API's error shape) by status.
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}

# Routes whose errors take Anthropic's shape.
ANTHROPIC_PATH = "/v1/messages"

RETRY_AFTER_S = 1  # a 503's Retry-After: a full queue moves in about a second

INTERNAL_ERROR_MESSAGE = "internal server error; the request was aborted (see the server log)"


class APIError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        param: str | None = None,
        code: int | str | None = None,
        error_type: str | None = None,  # else the status code's (ERROR_TYPES)
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type

    def body(self) -> ErrorResponse:
        return error_body(self.status_code, self.message, self.param, self.code, self.error_type)


def error_body(
    status_code: int, message: str, param: str | None = None, code: int | str | None = None,
    error_type: str | None = None,
) -> ErrorResponse:
    if error_type is None:
        error_type = ERROR_TYPES.get(status_code, "invalid_request_error" if status_code < 500 else "server_error")
    return ErrorResponse(error=ErrorInfo(message=message, type=error_type, param=param, code=code))


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def anthropic_error_dict(status_code: int, message: str) -> dict[str, Any]:
    error_type = ANTHROPIC_ERROR_TYPES.get(status_code, "invalid_request_error" if status_code < 500
                                           else "api_error")
    return {"type": "error", "error": {"type": error_type, "message": message}}


def error_bytes(
    status_code: int, message: str, param: str | None = None, code: int | str | None = None,
    error_type: str | None = None, path: str = "",
) -> bytes:
    """An error's body in the shape of the API `path` belongs to, as ASCII JSON
    (so any text it echoes can be encoded)."""
    if is_anthropic_path(path):
        body = anthropic_error_dict(status_code, message)
    else:
        body = error_body(status_code, message, param, code, error_type).model_dump()
    return json.dumps(body, ensure_ascii=True).encode("ascii")


def error_json(
    status_code: int, message: str, param: str | None = None, code: int | str | None = None,
    error_type: str | None = None, path: str = "",
) -> Response:
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status_code == 503 else None
    return Response(error_bytes(status_code, message, param, code, error_type, path),
                    status_code=status_code, headers=headers, media_type="application/json")


def describe_validation_error(errors: Sequence[Any]) -> tuple[str, str | None]:
    """(message, param) for the first of pydantic's (or FastAPI's) errors: the
    field it names, or none for a body that is not JSON at all."""
    first = errors[0] if errors else {}
    if first.get("type") == "json_invalid":  # loc is ("body", character position)
        where = [p for p in first.get("loc", ()) if isinstance(p, int)]
        at = f" at character {where[0]}" if where else ""
        reason = first.get("ctx", {}).get("error", first.get("msg", "invalid JSON"))
        return f"the request body is not valid JSON: {reason}{at}", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    msg = str(first.get("msg", "invalid value"))
    return (f"{param}: {msg}" if param else msg or "invalid request body"), param


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> Response:
        return error_json(exc.status_code, exc.message, exc.param, exc.code, exc.error_type,
                          request.url.path)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        # FastAPI says 422; OpenAI and vLLM say 400.
        message, param = describe_validation_error(exc.errors())
        return error_json(400, message, param, path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        message = str(exc.detail) if exc.status_code != 404 else "not found: no such route"
        response = error_json(exc.status_code, message, path=request.url.path)
        response.headers.update(exc.headers or {})  # e.g. a 405's Allow
        return response

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> Response:
        logger.exception("internal error while serving %s", request.url.path)
        return error_json(500, INTERNAL_ERROR_MESSAGE, path=request.url.path)
