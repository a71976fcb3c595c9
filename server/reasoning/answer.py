"""One answer as the protocols see it: reasoning first, then content or tool calls.

`AnswerStream` turns the engine's text, step by step, into chat-completion deltas:
`{"reasoning_content": ..., "reasoning": ...}` (llama.cpp's and DeepSeek's name, and
vLLM's newer one) while the think block lasts, then the content and tool-call deltas of
server/structured/tool_stream.py, which never sees the think block: a call written while
thinking is reasoning, not a call. `AnswerParts` gathers the same split for a whole
answer. Chat, Responses and Messages all read these, so each protocol's reasoning is the
same text. Under harmony (gpt-oss) the channels say what is reasoning, content or a call
(server/reasoning/harmony.py), so the answer's calls come from there, never from parsing
the content.
"""

from __future__ import annotations

from typing import Any

from server.reasoning.formats import ReasoningFormat
from server.reasoning.harmony import HarmonySplitter
from server.reasoning.splitter import Piece, ReasoningSplitter
from server.structured.tool_calls import ParsedCall, ToolPlan, new_call_id, parse_tool_calls
from server.structured.tool_stream import ToolCallStream


def reasoning_delta(text: str) -> dict[str, Any]:
    return {"reasoning_content": text, "reasoning": text}


def call_delta(index: int, name: str) -> dict[str, Any]:
    header = {"index": index, "id": new_call_id(), "type": "function"}
    return {"tool_calls": [{**header, "function": {"name": name, "arguments": ""}}]}


def arguments_delta(index: int, fragment: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": fragment}}]}


class AnswerParts:
    """A whole answer's reasoning (None when there was none), content and think tokens;
    under harmony also its calls (`calls` is None where calls are parsed from content)."""

    def __init__(self, fmt: ReasoningFormat | None) -> None:
        self._splitter: ReasoningSplitter | HarmonySplitter | None = None
        if fmt is not None:
            self._splitter = HarmonySplitter() if fmt.channels else ReasoningSplitter(fmt)
        self.calls: list[ParsedCall] | None = [] if fmt is not None and fmt.channels else None
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
            elif kind == "call" and self.calls is not None:
                self.calls.append(ParsedCall(piece, ""))
            elif kind == "arguments" and self.calls:
                self.calls[-1].arguments += piece
            elif kind == "content":
                self.content += piece
        return pieces

    def content_and_calls(self, plan: ToolPlan | None) -> tuple[str | None, list[ParsedCall]]:
        """The answer's content and its calls: from harmony's channels, or parsed from the
        content when the request offered tools."""
        if self.calls is not None:  # content beside calls is null, as OpenAI sends it
            return (self.content or None) if self.calls else self.content, list(self.calls)
        if plan is None:
            return self.content, []
        return parse_tool_calls(self.content, plan)

    @property
    def reasoning(self) -> str | None:
        return self._reasoning or None

    @property
    def reasoning_tokens(self) -> int:
        return self._splitter.reasoning_tokens if self._splitter else 0


class AnswerStream:
    def __init__(self, fmt: ReasoningFormat | None, plan: ToolPlan | None) -> None:
        self.parts = AnswerParts(fmt)
        channels = self.parts.calls is not None
        self._tools = ToolCallStream(plan) if plan and not channels else None
        self._calls_sent = 0

    @property
    def num_calls(self) -> int:
        if self.parts.calls is not None:
            return len(self.parts.calls)
        return self._tools.num_calls if self._tools else 0

    def feed(self, text: str, num_tokens: int = 0, final: bool = False) -> list[dict[str, Any]]:
        """Chat-completion deltas for `text`; `final` flushes everything held back."""
        deltas: list[dict[str, Any]] = []
        for kind, piece in self.parts.add(text, num_tokens, final):
            if kind == "reasoning":
                deltas.append(reasoning_delta(piece))
            elif kind == "call":
                deltas.append(call_delta(self._calls_sent, piece))
                self._calls_sent += 1
            elif kind == "arguments":
                deltas.append(arguments_delta(self._calls_sent - 1, piece))
            elif self._tools is None:
                deltas.append({"content": piece})
            else:
                deltas += self._tools.feed(piece)
        if final and self._tools is not None:
            deltas += self._tools.feed("", final=True)
        return deltas
