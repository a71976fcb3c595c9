"""Structured output through the official `openai` client against a real server on the
default 135M model: `chat.completions.parse` with a pydantic model on 50 varied prompts,
a nested schema validated with `jsonschema` (whole and streamed), vLLM's
`structured_outputs` on completions, OpenAI-shaped 400s naming the field for every
constraint that cannot be honoured, and `usage.prompt_tokens_details.cached_tokens`."""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Literal

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.live_server import assert_error

TOPICS = [
    "a chef", "a pilot", "a child", "a painter", "a farmer", "a doctor", "a sailor",
    "a teacher", "a robot", "a king", "a student", "a nurse", "a poet", "a baker",
    "a miner", "a judge", "a dancer", "a monk", "a spy", "a clown", "a coach", "a tailor",
    "a driver", "a singer", "a writer", "a hunter", "a potter", "a barber", "a priest",
    "a guard", "a scientist", "a gardener", "a musician", "a lawyer", "a plumber",
    "a dentist", "a soldier", "a merchant", "a wizard", "a knight", "a pirate", "an actor",
    "an artist", "an engineer", "an athlete", "an explorer", "an author", "an inventor",
    "an astronaut", "an archer",
]  # fmt: skip


class Person(BaseModel):
    name: Annotated[str, Field(max_length=12)]
    age: Annotated[int, Field(ge=0, le=150)]
    mood: Literal["happy", "sad", "calm"]


NESTED = {
    "type": "object",
    "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"},
        "status": {"enum": ["open", "closed", "pending"]},
        "owner": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 12},
                "email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"},
            },
            "required": ["name"],
            "additionalProperties": False,
        },
        "items": {
            "type": "array",
            "items": {"type": "integer", "minimum": 1, "maximum": 99},
            "minItems": 2,
            "maxItems": 4,
        },
        "note": {"type": "string", "maxLength": 10},
    },
    "required": ["id", "status", "owner", "items"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def client(live_server):
    with openai.OpenAI(base_url=live_server.v1, api_key="x", max_retries=0, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def model(live_server):
    return live_server.state.model_name


def test_parse_with_a_pydantic_model_on_50_prompts(live_server, model):
    async def run() -> list:
        limit = asyncio.Semaphore(25)
        async with openai.AsyncOpenAI(
            base_url=live_server.v1, api_key="x", max_retries=0, timeout=120
        ) as client:

            async def one(topic: str):
                async with limit:
                    return await client.chat.completions.parse(
                        model=model,
                        messages=[{"role": "user", "content": f"Describe {topic}."}],
                        response_format=Person,
                        max_tokens=60,
                    )

            return await asyncio.gather(*(one(t) for t in TOPICS))

    replies = asyncio.run(run())
    for reply in replies:
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        assert isinstance(choice.message.parsed, Person)
    assert len({r.choices[0].message.content for r in replies}) > 40  # varied, not one answer


def test_nested_schema_validates_whole_and_streamed(live_server, model):
    """Two seeds, each whole and streamed, all four in one batch."""
    request = dict(
        model=model,
        messages=[{"role": "user", "content": "Open a support ticket as JSON."}],
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "ticket", "schema": NESTED, "strict": True},
        },
        max_tokens=150,
        temperature=1.0,
    )

    async def run() -> list:
        async with openai.AsyncOpenAI(
            base_url=live_server.v1, api_key="x", max_retries=0, timeout=120
        ) as client:

            async def streamed(seed: int) -> list:
                stream = await client.chat.completions.create(**request, seed=seed, stream=True)
                return [chunk async for chunk in stream]

            wholes = [client.chat.completions.create(**request, seed=s) for s in (1, 2)]
            return await asyncio.gather(*wholes, streamed(1), streamed(2))

    *wholes, stream_1, stream_2 = asyncio.run(run())
    for whole, chunks in zip(wholes, [stream_1, stream_2], strict=True):
        assert whole.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(whole.choices[0].message.content), NESTED)
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert text == whole.choices[0].message.content
        assert chunks[-1].choices[0].finish_reason == "stop"
    assert wholes[0].choices[0].message.content != wholes[1].choices[0].message.content


def test_json_object_is_one_json_object(client, model):
    reply = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "Give me a JSON object about cats."}],
        response_format={"type": "json_object"},
        max_tokens=40,
        temperature=0.0,
    )
    choice = reply.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:
        assert choice.finish_reason == "length" and choice.message.content.startswith("{")


@pytest.mark.parametrize(
    "constraint, check",
    [
        ({"choice": ["positive", "negative"]}, lambda t: t in ("positive", "negative")),
        ({"regex": "[0-9]{3}-[0-9]{4}"}, lambda t: len(t) == 8 and t[3] == "-"),
        ({"grammar": 'root ::= "The answer is " [0-9]+ "."'}, lambda t: t.endswith(".")),
        ({"json": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2}},
         lambda t: len(json.loads(t)) == 2),
    ],
)  # fmt: skip
def test_structured_outputs_on_completions(client, model, constraint, check):
    reply = client.completions.create(
        model=model,
        prompt="Question: is this review good?\nAnswer:",
        max_tokens=30,
        extra_body={"structured_outputs": constraint},
    )
    assert reply.choices[0].finish_reason == "stop"
    assert check(reply.choices[0].text), reply.choices[0].text


def post(live_server, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{live_server.v1}{path}", json=body, timeout=60)


CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize(
    "body, param",
    [
        ({"response_format": {"type": "yaml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "array", "uniqueItems": True}}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "bogus"}}}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {
            "name": "x", "schema": {"type": "string", "pattern": "(a"}}}}, "response_format"),
        ({"structured_outputs": {"regex": "(a"}}, "structured_outputs"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"grammar": "root ::= nowhere"}}, "structured_outputs"),
        ({"structured_outputs": {"json": "{not json"}}, "structured_outputs"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
         "structured_outputs"),
        ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens"),
    ],
)  # fmt: skip
def test_unenforceable_constraints_are_400_naming_the_field(live_server, body, param):
    assert_error(post(live_server, "/chat/completions", {**CHAT, **body}), 400, param)


def test_completions_refuse_bad_constraints_too(live_server):
    body = {"prompt": "x", "max_tokens": 2, "response_format": {"type": "xml"}}
    assert_error(post(live_server, "/completions", body), 400, "response_format")


def test_cached_tokens_count_prefix_cache_hits(client, model, live_server):
    messages = [{"role": "user", "content": "Tell me about prefix caching " * 6}]
    first = client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    second = client.chat.completions.create(model=model, messages=messages, max_tokens=2)
    block = live_server.engine.scheduler.kv.block_size
    prompt = second.usage.prompt_tokens
    # The whole blocks of the prompt, less the last token, which is always computed.
    assert second.usage.prompt_tokens_details.cached_tokens == (prompt - 1) // block * block
    assert first.usage.prompt_tokens_details.cached_tokens < prompt
    streamed = list(
        client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == (prompt - 1) // block * block
    completion = client.completions.create(model=model, prompt="Hello " * 40, max_tokens=1)
    again = client.completions.create(model=model, prompt="Hello " * 40, max_tokens=1)
    assert completion.usage.prompt_tokens_details.cached_tokens < 40
    assert again.usage.prompt_tokens_details.cached_tokens == 32
