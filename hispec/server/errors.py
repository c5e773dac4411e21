"""OpenAI-style errors: ``{"error": {"message", "type", "param", "code"}}`` with an HTTP status.

Every failure the server answers goes through ``APIError``; the handlers installed by
``add_error_handlers`` also answer Starlette's HTTP errors (404, 405) and bugs (500) in the same shape.
"""
from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException


class APIError(Exception):
    """An error answered to the client in OpenAI's shape."""

    def __init__(self, message: str, *, status: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param, self.code = message, status, type, param, code
        self.headers = dict(headers or {})
        if status == 401:
            self.headers.setdefault("WWW-Authenticate", "Bearer")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    """A 400 ``invalid_request_error``."""
    return APIError(message, param=param, code=code)


class SafeJSONResponse(JSONResponse):
    """JSON that always encodes: text that UTF-8 cannot carry (lone surrogates) goes out \\u-escaped."""

    def render(self, content) -> bytes:
        try:
            return super().render(content)
        except UnicodeEncodeError:
            return json.dumps(content, ensure_ascii=True, allow_nan=False, separators=(",", ":")).encode()


def error_response(err: APIError) -> JSONResponse:
    return SafeJSONResponse(err.body(), status_code=err.status, headers=err.headers or None)


async def _api_error(request: Request, err: APIError) -> JSONResponse:
    return error_response(err)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
    return error_response(APIError(str(exc.detail), status=exc.status_code, type=kind))


async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
    """A bug: still answered in OpenAI's shape."""
    return error_response(APIError(f"internal error: {type(exc).__name__}", status=500, type="server_error"))


def add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _internal_error)
