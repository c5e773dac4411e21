"""``GET /metrics``: the server's metrics in the Prometheus text format (no API key)."""
from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import PlainTextResponse

from ..deps import server_state
from ..state import ServerState

router = APIRouter()


@router.get("/metrics")
async def metrics(state: ServerState = Depends(server_state)):
    return PlainTextResponse(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
