"""The paths of pair scoring on a cross-encoder: rerank where Jina's, Cohere's (v1 and v2)
and vLLM's clients post it, and vLLM's score. Each checks the model name, then hands the
request to server/routes/scoring.py. The app's assembly guards the router with the API key."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from server.routes.guards import check_model
from server.routes.scoring import create_rerank, create_score
from server.routes.scoring_protocol import RerankRequest, ScoreRequest
from server.state import served_state

router = APIRouter()


@router.post("/v1/rerank")
@router.post("/v2/rerank")
@router.post("/rerank")
async def rerank(req: RerankRequest, raw: Request) -> Any:
    state = served_state(raw)
    check_model(req.model, state)
    return await create_rerank(req, raw, state)


@router.post("/v1/score")
@router.post("/score")
async def score(req: ScoreRequest, raw: Request) -> Any:
    state = served_state(raw)
    check_model(req.model, state)
    return await create_score(req, raw, state)
