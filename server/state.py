"""`ServerState`: what every route handler needs, built once at start-up and stored on
the app, where `served_state` finds it. Handlers read it; only the engine thread changes
engine state."""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import Request

from model.text.chat_template import ChatTemplate
from model.text.tokenizer import Tokenizer
from model.text.wordpiece import WordPieceTokenizer
from scheduler import AsyncEngine, LoraRequest
from server.adapters.registry import AdapterRegistry
from server.reasoning.formats import ReasoningFormat
from server.structured.grammar import GrammarCompiler


@dataclass(frozen=True)
class EmbeddingSpec:
    """What the embeddings route must know of a model that embeds."""

    dim: int
    normalize: bool  # vectors cut by `dimensions` are normalised again
    matryoshka: list[int] | str | None  # lengths `dimensions` may ask; "any"; None: none


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Tokenizer | WordPieceTokenizer
    chat_template: ChatTemplate | None
    model_name: str
    max_model_len: int
    vocab_size: int
    api_keys: list[str] = field(default_factory=list)  # empty: no key needed
    metrics_require_api_key: bool = False
    max_request_bytes: int = 8 * 2**20
    fingerprint: str = "fp_llamaserve"
    extra_model_names: list[str] = field(default_factory=list)
    embedding: EmbeddingSpec | None = None  # set: the model embeds and generates nothing
    # A cross-encoder: scores text pairs (rerank, score); neither embeds nor generates.
    scores_pairs: bool = False
    reasoning: ReasoningFormat | None = None  # --reasoning-parser: how think blocks look
    adapters: AdapterRegistry | None = None  # --enable-lora: the adapters' names
    grammars: GrammarCompiler = field(init=False)

    def __post_init__(self) -> None:
        self.grammars = GrammarCompiler(self.tokenizer)

    @property
    def task(self) -> str:
        if self.scores_pairs:
            return "score"
        return "generate" if self.embedding is None else "embed"

    def serves(self, model: str | None) -> bool:
        return (
            model is None
            or model == self.model_name
            or model in self.extra_model_names
            or self.lora_for(model) is not None
        )

    def answering_name(self, model: str | None) -> str:
        """The `model` a response reports: the adapter's name, as vLLM's, else the base's."""
        lora = self.lora_for(model)
        return lora.name if lora is not None else self.model_name

    def lora_for(self, model: str | None) -> LoraRequest | None:
        """The adapter a request's `model` names; None: the base model."""
        return self.adapters.get(model) if self.adapters is not None else None


def served_state(request: Request) -> ServerState:
    """The state `build_app` stored on the app that received `request`."""
    return request.app.state.llamaserve
