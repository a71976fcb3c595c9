"""A grammar that constrains only the answer: the think block before it stays free text.

A constraint from `response_format` or a forced tool call describes the answer, and a
reasoning model writes its think block first; enforcing the grammar from the first token
would forbid the block (or force the JSON into it). So the compiled grammar is wrapped:
a new start rule lets the think block through (optional where the model opens it itself,
required where the prompt has opened it), then hands over to the original grammar,
which llguidance keeps as a named sub-grammar. The block is one lexeme that ends at the
first end tag (and the whitespace after it), so nothing inside it is ever constrained.
"""

from __future__ import annotations

import json
import re

from server.reasoning.formats import ReasoningFormat

ANSWER = "answer"


def _lark_text(tag: str) -> str:
    return re.escape(tag).replace("/", "\\/")


def after_think_block(source: str, fmt: ReasoningFormat) -> str:
    """llguidance's top-level grammar `source` (`{"grammars": [...]}`) with the think block
    allowed before it."""
    top = json.loads(source)
    grammars = top["grammars"]
    first = grammars[0]
    if not first.get("name"):
        first["name"] = ANSWER
    start, end = _lark_text(fmt.start_tag), _lark_text(fmt.end_tag)
    opening = f"({start})?" if fmt.starts_inside else start
    # `&` and `~` are llguidance's intersection and complement: the block ends at the
    # first end tag, so a second one can only be the answer's.
    block = f"/{opening}(?s:.*){end}[ \\n]*/ & ~/(?s:.*){end}(?s:.*){end}(?s:.*)/"
    think = "think" if fmt.starts_inside else "think?"
    wrapper = f"start: {think} @{first['name']}\nthink: THINK\nTHINK: {block}\n"
    top["grammars"] = [{"lark_grammar": wrapper}, *grammars]
    return json.dumps(top)
