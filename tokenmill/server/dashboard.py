"""`tokenmill serve --dashboard`: the live view's page and its event feed.

GET /dashboard         one static HTML/JS page (package data, plain SVG and canvas)
GET /dashboard/events  server-sent events: `hello` once, then a `snapshot` per
                       engine snapshot (engine/live_view.py), at most 10 a second

A connection subscribes to the engine's LiveView for as long as it is open;
with none open the engine takes no snapshots. The feed carries request ids and
counts, never prompt or output text.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from importlib import resources

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, StreamingResponse

from tokenmill.engine.client import EngineClient

# A comment line this often keeps idle connections (and proxies) from timing out.
KEEPALIVE_S = 15.0


def dashboard_html() -> str:
    return resources.files("tokenmill.server").joinpath("static/dashboard.html").read_text("utf-8")


def build_dashboard_router(engine: EngineClient, model_name: str) -> APIRouter:
    router = APIRouter(prefix="/dashboard")
    page = dashboard_html()

    @router.get("", response_class=HTMLResponse)
    async def dashboard() -> HTMLResponse:
        return HTMLResponse(page, headers={"Cache-Control": "no-cache"})

    @router.get("/events")
    async def events() -> StreamingResponse:
        live = engine.live_view
        hello = json.dumps({"model": model_name, "max_model_len": engine.facts.max_model_len,
                            "max_rate_hz": 1 / live.min_interval_s if live.min_interval_s else None})

        async def stream() -> AsyncIterator[str]:
            subscriber = live.subscribe()
            try:
                yield f"retry: 2000\nevent: hello\ndata: {hello}\n\n"
                while True:
                    data = await subscriber.get(KEEPALIVE_S)
                    yield f"event: snapshot\ndata: {data}\n\n" if data is not None else ": keepalive\n\n"
            finally:  # the client went away (starlette cancels the stream) or the server stops
                live.unsubscribe(subscriber)

        return StreamingResponse(stream(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return router
