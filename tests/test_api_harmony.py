"""gpt-oss's harmony format through a real server, on a tiny random checkpoint that carries
gpt-oss's chat template and o200k_harmony's special tokens (tests/harmony_model.py). A Lark
grammar (`structured_outputs`) makes the random model write exact harmony, special tokens
included, so nothing rests on its weights; the official `openai` and `anthropic` clients read
the answers: `analysis` as reasoning, `final` as content, a message to `functions.NAME` as a
tool call ended by `<|call|>`, whole and streamed, on chat, Responses and Messages; and
`tool_choice: "required"` writes a call whose arguments hold to the tool's schema."""

import json

import anthropic
import httpx
import jsonschema
import pytest
from openai import OpenAI

from model.loader import load_model
from tests.harmony_model import make_tiny_harmony
from tests.live_server import MAX_MODEL_LEN, running_server

USER = [{"role": "user", "content": "Weather in Paris?"}]
PARAMS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": PARAMS},
    }
]
THINK = "The user asks for weather."
ANSWER = "Sunny in Paris."
ARGS = '{"city": "Paris"}'
ANALYSIS = f'<|channel|> "analysis" <|message|> {json.dumps(THINK)} <|end|> <|start|> "assistant"'
FINAL = f'<|channel|> "final" <|message|> {json.dumps(ANSWER)}'
# As gpt-oss writes a call: the recipient after the channel, then `<|constrain|>json`.
CALL = (
    '<|channel|> "commentary to=functions.get_weather " <|constrain|> "json" <|message|> '
    f"{json.dumps(ARGS)} <|call|>"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    directory = make_tiny_harmony(tmp_path_factory.mktemp("harmony"))
    loaded = load_model(directory, max_position=MAX_MODEL_LEN, progress=False)
    with running_server(loaded, served_model_name=["m"]) as live:
        yield live


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=server.v1, api_key="unused", max_retries=0)


def forced(*parts: str) -> dict:
    """The request field that makes the model write exactly these harmony messages."""
    return {"structured_outputs": {"grammar": "start: " + " ".join(parts) + "\n"}}


def test_the_auto_parser_is_harmony(server) -> None:
    assert server.state.reasoning.name == "openai_gptoss"
    tokenizer = server.state.tokenizer
    assert tokenizer.stop_ids == {199999, 200002, 200012}  # <|end|> does not stop


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_analysis_is_reasoning_and_final_is_content(client, stream) -> None:
    fields = dict(model="m", messages=USER, max_tokens=60, extra_body=forced(ANALYSIS, FINAL))
    if not stream:
        message = client.chat.completions.create(**fields).choices[0].message
        assert message.model_extra["reasoning_content"] == THINK
        assert message.model_extra["reasoning"] == THINK
        assert message.content == ANSWER
        return
    reasoning, content, finish = "", "", None
    for chunk in client.chat.completions.create(**fields, stream=True):
        for choice in chunk.choices:
            delta = choice.delta.model_extra or {}
            reasoning += delta.get("reasoning_content") or ""
            content += choice.delta.content or ""
            finish = choice.finish_reason or finish
    assert (reasoning, content, finish) == (THINK, ANSWER, "stop")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_call_ends_the_turn_with_tool_calls(client, stream) -> None:
    fields = dict(
        model="m", messages=USER, tools=TOOLS, max_tokens=60, extra_body=forced(ANALYSIS, CALL)
    )
    if not stream:
        choice = client.chat.completions.create(**fields).choices[0]
        call = choice.message.tool_calls[0]
        assert (call.function.name, call.function.arguments) == ("get_weather", ARGS)
        assert choice.message.model_extra["reasoning_content"] == THINK
        assert (choice.message.content, choice.finish_reason) == (None, "tool_calls")
        return
    names, arguments, finish = [], "", None
    for chunk in client.chat.completions.create(**fields, stream=True):
        for choice in chunk.choices:
            for call in choice.delta.tool_calls or []:
                assert call.index == 0
                names += [call.function.name] if call.function.name else []
                arguments += call.function.arguments or ""
            finish = choice.finish_reason or finish
    assert (names, arguments, finish) == (["get_weather"], ARGS, "tool_calls")


def test_a_call_cut_by_max_tokens_keeps_what_was_written(client, server) -> None:
    header = server.state.tokenizer.encode("commentary to=functions.get_weather ")
    cut_at = 1 + len(header) + 3 + 2  # into the arguments
    choice = client.chat.completions.create(
        model="m", messages=USER, tools=TOOLS, max_tokens=cut_at, extra_body=forced(CALL)
    ).choices[0]
    call = choice.message.tool_calls[0]
    assert choice.finish_reason == "length"
    assert call.function.name == "get_weather"
    assert call.function.arguments and ARGS.startswith(call.function.arguments)
    assert call.function.arguments != ARGS


# A random model that enters the analysis message never ends it: a bias on `<|end|>` ends
# it at once (the grammar allows it there, and nowhere in the call).
END_THINKING = {"200007": 100}


def test_tool_choice_required_validates_against_the_schema(client) -> None:
    choice = client.chat.completions.create(
        model="m",
        messages=USER,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=100,
        logit_bias=END_THINKING,
    ).choices[0]
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS)


@pytest.fixture(scope="module")
def analysis_written(client) -> str:
    """What the model thinks under a required call, read raw: the tokens' own texts (its
    logprobs) from chat, special tokens included, then split here by harmony's definition.
    Random weights never end the analysis message, so max_tokens cuts it."""
    choice = client.chat.completions.create(
        model="m",
        messages=USER,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=MAX_THINKING,
        temperature=0,
        logprobs=True,
    ).choices[0]
    written = "".join(entry.token for entry in choice.logprobs.content)
    head, opened, thought = written.partition("<|channel|>analysis<|message|>")
    assert (head, opened) == ("", "<|channel|>analysis<|message|>") and thought
    assert choice.finish_reason == "length"
    return thought


MAX_THINKING = 12


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_responses_reads_the_channels(client, analysis_written, stream) -> None:
    fields = dict(
        model="m",
        input=USER[0]["content"],
        tools=[{"type": "function", "name": "get_weather", "description": "Weather",
                "parameters": PARAMS}],
        tool_choice="required",
        max_output_tokens=MAX_THINKING,
        temperature=0,
        reasoning={"effort": "medium"},  # the template's default: the same prompt as chat's
    )  # fmt: skip
    if stream:
        response = list(client.responses.create(**fields, stream=True))[-1].response
    else:
        response = client.responses.create(**fields)
    assert [item.type for item in response.output] == ["reasoning"]
    assert response.output[0].content[0].text == analysis_written
    assert (response.status, response.reasoning.effort) == ("incomplete", "medium")


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_messages_reads_the_channels(server, analysis_written, stream) -> None:
    client = anthropic.Anthropic(base_url=server.base_url, api_key="unused", max_retries=0)
    tool = {"name": "get_weather", "description": "Weather", "input_schema": PARAMS}
    fields = dict(
        model="m",
        max_tokens=MAX_THINKING,
        messages=USER,
        tools=[tool],
        tool_choice={"type": "any"},
        extra_body={"temperature": 0},
    )
    if stream:
        with client.messages.stream(**fields) as events:
            message = events.get_final_message()
    else:
        message = client.messages.create(**fields)
    assert [block.type for block in message.content] == ["thinking"]
    assert message.content[0].thinking == analysis_written
    assert message.stop_reason == "max_tokens"


def test_response_format_holds_the_final_message(client) -> None:
    schema = {"name": "weather", "schema": PARAMS}
    choice = client.chat.completions.create(
        model="m",
        messages=USER,
        response_format={"type": "json_schema", "json_schema": schema},
        max_tokens=100,
        logit_bias=END_THINKING,
    ).choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PARAMS)


def test_an_unknown_reasoning_effort_is_a_400(server) -> None:
    chat = {"model": "m", "messages": USER, "reasoning_effort": "extreme"}
    responses = {"model": "m", "input": "hi", "reasoning": {"effort": "extreme"}}
    for path, body in (("chat/completions", chat), ("responses", responses)):
        reply = httpx.post(f"{server.v1}/{path}", json=body)
        assert reply.status_code == 400, reply.text
        assert "effort" in reply.json()["error"]["message"]
