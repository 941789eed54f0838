"""Run the app with uvicorn until SIGTERM or SIGINT, then shut down gracefully:
stop accepting, let running requests finish (up to a timeout, then abort
them), stop the engine loop, return 0."""

from __future__ import annotations

import logging
import signal
from types import FrameType

import uvicorn

from tokenmill.config import ServerConfig
from tokenmill.engine.async_engine import AsyncEngine
from tokenmill.engine.process_settings import apply_process_settings
from tokenmill.server.app import build_app

logger = logging.getLogger("tokenmill")


def run_server(
    engine: AsyncEngine, config: ServerConfig, graceful_shutdown_timeout_s: float = 30.0
) -> int:
    app = build_app(engine, config)
    # The server is the whole process: its long-lived heap (model, tokenizer, app)
    # is frozen and freed memory kept (engine/process_settings.py says why).
    apply_process_settings()
    server = uvicorn.Server(uvicorn.Config(
        app, host=config.host, port=config.port, log_level="info",
        timeout_graceful_shutdown=int(graceful_shutdown_timeout_s),
    ))

    # uvicorn handles the signal (graceful shutdown) and then raises it again
    # for the handler it found; this one lets the process return 0 instead of
    # dying of the signal.
    def after_shutdown(sig: int, _: FrameType | None) -> None:
        logger.info("shut down after %s", signal.Signals(sig).name)

    previous = {sig: signal.signal(sig, after_shutdown) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run()
    finally:
        engine.shutdown()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 0
