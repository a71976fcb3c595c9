"""The pieces of a Messages API answer, shared by the whole and the streamed form: the
message shell, content blocks (`thinking` for the think block under a reasoning parser,
`text`, `tool_use`), the stop reason, and usage. A thinking block's `signature` is empty:
nothing here signs it, and a client that sends the block back has it skipped.

Usage follows Anthropic's arithmetic: `input_tokens` are the prompt tokens computed for
this request, `cache_read_input_tokens` those the prefix cache served instead, so the two
add up to the prompt (what `/v1/messages/count_tokens` counts). Nothing is written to a
cache on request, so `cache_creation_input_tokens` is 0.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

from model.text.tokenizer import Tokenizer
from scheduler import RequestOutput
from server.reasoning.answer import AnswerParts
from server.structured.tool_calls import ToolPlan

STOP_REASONS = {"length": "max_tokens"}


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, int]:
    return {
        "input_tokens": prompt_tokens - cached_tokens,
        "output_tokens": output_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": cached_tokens,
    }


def message_shell(message_id: str, model: str, usage_counts: dict[str, int]) -> dict[str, Any]:
    return {
        "id": message_id,
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": model,
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage_counts,
    }


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments as the object Anthropic sends; a call that max_tokens cut short
    has no whole object yet, and gets an empty one (its stop reason says why)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def thinking_block(text: str) -> dict[str, Any]:
    return {"type": "thinking", "thinking": text, "signature": ""}


def content_blocks(parts: AnswerParts, plan: ToolPlan | None) -> list[dict[str, Any]]:
    content, calls = parts.content_and_calls(plan)
    blocks = [thinking_block(parts.reasoning)] if parts.reasoning is not None else []
    blocks += [{"type": "text", "text": content}] if content else []
    for call in calls:
        block = {"type": "tool_use", "id": new_tool_use_id(), "name": call.name}
        blocks.append({**block, "input": tool_input(call.arguments)})
    return blocks


@dataclass
class Finish:
    """What a request's outputs say about how it ended, read as they arrive."""

    tokenizer: Tokenizer
    stop_sequences: list[str]
    prompt_tokens: int
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    reason: str | None = None
    output_tokens: int = 0
    cached_tokens: int = 0

    def add(self, out: RequestOutput) -> None:
        self.text += out.new_text
        self.output_ids += out.new_token_ids
        self.cached_tokens = out.num_cached_tokens
        if out.finished:
            self.reason, self.output_tokens = out.finish_reason, out.num_output_tokens

    def usage(self) -> dict[str, int]:
        return usage(self.prompt_tokens, self.output_tokens, self.cached_tokens)

    def stop(self, called_tools: bool) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence)."""
        if self.reason in STOP_REASONS:
            return STOP_REASONS[self.reason], None
        sequence = self._stop_sequence()
        if sequence is not None:
            return "stop_sequence", sequence
        return ("tool_use" if called_tools else "end_turn"), None

    def _stop_sequence(self) -> str | None:
        """The stop sequence that ended the answer, if one did. The engine cuts the text
        just before it and reports a plain stop; the tokens still hold it, and its match
        begins where the text ends."""
        last = self.output_ids[-1] if self.output_ids else None
        if not self.stop_sequences or last is None or last in self.tokenizer.stop_ids:
            return None
        written = self.tokenizer.decode(self.output_ids, skip_special=True)
        start = max(0, len(self.text) - 1)
        hits = [(at, s) for s in self.stop_sequences if (at := written.find(s, start)) != -1]
        return min(hits)[1] if hits else None
