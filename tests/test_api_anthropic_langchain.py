"""LangChain's Anthropic integration (`ChatAnthropic`), unchanged, pointed at our
`/v1/messages`: `invoke`, `stream`, `bind_tools(..., tool_choice="any")` and
`with_structured_output` on the default model, and the same on Qwen2.5-Coder-0.5B-Instruct's
GGUF, whose own ChatML template renders the tools."""

from __future__ import annotations

import pytest

from tests.live_server import running_server
from tests.tool_schemas import City, Multiply

langchain_anthropic = pytest.importorskip("langchain_anthropic")


def chat_model(base_url: str, model: str):
    return langchain_anthropic.ChatAnthropic(
        base_url=base_url,
        api_key="unused",
        model=model,
        max_tokens=40,
        temperature=0,
        max_retries=0,
    )


@pytest.fixture(scope="module")
def default_chat(live_server):
    return chat_model(live_server.base_url, live_server.state.model_name)


@pytest.fixture(scope="module")
def qwen_chat(qwen_coder_small):
    with running_server(qwen_coder_small) as live:
        yield chat_model(live.base_url, live.state.model_name)


def check_invoke_and_stream(chat) -> None:
    reply = chat.invoke("What is the capital of France?")
    assert isinstance(reply.content, str) and reply.content
    assert reply.response_metadata["stop_reason"] in ("end_turn", "max_tokens")
    assert reply.usage_metadata["output_tokens"] > 0
    streamed = "".join(
        chunk.text if isinstance(chunk.text, str) else chunk.text()
        for chunk in chat.stream("What is the capital of France?")
    )
    assert streamed == reply.content


def check_tools_and_structured_output(chat) -> None:
    tools = chat.bind_tools([Multiply], tool_choice="any", parallel_tool_calls=False)
    reply = tools.invoke("What is 6 times 7?")
    (call,) = reply.tool_calls
    assert call["name"] == "Multiply" and call["id"].startswith("toolu_")
    Multiply(**call["args"])
    city = chat.with_structured_output(City).invoke("Name a city in Japan.")
    assert isinstance(city, City)


def test_invoke_and_stream(default_chat):
    check_invoke_and_stream(default_chat)


def test_tools_and_structured_output(default_chat):
    check_tools_and_structured_output(default_chat)


@pytest.mark.slow
def test_qwen_gguf(qwen_chat):
    check_invoke_and_stream(qwen_chat)
    check_tools_and_structured_output(qwen_chat)
