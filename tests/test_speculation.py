"""n-gram speculative decoding: greedy output (tokens, logprobs, text, finish reasons,
usage) identical with and without it on the default model, alone, crowded, chunked and
after preemption, with stop strings, stop tokens and max_tokens landing inside an
accepted run; the proposer, the acceptance rule, the config and the KV bookkeeping."""

import json
import math
from dataclasses import replace

import httpx
import pytest
import torch

from model.quant.int8_group import Int8GroupLinear
from scheduler.config import EngineConfig
from scheduler.engine.factory import create_engine
from scheduler.kv_cache import KVCacheManager
from scheduler.request import Request
from scheduler.sampling_params import SamplingParams
from scheduler.spec.costs import SpecCosts
from scheduler.spec.length import guess_length, probe_interval
from scheduler.spec.speculation import (
    SpeculativeConfig,
    SpeculativeConfigError,
    Speculator,
    accepted,
    propose_ngram,
)
from server.structured.grammar import GrammarCompiler
from tests.engine_driver import run_engine
from tests.live_server import engine_config, running_server
from tests.test_engine import engine_for
from tests.tiny_models import make_tiny_llama, random_draft, write_tiny_tokenizer

# Text that repeats itself, where lookup guesses well, and text that does not.
TEXTS = [
    "Count from one: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,",
    "def add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\ndef mul(a, b):",
    "The quick brown fox jumps over the lazy dog. The quick brown fox jumps over the",
    "Repeat after me: red green blue, red green blue, red green blue,",
    "The capital of France is",
]
# Repeated keys: JSON a lookup guesses well in.
PEOPLE = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    },
    "minItems": 3,
}
# The draft guesses every slot (no draft_p_min): the tests below need its wrong guesses.
DRAFT = SpeculativeConfig(
    num_speculative_tokens=3,
    disable_by_batch_size=64,
    method="draft_model",
    model="draft",
    draft_p_min=0.0,
)
NGRAM = SpeculativeConfig(num_speculative_tokens=4, disable_by_batch_size=64)


def params(**fields) -> SamplingParams:
    return SamplingParams(**{"max_tokens": 16, "temperature": 0.0, "logprobs": 2, **fields})


@pytest.fixture(scope="module")
def target():
    """The default model in float32 with --batch-invariant: each product and attention row
    computed as it would be alone (model/row_invariant.py), so the logprobs of a verified
    token can be held to within 1e-5 of the plain run's, however the steps were shaped."""
    from model.loader import load_model

    return load_model(batch_invariant=True, progress=False)


@pytest.fixture(scope="module")
def requests(target):
    encode = target.tokenizer.encode
    reqs = {f"r{i}": (encode(t), params()) for i, t in enumerate(TEXTS)}
    # Ends inside runs the guesses make likely: a stop string, a stop token, max_tokens.
    reqs["stop"] = (encode(TEXTS[0]), params(stop=[" 15,"]))
    reqs["stop_id"] = (encode(TEXTS[3]), params(stop_token_ids=encode(" blue")[-1:]))
    reqs["short"] = (encode(TEXTS[2]), params(max_tokens=7))
    reqs["pair"] = (encode(TEXTS[1]), params(n=2))
    # Constrained: guesses within the grammar only, each row masked after those before it.
    grammar = GrammarCompiler(target.tokenizer).compile_sync("json", json.dumps(PEOPLE))
    reqs["json"] = (encode(TEXTS[4]), params(max_tokens=48, grammar=grammar))
    # Sampled and seeded: its draws are its own at each position, with or without guesses.
    reqs["sampled"] = (encode(TEXTS[0]), params(temperature=0.8, seed=7, logprobs=None))
    return reqs


# A fixed step budget: no start-up timing of the prefill for each engine.
BUDGET = dict(max_num_batched_tokens=512)


@pytest.fixture(scope="module")
def plain(target, requests):
    results, _ = run_engine(engine_for(target, **BUDGET), requests)
    return results


def run_speculating(
    loaded, requests, one_at_a_time: bool = False, draft=None, spec=NGRAM, **engine
):
    """`one_at_a_time`: each request alone in the engine, after the one before finished.
    `draft`: a draft model (a `Llama`) guesses instead of n-gram lookup."""
    if draft is not None and spec is NGRAM:
        spec = DRAFT
    config = EngineConfig(speculative=spec, **{**BUDGET, **engine})
    e = create_engine(loaded.model, loaded.tokenizer, config, draft)
    drafted = accepted_total = 0
    preemptions = 0
    results: dict = {}
    waves = [[item] for item in requests.items()] if one_at_a_time else [requests.items()]
    for wave in waves:
        for rid, (ids, p) in wave:
            e.add_request(rid, ids, p)
        while e.has_work():
            outputs, stats = e.step()
            preemptions += stats.num_preemptions
            if stats.spec is not None:
                drafted += stats.spec.num_draft_tokens
                accepted_total += stats.spec.num_accepted_tokens
            for out in outputs:
                results.setdefault((out.request_id, out.index), []).append(out)
    e.scheduler.kv.check_invariants()
    assert e.scheduler.kv.num_used_blocks == 0
    return results, drafted, accepted_total, preemptions


def assert_same(plain, spec) -> None:
    assert set(spec) == set(plain)
    for key, outs in spec.items():
        want = plain[key]
        assert [t for o in outs for t in o.new_token_ids] == want.token_ids, key
        assert "".join(o.new_text for o in outs) == want.text, key
        assert outs[-1].finish_reason == want.finish_reason, key
        assert outs[-1].num_output_tokens == want.outputs[-1].num_output_tokens, key
        got_lps = [lp for o in outs for lp in (o.logprobs or [])]
        want_lps = [lp for o in want.outputs for lp in (o.logprobs or [])]
        assert [lp.token_id for lp in got_lps] == [lp.token_id for lp in want_lps], key
        for g, w in zip(got_lps, want_lps, strict=True):
            # A verifying step computes a sequence's rows as a short prefill, its products
            # in a batch of another shape: without --batch-invariant, float32 sums in
            # another order, up to 2.7e-5 apart (0 with it, and on the default format).
            assert abs(g.logprob - w.logprob) <= 1e-5, key
            assert [i for i, _ in g.top] == [i for i, _ in w.top], key
            for (_, got_top), (_, want_top) in zip(g.top, w.top, strict=True):
                assert abs(got_top - want_top) <= 1e-5, key


# Every request at once in each (crowded), with prompts cut into chunks, or with too
# little cache for all of them.
SCENARIOS = {
    "chunked_prefill": dict(max_num_batched_tokens=12),
    "preemption": dict(kv_cache_memory=14 * 737280),
}
# About ten blocks: with a draft of the default model's shape each costs twice the bytes,
# with the small draft about as much as without.
KV = {"itself": 2 * 10 * 737280, "small": 10 * 737280}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_greedy_output_is_unchanged(target, requests, plain, scenario) -> None:
    spec, drafted, accepted_total, preemptions = run_speculating(
        target, requests, **SCENARIOS[scenario]
    )
    assert_same(plain, spec)
    assert accepted_total > 0.3 * drafted > 0  # the guesses were used, and mostly right
    if scenario == "preemption":
        assert preemptions > 0


def test_the_default_format_keeps_the_plain_logprobs(requests) -> None:
    """The default format on an AVX-512 BF16 CPU (bf16 activations, int4 layers and the
    int8 output projection on the C kernels, which compute each row alone) needs no flag:
    prompts in chunks and every request at once, the plain run's logprobs. Pinned rather
    than timed (`--cpu-kernels native`): on a busy machine the start-up timing can take the
    bf16 output projection instead, whose bf16 logits round by the batch's shape (a CI run
    saw one logprob 0.078 apart)."""
    from model.loader import load_model

    fast = load_model(
        dtype=torch.bfloat16, quantization="int4", cpu_kernels="native", progress=False
    )
    assert isinstance(fast.model.lm_head, Int8GroupLinear)
    want, _ = run_engine(engine_for(fast, **BUDGET), requests)
    spec, drafted, accepted_total, _ = run_speculating(fast, requests, max_num_batched_tokens=12)
    assert_same(want, spec)
    assert accepted_total > 0.3 * drafted > 0


@pytest.fixture(scope="module")
def small_draft(target):
    """Its guesses are mostly wrong, and stale draft context would cost nothing the
    output shows."""
    return random_draft(target.config)


@pytest.mark.parametrize("draft", ["itself", "small"])
def test_draft_model_keeps_greedy_output(target, requests, plain, small_draft, draft):
    """Every request at once, prompts in chunks, and a cache that holds too few blocks."""
    model = target.model if draft == "itself" else small_draft
    ids = ("r0", "r1", "stop_id", "pair") + (("sampled",) if draft == "itself" else ())
    some = {rid: requests[rid] for rid in ids}
    spec, drafted, accepted_total, preemptions = run_speculating(
        target, some, draft=model, max_num_batched_tokens=12, kv_cache_memory=KV[draft]
    )
    assert_same({k: v for k, v in plain.items() if k[0] in some}, spec)
    assert preemptions > 0
    if draft == "itself":  # the target as its own draft: every guess is its own choice
        assert accepted_total > 0.95 * drafted > 0
    else:
        assert accepted_total < 0.5 * drafted


def test_a_draft_guesses_among_the_first_ids_only(target, requests, plain, monkeypatch):
    """draft_vocab_size 256: the target as its own draft guesses its own choice where that
    lies among the first 256 ids and something else where not; the output is the plain
    run's either way."""
    from scheduler.runner.draft_model import DraftModel

    guessed: list[int] = []
    propose = DraftModel.propose

    def recording(self, scheduled, vocab):
        filled = propose(self, scheduled, vocab)
        guessed.extend(t for s in filled for t in s.draft_token_ids)
        return filled

    monkeypatch.setattr(DraftModel, "propose", recording)
    some = {rid: requests[rid] for rid in ("r0", "r1", "json")}
    spec, drafted, accepted_total, _ = run_speculating(
        target, some, draft=target.model, spec=replace(DRAFT, draft_vocab_size=256)
    )
    assert_same({k: v for k, v in plain.items() if k[0] in some}, spec)
    outputs = [t for (rid, _), got in plain.items() if rid in some for t in got.token_ids]
    assert any(t >= 256 for t in outputs) and any(t < 256 for t in outputs)
    assert guessed and max(guessed) < 256
    assert 0 < accepted_total < 0.95 * drafted


def test_a_draft_guesses_while_it_is_sure(target, requests, plain, monkeypatch) -> None:
    """draft_p_min: the target as its own draft gives each guess the probability the plain
    run's logprobs give that token, so each step's guesses are the plain output from the
    step's position on, as long as each has at least p_min and slots are left; all kept.
    A seeded sampled request beside them gets its plain tokens: which guesses are made
    depends on the draft alone."""
    from scheduler.runner.draft_model import DraftModel

    p_min = 0.6
    steps: list[tuple[str, int, int, list[int]]] = []  # id, output index, slots, guesses
    propose = DraftModel.propose

    def recording(self, scheduled, vocab):
        filled = propose(self, scheduled, vocab)
        for s, f in zip(scheduled, filled, strict=True):
            if s.draft_token_ids:
                at = s.num_computed_tokens + 1 - len(s.prompt_ids)
                steps.append((s.request_id, at, len(s.draft_token_ids), f.draft_token_ids))
        return filled

    monkeypatch.setattr(DraftModel, "propose", recording)
    greedy = ("r0", "r2", "r4")
    some = {rid: requests[rid] for rid in (*greedy, "sampled")}
    spec = replace(DRAFT, num_speculative_tokens=4, draft_p_min=p_min)
    got, drafted, accepted_total, _ = run_speculating(target, some, draft=target.model, spec=spec)
    assert_same({k: v for k, v in plain.items() if k[0] in some}, got)
    sure: dict[str, list[bool]] = {}
    for rid in greedy:
        lps = [lp.logprob for o in plain[(rid, 0)].outputs for lp in (o.logprobs or [])]
        assert all(abs(math.exp(lp) - p_min) > 1e-3 for lp in lps)  # no near tie
        sure[rid] = [math.exp(lp) >= p_min for lp in lps]
    cut = full = 0
    for rid, at, slots, guesses in steps:
        if rid not in sure:
            continue
        want = 0
        while want < slots and sure[rid][at + want]:
            want += 1
        assert guesses == plain[(rid, 0)].token_ids[at : at + want], (rid, at)
        cut += want < slots
        full += want == slots
    assert cut > 0 and full > 0  # some steps cut short, some not
    assert drafted == sum(len(g) for *_, g in steps) > 0
    kept = sum(len(g) for rid, *_, g in steps if rid in sure)
    assert kept <= accepted_total <= drafted  # the greedy ones' guesses all kept
    assert any(rid == "sampled" and g for rid, *_, g in steps)  # it guessed too


def test_beside_a_draft_a_step_without_guesses_is_timed_as_plain(target, requests) -> None:
    """A step where nobody guesses neither runs the draft nor counts its time: were it
    taken for a guessing step, no plain step would ever be timed, guesses never priced,
    and after its first step nobody would guess again."""
    e = create_engine(target.model, target.tokenizer, EngineConfig(speculative=DRAFT), target.model)
    e.add_request("r0", *requests["r0"])
    while e.has_work():
        e.step()
    costs = e.scheduler.speculator.costs
    assert costs.guess_cost(1) is not None  # both kinds of step timed


@pytest.mark.parametrize("draft", ["itself", "small"])
def test_a_draft_guesses_for_constrained_sequences(target, requests, plain, small_draft, draft):
    """A JSON-schema request: the draft's guesses for it are picked among what the grammar
    allows, cut where it refuses one, and its verified rows masked, so its output is the
    plain run's (a guess verified unmasked would let the target pick what the grammar
    forbids). The target as its own draft, alone: it guesses the target's own choices. A
    random draft, beside a free request: its guesses are mostly wrong."""
    model = target.model if draft == "itself" else small_draft
    ids = ("json",) if draft == "itself" else ("json", "r1")
    some = {rid: requests[rid] for rid in ids}
    spec, drafted, accepted_total, _ = run_speculating(target, some, draft=model)
    assert_same({k: v for k, v in plain.items() if k[0] in some}, spec)
    assert drafted > 0  # it guessed, constrained as it is
    if draft == "itself":
        assert accepted_total > 0.5 * drafted


def test_a_draft_that_sat_out_crowded_steps_catches_up(target, requests, plain) -> None:
    """Above disable_by_batch_size nobody guesses and the draft does not run; once the
    short requests have finished, the others guess, the draft first computing what it
    missed. The target as its own draft: every guess is right only if it did."""
    some = {rid: requests[rid] for rid in ("short", "stop", "r0", "r1", "pair")}
    spec = replace(DRAFT, disable_by_batch_size=4)
    results, drafted, accepted_total, _ = run_speculating(
        target, some, draft=target.model, spec=spec
    )
    assert_same({k: v for k, v in plain.items() if k[0] in some}, results)
    assert accepted_total > 0.95 * drafted > 0


@pytest.mark.parametrize("ids", [("r0", "stop", "short"), ("json",)])
def test_alone_as_in_a_crowd(target, requests, plain, ids) -> None:
    alone = {rid: requests[rid] for rid in ids}
    spec, _, accepted_total, _ = run_speculating(target, alone, one_at_a_time=True)
    assert_same({k: v for k, v in plain.items() if k[0] in alone}, spec)
    assert accepted_total > 0


def test_proposals() -> None:
    assert propose_ngram([1, 2, 3, 9, 1, 2, 3], 1, 3, 2) == [9, 1]
    # The longest suffix that occurred wins over a later, shorter one.
    assert propose_ngram([5, 6, 7, 8, 0, 6, 7, 1, 5, 6, 7], 1, 3, 3) == [8, 0, 6]
    # Among equal lengths, the latest occurrence.
    assert propose_ngram([4, 1, 4, 2, 4], 1, 1, 1) == [2]
    assert propose_ngram([1, 2, 3], 2, 3, 2) == []
    # Cut where an earlier occurrence of the same tokens went on otherwise...
    assert propose_ngram([1, 2, 5, 6, 1, 2, 5, 7, 3, 1, 2], 2, 2, 4) == [5]
    assert propose_ngram([1, 2, 5, 6, 1, 2, 5, 6, 3, 1, 2], 2, 2, 4) == [5, 6]
    # ...the first token guessed whatever the others say...
    assert propose_ngram([1, 2, 8, 1, 2, 9, 3, 1, 2], 2, 2, 4) == [9]
    # ...and only by occurrences of the longest length found.
    assert propose_ngram([4, 1, 2, 8, 0, 1, 2, 9, 3, 4, 1, 2], 2, 3, 4) == [8, 0, 1, 2]
    assert propose_ngram([7], 1, 4, 3) == []


def test_acceptance_is_the_leading_agreement() -> None:
    assert accepted([5, 6, 7], [5, 6, 9, 1]) == 2
    assert accepted([5, 6], [4, 6, 7]) == 0
    assert accepted([5, 6], [5, 6, 8]) == 2


@pytest.mark.parametrize(
    "text",
    [
        "{bad",
        "[]",
        '{"method": "ngram"}',
        '{"method": "ngram", "num_speculative_tokens": 0}',
        '{"method": "ngram", "num_speculative_tokens": true}',
        '{"method": "eagle", "num_speculative_tokens": 2}',
        '{"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}',
        '{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 5}',
        '{"method": "draft_model", "num_speculative_tokens": 2}',
        '{"method": "ngram", "model": "draft.gguf", "num_speculative_tokens": 2}',
        '{"model": "draft.gguf", "num_speculative_tokens": 2, "prompt_lookup_min": 2}',
        '{"model": "", "num_speculative_tokens": 2}',
        '{"method": "ngram", "num_speculative_tokens": 2, "draft_vocab_size": 64}',
        '{"model": "draft.gguf", "num_speculative_tokens": 2, "draft_vocab_size": 0}',
        '{"method": "ngram", "num_speculative_tokens": 2, "draft_p_min": 0.5}',
        '{"model": "draft.gguf", "num_speculative_tokens": 2, "draft_p_min": 1}',
        '{"model": "draft.gguf", "num_speculative_tokens": 2, "draft_p_min": -0.1}',
        '{"model": "draft.gguf", "num_speculative_tokens": 2, "draft_p_min": "high"}',
        '{"model": "draft.gguf", "num_speculative_tokens": 2, "draft_p_min": true}',
    ],
)
def test_bad_configs_are_one_sentence(text, capsys) -> None:
    from server.startup.cli import main

    with pytest.raises(SpeculativeConfigError):
        SpeculativeConfig.parse(text)
    assert main(["serve", "--speculative-config", text]) == 2
    err = capsys.readouterr().err
    assert "--speculative-config" in err and "Traceback" not in err


def test_a_draft_with_another_vocabulary_is_one_sentence(tmp_path, capsys) -> None:
    from server.startup.cli import main

    make_tiny_llama(tmp_path)
    write_tiny_tokenizer(tmp_path)
    text = json.dumps({"model": str(tmp_path), "num_speculative_tokens": 2})
    assert main(["serve", "--speculative-config", text, "--max-model-len", "256"]) == 2
    err = capsys.readouterr().err
    assert "another vocabulary" in err and "Traceback" not in err


def test_trim_frees_the_blocks_of_rejected_guesses() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(9))
    assert kv.allocate_slots("a", tokens, 0, 9)
    assert kv.allocate_slots("a", tokens, 9, 1 + 6)  # a token and 6 guesses: 16 slots
    assert len(kv.block_table("a")) == 4
    kv.trim("a", 11)  # two of them accepted, plus the next token to compute
    assert len(kv.block_table("a")) == 3 and kv.num_free_blocks == 5
    kv.check_invariants()


def test_served_with_speculation(ours_default, live_server) -> None:
    """Over HTTP: the same completions, whole and streamed, as a server without it, and
    the spec_decode counters say guesses were verified and accepted."""
    body = {"prompt": TEXTS[2], "max_tokens": 24, "temperature": 0, "logprobs": 1}
    with running_server(ours_default, engine_config(speculative=NGRAM)) as spec_server:
        with httpx.Client(timeout=120) as c:
            want = c.post(f"{live_server.v1}/completions", json=body).json()["choices"][0]
            got = c.post(f"{spec_server.v1}/completions", json=body).json()["choices"][0]
            chunks = []
            streamed = {**body, "stream": True}
            with c.stream("POST", f"{spec_server.v1}/completions", json=streamed) as r:
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunks.append(line)
            metrics = c.get(f"{spec_server.base_url}/metrics").text
    assert got["text"] == want["text"] and got["logprobs"]["tokens"] == want["logprobs"]["tokens"]
    assert "".join(json.loads(x[6:])["choices"][0]["text"] for x in chunks) == want["text"]
    accepted_line = [
        line
        for line in metrics.splitlines()
        if line.startswith("llamaserve:spec_decode_num_accepted_tokens_total{")
    ]
    assert float(accepted_line[0].rsplit(" ", 1)[1]) > 0


def test_a_guess_costs_its_verified_row_and_a_draft_step() -> None:
    """Steps of one sequence: plain 40 ms; four guesses 120 ms, 75 of them the draft's, of
    which three one-token steps of 15 ms after its first forward: a guess costs 5 / 4 ms
    of verification and 15 of drafting, 0.40625 of a plain step."""
    costs = SpecCosts()
    costs.observe(1, guesses=4, forward_s=0.120, draft_s=0.075, draft_step_s=0.015)
    assert costs.guess_cost(1) is None  # no plain step seen yet
    costs.observe(1, guesses=0, forward_s=0.040)
    assert costs.guess_cost(1) == pytest.approx(0.40625)
    assert costs.guess_cost(2) is None  # costs are per batch size


def test_in_a_batch_a_guess_weighs_against_its_sequences_part_of_the_step() -> None:
    """Steps of two sequences: plain 50 ms, which gives each a token for 25 ms of it; four
    guesses in all 90 ms, 10 ms a verified row: a guess costs 0.4 of a sequence's part.
    With a draft, its one-token step (15 ms) serves both sequences' guesses at once."""
    costs = SpecCosts()
    costs.observe(2, guesses=4, forward_s=0.090)
    costs.observe(2, guesses=0, forward_s=0.050)
    assert costs.guess_cost(2) == pytest.approx(0.4)
    costs.observe(2, guesses=4, forward_s=0.090, draft_s=0.0, draft_step_s=0.015)
    assert costs.guess_cost(2) == pytest.approx((2 * 0.010 + 0.015) / 0.050)


@pytest.mark.parametrize("rate", [0.0, 0.1, 0.3, 0.5, 0.7, 0.9, 0.99, 1.0])
@pytest.mark.parametrize("cost", [0.05, 0.25, 0.75, 1.5])
def test_the_guess_length_maximises_expected_tokens_per_cost(rate, cost) -> None:
    """Against every length tried: guesses kept one after another at `rate`."""

    def per_cost(k: int) -> float:
        return sum(rate**i for i in range(k + 1)) / (1 + k * cost)

    best = max(per_cost(k) for k in range(9))
    assert per_cost(guess_length(rate, cost, 8)) == pytest.approx(best)


def test_a_sequence_guesses_as_far_as_its_acceptance_pays_and_probes_when_it_does_not():
    config = SpeculativeConfig(num_speculative_tokens=8, prompt_lookup_min=1)
    req = Request("r", [1, 2, 3, 4, 5, 6, 7, 8, 9, 1], params())
    speculator = Speculator(config, max_model_len=256)
    speculator.costs.observe(1, guesses=4, forward_s=0.080)
    assert not speculator.active(1)  # a plain step first, to price a guess
    speculator.costs.observe(1, guesses=0, forward_s=0.040)
    assert speculator.active(1)  # a guess costs a quarter of a step
    assert speculator.drafts(req, room=16) == [2, 3, 4, 5, 6, 7, 8, 9]  # its first guess
    for _ in range(3):
        speculator.record(req, 8, 0)
    assert speculator.drafts(req, room=16) == []  # three wrong: a guess does not pay
    for _ in range(6):  # every guess kept: 25 of 29 with the prior, five guesses pay
        speculator.record(req, 4, 4)
    assert speculator.drafts(req, room=16) == [2, 3, 4, 5, 6]
    assert speculator.drafts(req, room=3) == [2, 3, 4]
    wrong = Request("w", [1, 2, 3, 4, 5, 6, 7, 8, 9, 1], params(max_tokens=64))
    for _ in range(3):  # every guess wrong
        speculator.record(wrong, 4, 0)
    assert speculator.drafts(wrong, room=16) == []
    for token in [*range(10, 9 + probe_interval(0.25)), 1]:  # decoded without guessing
        wrong.append_output(token)
    assert speculator.drafts(wrong, room=16) == [10]  # one guess, to see if that changed
