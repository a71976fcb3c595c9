"""The OpenAI API's paths: each names the model it may be asked for, then hands the
request to its handler module (completions, chat, responses, embeddings), and
`/v1/models` lists the names this server answers to. The app's assembly guards the
router with the API key."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from server.routes.chat import create_chat_completion
from server.routes.completions import create_completion
from server.routes.embeddings import create_embedding
from server.routes.guards import check_generates, check_model
from server.routes.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    EmbeddingRequest,
    ModelCard,
    ModelList,
)
from server.routes.responses import create_response
from server.routes.responses_protocol import ResponsesRequest
from server.state import served_state

router = APIRouter()


@router.post("/v1/completions")
async def completions(req: CompletionRequest, raw: Request) -> Any:
    state = served_state(raw)
    check_generates(req.model, state)
    return await create_completion(req, raw, state)


@router.post("/v1/chat/completions")
async def chat(req: ChatCompletionRequest, raw: Request) -> Any:
    state = served_state(raw)
    check_generates(req.model, state)
    return await create_chat_completion(req, raw, state)


@router.post("/v1/responses")
async def responses(req: ResponsesRequest, raw: Request) -> Any:
    state = served_state(raw)
    check_generates(req.model, state)
    return await create_response(req, raw, state)


@router.post("/v1/embeddings")
async def embeddings(req: EmbeddingRequest, raw: Request) -> Any:
    state = served_state(raw)
    check_model(req.model, state)
    return await create_embedding(req, raw, state)


@router.get("/v1/models")
async def models(raw: Request) -> ModelList:
    state = served_state(raw)
    names = [state.model_name, *state.extra_model_names]
    cards = [ModelCard(id=n, max_model_len=state.max_model_len, task=state.task) for n in names]
    for lora in state.adapters.adapters() if state.adapters is not None else []:
        card = ModelCard(
            id=lora.name,
            max_model_len=state.max_model_len,
            root=lora.path,
            parent=state.model_name,
        )
        cards.append(card)
    return ModelList(data=cards)
