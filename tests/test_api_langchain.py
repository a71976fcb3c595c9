"""LangChain's OpenAI integration, unchanged, against our server on the default model:
`with_structured_output` returns the pydantic object and `bind_tools` with a required
choice returns a tool call whose arguments validate."""

from __future__ import annotations

import pytest

from tests.tool_schemas import City, Multiply

langchain_openai = pytest.importorskip("langchain_openai")


@pytest.fixture(scope="module")
def chat(live_server):
    return langchain_openai.ChatOpenAI(
        base_url=live_server.v1,
        api_key="unused",
        model=live_server.state.model_name,
        max_tokens=60,
        temperature=0,
        max_retries=0,
    )


def test_with_structured_output(chat):
    city = chat.with_structured_output(City).invoke("Name a city in Japan.")
    assert isinstance(city, City)


def test_bind_tools_required(chat):
    reply = chat.bind_tools([Multiply], tool_choice="required", parallel_tool_calls=False).invoke(
        "What is 6 times 7?"
    )
    (call,) = reply.tool_calls
    assert call["name"] == "Multiply" and call["id"].startswith("call_")
    Multiply(**call["args"])
