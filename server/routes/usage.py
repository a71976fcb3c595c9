"""The `usage` object every OpenAI-style answer ends with, in its one home."""

from __future__ import annotations

from typing import Any


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    cached_tokens: int = 0,
    reasoning_tokens: int | None = None,
) -> dict[str, Any]:
    """`cached_tokens`: prompt tokens served by the prefix cache instead of computed, as
    OpenAI reports them (vLLM reports the same under the same name). `reasoning_tokens`:
    the think block's share of the completion, given where a reasoning parser runs."""
    counts = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if reasoning_tokens is not None:
        counts["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return counts
