"""vLLM's run-time adapter endpoints, `POST /v1/load_lora_adapter` and
`POST /v1/unload_lora_adapter`, behind the API key as every API route. They change only
the names the server answers to (server/adapters/registry.py); the engine reads an
adapter's weights when a request first needs them."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from model.lora import AdapterError
from server.adapters.registry import AdapterRegistry
from server.edge.errors import APIError
from server.state import ServerState, served_state

router = APIRouter()


class LoadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    lora_name: str
    lora_int_id: int | None = None


def _registry(state: ServerState) -> AdapterRegistry:
    if state.adapters is None:
        raise APIError(400, "LoRA adapters are off: start the server with --enable-lora")
    return state.adapters


@router.post("/v1/load_lora_adapter")
async def load_lora_adapter(req: LoadLoraAdapterRequest, raw: Request) -> PlainTextResponse:
    registry = _registry(served_state(raw))
    try:
        # Reading and checking the weights takes file I/O: off the event loop.
        await asyncio.to_thread(registry.add, req.lora_name, req.lora_path)
    except AdapterError as exc:
        raise APIError(400, str(exc), "lora_path") from None
    except ValueError as exc:
        raise APIError(400, str(exc), "lora_name") from None
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter")
async def unload_lora_adapter(req: UnloadLoraAdapterRequest, raw: Request) -> PlainTextResponse:
    registry = _registry(served_state(raw))
    if not registry.remove(req.lora_name):
        raise APIError(
            404,
            f"the LoRA adapter `{req.lora_name[:200]}` is not loaded",
            "lora_name",
            code="model_not_found",
        )
    return PlainTextResponse(f"Success: LoRA adapter '{req.lora_name}' removed successfully.")
