"""`GrammarCompiler`: turns a request's constraint (a JSON schema, a regex, a list of
choices, a Lark or GBNF grammar) into a compiled `Grammar` for the scheduler, with
llguidance, off the engine thread and the event loop.

Owns the llguidance view of our tokenizer (built on first use: ~0.1 s for a 49k-token
vocabulary), a cache of compiled grammars by (kind, spec), and the time limit. A
constraint it cannot honour (a malformed schema, a keyword llguidance does not enforce)
is a `GrammarError`, never a silently looser grammar; one that takes longer than the limit
is a `GrammarError` too, while the compilation finishes in its thread and is cached for the
next request. Compiling one grammar never delays requests that do not use it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import threading
import time
from collections import OrderedDict
from typing import Any

import llguidance

from model.text.tokenizer import Tokenizer
from scheduler import Grammar
from server.reasoning.constraint import after_think_block
from server.reasoning.formats import ReasoningFormat

logger = logging.getLogger("llamaserve.server")

# One fixed layout for JSON output: `{"a": 1, "b": [2, 3]}`. Flexible whitespace would let
# a small model pad its answer with newlines until max_tokens; this way it cannot.
JSON_OPTIONS: dict[str, Any] = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class GrammarError(ValueError):
    """The constraint cannot be compiled or enforced; the message says why."""


class _LLTokenizerSource:
    """What llguidance's `TokenizerWrapper` reads: every token id's bytes, the specials
    (never produced from text, so a grammar never allows them), and a way to encode."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)]
        self.special_token_ids = sorted(tokenizer.special_tokens.values())

    def __call__(self, text: bytes) -> list[int]:
        return self._tokenizer.encode(text.decode("utf-8", errors="replace"))


class GrammarCompiler:
    def __init__(
        self,
        tokenizer: Tokenizer,
        timeout_s: float = 10.0,
        cache_size: int = 256,
        max_workers: int = 2,
    ) -> None:
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.cache_size = cache_size
        self._lock = threading.Lock()
        self._lltokenizer: llguidance.LLTokenizer | None = None
        # Finished and in-flight compilations alike: a second request for a schema being
        # compiled waits for the same result instead of compiling it again.
        self._cache: OrderedDict[tuple[str, str, str], concurrent.futures.Future[Grammar]] = (
            OrderedDict()
        )
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=max_workers, thread_name_prefix="llamaserve-grammar"
        )

    async def compile(self, kind: str, spec: str, after: ReasoningFormat | None = None) -> Grammar:
        """The compiled grammar for (kind, spec), from the cache or a worker thread;
        raises GrammarError when it cannot be had within the time limit. `after`: the
        grammar applies after a think block of this format (server/reasoning/constraint.py)."""
        future = self._future(kind, spec, after)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except asyncio.TimeoutError:
            raise GrammarError(
                f"compiling this {kind} constraint took longer than {self.timeout_s:g} s"
            ) from None

    def compile_sync(self, kind: str, spec: str, after: ReasoningFormat | None = None) -> Grammar:
        return self._future(kind, spec, after).result()

    def _future(
        self, kind: str, spec: str, after: ReasoningFormat | None
    ) -> concurrent.futures.Future[Grammar]:
        key = (kind, spec, after.name if after else "")
        with self._lock:
            future = self._cache.get(key)
            if future is not None and not (future.done() and future.exception()):
                self._cache.move_to_end(key)
                return future
            future = self._pool.submit(self._build, kind, spec, after)
            self._cache[key] = future
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)
            return future

    def _tokenizer(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._lltokenizer is None:
                started = time.perf_counter()
                source = llguidance.TokenizerWrapper(_LLTokenizerSource(self.tokenizer))
                self._lltokenizer = llguidance.LLTokenizer(
                    source, eos_token=sorted(self.tokenizer.stop_ids)
                )
                logger.info(
                    "grammar tokenizer built in %.2f s (%d tokens)",
                    time.perf_counter() - started,
                    self._lltokenizer.vocab_size,
                )
            return self._lltokenizer

    def _build(self, kind: str, spec: str, after: ReasoningFormat | None) -> Grammar:
        started = time.perf_counter()
        tokenizer = self._tokenizer()
        source = _grammar_source(kind, spec)
        if after is not None:
            source = after_think_block(source, after)
        try:
            failed, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
                source, tokenizer
            )
            matcher = None if failed else llguidance.LLMatcher(tokenizer, source, log_level=0)
        except Exception as exc:  # whatever the client's grammar does to the engine: a 400
            raise GrammarError(_first_line(str(exc))) from None
        if matcher is None:
            raise GrammarError(_first_line(messages[0]))
        if matcher.is_error():
            raise GrammarError(_first_line(matcher.get_error()))
        logger.debug(
            "compiled a %s grammar in %.1f ms", kind, (time.perf_counter() - started) * 1e3
        )
        return Grammar(
            key=(kind, spec),
            start=matcher,
            vocab_size=tokenizer.vocab_size,
            eos_ids=frozenset(tokenizer.eos_tokens),
        )


def _grammar_source(kind: str, spec: str) -> str:
    """llguidance's grammar text for a constraint; GrammarError when it is malformed."""
    try:
        if kind == "json":
            schema = json.loads(spec)
            if not isinstance(schema, dict):
                raise GrammarError("a JSON schema must be an object")
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if kind == "choice":
            choices = json.loads(spec)
            if not choices or not all(isinstance(c, str) for c in choices):
                raise GrammarError("choice must be a non-empty list of strings")
            return llguidance.grammar_from("choice", spec)
        if kind == "regex":
            return llguidance.grammar_from("regex", spec)
        if kind == "grammar":
            # Lark, or GBNF as llama.cpp writes it (`root ::= ...`), converted to Lark.
            return llguidance.grammar_from("grammar", spec)
        if kind == "lark":  # our own grammars (tool calls), never converted
            return llguidance.LLMatcher.grammar_from_lark(spec)
    except GrammarError:
        raise
    except (ValueError, TypeError, KeyError) as exc:
        raise GrammarError(_first_line(str(exc))) from None
    raise GrammarError(f"unknown constraint kind {kind!r}")


def _first_line(message: str) -> str:
    """llguidance's messages can carry the whole grammar and parser state after the first
    line; the client needs the reason, not a dump."""
    return (message.strip().splitlines() or ["invalid grammar"])[0][:500]
