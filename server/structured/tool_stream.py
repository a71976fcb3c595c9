"""Streaming tool calls as OpenAI's deltas: per call index, one delta with the id, type
and name, then argument fragments that concatenate to exactly the `arguments` the whole
answer would carry (the text the model wrote, never re-serialised).

When the grammar enforces the calls (`required`, a named function), the output can only be
calls, so arguments stream as they are generated, cut exactly where their JSON object
closes; an answer that ends inside a call (max_tokens) ends with that call as far as it
got, named before its arguments began as `forced_calls` names it, never with markup.
With `auto` nothing is known until a call is complete: text streams as content, holding
back what could be the start of a call tag, and a call is sent once its closing tag
arrives and it parsed as a call to a known tool; anything else goes out as content.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.structured.tool_calls import (
    ParsedCall,
    ToolPlan,
    call_head,
    forced_calls,
    new_call_id,
    parse_tool_calls,
)


@dataclass
class _OpenCall:
    args_start: int
    scanned: int  # arguments text up to here has been looked at (and sent)
    depth: int = 0
    in_string: bool = False
    escaped: bool = False


class ToolCallStream:
    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        fmt = plan.format
        self.text = ""
        self.num_calls = 0
        self._pos = 0  # text before this is sent (as content or as calls)
        self._open: _OpenCall | None = None
        self._head = call_head(fmt)
        self._tag = fmt.open_tag.strip()
        self._plain = False  # Meta's JSON format: the answer is plainly not a call

    def feed(self, new_text: str, final: bool = False) -> list[dict[str, Any]]:
        """Chat-completion deltas for `new_text`; `final` flushes what was held back."""
        self.text += new_text
        if self.plan.enforced:
            return self._enforced() + (self._cut_short() if final else [])
        return self._auto(final)

    # ---- enforced: the output is calls only, in the grammar's exact layout ------------

    def _enforced(self) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        while True:
            if self._open is None:
                head = self._head.search(self.text, self._pos)
                if head is None:
                    return deltas
                deltas.append(self._call_header(head.group(1)))
                self._open = _OpenCall(head.end(), head.end())
            call = self._open
            end = _scan_json(self.text, call)
            fragment = self.text[call.scanned : end or len(self.text)]
            call.scanned = end or len(self.text)
            if fragment:
                deltas.append(self._arguments(fragment))
            if end is None:
                return deltas
            self._pos, self._open = end, None
            self.num_calls += 1

    def _cut_short(self) -> list[dict[str, Any]]:
        """At the end: a call whose arguments had begun was sent as far as it got; one cut
        before them is sent now, named and with the arguments `forced_calls` gives it."""
        if self._open is not None:
            self._open = None
            self.num_calls += 1
            return []
        deltas: list[dict[str, Any]] = []
        for call in forced_calls(self.text, self.plan)[self.num_calls :]:
            deltas += self._whole_call(call)
        return deltas

    # ---- auto: content, with calls recognised once complete ---------------------------

    def _auto(self, final: bool) -> list[dict[str, Any]]:
        if not self._tag:  # Meta's JSON: the whole answer is a call, or it is content
            return self._whole_answer(final)
        deltas: list[dict[str, Any]] = []
        while True:
            start = self.text.find(self._tag, self._pos)
            if start == -1:
                end = (
                    len(self.text) if final else len(self.text) - partial_tag(self.text, self._tag)
                )
                if end > self._pos:
                    deltas.append({"content": self.text[self._pos : end]})
                    self._pos = end
                return deltas
            if start > self._pos:
                deltas.append({"content": self.text[self._pos : start]})
                self._pos = start
            close = self.plan.format.close_tag.strip()
            closed = self.text.find(close, start)
            if closed == -1 and not final:
                return deltas
            block_end = len(self.text) if closed == -1 else closed + len(close)
            block = self.text[start:block_end]
            content, calls = parse_tool_calls(block, self.plan)
            if calls and (self.plan.parallel or self.num_calls == 0):
                deltas += self._whole_call(calls[0])
            else:
                deltas.append({"content": block})
            self._pos = block_end

    def _whole_answer(self, final: bool) -> list[dict[str, Any]]:
        if self._pos == 0 and not self.text.lstrip().startswith("{") and self.text.strip():
            self._plain = True
        if self._plain:
            new, self._pos = self.text[self._pos :], len(self.text)
            return [{"content": new}] if new else []
        if not final:
            return []
        _, calls = parse_tool_calls(self.text, self.plan)
        self._pos = len(self.text)
        return self._whole_call(calls[0]) if calls else [{"content": self.text}]

    # ---- delta shapes -----------------------------------------------------------------

    def _whole_call(self, call: ParsedCall) -> list[dict[str, Any]]:
        deltas = [self._call_header(call.name)]
        if call.arguments:
            deltas.append(self._arguments(call.arguments))
        self.num_calls += 1
        return deltas

    def _call_header(self, name: str) -> dict[str, Any]:
        header = {
            "index": self.num_calls,
            "id": new_call_id(),
            "type": "function",
            "function": {"name": name, "arguments": ""},
        }
        return {"tool_calls": [header]}

    def _arguments(self, fragment: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": self.num_calls, "function": {"arguments": fragment}}]}


def _scan_json(text: str, call: _OpenCall) -> int | None:
    """Advances over the arguments' JSON value; the index just past it once it closed."""
    for i in range(call.scanned, len(text)):
        c = text[i]
        if call.in_string:
            if call.escaped:
                call.escaped = False
            elif c == "\\":
                call.escaped = True
            elif c == '"':
                call.in_string = False
        elif c == '"':
            call.in_string = True
        elif c in "{[":
            call.depth += 1
        elif c in "}]":
            call.depth -= 1
            if call.depth == 0:
                return i + 1
    return None


def partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could begin `tag`: what a stream must
    hold back until the next piece says whether the tag is there (the reasoning splitter
    holds back `</think>` with it too)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
