"""Recorded engine outputs (a DeepSeek-R1-style answer whose `</think>` arrives cut in two,
then an answer) through the streamed Responses and Messages renderers, read back with the
official SDKs' own types and accumulator: a reasoning item, then the message; a thinking
block, then the text; each holding exactly its side of the split."""

import asyncio
import json
from types import SimpleNamespace

import pytest
from openai._models import construct_type
from openai.types.responses import Response

from scheduler import RequestOutput
from server.reasoning.formats import FORMATS
from server.routes.chat_inputs import ChatInputs
from server.routes.messages_reply import Finish
from server.routes.messages_stream import message_events
from server.routes.responses_stream import response_events

TOKENS = ["Let", " me", " see", "</th", "ink>", "\n\n", "Yes", "."]
REASONING, CONTENT = "Let me see", "Yes."


class _Recorded:
    def __init__(self) -> None:
        last = len(TOKENS) - 1
        self.outputs = [
            RequestOutput(
                "r",
                [i],
                token,
                num_prompt_tokens=4,
                num_output_tokens=i + 1,
                finished=i == last,
                finish_reason="stop" if i == last else None,
            )  # fmt: skip
            for i, token in enumerate(TOKENS)
        ]

    async def __aiter__(self):
        for out in self.outputs:
            yield out

    def close(self) -> None:
        pass


def _collect(events) -> list[tuple[str, dict]]:
    async def run() -> list[str]:
        return [chunk async for chunk in events]

    parsed = []
    for chunk in asyncio.run(run()):
        kind, data = chunk.split("\n", 1)
        parsed.append((kind.removeprefix("event: "), json.loads(data.removeprefix("data: "))))
    return parsed


def test_responses_events_carry_a_reasoning_item_first() -> None:
    raw = SimpleNamespace(state=SimpleNamespace())
    shell = {"id": "resp_x", "object": "response", "created_at": 0, "model": "m", "output": [],
             "status": "in_progress", "parallel_tool_calls": True, "tool_choice": "auto",
             "tools": []}  # fmt: skip
    inputs = ChatInputs([1, 2, 3, 4], None, None, {})
    events = _collect(response_events(raw, _Recorded(), shell, inputs, FORMATS["deepseek_r1"]))
    deltas = {"reasoning": "", "text": ""}
    for kind, data in events:
        if kind == "response.reasoning_text.delta":
            assert not deltas["text"]  # every reasoning delta before the answer's
            deltas["reasoning"] += data["delta"]
        if kind == "response.output_text.delta":
            deltas["text"] += data["delta"]
    assert deltas == {"reasoning": REASONING, "text": CONTENT}
    kind, data = events[-1]
    assert kind == "response.completed"
    # As the client reads it: by the SDK's types, without refusing fields it does not know.
    response = construct_type(type_=Response, value=data["response"])
    reasoning, message = response.output
    assert reasoning.type == "reasoning" and reasoning.content[0].text == REASONING
    assert message.type == "message" and response.output_text == CONTENT
    assert response.usage.output_tokens_details.reasoning_tokens == 5  # through "ink>"


def test_messages_events_carry_a_thinking_block_first() -> None:
    streaming = pytest.importorskip("anthropic.lib.streaming._messages")
    raw = SimpleNamespace(state=SimpleNamespace())
    state = SimpleNamespace(model_name="m", reasoning=FORMATS["deepseek_r1"])
    finish = Finish(SimpleNamespace(), [], 4)
    events = _collect(message_events(raw, _Recorded(), "msg_x", state, finish, None))
    snapshot, bufs = None, {}
    for kind, data in events:
        assert data["type"] == kind
        if kind != "ping":
            snapshot = streaming.accumulate_event(
                event=data, current_snapshot=snapshot, json_bufs=bufs
            )
    thinking, text = snapshot.content
    assert (thinking.type, thinking.thinking, thinking.signature) == ("thinking", REASONING, "")
    assert (text.type, text.text) == ("text", CONTENT)
    assert snapshot.stop_reason == "end_turn"
