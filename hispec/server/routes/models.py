"""``GET /v1/models``, ``GET /v1/models/{model}`` (the served model's card) and ``GET /health``."""
from __future__ import annotations

from fastapi import APIRouter, Depends
from fastapi.responses import JSONResponse

from ..deps import check_key, server_state
from ..errors import APIError
from ..state import ServerState

router = APIRouter()


@router.get("/health")
async def health(state: ServerState = Depends(server_state)):
    if not state.engine.alive:
        return JSONResponse({"status": "error", "error": str(state.engine.error or "engine stopped")},
                            status_code=503)
    return {"status": "ok"}


@router.get("/v1/models", dependencies=[Depends(check_key)])
async def models(state: ServerState = Depends(server_state)):
    return {"object": "list", "data": [model_card(state)]}


@router.get("/v1/models/{model:path}", dependencies=[Depends(check_key)])
async def model(model: str, state: ServerState = Depends(server_state)):
    if model not in state.model_names:
        raise APIError(f"The model '{model}' does not exist", status=404, type="not_found_error",
                       param="model", code="model_not_found")
    return model_card(state)


def model_card(state: ServerState) -> dict:
    return {"id": state.served_name, "object": "model", "created": state.created, "owned_by": "hispec",
            "max_model_len": state.context_length, "strategy": state.strategy}
