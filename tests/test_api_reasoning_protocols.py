"""The think block in the other protocols, through their official clients, on a tiny random
Qwen3 under a DeepSeek-R1-style template (tests/qwen3_reasoner.py): the generation prompt
opens the block, so `--reasoning-parser auto` picks deepseek_r1 and the output begins as
reasoning. What the model writes is read raw from `/v1/completions` on the same prompt
ids and split here by the parser's definition; the Responses API must answer it as a
reasoning item before the message, the Messages API as a thinking block before the text,
whole and streamed alike, and LangChain's ChatAnthropic must see the same blocks."""

import httpx
import pytest
from openai import OpenAI

from model.loader import load_model
from tests.live_server import MAX_MODEL_LEN, running_server
from tests.qwen3_reasoner import R1_TEMPLATE, make_tiny_qwen3_reasoner

QUESTION = "Why is the sky blue?"
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = make_tiny_qwen3_reasoner(tmp_path_factory.mktemp("r1"), template=R1_TEMPLATE)
    loaded = load_model(directory, max_position=MAX_MODEL_LEN, progress=False)
    with running_server(loaded, served_model_name=["m"]) as live:
        yield live


@pytest.fixture(scope="module")
def written(server) -> tuple[str | None, str]:
    """(reasoning, content) of what the model writes for QUESTION, by definition: all
    of it up to `</think>` is reasoning (a leading `<think>` dropped), the rest content."""
    messages = [{"role": "user", "content": QUESTION}]
    ids = httpx.post(f"{server.base_url}/tokenize", json={"messages": messages}).json()["tokens"]
    body = {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0}
    text = httpx.post(f"{server.v1}/completions", json=body).json()["choices"][0]["text"]
    assert text
    thought, closed, answer = text.lstrip().removeprefix("<think>").partition("</think>")
    if not closed:
        thought = text
    return thought or None, answer.lstrip()


def test_the_auto_parser_is_deepseek_r1(server) -> None:
    assert server.state.reasoning.name == "deepseek_r1"


def test_responses_reasoning_item(server, written) -> None:
    client = OpenAI(base_url=server.v1, api_key="unused", max_retries=0)
    fields = dict(model="m", input=QUESTION, max_output_tokens=MAX_TOKENS, temperature=0)
    whole = client.responses.create(**fields)
    reasoning, content = written
    kinds = [item.type for item in whole.output]
    assert kinds == ["reasoning"] + (["message"] if content else [])
    assert whole.output[0].content[0].text == reasoning
    assert whole.output_text == content
    assert 0 < whole.usage.output_tokens_details.reasoning_tokens <= whole.usage.output_tokens
    deltas, completed = "", None
    for event in client.responses.create(**fields, stream=True):
        if event.type == "response.reasoning_text.delta":
            deltas += event.delta
        if event.type in ("response.completed", "response.incomplete"):
            completed = event.response
    assert deltas == reasoning
    assert [item.type for item in completed.output] == kinds
    assert completed.output[0].content[0].text == reasoning
    assert completed.usage == whole.usage


def test_messages_thinking_block(server, written) -> None:
    anthropic = pytest.importorskip("anthropic")
    reasoning, content = written
    with anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0) as client:
        fields = dict(
            model="m", max_tokens=MAX_TOKENS, extra_body={"temperature": 0},
            messages=[{"role": "user", "content": QUESTION}],
        )  # fmt: skip
        whole = client.messages.create(**fields)
        with client.messages.stream(**fields) as stream:
            streamed = stream.get_final_message()
    for message in (whole, streamed):
        kinds = [block.type for block in message.content]
        assert kinds == ["thinking"] + (["text"] if content else [])
        assert message.content[0].thinking == reasoning
        if content:
            assert message.content[1].text == content
    assert streamed.usage.output_tokens == whole.usage.output_tokens


def test_langchain_anthropic_sees_the_thinking(server, written) -> None:
    langchain_anthropic = pytest.importorskip("langchain_anthropic")
    chat = langchain_anthropic.ChatAnthropic(
        base_url=server.base_url, api_key="unused", model="m", max_tokens=MAX_TOKENS,
        temperature=0, max_retries=0,
    )  # fmt: skip
    reply = chat.invoke(QUESTION)
    blocks = reply.content if isinstance(reply.content, list) else []
    thinking = [b["thinking"] for b in blocks if b.get("type") == "thinking"]
    assert thinking == [written[0]]
