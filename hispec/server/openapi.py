"""``GET /openapi.json``: FastAPI's description of the routes, with each generation route's request
body (the ``schema`` model its ``RequestBody`` validates with) and OpenAI's error shape."""
from __future__ import annotations

from typing import Optional

from fastapi import APIRouter, FastAPI
from fastapi.openapi.utils import get_openapi
from fastapi.routing import APIRoute
from pydantic import BaseModel

from .deps import RequestBody


class ErrorBody(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[str] = None


class ErrorResponse(BaseModel):
    error: ErrorBody


ERRORS = {"400": "invalid request", "401": "missing or wrong API key", "413": "body too large",
          "429": "the queue is full", "500": "generation failed", "503": "shutting down"}


def request_models(routers: tuple[APIRouter, ...]) -> dict[str, type[BaseModel]]:
    """path -> the model its route validates its body with."""
    return {route.path: dep.call.model for router in routers for route in router.routes
            if isinstance(route, APIRoute) for dep in route.dependant.dependencies if isinstance(dep.call, RequestBody)}


def openapi(app: FastAPI, routers: tuple[APIRouter, ...]) -> dict:
    """The OpenAPI schema of ``app``, made of ``routers`` (built once)."""
    if app.openapi_schema is None:
        schema = get_openapi(title=app.title, version=app.version, summary=app.summary, routes=app.routes)
        app.openapi_schema = add_request_bodies(schema, request_models(routers))
    return app.openapi_schema


def add_request_bodies(schema: dict, models: dict[str, type[BaseModel]]) -> dict:
    """Put the request bodies and the error responses into FastAPI's generated ``schema``."""
    components = schema.setdefault("components", {}).setdefault("schemas", {})

    def ref(model: type[BaseModel]) -> dict:
        js = model.model_json_schema(ref_template="#/components/schemas/{model}")
        components.update(js.pop("$defs", {}))
        components[model.__name__] = js
        return {"$ref": f"#/components/schemas/{model.__name__}"}

    error = {"content": {"application/json": {"schema": ref(ErrorResponse)}}}
    for path, model in models.items():
        op = schema["paths"][path]["post"]
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": ref(model)}}}
        op["responses"] = {"200": {"description": "the completion (JSON), or server-sent events with stream=true",
                                   "content": {"application/json": {"schema": {"type": "object"}},
                                               "text/event-stream": {"schema": {"type": "string"}}}},
                           **{code: {"description": text, **error} for code, text in ERRORS.items()}}
    return schema
