"""One answer as the protocols see it: reasoning first, then content or tool calls.

`AnswerStream` turns the engine's text, step by step, into chat-completion deltas:
`{"reasoning_content": ..., "reasoning": ...}` (llama.cpp's and DeepSeek's name, and
vLLM's newer one) while the think block lasts, then the content and tool-call deltas of
server/structured/tool_stream.py, which never sees the think block: a call written while
thinking is reasoning, not a call. `AnswerParts` gathers the same split for a whole
answer. Chat, Responses and Messages all read these, so each protocol's reasoning is the
same text.
"""

from __future__ import annotations

from typing import Any

from server.reasoning.formats import ReasoningFormat
from server.reasoning.splitter import Piece, ReasoningSplitter
from server.structured.tool_calls import ToolPlan
from server.structured.tool_stream import ToolCallStream


def reasoning_delta(text: str) -> dict[str, Any]:
    return {"reasoning_content": text, "reasoning": text}


class AnswerParts:
    """A whole answer's reasoning (None when there was none), content and think tokens."""

    def __init__(self, fmt: ReasoningFormat | None) -> None:
        self._splitter = ReasoningSplitter(fmt) if fmt else None
        self._reasoning = ""
        self.content = ""

    def add(self, text: str, num_tokens: int, final: bool) -> list[Piece]:
        if self._splitter is None:
            pieces = [("content", text)] if text else []
        else:
            pieces = self._splitter.feed(text, num_tokens, final)
        for kind, piece in pieces:
            if kind == "reasoning":
                self._reasoning += piece
            else:
                self.content += piece
        return pieces

    @property
    def reasoning(self) -> str | None:
        return self._reasoning or None

    @property
    def reasoning_tokens(self) -> int:
        return self._splitter.reasoning_tokens if self._splitter else 0


class AnswerStream:
    def __init__(self, fmt: ReasoningFormat | None, plan: ToolPlan | None) -> None:
        self.parts = AnswerParts(fmt)
        self._tools = ToolCallStream(plan) if plan else None

    @property
    def num_calls(self) -> int:
        return self._tools.num_calls if self._tools else 0

    def feed(self, text: str, num_tokens: int = 0, final: bool = False) -> list[dict[str, Any]]:
        """Chat-completion deltas for `text`; `final` flushes everything held back."""
        deltas: list[dict[str, Any]] = []
        for kind, piece in self.parts.add(text, num_tokens, final):
            if kind == "reasoning":
                deltas.append(reasoning_delta(piece))
            elif self._tools is None:
                deltas.append({"content": piece})
            else:
                deltas += self._tools.feed(piece)
        if final and self._tools is not None:
            deltas += self._tools.feed("", final=True)
        return deltas
