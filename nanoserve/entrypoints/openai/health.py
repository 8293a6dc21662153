"""GET /health (and /ping, its alias for SageMaker-style probes), GET /version.

/health says whether the engine serves: 200 `{"status": "ok"}`; 200 `{"status": "restarting", ...}`
while a dead engine core comes back within its restart budget (--engine-restarts); 200
`{"status": "degraded", ...}` when some data-parallel ranks died and others still serve; 503 (an error
body) when it is dead or hung.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

import nanoserve
from nanoserve.engine.exceptions import EngineDeadError
from nanoserve.entrypoints.openai.errors import error_json, error_responses
from nanoserve.entrypoints.openai.protocol import HealthResponse, VersionResponse
from nanoserve.entrypoints.openai.serving import Serving

router = APIRouter()


async def health_response(raw_request: Request, serving: Serving) -> JSONResponse:
    engine = serving.engine
    try:
        await engine.check_health(raw_request.app.state.options.health_hang_timeout)
    except EngineDeadError as e:
        return error_json(f"The engine is not healthy: {e}", 503, "service_unavailable")
    dead, restarting = engine.dead_ranks, engine.restarting_ranks
    errors = {str(rank): str(error) for rank, error in sorted(dead.items())}
    if restarting:  # coming back, not gone
        body = HealthResponse(
            status="restarting", restarting_ranks=restarting, dead_ranks=sorted(dead), errors=errors
        )
    elif dead:  # some data-parallel ranks still serve: healthy enough to keep, but say what is lost
        body = HealthResponse(status="degraded", dead_ranks=sorted(dead), errors=errors)
    else:
        body = HealthResponse(status="ok")
    return JSONResponse(body.model_dump())


router.add_api_route(
    "/health", health_response, methods=["GET"], response_model=HealthResponse, responses=error_responses(503)
)
router.add_api_route(
    "/ping",
    health_response,
    methods=["GET", "POST"],
    response_model=HealthResponse,
    responses=error_responses(503),
)


@router.get("/version")
async def version() -> VersionResponse:
    return VersionResponse(version=nanoserve.__version__)
