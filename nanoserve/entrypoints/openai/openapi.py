"""/openapi.json as the server answers: FastAPI documents validation errors as 422 with its own body,
but the server sends them as 400 in OpenAI's error format, and any route can answer a 500 in that format."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from nanoserve.entrypoints.openai.errors import ERROR_STATUSES
from nanoserve.entrypoints.openai.protocol import ErrorResponse

ERROR_REF = "#/components/schemas/ErrorResponse"


def use_truthful_openapi(app: FastAPI) -> None:
    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            app.openapi_schema = truthful(
                get_openapi(title=app.title, version=app.version, routes=app.routes)
            )
        return app.openapi_schema

    app.openapi = openapi


def truthful(schema: dict[str, Any]) -> dict[str, Any]:
    schemas = schema.setdefault("components", {}).setdefault("schemas", {})
    schemas.pop("HTTPValidationError", None)
    schemas.pop("ValidationError", None)
    error_schema = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(error_schema.pop("$defs", {}))
    schemas["ErrorResponse"] = error_schema
    for path_item in schema.get("paths", {}).values():
        for operation in path_item.values():
            responses = operation["responses"]
            if responses.pop("422", None) is not None:
                responses["400"] = error_doc(400)
            responses.setdefault("500", error_doc(500))
    return schema


def error_doc(status: int) -> dict[str, Any]:
    return {
        "description": ERROR_STATUSES[status],
        "content": {"application/json": {"schema": {"$ref": ERROR_REF}}},
    }
