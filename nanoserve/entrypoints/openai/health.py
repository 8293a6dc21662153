"""GET /health and /version: is the engine serving (all of it, part of it, or not at all)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

import nanoserve
from nanoserve.engine.exceptions import EngineDeadError
from nanoserve.entrypoints.openai.errors import error_json
from nanoserve.entrypoints.openai.serving import Serving

router = APIRouter()


@router.get("/health")
async def health(raw_request: Request, serving: Serving) -> Response:
    engine = serving.engine
    try:
        await engine.check_health(raw_request.app.state.options.health_hang_timeout)
    except EngineDeadError as e:
        return error_json(f"The engine is not healthy: {e}", 503, "service_unavailable")
    dead = engine.dead_ranks
    if dead:  # some data-parallel ranks still serve: healthy enough to keep, but say what is lost
        return JSONResponse(
            {
                "status": "degraded",
                "dead_ranks": sorted(dead),
                "errors": {str(rank): str(error) for rank, error in sorted(dead.items())},
            }
        )
    return Response(status_code=200)


@router.get("/version")
async def version() -> dict[str, str]:
    return {"version": nanoserve.__version__}
