"""Qwen2.5-Coder-0.5B-Instruct (the real GGUF from PyPI, in the weight format start-up
picks) behind a real server, through the official `openai` client: a chat answer, the
same answer streamed, a JSON-schema answer and a forced tool call whose arguments
validate against the tool's schema, all through Qwen's own ChatML template."""

import json

import jsonschema
import pytest
from openai import OpenAI

from tests.live_server import running_server

pytestmark = pytest.mark.slow

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city"],
}
PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(qwen_coder_small):
    with running_server(qwen_coder_small) as live:
        yield OpenAI(base_url=live.v1, api_key="unused"), qwen_coder_small.name


def test_chat_answer_whole_and_streamed(client) -> None:
    openai, model = client
    messages = [{"role": "user", "content": "Write a Python function that squares a number."}]
    whole = openai.chat.completions.create(
        model=model, messages=messages, max_tokens=48, temperature=0
    )
    text = whole.choices[0].message.content
    assert "def square" in text, text
    stream = openai.chat.completions.create(
        model=model, messages=messages, max_tokens=48, temperature=0, stream=True
    )
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert streamed == text


def test_json_schema_answer_validates(client) -> None:
    openai, model = client
    reply = openai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        max_tokens=60,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
    )
    jsonschema.validate(json.loads(reply.choices[0].message.content), PERSON)


def test_required_tool_call_validates(client) -> None:
    openai, model = client
    tools = [
        {
            "type": "function",
            "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER},
        }
    ]
    reply = openai.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=tools,
        tool_choice="required",
        max_tokens=60,
        temperature=0,
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, WEATHER)
    assert "paris" in arguments["city"].lower()
