"""`HarmonySplitter`: gpt-oss's output, written in OpenAI's harmony format, split by channel
as it streams.

An answer is a run of messages after the generation prompt `<|start|>assistant`, each a
header, `<|message|>`, a body and `<|end|>` (the last one ends with the stop token
`<|return|>` or `<|call|>` instead, which never reaches the text):

    <|channel|>analysis<|message|>thinking...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"x": 1}
    <|start|>assistant<|channel|>final<|message|>The answer

The header names the channel and, for a tool call, the recipient (`to=`, after the role or
after the channel). `analysis` is reasoning; `final` is content; a message to
`functions.NAME` is a call of NAME whose arguments are the body exactly as written;
`commentary` without a recipient (a preamble the user may see) is content; a message to any
other recipient (the built-in browser and python tools, which this server does not run) is
reasoning. The splitter reads decoded text with the special tokens left in (the server asks
for them), holding back a tail that may be the start of `<|end|>` until the next piece decides
it. An output that is not harmony at all (no header ever completes) is content.
"""

from __future__ import annotations

import re
from enum import Enum

from server.structured.tool_stream import partial_tag

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
# Stop tokens end the text before they would be written; with ignore_eos they are in it.
_BODY_ENDS = (END, "<|return|>", "<|call|>")
_RECIPIENT = re.compile(r"to=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
FUNCTIONS = "functions."

# What each piece is: "reasoning" and "content" text; "call" starts a tool call (the text
# is its name) and "arguments" continues the last one.
Piece = tuple[str, str]


class Phase(Enum):
    HEADER = "header"  # reading a message's header, up to <|message|>
    BODY = "body"
    BETWEEN = "between"  # after <|end|>, until the next <|start|>


def message_kind(header: str) -> tuple[str, str]:
    """(kind of the body's pieces, call name or "") for a message header."""
    channel = _CHANNEL.search(header)
    recipient = _RECIPIENT.search(header)
    if recipient is not None:
        name = recipient.group(1)
        if name.startswith(FUNCTIONS) and len(name) > len(FUNCTIONS):
            return "arguments", name[len(FUNCTIONS) :]
        return "reasoning", ""
    if channel is not None and channel.group(1) == "analysis":
        return "reasoning", ""
    return "content", ""


class HarmonySplitter:
    def __init__(self) -> None:
        self.phase = Phase.HEADER  # the generation prompt has written `<|start|>assistant`
        self.reasoning_tokens = 0
        self._pending = ""
        self._kind = "content"
        self._any_message = False
        self._header_tokens = 0  # tokens of a header whose channel is not known yet

    def feed(self, text: str, num_tokens: int = 0, final: bool = False) -> list[Piece]:
        """The pieces `text` completes; `final` flushes what was held back. A step's tokens
        count as reasoning when its text reached into an analysis message, and so do those
        of that message's header."""
        self._pending += text
        touched = self.phase is Phase.BODY and self._kind == "reasoning"
        pieces: list[Piece] = []
        while True:
            before = (self.phase, len(self._pending))
            self._advance(pieces, final)
            touched = touched or (self.phase is Phase.BODY and self._kind == "reasoning")
            if (self.phase, len(self._pending)) == before:
                break
        if touched:
            self.reasoning_tokens += num_tokens
        elif self.phase is Phase.HEADER:
            self._header_tokens += num_tokens
        if final and self.phase is Phase.HEADER and not self._any_message:
            # Not harmony: no message header ever completed, so the text is the answer.
            if self._pending.strip():
                pieces.append(("content", self._pending))
            self._pending = ""
        return _merged(pieces)

    def _advance(self, pieces: list[Piece], final: bool) -> None:
        pending = self._pending
        if self.phase is Phase.HEADER:
            cut = pending.find(MESSAGE)
            if cut == -1:
                return
            self._kind, name = message_kind(pending[:cut])
            if self._kind == "reasoning":
                self.reasoning_tokens += self._header_tokens
            self._header_tokens = 0
            if name:
                pieces.append(("call", name))
            self._pending = pending[cut + len(MESSAGE) :]
            self.phase, self._any_message = Phase.BODY, True
        elif self.phase is Phase.BODY:
            ends = [(i, tag) for tag in _BODY_ENDS if (i := pending.find(tag)) != -1]
            if ends:
                cut, tag = min(ends)
                rest = cut + len(tag)
                self.phase = Phase.BETWEEN
            else:
                held = 0 if final else max(partial_tag(pending, tag) for tag in _BODY_ENDS)
                cut = rest = len(pending) - held
            if cut:
                pieces.append((self._kind, pending[:cut]))
            self._pending = pending[rest:]
        else:
            start = pending.find(START)
            if start != -1:
                self._pending = pending[start + len(START) :]
                self.phase = Phase.HEADER
            elif not final:
                # Nothing but the next <|start|> belongs here; keep only what may begin it.
                self._pending = pending[len(pending) - partial_tag(pending, START) :]


def _merged(pieces: list[Piece]) -> list[Piece]:
    out: list[Piece] = []
    for kind, text in pieces:
        if out and out[-1][0] == kind and kind != "call":
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))
    return out
