"""server/structured/grammar.py: constraints compile to grammars once (cached by kind and spec, one
compilation shared by concurrent requests), a constraint llguidance cannot enforce is a
GrammarError with a one-line reason, and a compilation past the time limit is refused
without holding up other compilations."""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from server.structured.grammar import GrammarCompiler, GrammarError


@pytest.fixture
def compiler(tok):
    return GrammarCompiler(tok)


def test_each_kind_compiles_and_is_cached(compiler):
    specs = [
        ("json", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})),
        ("regex", r"[a-z]+@[a-z]+\.com"),
        ("choice", json.dumps(["red", "green"])),
        ("grammar", 'root ::= "a" [0-9]+'),  # GBNF, as llama.cpp writes it
        ("grammar", 'start: /[0-9]+/ "!"'),  # Lark
    ]
    for kind, spec in specs:
        first = compiler.compile_sync(kind, spec)
        assert first.key == (kind, spec)
        assert compiler.compile_sync(kind, spec) is first


@pytest.mark.parametrize(
    "kind, spec, reason",
    [
        ("json", json.dumps({"type": "array", "uniqueItems": True}), "uniqueItems"),
        ("json", json.dumps({"type": "wat"}), "wat"),
        ("json", json.dumps({"type": "string", "pattern": "(a"}), "regex"),
        ("json", json.dumps({"$ref": "#/$defs/missing"}), "missing"),
        ("json", "[1, 2]", "object"),
        ("regex", "(a", "regex"),
        ("choice", "[]", "choice"),
        ("grammar", "root ::= undefined_rule", "undefined_rule"),
    ],
)
def test_what_cannot_be_enforced_is_refused(compiler, kind, spec, reason):
    with pytest.raises(GrammarError) as info:
        compiler.compile_sync(kind, spec)
    message = str(info.value)
    assert reason in message and "\n" not in message


def test_a_slow_compilation_is_refused_and_others_go_on(compiler, monkeypatch):
    release = threading.Event()
    build = compiler._build

    def slow_build(kind, spec, after):
        if spec == '"slow"':
            release.wait(10)
        return build(kind, spec, after)

    monkeypatch.setattr(compiler, "_build", slow_build)
    compiler.timeout_s = 0.5

    async def both():
        slow = asyncio.ensure_future(compiler.compile("json", '"slow"'))
        fast = await compiler.compile("regex", "[0-9]+")
        return fast, await asyncio.gather(slow, return_exceptions=True)

    fast, (slow,) = asyncio.run(both())
    release.set()
    assert fast.key == ("regex", "[0-9]+")
    assert isinstance(slow, GrammarError) and "longer than" in str(slow)


def test_concurrent_requests_share_one_compilation(compiler, monkeypatch):
    calls = []
    build = compiler._build
    monkeypatch.setattr(compiler, "_build", lambda k, s, a: calls.append(s) or build(k, s, a))

    async def many():
        return await asyncio.gather(*(compiler.compile("regex", "x+y") for _ in range(8)))

    grammars = asyncio.run(many())
    assert calls == ["x+y"] and all(g is grammars[0] for g in grammars)
