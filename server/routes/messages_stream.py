"""A streamed `/v1/messages` answer as Anthropic's named SSE events, in its order:
`message_start` (its usage already counting the input), then per content block
`content_block_start`, its deltas (`thinking_delta` and an empty `signature_delta` for
the think block, `text_delta`, or `input_json_delta` for a tool's input) and
`content_block_stop`, a `ping` after the first block opens, `message_delta`
(stop reason, output tokens) and `message_stop`. No `[DONE]`; a failure is an `error`
event.

`message_start` waits for the engine's first output, which says how much of the prompt
the prefix cache served. Blocks come from the same tool-call stream as chat
(server/structured/tool_stream.py), so a tool's `partial_json` fragments concatenate to
exactly the input of the whole answer.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from scheduler import RequestStream
from server.edge.anthropic_errors import anthropic_error_body
from server.reasoning.answer import AnswerStream
from server.routes.messages_reply import Finish, message_shell, new_tool_use_id, thinking_block
from server.routes.streaming import merge
from server.state import ServerState
from server.structured.tool_calls import ToolPlan


def event(kind: str, **fields: Any) -> str:
    payload = json.dumps({"type": kind, **fields}, ensure_ascii=False)
    return f"event: {kind}\ndata: {payload}\n\n"


class _Blocks:
    """Opens, fills and closes content blocks from chat-completion deltas."""

    def __init__(self) -> None:
        self.count = 0  # blocks opened so far
        self.open: str | None = None  # the open block's type
        self.pinged = False
        self.called_tools = False

    def close(self) -> list[str]:
        if self.open is None:
            return []
        events = []
        if self.open == "thinking":
            events.append(self._delta({"type": "signature_delta", "signature": ""}))
        self.open = None
        return [*events, event("content_block_stop", index=self.count - 1)]

    def _start(self, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.open = block["type"]
        events.append(event("content_block_start", index=self.count, content_block=block))
        self.count += 1
        if not self.pinged:
            self.pinged = True
            events.append(event("ping"))
        return events

    def _delta(self, delta: dict[str, Any]) -> str:
        return event("content_block_delta", index=self.count - 1, delta=delta)

    def on_delta(self, delta: dict[str, Any]) -> list[str]:
        events: list[str] = []
        if delta.get("reasoning"):
            if self.open != "thinking":
                events += self._start(thinking_block(""))
            events.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning"]}))
        if delta.get("content"):
            if self.open != "text":
                events += self._start({"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls", []):
            if "id" in call:
                self.called_tools = True
                block = {"type": "tool_use", "id": new_tool_use_id(), "name": "", "input": {}}
                events += self._start({**block, "name": call["function"]["name"]})
            fragment = call["function"]["arguments"]
            if fragment and self.open == "tool_use":
                events.append(self._delta({"type": "input_json_delta", "partial_json": fragment}))
        return events


async def message_events(
    raw: Request,
    stream: RequestStream,
    message_id: str,
    state: ServerState,
    finish: Finish,
    plan: ToolPlan | None,
) -> AsyncIterator[str]:
    model = state.model_name
    blocks = _Blocks()
    answer = AnswerStream(state.reasoning, plan)
    started = False
    async for _, out in merge([stream]):
        if out.error is not None:
            error = anthropic_error_body(500, f"generation failed: {out.error}")
            yield event("error", error=error["error"])
            return
        finish.add(out)
        if not started:
            started = True
            shell = message_shell(message_id, model, {**finish.usage(), "output_tokens": 0})
            yield event("message_start", message=shell)
        for delta in answer.feed(out.new_text, len(out.new_token_ids), final=out.finished):
            for line in blocks.on_delta(delta):
                yield line
    if not started:
        yield event("message_start", message=message_shell(message_id, model, finish.usage()))
    for line in blocks.close():
        yield line
    if not blocks.pinged:
        yield event("ping")
    raw.state.completion_tokens = finish.output_tokens
    stop_reason, stop_sequence = finish.stop(blocks.called_tools)
    yield event(
        "message_delta",
        delta={"stop_reason": stop_reason, "stop_sequence": stop_sequence},
        usage=finish.usage(),
    )
    yield event("message_stop")
