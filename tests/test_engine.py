"""The engine with the default model: batch invariance of greedy output under every
scheduling condition (crowded batch, preemption, chunked prefill, prefix caching),
against the model alone and against `transformers`; stops, n > 1, aborts."""

import random

import pytest
import torch

from model.greedy import greedy_tokens
from model.network.kv_int8 import cache_dtype
from scheduler.config import EngineConfig
from scheduler.engine.factory import create_engine
from scheduler.runner.kv_capacity import model_bytes_per_block
from scheduler.sampling_params import SamplingParams
from tests.engine_driver import run_engine
from tests.native_builds import MACHINE_ISAS

MAX_TOKENS = 16
SHARED = (
    "You are a meticulous assistant. Answer every question with care, cite the reasons for "
    "each step, and keep the answer short. Question: "
)
TEXTS = [
    "Hi",
    "The capital of France is",
    "def add(a, b):\n    return",
    "我们今天去",
    "List three colours:\n1.",
    "Once upon a time, in a land far away, there lived a dragon who",
    SHARED + "Why is the sky blue?",
    SHARED + "What is 17 times 3?",
    SHARED + "Name a prime number larger than 100.",
    SHARED + "Who wrote Hamlet?",
    "import numpy as np\nx = np.arange(10)\nprint(",
    "The quick brown fox jumps over the lazy dog. " * 6,
    "Emoji test: 🤖🍕🎉 means",
    "In 1969, the first humans",
    "Water boils at",
    "A haiku about autumn:\n",
]


@pytest.fixture(scope="module")
def prompts(ours_default):
    tok = ours_default.tokenizer
    return [tok.encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def alone(ours_default, prompts):
    """Each prompt generated alone, on the model with a private cache: no scheduler."""
    return [
        list(greedy_tokens(ours_default.model, ids, MAX_TOKENS, ours_default.tokenizer.stop_ids))
        for ids in prompts
    ]


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0)


def engine_for(loaded, **kwargs):
    return create_engine(loaded.model, loaded.tokenizer, EngineConfig(**kwargs))


def strip_stop(tokens: list[int], stop_ids) -> list[int]:
    return tokens[:-1] if tokens and tokens[-1] in stop_ids else tokens


SCENARIOS = {
    "crowded": dict(),
    "no_prefix_cache": dict(enable_prefix_caching=False),
    "chunked_prefill": dict(max_num_batched_tokens=7),
    "preemption": dict(kv_cache_memory=20 * 737280),
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_batch_invariance(scenario, ours_default, prompts, alone):
    engine = engine_for(ours_default, **SCENARIOS[scenario])
    requests = {f"r{i}": (ids, greedy()) for i, ids in enumerate(prompts)}
    results, preemptions = run_engine(engine, requests)
    if scenario == "preemption":
        assert preemptions > 0
    for i in range(len(prompts)):
        got = results[(f"r{i}", 0)].token_ids
        assert got == alone[i], (scenario, TEXTS[i])
    assert engine.scheduler.kv.num_used_blocks == 0
    if scenario == "crowded":
        assert engine.scheduler.kv.prefix_cache_hits > 0  # the shared prefix was computed once


@pytest.mark.slow
def test_engine_matches_transformers(ours_default, hf_default, prompts):
    """transformers, teacher-forced on the engine's greedy continuations, predicts each of
    their tokens (as its own greedy generation would, in one forward per prompt)."""
    hf, _ = hf_default
    engine = engine_for(ours_default)
    picks = [1, 2, 6, 12]
    results, _ = run_engine(engine, {f"r{i}": (prompts[i], greedy()) for i in picks})
    for i in picks:
        ids, got = prompts[i], results[(f"r{i}", 0)].token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([ids + got[:-1]]), logits_to_keep=len(got)).logits[0]
        # An early end of sequence is transformers' choice too (token 2 is its eos).
        assert logits.argmax(-1).tolist() == got


def test_seeded_sampling_is_batch_invariant(ours_default, prompts):
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=1234)
    alone, _ = run_engine(engine_for(ours_default), {"a": (prompts[1], params)})
    crowd = {
        f"x{i}": (ids, SamplingParams(max_tokens=12, temperature=0.8))
        for i, ids in enumerate(prompts[:6])
    }
    crowd["a"] = (prompts[1], params)
    crowd["b"] = (prompts[1], SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9, seed=99))
    batched, _ = run_engine(engine_for(ours_default), crowd)
    assert batched[("a", 0)].token_ids == alone[("a", 0)].token_ids
    assert batched[("b", 0)].token_ids != alone[("a", 0)].token_ids


def test_top_k_one_equals_greedy(ours_default, prompts, alone):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, top_k=1, seed=5)
    results, _ = run_engine(engine_for(ours_default), {"k": (prompts[5], params)})
    assert results[("k", 0)].token_ids == alone[5]


def test_stop_string_spanning_tokens(ours_default, prompts, alone):
    tok = ours_default.tokenizer
    ids = alone[5]
    pieces = [tok.decode([t]) for t in ids]
    full = tok.decode(ids)
    # A stop string made of the end of token 3 and the start of token 4.
    boundary = len("".join(pieces[:4]))
    assert len(pieces[3]) >= 2 and len(pieces[4]) >= 2
    stop = full[boundary - 2 : boundary + 2]
    expected = full[: full.find(stop)]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, stop=[stop])
    results, _ = run_engine(engine_for(ours_default), {"s": (prompts[5], params)})
    got = results[("s", 0)]
    assert got.finish_reason == "stop"
    # What was streamed, concatenated, is exactly the text before the stop string: no
    # piece of it leaked, not even the part held back while it could still match.
    assert got.text == expected


def test_max_tokens_and_eos(ours_default, prompts):
    results, _ = run_engine(engine_for(ours_default), {"m": (prompts[0], greedy(3))})
    assert results[("m", 0)].finish_reason == "length"
    assert len(results[("m", 0)].token_ids) == 3


def test_n_shares_prompt_blocks(ours_default):
    tok = ours_default.tokenizer
    ids = tok.encode("The history of the printing press is long and " * 5)
    assert len(ids) > 32
    engine = engine_for(ours_default)
    params = SamplingParams(max_tokens=4, temperature=1.0, n=3, seed=7)
    engine.add_request("n", ids, params)
    full_blocks = len(ids) // engine.scheduler.kv.block_size
    seen_shared = False
    while engine.has_work():
        engine.step()
        tables = [engine.scheduler.kv.block_table(f"n#{i}") for i in range(3)]
        if all(tables):
            assert tables[0][:full_blocks] == tables[1][:full_blocks] == tables[2][:full_blocks]
            # shared prompt blocks are counted once
            assert engine.scheduler.kv.num_used_blocks < 3 * len(tables[0])
            seen_shared = True
    assert seen_shared


def test_n_returns_n_completions(ours_default, prompts):
    params = SamplingParams(max_tokens=6, temperature=1.0, n=3, seed=11)
    results, _ = run_engine(engine_for(ours_default), {"n": (prompts[6], params)})
    assert sorted(k for k in results) == [("n", 0), ("n", 1), ("n", 2)]
    assert all(len(results[("n", i)].token_ids) == 6 for i in range(3))


def test_abort_frees_blocks(ours_default, prompts):
    engine = engine_for(ours_default)
    for i, ids in enumerate(prompts[:8]):
        engine.add_request(f"r{i}", ids, greedy(50))
    for _ in range(3):
        engine.step()
    assert engine.scheduler.kv.num_used_blocks > 0
    for i in range(8):
        engine.abort(f"r{i}")
    assert engine.scheduler.kv.num_used_blocks == 0
    assert not engine.has_work()


def test_many_requests_with_random_aborts(ours_default):
    rng = random.Random(0)
    engine = engine_for(ours_default, max_num_seqs=32, kv_cache_memory=40 * 737280)
    vocab_words = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "seven"]
    pending = [f"q{i}" for i in range(120)]
    live: set[str] = set()
    while pending or engine.has_work():
        for _ in range(rng.randint(0, 12)):
            if pending:
                rid = pending.pop()
                text = " ".join(rng.choice(vocab_words) for _ in range(rng.randint(1, 30)))
                engine.add_request(rid, engine.tokenizer.encode(text), greedy(rng.randint(1, 6)))
                live.add(rid)
        outputs, _ = engine.step()
        for out in outputs:
            if out.finished:
                live.discard(out.request_id)
        for rid in list(live):
            if rng.random() < 0.05:
                engine.abort(rid)
                live.discard(rid)
        engine.scheduler.kv.check_invariants()
    assert not live
    assert engine.scheduler.kv.num_used_blocks == 0


def test_sampler_failure_fails_its_requests_not_the_engine(ours_default, prompts, alone):
    engine = engine_for(ours_default)
    # Valid as SamplingParams, but no int64 tensor holds it: the sampler raises.
    engine.add_request("bad", prompts[0], SamplingParams(max_tokens=4, top_k=2**70))
    outputs, _ = engine.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("bad", "error")]
    assert outputs[0].error is not None
    assert engine.scheduler.kv.num_used_blocks == 0 and not engine.has_work()
    results, _ = run_engine(engine, {"ok": (prompts[5], greedy())})
    assert results[("ok", 0)].token_ids == alone[5]


def test_largest_seed_with_n_siblings(ours_default, prompts):
    # Sibling i is seeded with seed + i, which must wrap at 2**64 rather than overflow.
    params = SamplingParams(max_tokens=3, temperature=1.0, n=3, seed=2**64 - 1)
    results, _ = run_engine(engine_for(ours_default), {"s": (prompts[1], params)})
    assert all(len(results[("s", i)].token_ids) == 3 for i in range(3))
    # A seed of -1 is the same 64-bit seed as 2**64 - 1 (torch wraps negatives).
    again = SamplingParams(max_tokens=3, temperature=1.0, n=3, seed=-1)
    results2, _ = run_engine(engine_for(ours_default), {"s": (prompts[1], again)})
    assert all(results2[("s", i)].token_ids == results[("s", i)].token_ids for i in range(3))


@pytest.mark.parametrize("budget", [2048, 7])
def test_prompt_logprobs_match_transformers(ours_default, hf_default, prompts, budget):
    """Prompt logprobs (echo + logprobs) equal transformers' teacher-forced log-softmax,
    also when the prompt is prefilled in chunks and when its prefix is already cached."""
    hf, _ = hf_default
    ids = prompts[6]
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    engine = engine_for(ours_default, max_num_batched_tokens=budget)
    params = SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=3)
    warm, _ = run_engine(engine, {"warm": (ids, greedy(2))})  # caches the prefix blocks
    results, _ = run_engine(engine, {"p": (ids, params)})
    first = results[("p", 0)].outputs[0]
    got = first.prompt_logprobs
    assert got is not None and len(got) == len(ids) - 1
    for pos, entry in enumerate(got, start=1):
        assert entry.token_id == ids[pos]
        assert abs(entry.logprob - ref[pos - 1, ids[pos]].item()) < 1e-3
        want_top = ref[pos - 1].topk(3)
        assert [t for t, _ in entry.top] == want_top.indices.tolist()
    assert all(o.prompt_logprobs is None for o in results[("p", 0)].outputs[1:])
    assert results[("p", 0)].token_ids == warm[("warm", 0)].token_ids


@pytest.mark.slow
def test_batch_invariant_flag_gives_batch_invariant_greedy_output(prompts):
    """The fast formats need not be batch invariant (bf16 activations flip some greedy
    tokens between batch shapes); --batch-invariant picks one that is, quantised or not."""
    from model.loader import load_model

    loaded = load_model(dtype="auto", quantization="auto", batch_invariant=True, progress=False)
    assert loaded.model.embed_tokens.weight.dtype == torch.float32
    # A quarter of the prompts need a quarter of the cache to be preempted.
    assert_batch_invariant(loaded, prompts[:4], SCENARIOS["preemption"]["kv_cache_memory"] // 4)
    # The promise holds on an int8 KV cache too (float32 queries on its C kernel).
    per_block = model_bytes_per_block(loaded.model.config, 16, torch.int8)
    assert_batch_invariant(loaded, prompts[:4], 6 * per_block, kv_cache_dtype="int8")


def assert_batch_invariant(
    loaded, prompts: list[list[int]], preempting_cache: int, kv_cache_dtype: str = "auto"
) -> None:
    """Each prompt's greedy output alone equals its output crowded, chunked and preempted
    (with `preempting_cache` bytes of KV cache), all on a `kv_cache_dtype` cache."""
    tok = loaded.tokenizer
    kv_dtype = cache_dtype(kv_cache_dtype, loaded.model.dtype)
    alone = [
        list(greedy_tokens(loaded.model, ids, MAX_TOKENS, tok.stop_ids, kv_dtype=kv_dtype))
        for ids in prompts
    ]
    small_cache = {"kv_cache_memory": preempting_cache}
    for scenario in ("crowded", "chunked_prefill", "preemption"):
        engine = engine_for(
            loaded,
            kv_cache_dtype=kv_cache_dtype,
            **(small_cache if scenario == "preemption" else SCENARIOS[scenario]),
        )
        requests = {f"r{i}": (ids, greedy()) for i, ids in enumerate(prompts)}
        results, preemptions = run_engine(engine, requests)
        assert preemptions > 0 or scenario != "preemption"
        for i in range(len(prompts)):
            assert results[(f"r{i}", 0)].token_ids == alone[i], (scenario, TEXTS[i])


def test_an_int8_kv_cache_is_batch_invariant(ours_default, prompts) -> None:
    """--kv-cache-dtype int8 (model/network/kv_int8.py): a token's K/V bytes depend on it
    alone and every attention path reads them one query at a time, so greedy output alone
    equals it crowded, chunked and preempted (6 blocks of cache for 4 prompts), as with
    the model's own dtype; on the default format that is the C decoder layers' int8 path."""
    per_block = model_bytes_per_block(ours_default.model.config, 16, torch.int8)
    assert_batch_invariant(ours_default, prompts[:4], 6 * per_block, kv_cache_dtype="int8")


FAST_PATHS = [(kernel, isa) for kernel in ("native", "native_a8") for isa in MACHINE_ISAS]


@pytest.mark.slow
@pytest.mark.parametrize(("int4_kernel", "cpu_isa"), FAST_PATHS, indirect=["cpu_isa"])
def test_the_c_kernels_fast_path_is_batch_invariant(prompts, monkeypatch, int4_kernel, cpu_isa):
    """bf16 activations with int4 layers (bf16 or int8 activations into the products), the
    int8 output projection, the C decoder layers and C attention for prefill and decode:
    every kernel on that path computes a row alone, so greedy output does not depend on
    the batch even without --batch-invariant (--cpu-kernels native here, what an AVX-512
    machine's timing picks; with the bf16 output projection instead, this fails).
    At each instruction level the kernels are built for, each taking its own loops (with
    SDPA for the AVX2 and portable builds' prefills, chunking changed greedy tokens)."""
    from model.loader import load_model
    from model.quant.int4 import Int4Linear

    quantization = "w4a8" if int4_kernel == "native_a8" else "int4"
    loaded = load_model(
        dtype="bfloat16", quantization=quantization, progress=False, cpu_kernels="native"
    )
    kernels = {m.kernel for m in loaded.model.modules() if isinstance(m, Int4Linear)}
    assert kernels == {int4_kernel}
    assert all(layer.native is not None for layer in loaded.model.layers)
    assert loaded.model.embed_from_head
    # bf16 blocks are half the size of float32's: a quarter of the cache for half the prompts.
    # A level other than the machine's own runs its kernels slower (the AVX2 build's int8
    # products about twice as slow on an AVX-512 machine): half as many prompts again, in
    # half the cache, take the same three scenarios through them.
    count = 8 if cpu_isa == "native" else 4
    cache = SCENARIOS["preemption"]["kv_cache_memory"] // (4 * 8 // count)
    assert_batch_invariant(loaded, prompts[:count], cache)
