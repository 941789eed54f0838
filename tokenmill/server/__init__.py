"""The OpenAI-compatible HTTP server: `build_app(engine, server_config)`."""

from tokenmill.server.app import build_app

__all__ = ["build_app"]
