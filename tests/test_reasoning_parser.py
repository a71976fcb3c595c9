"""The reasoning parsers on recorded token streams: the split of each stream, fed one token
text at a time (tags whole or cut anywhere), equals the split of the whole text and the
split the parser's definition gives (written out by hand here); the parser a chat template
calls for; and the grammar that leaves the think block free before a constrained answer,
checked by llguidance itself on token ids."""

import json
from pathlib import Path

import pytest

from model.text.chat_template import ChatTemplate
from server.reasoning.answer import AnswerStream
from server.reasoning.formats import FORMATS, reasoning_format, template_reasoning
from server.reasoning.splitter import ReasoningSplitter, split_reasoning
from server.routes.protocol import FunctionDefinition, Tool
from server.structured.grammar import GrammarCompiler
from server.structured.tool_calls import HERMES, ToolPlan
from tests.chat_templates import CHATML_TOOLS
from tests.qwen3_reasoner import QWEN3_TEMPLATE, R1_TEMPLATE, make_tiny_qwen3_reasoner

QWEN3, R1 = FORMATS["qwen3"], FORMATS["deepseek_r1"]

# (parser, token texts as a model wrote them, reasoning, content, reasoning tokens)
RECORDED = [
    (
        QWEN3,
        ["<think>", "\n", "Two", " plus", " two", ".", "\n", "</think>", "\n\n", "4"],
        "\nTwo plus two.\n",
        "4",
        8,
    ),
    # Tags spelled out in pieces, as a tokenizer without them as tokens writes them.
    (QWEN3, ["<", "th", "ink", ">", "a", "</", "thi", "nk", ">", "b", "c"], "a", "bc", 9),
    (QWEN3, ["Just", " an", " answer", " <think>"], None, "Just an answer <think>", 0),
    (QWEN3, ["<think>", "\n\n", "</think>", "\n\n", "Hi"], "\n\n", "Hi", 3),
    (QWEN3, ["<th", "in"], None, "<thin", 0),  # cut short: never a think block
    (QWEN3, ["<think>", "cut", " by", " max"], "cut by max", "", 4),  # max_tokens: reasoning
    (QWEN3, ["<think>", "x", "</th", "in", "</think>", "ok"], "x</thin", "ok", 5),
    (R1, ["Let", " me", " see", "</think>", "\n\n", "Yes"], "Let me see", "Yes", 4),
    (R1, ["<think>", "\n", "Hmm", "</think>", "Yes"], "\nHmm", "Yes", 4),  # opened again
    (R1, ["never", " closed"], "never closed", "", 2),
    (R1, ["</think>", "Yes"], None, "Yes", 1),
]


@pytest.mark.parametrize(("fmt", "tokens", "reasoning", "content", "thought"), RECORDED)
def test_recorded_streams_split_as_defined(fmt, tokens, reasoning, content, thought) -> None:
    splitter = ReasoningSplitter(fmt)
    pieces = []
    for i, token in enumerate(tokens):
        pieces += splitter.feed(token, 1, final=i == len(tokens) - 1)
    kinds = [kind for kind, _ in pieces]
    assert kinds == sorted(kinds, reverse=True)  # every reasoning piece before any content
    streamed = {k: "".join(t for kind, t in pieces if kind == k) for k in ("reasoning", "content")}
    assert (streamed["reasoning"] or None, streamed["content"]) == (reasoning, content)
    assert split_reasoning("".join(tokens), fmt) == (reasoning, content)
    assert splitter.reasoning_tokens == thought


def test_a_call_written_while_thinking_is_reasoning() -> None:
    tool = Tool(type="function", function=FunctionDefinition(name="get_weather"))
    stream = AnswerStream(QWEN3, ToolPlan([tool], "auto", None, True, HERMES))
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "%s"}}\n</tool_call>'
    text = f"<think>{call % 'Rome'}</think>\n\n{call % 'Paris'}"
    deltas = []
    for i in range(0, len(text), 3):  # three characters a step: tags cut anywhere
        deltas += stream.feed(text[i : i + 3], 1, final=i + 3 >= len(text))
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    assert reasoning == call % "Rome"
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    calls = [c for d in deltas for c in d.get("tool_calls", [])]
    assert calls[0]["function"]["name"] == "get_weather" and stream.num_calls == 1
    arguments = "".join(c["function"]["arguments"] for c in calls)
    assert json.loads(arguments) == {"city": "Paris"}
    assert not any(d.get("content") for d in deltas)


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (QWEN3_TEMPLATE, "qwen3"),
        (R1_TEMPLATE, "deepseek_r1"),
        (CHATML_TOOLS, None),
        # One tag and no enable_thinking: not plain enough to guess.
        ("{% for m in messages %}<think>{{ m.content }}{% endfor %}", None),
    ],
)
def test_the_template_picks_the_parser(template, expected, caplog) -> None:
    picked = template_reasoning(ChatTemplate(template))
    assert (picked.name if picked else None) == expected
    with caplog.at_level("INFO", logger="llamaserve.server"):
        assert reasoning_format("auto", ChatTemplate(template)) == picked
        assert reasoning_format("none", ChatTemplate(template)) is None
        assert reasoning_format("deepseek_r1", ChatTemplate(template)) == R1
    lines = [r.getMessage() for r in caplog.records if "reasoning parser" in r.getMessage()]
    assert [line.split(" (")[0] for line in lines] == [
        f"reasoning parser: {expected or 'none'}",
        "reasoning parser: none",
        "reasoning parser: deepseek_r1",
    ]


@pytest.fixture(scope="module")
def compiler(tmp_path_factory):
    from model.loader import load_model

    directory = make_tiny_qwen3_reasoner(Path(tmp_path_factory.mktemp("qwen3")))
    tokenizer = load_model(directory, progress=False).tokenizer
    return GrammarCompiler(tokenizer), tokenizer


SCHEMA = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]})


@pytest.mark.parametrize(
    ("fmt", "text", "accepted"),
    [
        (QWEN3, '<think>\nany {"text", even </think\n</think>\n\n{"a": 1}', True),
        (QWEN3, '{"a": 1}', True),  # no think block at all
        (QWEN3, "<think>x</think>\n\nplain words", False),
        (QWEN3, '<think>x</think>{"a": 1}</think>', False),
        (QWEN3, '<think>x</think>\n\n\n{"a": 1}', False),  # no padding past two blanks
        (R1, 'thinking {"a": 1}</think>\n\n{"a": 2}', True),
        (R1, '{"a": 1}', False),  # the prompt opened the block: it must close first
    ],
)
def test_the_answer_grammar_leaves_the_think_block_free(compiler, fmt, text, accepted) -> None:
    grammars, tokenizer = compiler
    matcher = grammars.compile_sync("json", SCHEMA, after=fmt).new_matcher()
    ok = matcher.consume_tokens(tokenizer.encode(text)) and matcher.is_accepting()
    assert bool(ok) == accepted
    lark = grammars.compile_sync("lark", 'start: "{\\"a\\": 1}"', after=fmt).new_matcher()
    ok = lark.consume_tokens(tokenizer.encode(text)) and lark.is_accepting()
    assert bool(ok) == (accepted and text.endswith('{"a": 1}'))
    plain = grammars.compile_sync("json", SCHEMA).new_matcher()  # without a parser: as before
    assert not plain.consume_tokens(tokenizer.encode("<think>x</think>")) or plain.is_error()
