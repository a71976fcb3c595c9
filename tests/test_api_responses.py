"""`POST /v1/responses` through the official `openai` client (`client.responses.create`,
whole and streamed, and the SDK's stream helper): the same text as chat completions on the
same messages, OpenAI's event sequence, json_schema text formats that validate, function
calls whose streamed arguments are exactly the whole answer's, input items with calls and
their outputs, and a 400 naming the field for what a stateless server cannot do."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest

from tests.live_server import assert_error

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "rank": {"type": "integer"}},
    "required": ["city", "rank"],
    "additionalProperties": False,
}
ADD = {
    "type": "function",
    "name": "add",
    "description": "Add two integers",
    "parameters": {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}


@pytest.fixture(scope="module")
def client(live_server):
    with openai.OpenAI(base_url=live_server.v1, api_key="x", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(live_server):
    return live_server.state.model_name


def test_same_answer_as_chat_whole_and_streamed(client, model):
    fmt = {"type": "json_schema", "name": "city", "schema": SCHEMA, "strict": True}
    request = dict(model=model, instructions="Answer in JSON.", input="Name a big city.",
                   max_output_tokens=40, temperature=0.0, text={"format": fmt})  # fmt: skip
    whole = client.responses.create(**request)
    chat = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": "Answer in JSON."},
            {"role": "user", "content": "Name a big city."},
        ],
        max_completion_tokens=40,
        temperature=0.0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}},
    )
    assert whole.status == "completed" and whole.object == "response"
    assert whole.output_text == chat.choices[0].message.content
    jsonschema.validate(json.loads(whole.output_text), SCHEMA)
    assert whole.usage.input_tokens == chat.usage.prompt_tokens
    assert whole.usage.output_tokens == chat.usage.completion_tokens
    assert whole.usage.total_tokens == whole.usage.input_tokens + whole.usage.output_tokens

    with client.responses.stream(**request) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert final.output_text == whole.output_text
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 3 and "".join(deltas) == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_function_calls_whole_and_streamed(client, model):
    # A sampled answer with vLLM's extra `seed`: the streamed one is the same answer.
    request = dict(model=model, input="Add 2 and 3.", tools=[ADD], tool_choice="required",
                   parallel_tool_calls=False, max_output_tokens=40, temperature=1.0,
                   extra_body={"seed": 7})  # fmt: skip
    whole = client.responses.create(**request)
    (call,) = whole.output
    assert call.type == "function_call" and call.name == "add" and call.status == "completed"
    jsonschema.validate(json.loads(call.arguments), ADD["parameters"])
    events = list(client.responses.create(**request, stream=True))
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(fragments) == done.arguments == call.arguments
    assert events[-1].type == "response.completed"
    assert events[-1].response.output[0].arguments == call.arguments


def test_input_items_with_calls_and_outputs(client, model):
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Add 2 and 3."}]},
        {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2, "b": 3}'},
        {"type": "function_call_output", "call_id": "c1", "output": "5"},
    ]
    reply = client.responses.create(
        model=model, input=items, tools=[ADD], max_output_tokens=8, temperature=0.0
    )
    chat = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "user", "content": "Add 2 and 3."},
            {"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
                "name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "5"},
        ],
        tools=[{"type": "function", "function": {k: v for k, v in ADD.items() if k != "type"}}],
        max_tokens=8,
        temperature=0.0,
    )  # fmt: skip
    assert reply.usage.input_tokens == chat.usage.prompt_tokens
    assert reply.output_text == (chat.choices[0].message.content or "")


@pytest.mark.parametrize(
    "body, param",
    [
        ({"store": True}, "store"),
        ({"previous_response_id": "resp_123"}, "previous_response_id"),
        ({"background": True}, "background"),
        ({"text": {"format": {"type": "xml"}}}, "text.format"),
        ({"text": {"format": {"type": "json_schema", "name": "x",
                              "schema": {"type": "array", "uniqueItems": True}}}}, "text.format"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
         "input"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
        ({"tools": [ADD], "tool_choice": {"type": "function", "name": "sub"}}, "tool_choice"),
        ({"max_output_tokens": 10**6}, "max_output_tokens"),
    ],
)  # fmt: skip
def test_what_a_stateless_server_cannot_do_is_400(live_server, body, param):
    r = httpx.post(
        f"{live_server.v1}/responses", json={"input": "hi", "max_output_tokens": 4, **body}
    )
    assert_error(r, 400, param)
