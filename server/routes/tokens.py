"""`POST /tokenize` and `POST /detokenize`, as vLLM serves them: a prompt or chat
messages to the very token ids the generating routes would give the engine, and ids
back to text. The app's assembly guards the router with the API key."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from server.edge.errors import APIError
from server.routes.chat_inputs import render_chat
from server.routes.engine_inputs import check_token_ids
from server.routes.guards import check_model
from server.routes.protocol import DetokenizeRequest, TokenizeRequest
from server.state import served_state

router = APIRouter()


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, raw: Request) -> dict[str, Any]:
    state = served_state(raw)
    check_model(req.model, state)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", "prompt")
    if req.messages is not None:
        # The function chat completions use, so these are the ids the engine would get.
        ids = render_chat(req.messages, state, req.add_generation_prompt, req.chat_template_kwargs)
    else:
        # The same ids /v1/completions gives this prompt: special-token text is special.
        ids = state.tokenizer.encode(
            req.prompt or "",
            allow_special=True,
            add_bos=None if req.add_special_tokens else False,
        )
    return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, raw: Request) -> dict[str, Any]:
    state = served_state(raw)
    check_model(req.model, state)
    check_token_ids(req.tokens, state, "tokens")
    return {"prompt": state.tokenizer.decode(req.tokens)}
