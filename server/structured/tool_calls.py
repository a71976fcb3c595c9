"""Tool calling on chat completions: what a request's `tools`, `tool_choice` and
`parallel_tool_calls` ask for (`ToolPlan`), the syntax the model writes calls in
(`ToolCallFormat`), the grammar that enforces `required` and named choices, and parsing a
finished answer into OpenAI's `tool_calls`.

A call's `arguments` is always the exact text the model wrote for them (never
re-serialised), so a streamed answer's argument fragments and a whole answer's
arguments are the same string. Text is only taken for a call when it is a complete call
in the format's own syntax naming a known tool; a reply that merely contains `{` stays
content. Under `required` or a named function the grammar allows nothing but calls, so an
answer cut short (by max_tokens) is calls too, the last one holding the arguments written
so far (`forced_calls`), as OpenAI returns it.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from server.edge.errors import APIError
from server.routes.protocol import ChatCompletionRequest, Tool
from server.structured.grammar import JSON_OPTIONS


@dataclass(frozen=True)
class ToolCallFormat:
    """How calls look in the model's output: each call is one JSON object
    `{"name": ..., <args_key>: {...}}` between `open_tag` and `close_tag`."""

    name: str
    open_tag: str
    close_tag: str
    args_key: str
    multiple: bool  # several calls in one answer, one after another


# Hermes style, as Qwen 2.5, SmolLM3 and our fallback prompt write calls.
HERMES = ToolCallFormat("hermes", "<tool_call>\n", "\n</tool_call>", "arguments", True)
# Meta's JSON tool calling for Llama 3.x: the whole answer is one call.
LLAMA3_JSON = ToolCallFormat("llama3_json", "", "", "parameters", False)
# gpt-oss's harmony: a call is a message to `functions.NAME`, read from the channels
# (server/reasoning/harmony.py), never from the content; one per turn.
HARMONY = ToolCallFormat("harmony", "", "", "arguments", False)


@dataclass
class ToolPlan:
    tools: list[Tool]
    choice: str  # "auto", "required" or "function" (a named one); "none" needs no plan
    function: str | None  # the named function
    parallel: bool
    format: ToolCallFormat

    @property
    def enforced(self) -> bool:
        return self.choice in ("required", "function")

    @property
    def names(self) -> set[str]:
        return {t.function.name for t in self.tools}


@dataclass
class ParsedCall:
    name: str
    arguments: str  # the JSON object exactly as written

    def wire(self, call_id: str | None = None) -> dict[str, Any]:
        return {
            "id": call_id or new_call_id(),
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_plan(req: ChatCompletionRequest, fmt: ToolCallFormat) -> ToolPlan | None:
    """The request's tool settings, checked; None when no tool may be called."""
    tools = req.tools or []
    choice = req.tool_choice
    for tool in tools:
        if tool.type != "function":
            raise APIError(400, f"tools: type {tool.type!r} is not supported", "tools")
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: function names must be unique", "tools")
    function = None
    if isinstance(choice, dict):
        named = choice.get("function")
        function = named.get("name") if isinstance(named, dict) else None
        if choice.get("type") != "function" or not isinstance(function, str):
            raise APIError(
                400,
                'tool_choice: expected {"type": "function", "function": {"name": ...}}',
                "tool_choice",
            )
        choice = "function"
    elif choice not in (None, "none", "auto", "required"):
        raise APIError(
            400, "tool_choice: use none, auto, required or a named function", "tool_choice"
        )
    if choice not in (None, "none") and not tools:
        raise APIError(400, "tool_choice needs tools", "tool_choice")
    if function is not None and function not in names:
        raise APIError(400, f"tool_choice: no tool named {function!r}", "tool_choice")
    if not tools or choice == "none":
        return None
    parallel = req.parallel_tool_calls is not False and fmt.multiple and function is None
    return ToolPlan(tools, choice or "auto", function, parallel, fmt)


def tool_grammar(plan: ToolPlan) -> str:
    """Lark for llguidance: one call (or, with parallel calls, several) to the allowed
    tools, each call's arguments held to its tool's parameter schema."""
    allowed = [t for t in plan.tools if plan.function in (None, t.function.name)]
    fmt = plan.format
    call_schema = {
        "anyOf": [
            {
                "type": "object",
                "properties": {
                    "name": {"const": t.function.name},
                    fmt.args_key: t.function.parameters or {"type": "object"},
                },
                "required": ["name", fmt.args_key],
                "additionalProperties": False,
            }
            for t in allowed
        ],
        "x-guidance": JSON_OPTIONS,
    }
    call = " ".join(
        part
        for part in (
            json.dumps(fmt.open_tag) if fmt.open_tag else "",
            "%json " + json.dumps(call_schema),
            json.dumps(fmt.close_tag) if fmt.close_tag else "",
        )
        if part
    )
    start = 'start: call ("\\n" call)*' if plan.parallel else "start: call"
    return f"{start}\ncall: {call}\n"


def parse_tool_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[ParsedCall]]:
    """(content, calls) of a finished answer. Only complete, well-formed calls to known
    tools are calls; everything else is content, except in a forced answer that stopped
    inside a call: it is all calls (`forced_calls`), never the format's markup."""
    content, calls = _complete_calls(text, plan)
    if plan.enforced and text and (content is not None or not calls):
        return None, forced_calls(text, plan)
    return content, calls


def _complete_calls(text: str, plan: ToolPlan) -> tuple[str | None, list[ParsedCall]]:
    fmt = plan.format
    if not fmt.open_tag:
        call = _parse_call(text, 0, plan)
        if call is not None and not text[call[1] :].strip():
            return None, [call[0]]
        return text, []
    calls: list[ParsedCall] = []
    content: list[str] = []
    pos = 0
    opening = re.compile(re.escape(fmt.open_tag.strip()) + r"\s*")
    while (match := opening.search(text, pos)) is not None:
        parsed = _parse_call(text, match.end(), plan)
        if parsed is None:
            break
        call, end = parsed
        closing = re.compile(r"\s*" + re.escape(fmt.close_tag.strip()))
        closed = closing.match(text, end)
        if closed is None and text[end:].strip():
            break  # something other than the closing tag follows: not a call
        content.append(text[pos : match.start()])
        calls.append(call)
        pos = closed.end() if closed else len(text)
        if not plan.parallel:
            break
    content.append(text[pos:])
    rest = "".join(content).strip()
    if not calls:
        return text, []
    return rest or None, calls


def call_head(fmt: ToolCallFormat) -> re.Pattern[str]:
    """A call up to where its arguments begin, in the grammar's exact layout; group 1 is
    the name."""
    return re.compile(
        re.escape(fmt.open_tag) + r'\{"name": "([^"]*)", "' + re.escape(fmt.args_key) + '": '
    )


def forced_calls(text: str, plan: ToolPlan) -> list[ParsedCall]:
    """The calls of a forced answer (`required` or a named function), the last one cut
    short where generation stopped: its `arguments` are the text written so far, an
    incomplete JSON object, as OpenAI returns a call cut by max_tokens (with
    `finish_reason: "length"`). The grammar's layout is exact, so the text is calls in it,
    one after another, and nothing else."""
    fmt, pos, calls = plan.format, 0, []
    head = call_head(fmt)
    between = "}" + fmt.close_tag + "\n"  # one call's end and the next one's start
    while (match := head.match(text, pos)) is not None:
        end = _json_end(text, match.end())
        calls.append(ParsedCall(match.group(1), text[match.end() : end]))
        if end == len(text) or between.startswith(text[end:]):
            return calls  # cut inside the arguments, or (at most) in the closing tag
        pos = end + len(between)
    if text[pos:]:
        calls.append(ParsedCall(_cut_name(text[pos:], plan), ""))
    return calls


def _cut_name(text: str, plan: ToolPlan) -> str:
    """The name of a call cut short before its arguments began. OpenAI always names a
    call with a whole function name, so when only one name fits what was written (a
    named function, a single tool, or a prefix only one tool's name has) that name is the
    call's, as the grammar would have finished it. When several still fit, the text
    written so far (possibly empty) is the name: a whole one would claim a choice the
    model had not made, and leaving the call out would answer a forced call with none."""
    opening = plan.format.open_tag + '{"name": "'
    written, closed, _ = text[len(opening) :].partition('"')
    if closed:
        return written
    allowed = [t.function.name for t in plan.tools if plan.function in (None, t.function.name)]
    fitting = [name for name in allowed if name.startswith(written)]
    return fitting[0] if len(fitting) == 1 else written


def _json_end(text: str, start: int) -> int:
    """Where the JSON value at text[start] ends; the end of the text when it is cut."""
    try:
        return _DECODER.raw_decode(text, start)[1]
    except ValueError:
        return len(text)


def _parse_call(text: str, start: int, plan: ToolPlan) -> tuple[ParsedCall, int] | None:
    spans = json_member_spans(text, start)
    if spans is None:
        return None
    members, end = spans
    name_span = members.get("name")
    args_span = members.get(plan.format.args_key) or members.get("arguments")
    if name_span is None or args_span is None:
        return None
    name = json.loads(text[name_span[0] : name_span[1]])
    arguments = text[args_span[0] : args_span[1]]
    if name not in plan.names or not isinstance(json.loads(arguments), dict):
        return None
    return ParsedCall(name, arguments), end


_WHITESPACE = re.compile(r"[ \t\n\r]*")
_DECODER = json.JSONDecoder()


def json_member_spans(text: str, start: int) -> tuple[dict[str, tuple[int, int]], int] | None:
    """Where each member's value of the JSON object at text[start] lies, and where the
    object ends; None unless a whole, valid object starts there."""
    try:
        i = _WHITESPACE.match(text, start).end()
        if text[i] != "{":
            return None
        i = _WHITESPACE.match(text, i + 1).end()
        spans: dict[str, tuple[int, int]] = {}
        if text[i] == "}":
            return spans, i + 1
        while True:
            key, i = _DECODER.raw_decode(text, i)
            i = _WHITESPACE.match(text, i).end()
            if not isinstance(key, str) or text[i] != ":":
                return None
            i = _WHITESPACE.match(text, i + 1).end()
            _, end = _DECODER.raw_decode(text, i)
            spans[key] = (i, end)
            i = _WHITESPACE.match(text, end).end()
            if text[i] == "}":
                return spans, i + 1
            if text[i] != ",":
                return None
            i = _WHITESPACE.match(text, i + 1).end()
    except (ValueError, IndexError):
        return None
