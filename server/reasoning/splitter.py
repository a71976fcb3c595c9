"""`ReasoningSplitter`: the text of an answer as it streams, split into reasoning (inside
the think block) and content (after it), with the number of output tokens the think
block took.

Works on decoded text, so a tag split across tokens is found as surely as one that is a
single token: the part of a tag that may still be completing is held back, never sent
as the wrong kind. Leading whitespace before the block and between `</think>` and the
answer is dropped (models write `</think>\\n\\n`), so the streamed pieces concatenate to
exactly the whole answer's fields.
"""

from __future__ import annotations

from enum import Enum

from server.reasoning.formats import ReasoningFormat
from server.structured.tool_stream import partial_tag


class Phase(Enum):
    OPENING = "opening"  # deciding whether the output opens with the start tag
    INSIDE = "inside"  # in the think block
    AFTER = "after"  # the block closed; whitespace before the answer is dropped
    CONTENT = "content"


Piece = tuple[str, str]  # ("reasoning" | "content", text)


class ReasoningSplitter:
    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self.phase = Phase.OPENING
        self.reasoning_tokens = 0
        self._pending = ""
        self._undecided_tokens = 0  # tokens held while OPENING

    def feed(self, text: str, num_tokens: int = 0, final: bool = False) -> list[Piece]:
        """The pieces `text` completes; `final` flushes what was held back. A step's
        tokens count as reasoning when its text reached into the think block (the one
        that closes it included)."""
        self._pending += text
        touched = self.phase is Phase.INSIDE
        pieces: list[Piece] = []
        while True:
            before = (self.phase, len(self._pending))
            self._advance(pieces, final)
            touched = touched or self.phase is Phase.INSIDE
            if (self.phase, len(self._pending)) == before:
                break
        if self.phase is Phase.OPENING:
            self._undecided_tokens += num_tokens
        else:
            # Tokens held while opening belong to whatever the opening turned out to be.
            if touched:
                self.reasoning_tokens += num_tokens + self._undecided_tokens
            self._undecided_tokens = 0
        return _merged(pieces)

    def _advance(self, pieces: list[Piece], final: bool) -> None:
        fmt, pending = self.fmt, self._pending
        if self.phase is Phase.OPENING:
            stripped = pending.lstrip()
            if stripped.startswith(fmt.start_tag):
                self._pending = stripped[len(fmt.start_tag) :]
                self.phase = Phase.INSIDE
            elif not final and fmt.start_tag.startswith(stripped):
                return  # whitespace, or the start tag's beginning: wait for more
            elif fmt.starts_inside:
                self.phase = Phase.INSIDE
            else:
                self.phase = Phase.CONTENT
        elif self.phase is Phase.INSIDE:
            end = pending.find(fmt.end_tag)
            if end != -1:
                cut, rest = end, end + len(fmt.end_tag)
                self.phase = Phase.AFTER
            else:
                cut = rest = len(pending) - (0 if final else partial_tag(pending, fmt.end_tag))
            if cut:
                pieces.append(("reasoning", pending[:cut]))
            self._pending = pending[rest:]
        elif self.phase is Phase.AFTER:
            self._pending = pending.lstrip()
            if self._pending:
                self.phase = Phase.CONTENT
        elif pending:
            pieces.append(("content", pending))
            self._pending = ""


def split_reasoning(text: str, fmt: ReasoningFormat) -> tuple[str | None, str]:
    """(reasoning, content) of a whole answer; reasoning is None when there was none."""
    splitter = ReasoningSplitter(fmt)
    parts = {"reasoning": "", "content": ""}
    for kind, piece in splitter.feed(text, final=True):
        parts[kind] += piece
    return parts["reasoning"] or None, parts["content"]


def _merged(pieces: list[Piece]) -> list[Piece]:
    out: list[Piece] = []
    for kind, text in pieces:
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))
    return out
