"""GET /v1/models: the one model this server serves."""

from __future__ import annotations

from fastapi import APIRouter

from nanoserve.entrypoints.openai.errors import error_responses
from nanoserve.entrypoints.openai.protocol import ModelCard, ModelList
from nanoserve.entrypoints.openai.serving import Serving

router = APIRouter()


@router.get("/v1/models", responses=error_responses(401))
async def list_models(serving: Serving) -> ModelList:
    card = ModelCard(id=serving.served_model_name, max_model_len=serving.engine.max_model_len)
    return ModelList(data=[card])
