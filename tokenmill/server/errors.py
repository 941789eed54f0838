"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}.

400 for what the caller can fix, 401 for a bad key, 404 for an unknown route,
503 when the queue is full or the server is going away (with Retry-After), 500
only for real internal faults (logged here, never with a traceback in the body)."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
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


def error_json(
    status_code: int, message: str, param: str | None = None, code: int | str | None = None,
    error_type: str | None = None,
) -> JSONResponse:
    body = error_body(status_code, message, param, code, error_type)
    headers = {"Retry-After": str(RETRY_AFTER_S)} if status_code == 503 else None
    return JSONResponse(body.model_dump(), status_code=status_code, headers=headers)


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
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_json(exc.status_code, exc.message, exc.param, exc.code, exc.error_type)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI says 422; OpenAI and vLLM say 400.
        message, param = describe_validation_error(exc.errors())
        return error_json(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail) if exc.status_code != 404 else "not found: no such route"
        response = error_json(exc.status_code, message)
        response.headers.update(exc.headers or {})  # e.g. a 405's Allow
        return response

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error while serving %s", request.url.path)
        return error_json(500, INTERNAL_ERROR_MESSAGE)
