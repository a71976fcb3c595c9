"""scheduler/structured/manager.py and constrained decoding through the real engine on the
default model: the bitmask allows exactly what an independent prefix check over the
vocabulary allows; constrained output always parses and validates (sampled, n > 1,
preempted, beside unconstrained requests), ends with "stop" or "length", and leaves the
unconstrained requests of its batch exactly as they are alone."""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from scheduler.config import EngineConfig
from scheduler.engine.factory import create_engine
from scheduler.sampling_params import InvalidParams, SamplingParams
from scheduler.structured.manager import StructuredOutputManager
from server.structured.grammar import GrammarCompiler
from tests.engine_driver import run_engine

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[A-Z][a-z]{1,12}$"},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {
            "type": "array",
            "items": {"type": "string", "maxLength": 10},
            "minItems": 1,
            "maxItems": 3,
        },
        "nickname": {"type": "string", "maxLength": 12},
    },
    "required": ["name", "age", "role", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def compiler(ours_default):
    return GrammarCompiler(ours_default.tokenizer)


@pytest.fixture(scope="module")
def engine(ours_default):
    return create_engine(
        ours_default.model, ours_default.tokenizer, EngineConfig(max_num_batched_tokens=512)
    )


@pytest.fixture(scope="module")
def prompt(ours_default):
    tok = ours_default.tokenizer
    return tok.encode("<|im_start|>user\nDescribe a person as JSON.<|im_end|>\n", True)


def allowed_ids(bitmask_row: np.ndarray, vocab: int) -> set[int]:
    bits = np.unpackbits(bitmask_row.view(np.uint8), bitorder="little")[:vocab]
    return set(np.nonzero(bits)[0].tolist())


def test_bitmask_allows_exactly_the_prefixes_of_the_choices(ours_default, compiler):
    tok = ours_default.tokenizer
    choices = ["yes", "no way"]
    grammar = compiler.compile_sync("choice", json.dumps(choices))
    manager = StructuredOutputManager()
    manager.add("a", grammar)
    # Independent reference: a token may come first when its bytes start a choice.
    want = {
        t
        for t in range(tok.vocab_size)
        if not tok.is_special(t)
        and tok.token_bytes(t)
        and any(c.encode().startswith(tok.token_bytes(t)) for c in choices)
    }
    assert allowed_ids(manager.fill_bitmask(["a"])[0], tok.vocab_size) == want

    # Walk "no way" token by token; at the end only the end-of-sequence tokens remain.
    for token in tok.encode("no way"):
        assert manager.accept("a", token) is None
    assert allowed_ids(manager.fill_bitmask(["a"])[0], tok.vocab_size) == set(tok.stop_ids)
    assert manager.accept("a", tok.eos_id) == "stop"
    manager.remove("a")
    assert "a" not in manager and len(manager) == 0


def test_refused_token_is_an_error_not_silent_output(ours_default, compiler):
    manager = StructuredOutputManager()
    manager.add("a", compiler.compile_sync("choice", '["yes"]'))
    assert manager.accept("a", ours_default.tokenizer.encode("no")[0]) == "error"


def test_min_tokens_cannot_be_combined_with_a_grammar(compiler):
    grammar = compiler.compile_sync("regex", "[0-9]+")
    with pytest.raises(InvalidParams) as info:
        SamplingParams(min_tokens=2, grammar=grammar)
    assert info.value.param == "min_tokens"


def test_sampled_constrained_output_validates_beside_unconstrained(
    ours_default, compiler, engine, prompt
):
    grammar = compiler.compile_sync("json", json.dumps(SCHEMA))
    plain = SamplingParams(max_tokens=24, temperature=0.0)
    alone, _ = run_engine(engine, {"plain": (prompt, plain)})
    requests = {
        f"json{i}": (
            prompt,
            SamplingParams(max_tokens=120, temperature=1.0, seed=10 * i, n=2, grammar=grammar),
        )
        for i in range(3)
    }
    requests["plain"] = (prompt, plain)
    results, _ = run_engine(engine, requests)
    assert results[("plain", 0)].token_ids == alone[("plain", 0)].token_ids
    for (rid, index), got in results.items():
        if rid == "plain":
            continue
        assert got.finish_reason == "stop", (rid, index, got.text)
        jsonschema.validate(json.loads(got.text), SCHEMA)
        # The grammar's end: the output's last token is the end-of-sequence it forced.
        assert got.token_ids[-1] in ours_default.tokenizer.stop_ids
    assert len(engine.scheduler.structured) == 0


def test_length_cut_is_a_prefix_of_valid_output(compiler, engine, prompt):
    grammar = compiler.compile_sync("json", json.dumps(SCHEMA))
    params = SamplingParams(max_tokens=6, temperature=0.0, grammar=grammar)
    results, _ = run_engine(engine, {"cut": (prompt, params)})
    (got,) = results.values()
    assert got.finish_reason == "length" and len(got.token_ids) == 6
    assert got.text.startswith('{"name": "')


def test_preempted_constrained_requests_keep_their_grammar_state(
    ours_default, compiler, engine, prompt
):
    grammar = compiler.compile_sync("json", json.dumps(SCHEMA))
    params = SamplingParams(max_tokens=120, temperature=0.0, grammar=grammar)
    alone, _ = run_engine(engine, {"a": (prompt, params)})
    # 12 blocks of 16 tokens for 6 requests that each grow past 60 tokens: some must be
    # preempted and recomputed, and their matchers must not see their tokens twice.
    tight = create_engine(
        ours_default.model,
        ours_default.tokenizer,
        EngineConfig(kv_cache_memory=12 * 737_280, max_num_batched_tokens=512),
    )
    results, preemptions = run_engine(tight, {f"r{i}": (prompt, params) for i in range(6)})
    assert preemptions > 0
    for got in results.values():
        assert got.token_ids == alone[("a", 0)].token_ids
        jsonschema.validate(json.loads(got.text), SCHEMA)


def test_logprobs_of_constrained_tokens_are_the_models_own(compiler, engine, prompt):
    """Logprobs report the model's raw distribution, as for every other shaping: the first
    constrained token's logprob equals the unconstrained run's logprob of that token."""
    grammar = compiler.compile_sync("choice", '["Maybe"]')
    free = SamplingParams(max_tokens=1, temperature=0.0, logprobs=20)
    results, _ = run_engine(engine, {"free": (prompt, free)})
    (free_lp,) = results[("free", 0)].outputs[0].logprobs
    constrained = SamplingParams(max_tokens=4, temperature=0.0, logprobs=20, grammar=grammar)
    results, _ = run_engine(engine, {"c": (prompt, constrained)})
    got = results[("c", 0)]
    assert got.text == "Maybe" and got.finish_reason == "stop"
    first = got.outputs[0].logprobs[0]
    assert first.top == free_lp.top
    assert first.logprob < free_lp.top[0][1] or first.token_id == free_lp.top[0][0]


def test_stop_string_still_cuts_constrained_output(compiler, engine, prompt):
    grammar = compiler.compile_sync("json", json.dumps(SCHEMA))
    params = SamplingParams(max_tokens=120, temperature=0.0, stop=['"age"'], grammar=grammar)
    results, _ = run_engine(engine, {"s": (prompt, params)})
    (got,) = results.values()
    assert got.finish_reason == "stop" and got.text.startswith('{"name": "')
    assert '"age"' not in got.text and got.text.endswith(", ")
    assert len(engine.scheduler.structured) == 0


def test_a_refused_token_fails_the_sequence_in_the_scheduler(ours_default, compiler):
    """A runner that ignored the bitmask: the scheduler ends the sequence with an error
    rather than append output that breaks its grammar."""
    from scheduler.kv_cache import KVCacheManager
    from scheduler.request import Request
    from scheduler.scheduler import Scheduler, SchedulerConfig
    from scheduler.step_data import ModelRunnerOutput, SampledToken

    tok = ours_default.tokenizer
    sched = Scheduler(SchedulerConfig(256, 8, 64, 4), KVCacheManager(64, 4))
    params = SamplingParams(temperature=0.0, grammar=compiler.compile_sync("choice", '["yes"]'))
    sched.add(Request("a", tok.encode("Say yes:"), params))
    plan = sched.schedule()
    (row,) = plan.scheduled
    assert row.token_bitmask is not None and row.token_bitmask.dtype == np.int32
    wrong = tok.encode("no")[0]
    result = ModelRunnerOutput(sampled={"a": SampledToken(wrong, None)})
    (update,) = sched.update_from_output(plan, result)
    assert update.finish_reason == "error" and "grammar" in update.error
    assert not sched.has_work() and len(sched.structured) == 0


def test_a_draft_is_handed_a_copy_of_the_grammar(ours_default, compiler):
    """A draft model's guesses are made after the schedule, so a constrained sequence with
    guess slots gets no bitmask from the scheduler but a copy of its matcher for the step
    (`draft_grammar`): moving the copy leaves the scheduler's matcher where it was. The
    guesses are then cut where the grammar refuses one, and a sequence left without a
    guess still gets the mask of the row it samples."""
    from scheduler.step_data import DRAFT_SLOT, ScheduledRequest
    from scheduler.structured.grammar import constrain_guesses

    tok = ours_default.tokenizer
    manager = StructuredOutputManager()
    manager.add("a", compiler.compile_sync("choice", '["yes"]'))
    before = manager.fill_bitmask(["a"])
    step = ScheduledRequest(
        request_id="a",
        new_token_ids=[1, DRAFT_SLOT, DRAFT_SLOT],
        num_computed_tokens=4,
        block_table=[0, 1],
        sample=True,
        params=SamplingParams(temperature=0.0),
        seed=None,
        prompt_ids=[1, 2, 3, 4],
        output_ids=[1],
        draft_token_ids=[DRAFT_SLOT, DRAFT_SLOT],
    )
    manager.fill_rows([step])
    assert step.token_bitmask is None and step.draft_grammar is not None
    yes = tok.encode("yes")
    assert step.draft_grammar.matcher.consume_token(yes[0])
    assert np.array_equal(manager.fill_bitmask(["a"]), before)

    fresh = ScheduledRequest(**{**vars(step), "draft_grammar": None, "token_bitmask": None})
    manager.fill_rows([fresh])
    wrong = tok.encode("no")[0]
    (cut, none) = constrain_guesses(
        [(fresh.draft_grammar, [yes[0], wrong]), (fresh.draft_grammar, [])]
    )
    assert cut.shape[0] == 2 and none.shape[0] == 1  # one guess kept; one row each
    assert np.array_equal(none, before)
