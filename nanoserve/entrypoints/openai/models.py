"""GET /v1/models: the one model this server serves."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from nanoserve.entrypoints.openai.protocol import ModelCard, ModelList
from nanoserve.entrypoints.openai.serving import Serving

router = APIRouter()


@router.get("/v1/models")
async def list_models(serving: Serving) -> dict[str, Any]:
    card = ModelCard(id=serving.served_model_name, max_model_len=serving.engine.max_model_len)
    return ModelList(data=[card]).model_dump()
