"""A grammar that constrains only the answer: the think block before it stays free text.

A constraint from `response_format` or a forced tool call describes the answer, and a
reasoning model writes its think block first; enforcing the grammar from the first token
would forbid the block (or force the JSON into it). So the compiled grammar is wrapped:
a new start rule lets the think block through (optional where the model opens it itself,
required where the prompt has opened it), then hands over to the original grammar,
which llguidance keeps as a named sub-grammar. The block is one lexeme that ends at the
first end tag (and up to two blanks after it), so nothing inside it is ever constrained.

Under harmony (gpt-oss) the answer is the body of the `final` channel's message, and an
`analysis` message may come first: special tokens are named in the grammar as llguidance
reads them (`<|channel|>`), and the analysis body is one free lexeme ending at `<|end|>`.
"""

from __future__ import annotations

import json
import re
from typing import Any

from server.reasoning.formats import ReasoningFormat

ANSWER = "answer"


def _lark_text(tag: str) -> str:
    return re.escape(tag).replace("/", "\\/")


# An optional harmony analysis message, up to the next message's role (Lark rules).
HARMONY_ANALYSIS = (
    'analysis: <|channel|> "analysis" <|message|> ANALYSIS <|end|> <|start|> "assistant"\n'
    "ANALYSIS: /(?s:.*)/\n"
)


def after_think_block(source: str, fmt: ReasoningFormat) -> str:
    """A grammar source as llguidance takes it (a top-level `{"grammars": [...]}` or Lark
    text) with the think block allowed before it."""
    top = _top_level(source)
    grammars = top["grammars"]
    first = grammars[0]
    if not first.get("name"):
        first["name"] = ANSWER
    if fmt.channels:
        final = f'start: analysis? <|channel|> "final" <|message|> @{first["name"]}\n'
        top["grammars"] = [{"lark_grammar": final + HARMONY_ANALYSIS}, *grammars]
        return json.dumps(top)
    start, end = _lark_text(fmt.start_tag), _lark_text(fmt.end_tag)
    opening = f"({start})?" if fmt.starts_inside else start
    # `&` and `~` are llguidance's intersection and complement: the block ends at the
    # first end tag, so a second one can only be the answer's.
    # At most two blank characters after the block (models write `</think>\n\n`): with free
    # whitespace there a small model can pad until max_tokens, as with free JSON layout.
    block = f"/{opening}(?s:.*){end}[ \\n]{{0,2}}/ & ~/(?s:.*){end}(?s:.*){end}(?s:.*)/"
    think = "think" if fmt.starts_inside else "think?"
    wrapper = f"start: {think} @{first['name']}\nthink: THINK\nTHINK: {block}\n"
    top["grammars"] = [{"lark_grammar": wrapper}, *grammars]
    return json.dumps(top)


def _top_level(source: str) -> dict[str, Any]:
    try:
        top = json.loads(source)
    except ValueError:
        top = None
    if isinstance(top, dict) and isinstance(top.get("grammars"), list):
        return top
    return {"grammars": [{"lark_grammar": source}]}
