"""The pieces of a Responses API answer, shared by the whole and the streamed form: output
items (the think block as a reasoning item, the assistant's message, a function call),
usage, and the final status."""

from __future__ import annotations

import uuid
from typing import Any


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def finish(shell: dict, output: list[dict], reason: str | None, usage: dict) -> dict:
    done = {**shell, "output": output, "usage": usage}
    if reason == "length":
        done["status"] = "incomplete"
        done["incomplete_details"] = {"reason": "max_output_tokens"}
    else:
        done["status"] = "completed"
    return done


def usage(
    prompt_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int = 0
) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": cached_tokens},
        "output_tokens": output_tokens,
        "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
        "total_tokens": prompt_tokens + output_tokens,
    }


def message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    return {
        "type": "message",
        "id": item_id or new_id("msg"),
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]
        if status == "completed"
        else [],
    }


def call_item(
    name: str, arguments: str, status: str = "completed", call_id: str | None = None
) -> dict:
    return {
        "type": "function_call",
        "id": new_id("fc"),
        "call_id": call_id or new_id("call"),
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict:
    """The think block as OpenAI's reasoning item: its text in full (`reasoning_text`), no
    summary, nothing encrypted."""
    return {
        "type": "reasoning",
        "id": item_id or new_id("rs"),
        "status": status,
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}] if status == "completed" else [],
        "encrypted_content": None,
    }
