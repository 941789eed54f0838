"""Run the app with uvicorn until SIGTERM or SIGINT, then shut down gracefully:
stop accepting, let running requests finish (up to a timeout, then end each
with an error: a stream gets an error event and [DONE]), stop the engine loop,
return 0."""

from __future__ import annotations

import asyncio
import logging
import signal
import socket
from types import FrameType

import uvicorn

from tokenmill.config import ServerConfig
from tokenmill.engine.client import EngineClient
from tokenmill.engine.process_settings import apply_process_settings
from tokenmill.server.app import build_app
from tokenmill.server.limits import HTTP_PROTOCOL, MAX_HEADER_BYTES
from tokenmill.server.serving import Serving

logger = logging.getLogger("tokenmill")

# After the grace period, how long ended requests get to send their error before
# uvicorn cancels them (which would cut streams mid-chunk and log tracebacks).
END_REQUESTS_TIMEOUT_S = 5.0


class GracefulServer(uvicorn.Server):
    """uvicorn's shutdown, except that requests still running when the grace
    period ends are ended by the app itself (Serving.end_requests), so each
    closes cleanly; uvicorn's own cancel is only the backstop."""

    def __init__(self, config: uvicorn.Config, serving: Serving, grace_s: float) -> None:
        super().__init__(config)
        self.serving = serving
        self.grace_s = grace_s

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        def end_requests() -> None:
            logger.warning("graceful shutdown: %g s passed; ending the requests still running",
                           self.grace_s)
            self.serving.end_requests()

        timer = asyncio.get_running_loop().call_later(self.grace_s, end_requests)
        try:
            await super().shutdown(sockets)
        finally:
            timer.cancel()


def run_server(
    engine: EngineClient, config: ServerConfig, graceful_shutdown_timeout_s: float = 30.0
) -> int:
    app = build_app(engine, config)
    serving: Serving = app.state.serving
    # The server is the whole process: its long-lived heap (model, tokenizer, app)
    # is frozen and freed memory kept (engine/process_settings.py says why).
    apply_process_settings()
    server = GracefulServer(uvicorn.Config(
        app, host=config.host, port=config.port, log_level="info",
        timeout_graceful_shutdown=graceful_shutdown_timeout_s + END_REQUESTS_TIMEOUT_S,  # type: ignore[arg-type]
        # HTTP-layer errors (431, 400) in OpenAI's JSON shape (server/limits.py).
        http=HTTP_PROTOCOL, h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    ), serving, graceful_shutdown_timeout_s)

    # uvicorn handles the signal (graceful shutdown) and then raises it again
    # for the handler it found; this one lets the process return 0 instead of
    # dying of the signal.
    def after_shutdown(sig: int, _: FrameType | None) -> None:
        logger.info("shut down after %s", signal.Signals(sig).name)

    previous = {sig: signal.signal(sig, after_shutdown) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        serving.close()
        engine.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
