"""A streamed `/v1/responses` answer as OpenAI's event sequence: response.created and
response.in_progress; then for each output item `response.output_item.added`, its deltas
(`response.reasoning_text.delta` for the think block, `response.output_text.delta` for
the message, `response.function_call_arguments.delta` for a call), their `.done` events
and `response.output_item.done`; last
response.completed, or response.incomplete when max_output_tokens cut the answer.

Items come from the same tool-call stream as chat (server/structured/tool_stream.py), so a call's
argument deltas concatenate to exactly the arguments of the whole answer.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from scheduler import RequestStream
from server.reasoning.answer import AnswerStream
from server.reasoning.formats import ReasoningFormat
from server.routes.chat_inputs import ChatInputs
from server.routes.responses_items import (
    call_item,
    finish,
    message_item,
    reasoning_item,
    usage,
)
from server.routes.streaming import merge


class _Events:
    """Numbers the events and tracks the output item whose deltas are arriving."""

    def __init__(self) -> None:
        self.sequence = 0
        self.output: list[dict[str, Any]] = []
        self.open: dict[str, Any] | None = None
        self.text = ""  # the open message's (or reasoning item's) text so far

    def event(self, kind: str, **fields: Any) -> str:
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    def _at(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.output)}

    def close(self) -> list[str]:
        if self.open is None:
            return []
        at = self._at()
        if self.open["type"] == "reasoning":
            item = reasoning_item(self.text, item_id=self.open["id"])
            events = [
                self.event("response.reasoning_text.done", **at, content_index=0, text=self.text)
            ]
        elif self.open["type"] == "message":
            part = {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}
            item = {**self.open, "status": "completed", "content": [part]}
            events = [
                self.event("response.output_text.done", **at, content_index=0, text=self.text,
                           logprobs=[]),
                self.event("response.content_part.done", **at, content_index=0, part=part),
            ]  # fmt: skip
        else:
            item = {**self.open, "status": "completed"}
            events = [
                self.event("response.function_call_arguments.done", **at, name=item["name"],
                           arguments=item["arguments"]),
            ]  # fmt: skip
        events.append(self.event("response.output_item.done", output_index=at["output_index"],
                                 item=item))  # fmt: skip
        self.output.append(item)
        self.open, self.text = None, ""
        return events

    def _start(self, item: dict[str, Any]) -> list[str]:
        events = self.close()
        self.open = item
        return [*events, self.event("response.output_item.added", output_index=len(self.output),
                                    item=item)]  # fmt: skip

    def on_delta(self, delta: dict[str, Any]) -> list[str]:
        events: list[str] = []
        if delta.get("reasoning"):
            if self.open is None or self.open["type"] != "reasoning":
                events += self._start(reasoning_item("", "in_progress"))
            self.text += delta["reasoning"]
            events.append(self.event("response.reasoning_text.delta", **self._at(),
                                     content_index=0, delta=delta["reasoning"]))  # fmt: skip
        if delta.get("content"):
            if self.open is None or self.open["type"] != "message":
                events += self._start(message_item("", "in_progress"))
                part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
                events.append(self.event("response.content_part.added", **self._at(),
                                         content_index=0, part=part))  # fmt: skip
            self.text += delta["content"]
            events.append(self.event("response.output_text.delta", **self._at(), content_index=0,
                                     delta=delta["content"], logprobs=[]))  # fmt: skip
        for call in delta.get("tool_calls", []):
            if "id" in call:
                events += self._start(call_item(call["function"]["name"], "", "in_progress",
                                                call["id"]))  # fmt: skip
            fragment = call["function"]["arguments"]
            if fragment and self.open is not None:
                self.open["arguments"] += fragment
                events.append(self.event("response.function_call_arguments.delta", **self._at(),
                                         delta=fragment))  # fmt: skip
        return events


async def response_events(
    raw: Request,
    stream: RequestStream,
    shell: dict[str, Any],
    inputs: ChatInputs,
    reasoning: ReasoningFormat | None,
) -> AsyncIterator[str]:
    events = _Events()
    yield events.event("response.created", response=shell)
    yield events.event("response.in_progress", response=shell)
    answer = AnswerStream(reasoning, inputs.tools)
    reason, output_tokens, cached = None, 0, 0
    async for _, out in merge([stream]):
        if out.error is not None:
            error = {"code": "server_error", "message": f"generation failed: {out.error}"}
            failed = {**shell, "status": "failed", "error": error}
            yield events.event("response.failed", response=failed)
            return
        for delta in answer.feed(out.new_text, len(out.new_token_ids), final=out.finished):
            for line in events.on_delta(delta):
                yield line
        if out.finished:
            reason, output_tokens = out.finish_reason, out.num_output_tokens
            cached = out.num_cached_tokens
    for line in events.close():
        yield line
    raw.state.completion_tokens = output_tokens
    thought = answer.parts.reasoning_tokens
    counts = usage(len(inputs.prompt_ids), output_tokens, cached, thought)
    done = finish(shell, events.output, reason, counts)
    kind = "response.incomplete" if done["status"] == "incomplete" else "response.completed"
    yield events.event(kind, response=done)
