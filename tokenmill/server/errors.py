"""Errors in OpenAI's JSON shape: {"error": {"message", "type", "param", "code"}}.

400 for what the caller can fix, 401 for a bad key, 404 for an unknown route,
503 when the queue is full, 500 only for real internal faults (logged here,
never with a traceback in the body)."""

from __future__ import annotations

import logging

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

INTERNAL_ERROR_MESSAGE = "internal server error; the request was aborted (see the server log)"


class APIError(Exception):
    def __init__(
        self,
        status_code: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.param = param
        self.code = code

    def body(self) -> ErrorResponse:
        return error_body(self.status_code, self.message, self.param, self.code)


def error_body(
    status_code: int, message: str, param: str | None = None, code: str | None = None
) -> ErrorResponse:
    error_type = ERROR_TYPES.get(status_code, "invalid_request_error" if status_code < 500 else "server_error")
    return ErrorResponse(error=ErrorInfo(message=message, type=error_type, param=param, code=code))


def error_json(
    status_code: int, message: str, param: str | None = None, code: str | None = None
) -> JSONResponse:
    body = error_body(status_code, message, param, code)
    return JSONResponse(body.model_dump(), status_code=status_code)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_json(exc.status_code, exc.message, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI says 422; OpenAI and vLLM say 400. Name the first bad field.
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg', 'invalid value')}" if param else str(first.get("msg", "invalid request body"))
        return error_json(400, message, param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        message = str(exc.detail) if exc.status_code != 404 else "not found: no such route"
        return error_json(exc.status_code, message)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("internal error while serving %s", request.url.path)
        return error_json(500, INTERNAL_ERROR_MESSAGE)
