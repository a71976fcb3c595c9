"""Reasoning output through a real server on a tiny random Qwen3 (tests/qwen3_reasoner.py),
whose output a regex (`structured_outputs`) forces into a think block and an answer, so
nothing rests on the random weights: `reasoning_content` / `reasoning` beside `content`
read by the official `openai` client, whole and streamed, the think tokens in usage (their
number counted here from the tokens' logprobs), a think block cut by max_tokens, tool
calls parsed after the block only, `response_format` constraining the answer after it,
LangChain's usage, and `enable_thinking: false` reaching the template as `transformers`
renders it."""

import json
import re

import httpx
import pytest
from openai import OpenAI

from model.loader import load_model
from tests.live_server import MAX_MODEL_LEN, running_server
from tests.qwen3_reasoner import make_tiny_qwen3_reasoner

USER = [{"role": "user", "content": "What is the weather in Paris?"}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    return make_tiny_qwen3_reasoner(tmp_path_factory.mktemp("qwen3_reasoner"))


@pytest.fixture(scope="module")
def server(qwen3_dir):
    with running_server(
        load_model(qwen3_dir, max_position=MAX_MODEL_LEN, progress=False), served_model_name=["m"]
    ) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


def forced(text: str) -> dict:
    """The request fields that make the model write exactly `text`."""
    return {"structured_outputs": {"regex": re.escape(text)}}


def ask(client, text: str, **fields):
    fields = {"max_tokens": 60, **fields}
    return client.chat.completions.create(
        model="m", messages=USER, temperature=0, extra_body=forced(text), **fields
    )


def think_tokens(logprobs) -> int:
    """Tokens up to and including the one that completes `</think>`, from the answer's
    own token texts."""
    written = ""
    for i, entry in enumerate(logprobs.content):
        written += entry.token
        if "</think>" in written:
            return i + 1
    return 0


def think_bias(server) -> dict[str, int]:
    """Logit biases that open the think block first and close it at once: the grammar
    forbids `</think>` before `<think>`, and past it the bigger bias wins."""
    tok = server.state.tokenizer
    return {str(tok.encode("<think>")[0]): 50, str(tok.encode("</think>")[0]): 100}


def test_the_auto_parser_is_qwen3(server) -> None:
    assert server.state.reasoning is not None and server.state.reasoning.name == "qwen3"


def test_reasoning_and_content_whole(client) -> None:
    reply = ask(client, "<think>\nsome thought\n</think>\n\nThe answer", logprobs=True)
    message = reply.choices[0].message
    assert message.content == "The answer"
    assert message.model_extra["reasoning_content"] == "\nsome thought\n"
    assert message.model_extra["reasoning"] == "\nsome thought\n"
    details = reply.usage.completion_tokens_details
    assert details.reasoning_tokens == think_tokens(reply.choices[0].logprobs)
    assert 0 < details.reasoning_tokens < reply.usage.completion_tokens


def test_reasoning_streams_before_content(client) -> None:
    text = "<think>\nsome thought\n</think>\n\nThe answer"
    whole = ask(client, text).choices[0].message
    stream = ask(client, text, stream=True, stream_options={"include_usage": True})
    kinds, reasoning, content, usage = [], "", "", None
    for chunk in stream:
        usage = chunk.usage or usage
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        piece = (delta.model_extra or {}).get("reasoning_content")
        if piece:
            assert delta.model_extra["reasoning"] == piece
            kinds.append("reasoning")
            reasoning += piece
        if delta.content:
            kinds.append("content")
            content += delta.content
    assert kinds == sorted(kinds, reverse=True) and "content" in kinds
    assert (reasoning, content) == (whole.model_extra["reasoning_content"], whole.content)
    assert usage.completion_tokens_details.reasoning_tokens > 0


def test_no_think_block_is_all_content(client) -> None:
    reply = ask(client, "Plain answer")
    message = reply.choices[0].message
    assert message.content == "Plain answer"
    assert message.model_extra["reasoning_content"] is None
    assert reply.usage.completion_tokens_details.reasoning_tokens == 0


def test_a_block_cut_by_max_tokens_stays_reasoning(client) -> None:
    text = "<think>\n" + "long thought " * 10 + "</think>\n\nlate answer"
    reply = ask(client, text, max_tokens=6)
    choice = reply.choices[0]
    assert choice.finish_reason == "length"
    assert choice.message.content is None
    assert text.startswith("<think>" + choice.message.model_extra["reasoning_content"])
    assert reply.usage.completion_tokens_details.reasoning_tokens == 6


def test_a_tool_call_is_parsed_after_the_think_block(client) -> None:
    text = f"<think>\nmaybe {CALL % 'Rome'}\n</think>\n\n{CALL % 'Paris'}"
    reply = ask(client, text, tools=[WEATHER_TOOL], max_tokens=300)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    assert choice.message.model_extra["reasoning_content"] == f"\nmaybe {CALL % 'Rome'}\n"
    assert not choice.message.content
    streamed = ask(client, text, tools=[WEATHER_TOOL], max_tokens=300, stream=True)
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    calls = [t for d in deltas for t in d.tool_calls or []]
    assert [t.function.name for t in calls if t.function.name] == ["get_weather"]
    assert json.loads("".join(t.function.arguments or "" for t in calls)) == {"city": "Paris"}
    reasoning = "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas)
    assert reasoning == f"\nmaybe {CALL % 'Rome'}\n"


def test_response_format_applies_after_the_think_block(client, server) -> None:
    """Without a parser the schema would forbid `<think>`; with it the block is free and
    the JSON follows."""
    bias = think_bias(server)
    schema = {
        "type": "object",
        "properties": {"a": {"enum": ["x", "y"]}},
        "required": ["a"],
        "additionalProperties": False,
    }
    reply = client.chat.completions.create(
        model="m",
        messages=USER,
        max_tokens=30,
        temperature=0,
        logit_bias=bias,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    )
    assert reply.usage.completion_tokens_details.reasoning_tokens == 2  # <think></think>
    assert json.loads(reply.choices[0].message.content)["a"] in ("x", "y")


def test_a_completion_is_held_to_response_format_from_its_first_token(server) -> None:
    """No parser splits a completion's text, so no think block may come before the JSON."""
    body = {
        "prompt": "Answer:", "max_tokens": 30, "temperature": 0,
        "logit_bias": think_bias(server), "response_format": {"type": "json_object"},
    }  # fmt: skip
    text = httpx.post(f"{server.v1}/completions", json=body).json()["choices"][0]["text"]
    assert text.startswith("{")  # not "<think>", which the bias would pick if it could


def test_a_required_call_follows_the_think_block(client, server) -> None:
    bias = think_bias(server)
    reply = client.chat.completions.create(
        model="m", messages=USER, max_tokens=200, temperature=0, logit_bias=bias,
        tools=[WEATHER_TOOL], tool_choice="required",
    )  # fmt: skip
    choice = reply.choices[0]
    assert reply.usage.completion_tokens_details.reasoning_tokens == 2  # <think></think>
    assert choice.finish_reason in ("tool_calls", "length")
    calls = choice.message.tool_calls
    assert calls and {call.function.name for call in calls} == {"get_weather"}
    if choice.finish_reason == "tool_calls":
        assert all(isinstance(json.loads(c.function.arguments), dict) for c in calls)


def test_langchain_reads_the_answer_and_the_think_tokens(server) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(
        base_url=server.v1, api_key="unused", model="m", temperature=0, max_tokens=60,
        extra_body=forced("<think>\nhmm\n</think>\n\nDone"), max_retries=0,
    )  # fmt: skip
    reply = chat.invoke("Hi")
    assert reply.content == "Done"
    assert reply.usage_metadata["output_token_details"]["reasoning"] > 0
    streamed = "".join(str(chunk.content) for chunk in chat.stream("Hi"))
    assert streamed == "Done"


@pytest.mark.parametrize("thinking", [False, True, None])
def test_enable_thinking_renders_as_transformers_does(server, qwen3_dir, thinking) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(qwen3_dir)
    kwargs = {} if thinking is None else {"enable_thinking": thinking}
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "<think>\nold\n</think>\n\nHello"},
        {"role": "user", "content": "Again"},
    ]
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    assert text.endswith("<think>\n\n</think>\n\n") == (thinking is False)
    body = {"messages": messages, "chat_template_kwargs": kwargs}
    ours = httpx.post(f"{server.base_url}/tokenize", json=body).json()["tokens"]
    assert ours == hf.encode(text, add_special_tokens=False)
