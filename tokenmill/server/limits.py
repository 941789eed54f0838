"""Limits at the server's edge, before a request reaches the app: the size of its
headers (431) and of its body (413, counted as the body streams in, so a huge
body is refused without being held), errors of the HTTP layer itself in
OpenAI's JSON shape, and memory given back after a big request.

The HTTP layer is uvicorn's httptools protocol where httptools is installed
(HTTP_PROTOCOL), else its h11 one: h11's framing of each streamed chunk costs
the event loop ~10-15 us a token, which on 2 cores is the step's
(docs/perf-notes.md). Both refuse a head past MAX_HEADER_BYTES with a 431."""

from __future__ import annotations

import asyncio
import http
import logging
from typing import Any

import h11
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from tokenmill.engine.process_settings import give_back_freed_memory
from tokenmill.server.errors import error_bytes

logger = logging.getLogger("tokenmill")

# All of a request's header lines together (h11's default is 16 KiB for an
# incomplete head; a whole head read at once passed unchecked before).
MAX_HEADER_BYTES = 64 << 10
# After a request whose body was bigger than this, freed memory is given back to
# the system (malloc_trim): the heap otherwise stays at its peak (process_settings).
GIVE_BACK_AFTER_BODY_BYTES = 1 << 20


async def send_error(send: Send, status_code: int, message: str, code: str, path: str = "") -> None:
    """An error (in the shape of `path`'s API) that also closes the connection:
    what the client still sends of its body is never read."""
    body = error_bytes(status_code, message, code=code, path=path)
    await send({"type": "http.response.start", "status": status_code, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
        (b"connection", b"close"),
    ]})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class RequestLimits:
    """Pure ASGI (no body buffering of its own): 431 past MAX_HEADER_BYTES of
    headers; 413 for a Content-Length over `max_body_bytes`, or as soon as the
    bytes received pass it (chunked bodies); freed memory given back after a
    request whose body passed GIVE_BACK_AFTER_BODY_BYTES."""

    def __init__(self, app: ASGIApp, max_body_bytes: int) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self._give_back: asyncio.Task[None] | None = None
        self._give_back_again = False

    def too_large(self, size: str) -> str:
        return (f"the request body ({size}) is over this server's limit of "
                f"{self.max_body_bytes} bytes (--max-request-body-bytes)")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        header_bytes = sum(len(k) + len(v) + 4 for k, v in scope.get("headers", ()))
        if header_bytes > MAX_HEADER_BYTES:
            await send_error(send, 431, f"the request's headers ({header_bytes} bytes) are over "
                             f"this server's limit of {MAX_HEADER_BYTES} bytes",
                             "request_header_fields_too_large", scope.get("path", ""))
            return
        length = Headers(scope=scope).get("content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            await send_error(send, 413, self.too_large(f"{length} bytes"), "request_too_large",
                             scope.get("path", ""))
            return

        received = 0
        started = refused = False

        async def counted_receive() -> Message:
            # Past the limit: answer 413 now, and tell the app the client left
            # (raising would reach FastAPI's body parser, which makes it a 400).
            nonlocal received, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    refused = True
                    if not started:
                        await send_error(send, 413, self.too_large(f"over {received} bytes so far"),
                                         "request_too_large", scope.get("path", ""))
                    return {"type": "http.disconnect"}
            return message

        async def tracked_send(message: Message) -> None:
            nonlocal started
            if refused:  # (the app's answer to the "disconnect")
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, tracked_send)
        finally:
            if received > GIVE_BACK_AFTER_BODY_BYTES:
                self.give_back_memory()

    def give_back_memory(self) -> None:
        """One give-back at a time, on a worker thread; a request that ends
        while one runs gets one more after it (its memory may be freed late)."""
        if self._give_back is not None and not self._give_back.done():
            self._give_back_again = True
            return

        async def run() -> None:
            while True:
                self._give_back_again = False
                try:
                    await asyncio.to_thread(give_back_freed_memory)
                except Exception:  # (never a request's problem)
                    logger.exception("giving back freed memory failed")
                if not self._give_back_again:
                    return

        self._give_back = asyncio.get_running_loop().create_task(run())


class _Connection(h11.Connection):
    """h11's connection, keeping the protocol error it raised (its status hint:
    431 for a head past the size limit, else 400)."""

    error: h11.RemoteProtocolError | None = None

    def next_event(self) -> Any:
        try:
            return super().next_event()
        except h11.RemoteProtocolError as e:
            self.error = e
            raise


class JSONErrorsH11Protocol(H11Protocol):
    """uvicorn's h11 protocol, except that a request the HTTP layer cannot parse
    gets an OpenAI-shaped JSON error with h11's status (431: headers too large,
    400: a bad request line or header), not uvicorn's plain-text 400."""

    def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
        super().__init__(config, *args, **kwargs)
        size = config.h11_max_incomplete_event_size
        self.max_header_bytes = MAX_HEADER_BYTES if size is None else size
        self.conn = self.recording = _Connection(h11.SERVER, self.max_header_bytes)

    def send_400_response(self, msg: str) -> None:
        error = self.recording.error
        status = getattr(error, "error_status_hint", 400) if error is not None else 400
        if status == 431:
            message = (f"the request's headers are over this server's limit of "
                       f"{self.max_header_bytes} bytes")
            code = "request_header_fields_too_large"
        else:
            status = 400
            message = f"invalid HTTP request: {error or msg!s:.200}"
            code = "invalid_http_request"
        body = error_bytes(status, message, code=code)
        headers = [(b"content-type", b"application/json"),
                   (b"content-length", str(len(body)).encode()), (b"connection", b"close")]
        reason = http.HTTPStatus(status).phrase.encode()
        for event in (h11.Response(status_code=status, headers=headers, reason=reason),
                      h11.Data(data=body), h11.EndOfMessage()):
            self.transport.write(self.conn.send(event))
        self.transport.close()


def error_response_bytes(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 error response that closes the connection."""
    body = error_bytes(status, message, code=code)
    return b"".join([
        f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\n".encode(),
        b"content-type: application/json\r\n",
        f"content-length: {len(body)}\r\n".encode(),
        b"connection: close\r\n\r\n", body,
    ])


try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # httptools not installed: h11
    HTTP_PROTOCOL: type[asyncio.Protocol] = JSONErrorsH11Protocol
else:

    class JSONErrorsHttpToolsProtocol(HttpToolsProtocol):
        """uvicorn's httptools protocol with JSONErrorsH11Protocol's errors: a
        head still incomplete after MAX_HEADER_BYTES is a 431 (httptools
        itself would hold a header of any size), one httptools cannot parse a
        400, both in OpenAI's JSON shape."""

        def __init__(self, config: Any, *args: Any, **kwargs: Any) -> None:
            super().__init__(config, *args, **kwargs)
            size = config.h11_max_incomplete_event_size
            self.max_header_bytes = MAX_HEADER_BYTES if size is None else size
            self.in_head = True  # between a message's first byte and its headers' end
            self.head_bytes = 0  # fed while the head was incomplete
            self.head_too_large = False

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self.in_head = True

        def on_headers_complete(self) -> None:
            self.in_head = False
            self.head_bytes = 0
            super().on_headers_complete()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            # Counted after the parser saw it: a chunk that ends the head is never counted.
            if self.in_head and not self.transport.is_closing():
                self.head_bytes += len(data)
                if self.head_bytes > self.max_header_bytes:
                    self.head_too_large = True
                    self.send_400_response("")

        def send_400_response(self, msg: str) -> None:
            if self.head_too_large:
                reply = error_response_bytes(
                    431, f"the request's headers are over this server's limit of "
                    f"{self.max_header_bytes} bytes", "request_header_fields_too_large")
            else:
                reply = error_response_bytes(400, f"invalid HTTP request: {msg:.200}",
                                             "invalid_http_request")
            self.transport.write(reply)
            self.transport.close()

    HTTP_PROTOCOL = JSONErrorsHttpToolsProtocol
