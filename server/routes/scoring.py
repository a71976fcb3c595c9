"""`/v1/rerank` and `/score`: text pairs to one relevance score each, on a cross-encoder.

A pair is read as the model reads it in sentence-transformers' `CrossEncoder.predict`: the
tokenizer's pair template ([CLS] query [SEP] document [SEP], segments 0 and 1), cut to the
model's length longest text first, and the score is the classifier's after its activation.
Every pair is one engine request on the embedding engine, batched and limited as
`/v1/embeddings` inputs are (at most MAX_INPUTS pairs a call, admitted WAVE at a time).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse

from model.text.wordpiece import WordPieceTokenizer
from scheduler import PoolingParams
from server.edge.errors import APIError
from server.routes.embeddings import MAX_INPUTS, WAVE
from server.routes.scoring_protocol import RerankRequest, ScoreRequest
from server.routes.streaming import admit, merge, unless_disconnected
from server.state import ServerState


def pair_tokenizer(state: ServerState) -> WordPieceTokenizer:
    """The cross-encoder's tokenizer, or the 400 naming `model` any other model answers."""
    if not state.scores_pairs or not isinstance(state.tokenizer, WordPieceTokenizer):
        kind = "an embedding model" if state.task == "embed" else "a model that generates text"
        raise APIError(
            400,
            f"the model `{state.model_name}` is {kind}, not a cross-encoder: rerank and score "
            "need a sequence-classification model (a sentence-transformers CrossEncoder)",
            "model",
        )
    return state.tokenizer


def document_texts(documents: list[Any]) -> list[str]:
    texts = []
    for i, doc in enumerate(documents):
        if isinstance(doc, dict) and isinstance(doc.get("text"), str):
            texts.append(doc["text"])
        elif isinstance(doc, str):
            texts.append(doc)
        else:
            raise APIError(
                400, f"documents[{i}]: expected a string or an object with a `text`", "documents"
            )
    return texts


def _check_count(count: int, param: str) -> None:
    if count == 0:
        raise APIError(400, f"{param} must not be empty", param)
    if count > MAX_INPUTS:
        raise APIError(400, f"{param} holds {count} items, at most {MAX_INPUTS}", param)


async def create_rerank(req: RerankRequest, raw: Request, state: ServerState) -> Any:
    tokenizer = pair_tokenizer(state)
    texts = document_texts(req.documents)
    _check_count(len(texts), "documents")
    rid = raw.state.request_id
    scores, total = await _score_all(raw, state, tokenizer, [(req.query, t) for t in texts])
    order = sorted(range(len(texts)), key=lambda i: -scores[i])
    if req.top_n:
        order = order[: req.top_n]
    results = []
    for i in order:
        result: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if req.return_documents:
            result["document"] = {"text": texts[i]}
        results.append(result)
    return JSONResponse(
        {
            "id": f"rerank-{rid}",
            "model": state.model_name,
            "usage": {"prompt_tokens": total, "total_tokens": total},
            "results": results,
        }
    )


async def create_score(req: ScoreRequest, raw: Request, state: ServerState) -> Any:
    tokenizer = pair_tokenizer(state)
    firsts = [req.text_1] if isinstance(req.text_1, str) else req.text_1
    seconds = [req.text_2] if isinstance(req.text_2, str) else req.text_2
    _check_count(len(firsts), "text_1")
    _check_count(len(seconds), "text_2")
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    elif len(firsts) != len(seconds):
        raise APIError(
            400,
            f"text_1 holds {len(firsts)} texts and text_2 {len(seconds)}: pairs are one to "
            "one, one to many (text_1 one text) or many to many (two lists of one length)",
            "text_2",
        )
    rid = raw.state.request_id
    scores, total = await _score_all(raw, state, tokenizer, list(zip(firsts, seconds, strict=True)))
    return JSONResponse(
        {
            "id": f"score-{rid}",
            "object": "list",
            "created": int(time.time()),
            "model": state.model_name,
            "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
            "usage": {"prompt_tokens": total, "total_tokens": total, "completion_tokens": 0},
        }
    )


async def _score_all(
    raw: Request, state: ServerState, tokenizer: WordPieceTokenizer, pairs: list[tuple[str, str]]
) -> tuple[list[float], int]:
    """Each pair's score, in order, and the tokens the model read."""
    encoded = tokenizer.encode_pairs(pairs, state.max_model_len)
    raw.state.prompt_tokens = total = sum(len(ids) for ids, _ in encoded)
    rid = raw.state.request_id
    scores = await unless_disconnected(raw, _run_waves(rid, state, encoded))
    return scores, total


async def _run_waves(
    rid: str, state: ServerState, encoded: list[tuple[list[int], list[int]]]
) -> list[float]:
    scores: list[float] = []
    for start in range(0, len(encoded), WAVE):
        wave = encoded[start : start + WAVE]
        jobs = [
            (f"{rid}-{start + i}", ids, PoolingParams(token_type_ids=tuple(types)))
            for i, (ids, types) in enumerate(wave)
        ]
        got: list[float | None] = [None] * len(wave)
        async for i, out in merge(await admit(state, jobs)):  # type: ignore[arg-type]
            if out.error is not None or out.embedding is None:
                raise APIError(500, f"scoring failed: {out.error}")
            got[i] = float(out.embedding[0])
        for score in got:
            assert score is not None  # merge ends only when every stream has finished
            scores.append(score)
    return scores
