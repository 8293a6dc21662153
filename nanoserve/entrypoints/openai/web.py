"""The web page at `/`: a chat with the served model and a live dashboard of the engine.

The page is static files shipped in the package (`nanoserve/web/`, no build step, no CDN). It talks to
the server with relative URLs only, so it works unchanged under `--root-path` behind a proxy: the chat
over `/v1/chat/completions` (SSE), the dashboard by polling `STATS_PATH`, which is behind the API key
when one is set (the page itself and its files are not: they hold nothing secret).
"""

from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter, FastAPI
from fastapi.responses import FileResponse, JSONResponse
from fastapi.staticfiles import StaticFiles

import nanoserve
from nanoserve.engine.async_llm import AsyncLLM
from nanoserve.entrypoints.openai.dashboard import DashboardStatLogger

WEB_DIR = Path(nanoserve.__file__).parent / "web"
STATS_PATH = "/dashboard/stats"

# everything the page loads comes from this server; no inline script or style
CONTENT_SECURITY_POLICY = "default-src 'self'; object-src 'none'; base-uri 'none'"


def mount_web(app: FastAPI, engine: AsyncLLM, served_model_name: str) -> None:
    """Serve the page, its files and the dashboard's data; the dashboard starts listening to the engine."""
    dashboard = DashboardStatLogger()
    engine.stat_loggers.append(dashboard)
    router = APIRouter()

    @router.get("/", include_in_schema=False)
    async def index() -> FileResponse:
        return FileResponse(
            WEB_DIR / "index.html", headers={"Content-Security-Policy": CONTENT_SECURITY_POLICY}
        )

    @router.get(STATS_PATH)
    async def stats() -> JSONResponse:
        body = {"model": served_model_name, **dashboard.snapshot(engine)}
        return JSONResponse(body, headers={"Cache-Control": "no-store"})

    app.include_router(router)
    app.mount("/static", StaticFiles(directory=WEB_DIR), name="static")
