"""`POST /v1/embeddings`: inputs (a text, texts, token ids, lists of token ids) to one
vector each, as OpenAI's API returns them: float lists, or base64 of little-endian
float32 (what the official client asks for by default and decodes).

Every input becomes one engine request; all are admitted before any is answered, so an
overloaded engine refuses the whole call with a 503 rather than part of it.
"""

from __future__ import annotations

import base64
import time
from typing import Any

import numpy as np
from fastapi import Request
from fastapi.responses import JSONResponse

from scheduler import PoolingParams
from server.edge.errors import APIError
from server.routes.engine_inputs import check_token_ids
from server.routes.protocol import EmbeddingRequest
from server.routes.streaming import admit, merge, unless_disconnected
from server.state import EmbeddingSpec, ServerState

# OpenAI's limit of inputs per call.
MAX_INPUTS = 2048
# Inputs admitted to the engine at once, within the default waiting queue of 1,024.
WAVE = 256


def embedding_spec(state: ServerState) -> EmbeddingSpec:
    """The spec of a model that embeds, or the 400 a generating model answers."""
    if state.scores_pairs:
        raise APIError(
            400,
            f"the model `{state.model_name}` is a cross-encoder: it scores text pairs and has "
            "no embeddings; use /v1/rerank or /score",
            "model",
        )
    if state.embedding is None:
        raise APIError(
            400,
            f"the model `{state.model_name}` generates text and has no embeddings; "
            "start a server on an embedding model, or with --task embed",
            "model",
        )
    return state.embedding


def input_ids(req: EmbeddingRequest, state: ServerState) -> list[list[int]]:
    """Each input's token ids: text with the model's markup unless add_special_tokens is
    false, token ids as they are; cut to the last k tokens when truncation asks it."""
    if isinstance(req.input, str) or (req.input and isinstance(req.input[0], int)):
        texts: list[Any] = [req.input]
    else:
        texts = list(req.input)
    if not texts:
        raise APIError(400, "input must not be empty", "input")
    if len(texts) > MAX_INPUTS:
        raise APIError(400, f"input holds {len(texts)} items, at most {MAX_INPUTS}", "input")
    result = []
    for item in texts:
        if isinstance(item, str):
            ids = state.tokenizer.encode(
                item, allow_special=True, add_bos=None if req.add_special_tokens else False
            )
        else:
            ids = list(item)
            check_token_ids(ids, state, "input")
        keep = req.truncate_prompt_tokens
        if keep == -1:
            keep = state.max_model_len
        if keep is not None:
            if keep > state.max_model_len:
                raise APIError(
                    400,
                    f"truncate_prompt_tokens {keep} is over the model's limit of "
                    f"{state.max_model_len} tokens",
                    "truncate_prompt_tokens",
                )
            ids = ids[-keep:] if keep else []
        if not ids:
            raise APIError(400, "each input must have at least one token", "input")
        if len(ids) > state.max_model_len:
            raise APIError(
                400,
                f"an input has {len(ids)} tokens, over the model's limit of "
                f"{state.max_model_len}; shorten it or set truncate_prompt_tokens",
                "input",
            )
        result.append(ids)
    return result


def shaped(vector: np.ndarray, dimensions: int | None, spec: EmbeddingSpec) -> np.ndarray:
    """Cut to `dimensions` where the model was trained for it (normalised again if the
    model's vectors are); a 400 naming `dimensions` anywhere else."""
    if dimensions is None or dimensions == spec.dim:
        return vector
    if dimensions > spec.dim:
        raise APIError(400, f"dimensions {dimensions} is over the model's {spec.dim}", "dimensions")
    if spec.matryoshka is None:
        raise APIError(
            400,
            f"the model does not support matryoshka representation: dimensions must be "
            f"{spec.dim} or left out",
            "dimensions",
        )
    if isinstance(spec.matryoshka, list) and dimensions not in spec.matryoshka:
        allowed = ", ".join(map(str, spec.matryoshka))
        raise APIError(400, f"dimensions must be one of {allowed}", "dimensions")
    cut = vector[:dimensions]
    if spec.normalize:
        cut = cut / max(float(np.linalg.norm(cut)), 1e-12)
    return cut.astype(np.float32)


async def create_embedding(req: EmbeddingRequest, raw: Request, state: ServerState) -> Any:
    spec = embedding_spec(state)
    inputs = input_ids(req, state)
    shaped(np.zeros(spec.dim, np.float32), req.dimensions, spec)  # refuse before computing
    rid = raw.state.request_id
    raw.state.prompt_tokens = total = sum(len(ids) for ids in inputs)
    data = await unless_disconnected(raw, _embed_all(req, rid, state, inputs, spec))
    return JSONResponse(
        {
            "id": f"embd-{rid}",
            "object": "list",
            "created": int(time.time()),
            "model": state.model_name,
            "data": data,
            "usage": {"prompt_tokens": total, "total_tokens": total},
        }
    )


async def _embed_all(
    req: EmbeddingRequest,
    rid: str,
    state: ServerState,
    inputs: list[list[int]],
    spec: EmbeddingSpec,
) -> list[dict[str, Any]]:
    """In waves of WAVE inputs: a call of 2,048 inputs neither overflows the waiting
    queue (a 503 it could never get past) nor holds it against other clients."""
    data: list[dict[str, Any]] = []
    for start in range(0, len(inputs), WAVE):
        wave = inputs[start : start + WAVE]
        jobs = [(f"{rid}-{start + i}", ids, PoolingParams()) for i, ids in enumerate(wave)]
        vectors: list[np.ndarray | None] = [None] * len(wave)
        async for i, out in merge(await admit(state, jobs)):  # type: ignore[arg-type]
            if out.error is not None or out.embedding is None:
                raise APIError(500, f"embedding failed: {out.error}")
            vectors[i] = shaped(out.embedding, req.dimensions, spec)
        for i, vector in enumerate(vectors, start):
            assert vector is not None
            if req.encoding_format == "base64":
                value: Any = base64.b64encode(vector.astype("<f4").tobytes()).decode()
            else:
                value = vector.tolist()
            data.append({"object": "embedding", "index": i, "embedding": value})
    return data
