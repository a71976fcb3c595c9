"""The grammar that enforces a required (or named) tool call under harmony, gpt-oss's
format: an optional `analysis` message, then one message to `functions.NAME` on the
`commentary` channel whose body is JSON arguments held to NAME's parameter schema, ended
by `<|call|>`, the stop token that ends the turn.

The header is written the way gpt-oss writes its calls
(`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>`), so a forced call
reads like one the model chose. Harmony has one call per turn, so parallel calls do not
apply.
"""

from __future__ import annotations

import json

from server.reasoning.constraint import HARMONY_ANALYSIS
from server.structured.grammar import JSON_OPTIONS
from server.structured.tool_calls import HARMONY, ToolPlan


def harmony_tool_grammar(plan: ToolPlan) -> str:
    """Lark for llguidance: one call to one of the allowed tools."""
    assert plan.format is HARMONY
    allowed = [t for t in plan.tools if plan.function in (None, t.function.name)]
    alternatives = []
    for tool in allowed:
        schema = {**(tool.function.parameters or {"type": "object"}), "x-guidance": JSON_OPTIONS}
        header = json.dumps(f"commentary to=functions.{tool.function.name} ")
        alternatives.append(
            f'<|channel|> {header} <|constrain|> "json" <|message|> %json {json.dumps(schema)}'
            " <|call|>"
        )
    return "start: analysis? call\ncall: " + "\n    | ".join(alternatives) + "\n" + HARMONY_ANALYSIS
