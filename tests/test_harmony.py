"""gpt-oss's harmony format without a server: the o200k_harmony vocabulary read from a
checkpoint's tokenizer.json and from GGUF metadata (special tokens at tiktoken's ids, its
regex, the stop tokens), prompts rendered exactly as `transformers` renders gpt-oss's own
chat template, and answers split into OpenAI's fields (server/reasoning/harmony.py).

The recorded answers are what the chat template itself writes for an assistant turn with
its `thinking` and `content` or its tool call (the template is the format's definition),
fed token by token as the engine would stream them, special tokens included."""

import json
from types import SimpleNamespace

import pytest
from transformers import PreTrainedTokenizerFast

from model.text.chat_template import ChatTemplate
from model.text.detokenizer import IncrementalDetokenizer
from model.text.pretokenizer import O200K_PATTERN
from model.text.tokenizer_files import tokenizer_from_gguf, tokenizer_from_hf_dir
from server.edge.errors import APIError
from server.reasoning.answer import AnswerParts, AnswerStream
from server.reasoning.formats import HARMONY, template_reasoning
from server.routes.chat import assistant_message
from server.routes.chat_inputs import chat_prompt
from server.routes.messages_reply import content_blocks
from server.routes.protocol import ChatCompletionRequest
from server.routes.responses import output_items
from server.routes.responses_protocol import ResponsesRequest, chat_request
from tests.harmony_model import o200k_harmony, write_harmony_tokenizer

HARMONY_TOKENS = ("<|startoftext|>", "<|endoftext|>", "<|return|>", "<|constrain|>")
HARMONY_TOKENS += ("<|channel|>", "<|start|>", "<|end|>", "<|message|>", "<|call|>")
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather in a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "description": "The city"},
                    "unit": {"type": "string", "enum": ["c", "f"]},
                },
                "required": ["city"],
            },
        },
    }
]
CALL = {"id": "call_1", "type": "function"}
CALL["function"] = {"name": "get_weather", "arguments": {"city": "Paris"}}
THINK = "The user wants the weather. Call get_weather."
ANSWER = "It is 21 C and sunny in Paris."


@pytest.fixture(scope="module")
def directory(tmp_path_factory):
    path = tmp_path_factory.mktemp("harmony_tokenizer")
    write_harmony_tokenizer(path)
    return path


@pytest.fixture(scope="module")
def tok(directory):
    return tokenizer_from_hf_dir(directory)


@pytest.fixture(scope="module")
def hf_tok(directory):
    # gpt-oss's tokenizer_config.json names this class.
    return PreTrainedTokenizerFast.from_pretrained(directory)


@pytest.fixture(scope="module")
def template(directory, tok):
    return ChatTemplate.from_hf_dir(directory, tok)


def test_the_vocabulary_is_o200k_harmony(tok) -> None:
    spec = o200k_harmony()
    assert tok.vocab_size == 201_088
    assert {t: tok.special_tokens[t] for t in HARMONY_TOKENS} == {
        t: spec["special_tokens"][t] for t in HARMONY_TOKENS
    }
    assert O200K_PATTERN == spec["pat_str"]
    # gpt-oss's generation_config: <|return|>, <|endoftext|>, <|call|>; <|end|> goes on.
    assert tok.stop_ids == {200002, 199999, 200012}


def test_the_gguf_vocabulary_reads_the_same(directory, tok, hf_tok, template) -> None:
    """GGUF metadata as llama.cpp's converter writes it for gpt-oss (pre `gpt-4o`, the
    specials as control tokens), even naming `<|end|>` end of turn: the same ids as
    `transformers`, and generation still goes on past `<|end|>`."""
    spec = json.loads((directory / "tokenizer.json").read_text())
    tokens = [""] * tok.vocab_size
    for text, token_id in spec["model"]["vocab"].items():
        tokens[token_id] = text
    types = [1] * tok.vocab_size
    for added in spec["added_tokens"]:
        tokens[added["id"]], types[added["id"]] = added["content"], 3
    metadata = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-4o",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": [" ".join(m) for m in spec["model"]["merges"]],
        "tokenizer.ggml.bos_token_id": 199998,
        "tokenizer.ggml.eos_token_id": 200002,
        "tokenizer.ggml.eot_token_id": 200007,
        "tokenizer.ggml.padding_token_id": 199999,
    }
    gguf_tok = tokenizer_from_gguf(metadata)
    messages = [{"role": "user", "content": "Weather in Paris, 2026-11-28?\n\n  Thanks!"}]
    text = hf_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    expected = hf_tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    assert gguf_tok.encode(text, allow_special=True) == list(expected)
    assert 200007 not in gguf_tok.stop_ids and {200002, 200012} <= gguf_tok.stop_ids


CONVERSATIONS = {
    "developer": [
        {"role": "developer", "content": "Answer in one line."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "thinking": THINK, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ],
    "system": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "21 C"},
        {"role": "assistant", "content": ANSWER},
        {"role": "user", "content": "And tomorrow?"},
    ],
}


@pytest.mark.parametrize("name", sorted(CONVERSATIONS))
def test_prompts_are_the_templates_as_transformers_renders_it(name, tok, hf_tok, template):
    """System or developer instructions, tools, an earlier call and its result, and the
    request's `reasoning_effort`: the prompt ids are transformers' own."""
    history = CONVERSATIONS[name]
    wire = json.loads(json.dumps(history))  # the client sends arguments as a JSON string
    for message in wire:
        if "thinking" in message:  # sent back in the field our answers carry it in
            message["reasoning_content"] = message.pop("thinking")
        for call in message.get("tool_calls", []):
            call["function"]["arguments"] = json.dumps(call["function"]["arguments"])
    req = ChatCompletionRequest(messages=wire, tools=TOOLS, reasoning_effort="high")
    state = SimpleNamespace(chat_template=template, tokenizer=tok, reasoning=HARMONY)
    ids, plan = chat_prompt(req, state)
    expected = hf_tok.apply_chat_template(
        history, tools=TOOLS, reasoning_effort="high", add_generation_prompt=True, return_dict=False
    )
    assert ids == list(expected)
    assert "Reasoning: high" in tok.decode(ids) and plan.format.name == "harmony"
    assert (THINK in tok.decode(ids)) is (name == "developer")
    assert template_reasoning(template) is HARMONY


def recorded(hf_tok, tok, assistant: dict) -> list[str]:
    """The answer the template writes for `assistant` after the generation prompt, as the
    engine streams it: one token's text at a time, without the final stop token."""
    messages = [{"role": "user", "content": "Weather in Paris?"}, assistant]
    prompt = hf_tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    whole = hf_tok.apply_chat_template(messages, tokenize=False)
    assert whole.startswith(prompt)
    answer = whole[len(prompt) :]
    stop = next(s for s in ("<|return|>", "<|call|>") if answer.endswith(s))
    ids = tok.encode(answer.removesuffix(stop), allow_special=True)
    detok = IncrementalDetokenizer(tok)
    return [detok.add(i) for i in ids]


def streamed(pieces: list[str], cut: bool = False) -> dict:
    """Chat deltas of the streamed answer, gathered as a client would."""
    answer = AnswerStream(HARMONY, plan=None)
    fields = {"reasoning": "", "content": "", "names": [], "arguments": ""}
    for i, piece in enumerate(pieces):
        for delta in answer.feed(piece, 1, final=i == len(pieces) - 1):
            fields["reasoning"] += delta.get("reasoning_content") or ""
            fields["content"] += delta.get("content") or ""
            for call in delta.get("tool_calls", []):
                fields["names"] += (
                    [call["function"].get("name")] if "name" in call["function"] else []
                )
                fields["arguments"] += call["function"]["arguments"]
    return fields


def whole(pieces: list[str], reason: str) -> tuple[dict, str | None, AnswerParts]:
    parts = AnswerParts(HARMONY)
    for i, piece in enumerate(pieces):  # one engine step per token
        parts.add(piece, 1, final=i == len(pieces) - 1)
    message, finish = assistant_message(parts, reason, None, reasoning_on=True)
    return message, finish, parts


def test_analysis_then_final(hf_tok, tok) -> None:
    pieces = recorded(hf_tok, tok, {"role": "assistant", "thinking": THINK, "content": ANSWER})
    message, finish, parts = whole(pieces, "stop")
    assert (message["reasoning_content"], message["content"], finish) == (THINK, ANSWER, "stop")
    assert "tool_calls" not in message
    assert streamed(pieces) == {"reasoning": THINK, "content": ANSWER, "names": [], "arguments": ""}
    # From the first token to the one that ends the analysis message.
    assert parts.reasoning_tokens == pieces.index("<|end|>") + 1
    assert output_items(parts, None)[0]["content"][0]["text"] == THINK
    assert [b["type"] for b in content_blocks(parts, None)] == ["thinking", "text"]


def test_a_call_written_the_templates_way(hf_tok, tok) -> None:
    """The template puts the recipient in the role header (`assistant to=functions.NAME`)
    and writes `json` without `<|constrain|>`; the call is the same."""
    assistant = {"role": "assistant", "thinking": THINK, "tool_calls": [CALL]}
    pieces = recorded(hf_tok, tok, assistant)
    arguments = json.dumps(CALL["function"]["arguments"])
    message, finish, parts = whole(pieces, "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert message["reasoning_content"] == THINK
    (call,) = message["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": arguments}
    assert streamed(pieces)["names"] == ["get_weather"]
    assert streamed(pieces)["arguments"] == arguments
    items = output_items(parts, None)
    assert [item["type"] for item in items] == ["reasoning", "function_call"]
    blocks = content_blocks(parts, None)
    assert blocks[-1]["type"] == "tool_use" and blocks[-1]["input"] == {"city": "Paris"}


def test_a_call_cut_by_max_tokens(hf_tok, tok) -> None:
    assistant = {"role": "assistant", "tool_calls": [CALL]}
    pieces = recorded(hf_tok, tok, assistant)
    cut = pieces[: len(pieces) - 3]
    written = "".join(cut).rpartition("<|message|>")[2]
    message, finish, _ = whole(cut, "length")
    assert (finish, message["content"], message["reasoning_content"]) == ("length", None, None)
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": written}
    assert streamed(cut)["arguments"] == written and written


def test_output_that_is_not_harmony_is_content() -> None:
    message, finish, _ = whole(["Just ", "text."], "stop")
    assert (message["content"], message["reasoning_content"]) == ("Just text.", None)


def test_tools_without_the_harmony_parser_are_a_400(tok, template) -> None:
    """With `--reasoning-parser none` nothing reads the channels a call is written in."""
    req = ChatCompletionRequest(messages=CONVERSATIONS["developer"][:2], tools=TOOLS)
    state = SimpleNamespace(chat_template=template, tokenizer=tok, reasoning=None)
    with pytest.raises(APIError) as refused:
        chat_prompt(req, state)
    assert (refused.value.status, refused.value.param) == (400, "tools")


def test_responses_input_sends_reasoning_back(tok, hf_tok, template) -> None:
    """A Responses conversation sent back whole, its reasoning item included, renders as
    the chat conversation with the assistant's `thinking` does in transformers."""
    arguments = json.dumps(CALL["function"]["arguments"])
    items = [
        {"type": "message", "role": "user", "content": "Weather in Paris?"},
        {"type": "reasoning", "content": [{"type": "reasoning_text", "text": THINK}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": arguments},
        {"type": "function_call_output", "call_id": "c1", "output": "21 C"},
    ]
    tool = {"type": "function", **TOOLS[0]["function"]}
    req = chat_request(ResponsesRequest(input=items, tools=[tool]))
    state = SimpleNamespace(chat_template=template, tokenizer=tok, reasoning=HARMONY)
    ids, _ = chat_prompt(req, state)
    history = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "thinking": THINK, "tool_calls": [CALL]},
        {"role": "tool", "content": "21 C"},
    ]
    expected = hf_tok.apply_chat_template(
        history, tools=TOOLS, add_generation_prompt=True, return_dict=False
    )
    assert ids == list(expected) and THINK in tok.decode(ids)
