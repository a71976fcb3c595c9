"""What a router in front of several replicas asks of each one, beside the OpenAI API:
how loaded it is (vllm-router's `power_of_two` reads `GET /get_load`; vLLM serves the same
figure at `GET /load`), and a completion prompt's token ids before it is sent
(`POST /v1/completions/render`, vLLM's renderer API: the very ids, and the very errors,
that /v1/completions gives the prompt), which cache-aware routing keys its prefix tree on.
Chat prompts fall back to `POST /tokenize` with their messages, which renders them with
the model's chat template exactly as chat completions do. The app's assembly guards the
router with the API key."""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request

from server.routes.completions import prompt_ids
from server.routes.guards import check_model
from server.routes.protocol import CompletionPrompt, LenientModel
from server.state import ServerState, served_state


class RenderCompletionRequest(LenientModel):
    model: str | None = None
    prompt: CompletionPrompt


def load_figures(state: ServerState) -> dict[str, int]:
    """Sequences running and waiting in the scheduler (read between steps without a lock:
    two list lengths, a moment old at worst)."""
    scheduler = state.engine.engine.scheduler
    running, waiting = len(scheduler.running), len(scheduler.waiting)
    return {"running": running, "waiting": waiting, "load": running + waiting}


router = APIRouter()


@router.get("/get_load")
async def get_load(raw: Request) -> dict[str, int]:
    figures = load_figures(served_state(raw))
    return {
        "load": figures["load"],
        "num_reqs": figures["running"],
        "num_waiting_reqs": figures["waiting"],
    }


@router.get("/load")
async def load(raw: Request) -> dict[str, int]:
    return {"server_load": load_figures(served_state(raw))["load"]}


@router.post("/v1/completions/render")
async def render_completion(req: RenderCompletionRequest, raw: Request) -> list[dict[str, Any]]:
    state = served_state(raw)
    check_model(req.model, state)
    return [
        {
            "request_id": f"cmpl-{uuid.uuid4().hex}",
            "model": state.model_name,
            "token_ids": ids,
            "sampling_params": {},
        }
        for ids in prompt_ids(req.prompt, state)
    ]
