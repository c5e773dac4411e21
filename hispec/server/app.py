"""The FastAPI application: the routers (``routes``) over one ``ServerState``.

Every error is ``{"error": {"message", "type", "param", "code"}}`` (``errors``); ``/v1`` requests
are counted by endpoint and status code for ``/metrics``.
"""
from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager
from functools import partial

from fastapi import FastAPI

from .errors import SafeJSONResponse, add_error_handlers
from .metrics import Metrics
from .openapi import openapi
from .routes import chat, completions, metrics, models
from .state import ServerState

API_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/models")
ROUTERS = (completions.router, chat.router, models.router, metrics.router)


def create_app(state: ServerState) -> FastAPI:
    app = FastAPI(title="hispec", summary="OpenAI-compatible API of hispec (lossless self-speculative decoding)",
                  version=_version(), lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json",
                  default_response_class=SafeJSONResponse)
    app.state.hispec = state
    app.openapi = partial(openapi, app, ROUTERS)
    app.add_middleware(CountRequests, metrics=state.metrics)
    add_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    return app


@asynccontextmanager
async def lifespan(app: FastAPI):
    """The engine thread runs while the app does; stopping it cancels what is in flight."""
    engine = app.state.hispec.engine
    engine.start()
    try:
        yield
    finally:
        await asyncio.get_running_loop().run_in_executor(None, engine.stop, 10.0)


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hispec")
    except PackageNotFoundError:
        return "0"


class CountRequests:
    """ASGI middleware: count API responses by endpoint and status code."""

    def __init__(self, app, metrics: Metrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1"):
            return await self.app(scope, receive, send)
        path = scope["path"].rstrip("/")
        endpoint = path if path in API_PATHS else ("/v1/models" if path.startswith("/v1/models/") else "other")

        async def counting_send(message) -> None:
            if message["type"] == "http.response.start":
                self.metrics.count_http(endpoint, message["status"])
            await send(message)

        await self.app(scope, receive, counting_send)
