"""The wire format of the routes that score text pairs on a cross-encoder: Jina's and
Cohere's rerank request (`query`, `documents`, `top_n`, `return_documents`), which vLLM and
llama.cpp's server answer too, and vLLM's score request (`text_1`, `text_2`).

Documents are checked in the handler, not here: a document is a string or an object with a
`text`, and a 400 naming `documents` says more than pydantic's path into a union.
"""

from __future__ import annotations

from typing import Any

from pydantic import Field

from server.routes.protocol import LenientModel


class RerankRequest(LenientModel):
    model: str | None = None
    query: str
    documents: list[Any]
    # 0 or None: every document, as vLLM reads it; more than there are: every document.
    top_n: int | None = Field(None, ge=0)
    return_documents: bool = False


class ScoreRequest(LenientModel):
    model: str | None = None
    # One to one (two strings), one to many (a string, or a list of one, against a list),
    # or many to many (two lists of one length, pairwise), as vLLM's /score pairs them.
    text_1: str | list[str]
    text_2: str | list[str]
