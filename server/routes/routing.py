"""What a router in front of several replicas asks of each one, beside the OpenAI API:
how loaded it is (vllm-router's `power_of_two` reads `GET /get_load`; vLLM serves the same
figure at `GET /load`), and a completion prompt's token ids before it is sent
(`POST /v1/completions/render`, vLLM's renderer API: the very ids, and the very errors,
that /v1/completions gives the prompt), which cache-aware routing keys its prefix tree on.
Chat prompts fall back to `POST /tokenize` with their messages, which renders them with
the model's chat template exactly as chat completions do."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI
from fastapi.params import Depends

from server.routes.completions import prompt_ids
from server.routes.protocol import CompletionPrompt, LenientModel
from server.state import ServerState


class RenderCompletionRequest(LenientModel):
    model: str | None = None
    prompt: CompletionPrompt


def load_figures(state: ServerState) -> dict[str, int]:
    """Sequences running and waiting in the scheduler (read between steps without a lock:
    two list lengths, a moment old at worst)."""
    scheduler = state.engine.engine.scheduler
    running, waiting = len(scheduler.running), len(scheduler.waiting)
    return {"running": running, "waiting": waiting, "load": running + waiting}


def add_routing_endpoints(
    app: FastAPI,
    state: ServerState,
    guarded: list[Depends],
    check_model: Callable[[str | None], None],
) -> None:
    @app.get("/get_load", dependencies=guarded)
    async def get_load() -> dict[str, int]:
        figures = load_figures(state)
        return {
            "load": figures["load"],
            "num_reqs": figures["running"],
            "num_waiting_reqs": figures["waiting"],
        }

    @app.get("/load", dependencies=guarded)
    async def load() -> dict[str, int]:
        return {"server_load": load_figures(state)["load"]}

    @app.post("/v1/completions/render", dependencies=guarded)
    async def render_completion(req: RenderCompletionRequest) -> list[dict[str, Any]]:
        check_model(req.model)
        return [
            {
                "request_id": f"cmpl-{uuid.uuid4().hex}",
                "model": state.model_name,
                "token_ids": ids,
                "sampling_params": {},
            }
            for ids in prompt_ids(req.prompt, state)
        ]
