"""From a request's output constraint to a compiled grammar: OpenAI's `response_format`
(`json_object`, `json_schema`) and vLLM's `structured_outputs` (`json`, `regex`,
`choice`, `grammar`, `json_object`).

Every constraint a client sends is either enforced or refused with a 400 that names the
field; none is ever dropped, so an answer never looks constrained when it is not.

With a reasoning parser on, a chat request's `response_format` (like a forced tool call)
constrains the answer after the think block; `structured_outputs` constrains everything
the model writes, think block included, so a client can shape that block too
(docs/reasoning.md).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from scheduler import Grammar
from server.edge.errors import APIError
from server.routes.protocol import ResponseFormat, StructuredOutputs
from server.state import ServerState
from server.structured.grammar import GrammarError

logger = logging.getLogger("llamaserve.server")
ANY_JSON_OBJECT = '{"type": "object"}'


def response_format_constraint(fmt: ResponseFormat | None) -> tuple[str, str] | None:
    """(kind, spec) of OpenAI's response_format, or None for plain text."""
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return "json", ANY_JSON_OBJECT
    if fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise APIError(
                400, "response_format: json_schema needs a json_schema object", "response_format"
            )
        schema = fmt.json_schema.schema_
        if schema is None:
            # OpenAI's SDK always sends one; without it any JSON object will do.
            return "json", ANY_JSON_OBJECT
        return "json", _schema_text(schema, "response_format")
    raise APIError(
        400,
        f"response_format: type {fmt.type!r} is not supported; use text, json_object "
        "or json_schema",
        "response_format",
    )


def structured_outputs_constraint(so: StructuredOutputs | None) -> tuple[str, str] | None:
    """(kind, spec) of vLLM's structured_outputs: exactly one of its constraints."""
    if so is None:
        return None
    given: list[tuple[str, str]] = []
    if so.json_ is not None:
        given.append(("json", _schema_text(so.json_, "structured_outputs")))
    if so.regex is not None:
        given.append(("regex", so.regex))
    if so.choice is not None:
        given.append(("choice", json.dumps(so.choice, ensure_ascii=False)))
    if so.grammar is not None:
        given.append(("grammar", so.grammar))
    if so.json_object:
        given.append(("json", ANY_JSON_OBJECT))
    if len(given) != 1:
        raise APIError(
            400,
            "structured_outputs: give exactly one of json, regex, choice, grammar, json_object",
            "structured_outputs",
        )
    return given[0]


def _schema_text(schema: dict[str, Any] | str | bool, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise APIError(400, f"{param}: the schema is not valid JSON", param) from None
    if not isinstance(schema, dict):
        raise APIError(400, f"{param}: a JSON schema must be an object", param)
    # Key order is kept: it is the order the grammar writes properties in.
    return json.dumps(schema, ensure_ascii=False, separators=(",", ":"))


async def compile_constraint(
    constraint: tuple[str, str] | None,
    param: str,
    state: ServerState,
    request_id: str,
    answer_only: bool = False,
) -> Grammar | None:
    """The compiled grammar, or a 400 naming `param` when it cannot be enforced.
    `answer_only`: under a reasoning parser, the think block before it is left free."""
    if constraint is None:
        return None
    kind, spec = constraint
    started = time.perf_counter()
    after = state.reasoning if answer_only else None
    try:
        grammar = await state.grammars.compile(kind, spec, after)
    except GrammarError as exc:
        logger.info("request %s: %s constraint refused: %s", request_id, param, exc)
        raise APIError(400, f"{param}: {exc}", param) from None
    logger.info(
        "request %s: %s grammar (%s) ready in %.1f ms",
        request_id,
        kind,
        param,
        (time.perf_counter() - started) * 1e3,
    )
    return grammar


async def request_grammar(
    response_format: ResponseFormat | None,
    structured_outputs: StructuredOutputs | None,
    state: ServerState,
    request_id: str,
    chat: bool = False,
) -> Grammar | None:
    """The grammar a completions or chat request asked for, if any. Only a chat answer is
    split by the reasoning parser, so only there does `response_format` wait for the think
    block; a completion's text is held to it from the first token."""
    from_format = response_format_constraint(response_format)
    from_vllm = structured_outputs_constraint(structured_outputs)
    if from_format is not None and from_vllm is not None:
        raise APIError(
            400,
            "give either response_format or structured_outputs, not both",
            "structured_outputs",
        )
    if from_vllm is not None:
        return await compile_constraint(from_vllm, "structured_outputs", state, request_id)
    return await compile_constraint(
        from_format, "response_format", state, request_id, answer_only=chat
    )
